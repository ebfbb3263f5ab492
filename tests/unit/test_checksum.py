"""Per-transfer checksums (`refit.executor.checksum`, and its kernel path
`refit.executor.checksum_triton`): both ends of every transfer agree bit for bit, whatever their
layouts, and a corrupted box is caught.

Each end's local tensors are cut, per its layout, from the same canonical tensors of random bits
(NaN patterns included); every stage-1 transfer's two checksums must be equal, and equal to the
checksum of the canonical box itself.  The Triton kernel runs in Triton's interpreter (a fresh
process) against the torch path; tests/gpu/test_gpu_checksum.py runs it on CUDA.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.control.dataplane import BaseDataPlane, Seat
from refit.control.dataplane_executor import ExecutorDataPlane
from refit.errors import InvalidInput
from refit.executor import checksum as ck
from refit.executor import checksum_triton as ckt
from refit.executor.checksum import box_checksum, fold, share_checksums
from refit.executor.values import int_view
from refit.planners import make_plan
from refit.regions import slices
from refit.sides import Side
from refit.spec import ModelSpec
from tests.harness.checksums import WIDTHS, canonical, cut, random_bits, spec_of, synthetic

ROOT = Path(__file__).resolve().parents[2]


def all_checksums(spec: ModelSpec, r, canon: dict[str, torch.Tensor], scatter_side: Side | None = None) \
        -> dict[tuple[Side, int], dict[int, int]]:
    out = {}
    for side, layout in ((Side.TRAINER, r.src), (Side.ENGINE, r.dst)):
        for rank in range(layout.world_size):
            tensors = cut(spec, layout, rank, canon, scatter=side is scatter_side)
            out[side, rank] = share_checksums(r.plan, spec, r.src, r.dst, side, rank, tensors)
    return out


CASES = [("tiny-qwen3", "megatron:tp2", "vllm:tp1"),
         ("tiny-qwen3-moe", "fsdp:dp2", "vllm:tp2"),
         ("tiny-qwen3-moe", "megatron:tp2ep2", "vllm:tp2ep2"),
         ("tiny-deepseek-v3", "megatron:tp2", "vllm:tp2"),  # fused MLA projections, float32 router bias
         ("tiny-qwen3-moe-fp8/fp8", "megatron:tp2", "vllm:tp2")]  # FP8 values, float32 scales


@pytest.mark.parametrize("model,src,dst", CASES, ids=[f"{m}-{s}-{d}" for m, s, d in CASES])
@pytest.mark.parametrize("scatter_side", [None, Side.ENGINE], ids=["fresh", "restrided"])
def test_both_ends_agree_bit_for_bit(model: str, src: str, dst: str, scatter_side: Side | None) -> None:
    spec = spec_of(model)
    r = make_plan(spec, src, dst, bucket_bytes=4096)
    canon = canonical(spec)
    got = all_checksums(spec, r, canon, scatter_side)
    stage1 = [(i, t) for i, t in enumerate(r.plan.transfers) if t.stage == 1]
    assert stage1
    for (side, rank), sums in got.items():
        sent = side is Side.TRAINER
        assert set(sums) == {i for i, t in stage1 if (t.sender if sent else t.receiver) == rank}, (side, rank)
        assert all(0 <= v < 2 ** 63 for v in sums.values())
    for i, t in stage1:
        want = box_checksum(canon[t.tensor][slices(t.start, t.size)])
        assert got[Side.TRAINER, t.sender][i] == got[Side.ENGINE, t.receiver][i] == want, (i, t)


def corrupt_one_box(how: str) -> tuple[set[int], int]:
    """Corrupt one element (or pair) of one received box on engine rank 0: the transfers whose
    checksums then differ between the two ends, and the one corrupted."""
    spec = spec_of("tiny-qwen3")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    canon = canonical(spec, seed=3)
    sent = {}
    for rank in range(r.src.world_size):
        sent.update(share_checksums(r.plan, spec, r.src, r.dst, Side.TRAINER, rank, cut(spec, r.src, rank, canon)))
    tensors = cut(spec, r.dst, 0, canon)
    share = ck._share(r.plan, spec, r.src, r.dst, Side.ENGINE, 0)
    box = next(b for b in share.boxes if "qkv" in b.blocks[-1].local)  # in a fused local tensor
    blk = box.blocks[-1]
    v = ck._Views(share, tensors).of(blk.local, len(blk.size))  # a view: writes reach the tensor
    pos = blk.local_start
    if how == "bit":
        v[pos] ^= 1 << 5
    elif how == "sign":
        v[pos] ^= torch.iinfo(v.dtype).min  # the sign bit
    else:  # two different elements of a row swapped
        row = v[pos[:-1]][pos[-1]:pos[-1] + blk.size[-1]]
        j = next(j for j in range(1, len(row)) if row[j] != row[0])
        row[0], row[j] = row[j].clone(), row[0].clone()
    got = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, tensors)
    return {i for i, v in got.items() if v != sent[i]}, box.index


@pytest.mark.parametrize("how", ["bit", "sign", "swap"])
def test_a_corrupted_box_differs_and_only_it(how: str) -> None:
    differ, corrupted = corrupt_one_box(how)
    assert differ == {corrupted}


# ------------------------------------------------------------------------------------------------
# The definition's promises, on boxes given whole


@st.composite
def boxes(draw) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    width = draw(st.sampled_from([1, 2, 4]))
    return random_bits(shape, WIDTHS[width], torch.Generator().manual_seed(draw(st.integers(0, 2 ** 30))))


@settings(max_examples=150, deadline=None)
@given(boxes(), st.data())
def test_any_flipped_bit_changes_the_checksum(box: torch.Tensor, data: st.DataObject) -> None:
    flat = int_view(box).view(-1)
    i = data.draw(st.integers(0, flat.numel() - 1))
    bit = data.draw(st.integers(0, 8 * box.element_size() - 1))
    other = box.clone()
    int_view(other).view(-1)[i] ^= 1 << bit if bit < 8 * box.element_size() - 1 else -(1 << bit)  # the sign bit
    assert box_checksum(other) != box_checksum(box)


@settings(max_examples=150, deadline=None)
@given(boxes(), st.data())
def test_any_swap_of_two_different_elements_changes_the_checksum(box: torch.Tensor, data: st.DataObject) -> None:
    flat = int_view(box).view(-1)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return
    i, j = data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=2, max_size=2, unique=True))
    if flat[i] == flat[j]:
        return
    other = box.clone()
    o = int_view(other).view(-1)
    o[i], o[j] = flat[j], flat[i]
    assert box_checksum(other) != box_checksum(box)


def test_a_box_shifted_by_one_element_differs() -> None:
    gen = torch.Generator().manual_seed(1)
    for width in (1, 2, 4):
        t = random_bits((64, 33), WIDTHS[width], gen)
        flat = t.view(-1)
        for start, size in (((3, 0), (5, 33)), ((10, 4), (7, 20)), ((0, 0), (64, 32))):
            box = t[slices(start, size)]
            rows = [flat[(start[0] + k) * 33 + start[1] + 1:][:size[1]] for k in range(size[0])]
            assert box_checksum(torch.stack(rows)) != box_checksum(box)  # every row read one element late
            assert box_checksum(box.reshape(-1).roll(1).view(size)) != box_checksum(box)


def test_nan_patterns_are_bits() -> None:
    """NaNs of every payload and sign, infinities and negative zeros are compared by their bits."""
    quiet = torch.full((4, 8), 0x7FC0, dtype=torch.int16).view(torch.bfloat16)
    assert bool(quiet.isnan().all())
    payload = quiet.clone()
    int_view(payload)[2, 3] = 0x7FC1
    negative = quiet.clone()
    int_view(negative)[0, 0] = -0x40  # 0xFFC0: a NaN with the sign bit set
    sums = {box_checksum(t) for t in (quiet, payload, negative)}
    assert len(sums) == 3 and box_checksum(quiet.clone()) == box_checksum(quiet)
    zeros = torch.zeros(5, dtype=torch.float32)
    assert box_checksum(-zeros) != box_checksum(zeros) and bool((-zeros == zeros).all())
    f32 = torch.tensor([0x7FC00000, 0x7FC00001, 0x7F800000], dtype=torch.int32).view(torch.float32)
    assert box_checksum(f32) != box_checksum(f32.flip(0))


def test_fold_is_63_bits_and_known() -> None:
    """The definition, pinned: a change here is a change of wire format (both ends must agree)."""
    assert fold(0, 0) == 0
    assert box_checksum(torch.arange(6, dtype=torch.int16).view(torch.bfloat16).view(2, 3)) == fold(15, 70)
    assert all(0 <= fold(a, b) < 2 ** 63 for a, b in [(-1, -1), (2 ** 64 - 1, 1), (-(2 ** 63), 2 ** 63)])
    assert fold(-1, 5) == fold(2 ** 64 - 1, 5 + 2 ** 64)


# ------------------------------------------------------------------------------------------------
# Boxes in blocks of local tensors stored every which way (synthetic shares)


@st.composite
def stored_boxes(draw):
    box = draw(boxes())
    d = draw(st.integers(0, box.dim() - 1))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, box.shape[d] - 1)), max_size=2)))) if box.shape[d] > 1 else []
    edges = [0, *cuts, box.shape[d]]
    blocks = []
    for lo, hi in zip(edges, edges[1:]):
        start = tuple(lo if k == d else 0 for k in range(box.dim()))
        size = tuple(hi - lo if k == d else n for k, n in enumerate(box.shape))
        pad = tuple(draw(st.lists(st.integers(0, 2), min_size=box.dim(), max_size=box.dim())))
        at = tuple(draw(st.integers(0, p)) for p in pad)
        order = tuple(draw(st.permutations(range(box.dim()))))
        blocks.append((start, size, {"pad": pad, "at": at, "order": order, "misalign": draw(st.booleans())}))
    return box, blocks


@settings(max_examples=100, deadline=None)
@given(stored_boxes())
def test_a_box_in_blocks_stored_any_way_sums_as_the_box(case) -> None:
    box, blocks = case
    share, tensors = synthetic([(box, blocks)])
    views = ck._Views(share, tensors)
    sums = ck._sums_torch(share, views)
    assert fold(*sums[0].tolist()) == box_checksum(box)
    strides = ckt._row_major(box.shape)
    for b in share.boxes[0].blocks:  # the kernel's 2-D segments: each element's memory offset and box index
        local = views.of(b.local, box.dim()).stride()
        want = {sum((a + q) * s for a, q, s in zip(b.local_start, qs, local)):
                sum((a + q) * s for a, q, s in zip(b.box_start, qs, strides))
                for qs in itertools.product(*map(range, b.size))}
        off = sum(a * s for a, s in zip(b.local_start, local))
        idx = sum(a * s for a, s in zip(b.box_start, strides))
        got = {g.off + r * g.lr + c * g.lc: g.idx + r * g.br + c * g.bc
               for g in ckt._segments(off, idx, b.size, local, strides) for r in range(g.rows) for c in range(g.cols)}
        assert got == want


_INTERPRETED = """
import torch
from refit.executor import checksum as ck
from tests.harness.checksums import kernel_cases
seen = set()
cases = kernel_cases()
for n, (share, tensors) in enumerate(cases):
    views = ck._Views(share, tensors)
    want = ck._sums_torch(share, views)
    got = ck._sums(share, views, use_kernel=True)
    assert share.launches is not None, "the kernel did not run"
    assert torch.equal(got, want), (got - want).nonzero()[:5].tolist()
    seen |= {(g.width, g.mode, g.rows) for g in share.launches.groups}
    if n != len(cases) - 2:  # the source end of the real plan
        continue
    launches = share.launches  # the same tensors again: the same launches; one moved: new ones, same sums
    assert torch.equal(ck._sums(share, ck._Views(share, tensors), use_kernel=True), want)
    assert share.launches is launches
    name = next(iter(tensors))
    moved = {**tensors, name: tensors[name].clone()}
    assert torch.equal(ck._sums(share, ck._Views(share, moved), use_kernel=True), want)
    assert share.launches is not launches
print("launches", sorted(seen))
"""


def test_the_kernel_equals_the_torch_path_in_the_interpreter() -> None:
    """Every launch of the Triton kernel (widths, strides, alignment, rows, long rows cut into
    items), run by Triton's interpreter on the CPU in a fresh process (triton reads
    TRITON_INTERPRET when it is imported): the same sums as the torch path."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    every = sorted(itertools.product((1, 2, 4), (0, 1, 2), (False, True)))
    assert f"launches {every}" in res.stdout, res.stdout


# ------------------------------------------------------------------------------------------------
# Refusals, and the data planes


def test_refusals() -> None:
    spec = spec_of("tiny-qwen3")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    tensors = cut(spec, r.dst, 0, canonical(spec))
    with pytest.raises(InvalidInput, match="side must be a refit.sides.Side"):
        share_checksums(r.plan, spec, r.src, r.dst, "engine", 0, tensors)
    with pytest.raises(InvalidInput, match="no rank 1"):
        share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 1, tensors)
    with pytest.raises(InvalidInput, match="missing"):
        share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, dict(list(tensors.items())[1:]))
    name = next(iter(tensors))
    with pytest.raises(InvalidInput, match=f"local tensor {name} is float32"):
        share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, {**tensors, name: tensors[name].float()})
    other = make_plan(spec, "megatron:tp2", "vllm:tp2", bucket_bytes=4096)
    with pytest.raises(InvalidInput, match="destination layout"):
        share_checksums(r.plan, spec, r.src, other.dst, Side.ENGINE, 0, tensors)
    bc = make_plan(spec, "megatron:tp2", "vllm:tp1", planner="broadcast", bucket_bytes=4096)
    with pytest.raises(InvalidInput, match="gathers whole tensors"):
        share_checksums(bc.plan, spec, bc.src, bc.dst, Side.ENGINE, 0, tensors)


def test_a_tensor_repointed_in_place_is_checked_again() -> None:
    """The same tensor objects at the same addresses skip the checks; a parameter whose ``.data``
    was replaced (offload and reload) is checked again, and read where it now lies."""
    spec = spec_of("tiny-qwen3")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    canon = canonical(spec)
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in cut(spec, r.dst, 0, canon).items()}
    want = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, params)
    p = next(iter(params.values()))
    p.data = p.data.clone()
    assert share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, params) == want
    p.data = torch.zeros(3, dtype=p.dtype)
    with pytest.raises(InvalidInput, match="the layout says"):
        share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, params)


def test_the_data_planes() -> None:
    """The base data plane cannot verify; the executor's gives the checksums of the tensors its
    last run moved, as `share_checksums` does."""
    spec = spec_of("tiny-qwen3")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    with pytest.raises(InvalidInput, match="cannot verify"):
        BaseDataPlane().checksums(r.plan)
    assert not BaseDataPlane.verifies and ExecutorDataPlane.verifies
    plane = ExecutorDataPlane()
    plane.open(Seat(Side.ENGINE, 0, spec, r.dst))
    plane.prepare(r.plan)
    with pytest.raises(InvalidInput, match="has not run"):
        plane.checksums(r.plan)
    tensors = cut(spec, r.dst, 0, canonical(spec))
    plane._moved[r.plan.plan_hash] = tensors  # what `run` keeps
    assert plane.checksums(r.plan) == share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, tensors)
    plane.close()


def test_a_phased_plan_sums_phase_by_phase_to_the_whole() -> None:
    """An engine that stages one window at a time sums each phase as it lands (`phase`): the
    phases' checksums together are the whole share's, each phase holding only its transfers."""
    spec = spec_of("tiny-qwen3-moe")
    r = make_plan(spec, "megatron:tp2ep2", "vllm:tp2", bucket_bytes=4096, phase_layers=1)
    tensors = cut(spec, r.dst, 1, canonical(spec, seed=5))
    whole = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 1, tensors)
    parts: dict[int, int] = {}
    for key, first, end in r.plan.phase_ranges():
        part = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 1, tensors, phase=key)
        mine = {i for b in r.plan.buckets[first:end] for i in range(b.first, b.first + b.count)}
        assert set(part) <= mine and not set(part) & set(parts), key
        parts.update(part)
    assert len(r.plan.phase_ranges()) > 2 and parts == whole
    with pytest.raises(InvalidInput, match="has no phase 999"):
        share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 1, tensors, phase=999)
