"""Per-transfer checksums on CUDA (`refit.executor.checksum`): `make test-gpu`.

The Triton kernel, and torch's own path on CUDA, must give the bits of the torch path on the CPU:
for every launch the kernel has (element widths 1, 2 and 4; strided, unit-stride and aligned
rows; one row or several; rows longer than one item), for both ends of real plans (fused,
restrided and misaligned local tensors), after the tensors' values change under a cached launch,
and past 2**31 elements (offsets and box indices in 64 bits).  Without a CUDA device every test
skips with its reason.
"""

from __future__ import annotations

import pytest
import torch

from refit.executor.triton_support import triton_importable
from refit.executor import checksum as ck
from refit.executor.checksum import share_checksums
from refit.executor.values import int_view
from refit.layouts import LocalTensor
from refit.planners import make_plan
from refit.regions import Block
from refit.sides import Side
from tests.harness.checksums import canonical, cut, kernel_cases, spec_of

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]
PLANS = [("tiny-qwen3-moe", "megatron:tp2ep2", "vllm:tp2ep2"), ("tiny-deepseek-v3", "fsdp:dp2", "vllm:tp2"),
         ("tiny-qwen3-moe-fp8/fp8", "megatron:tp2", "vllm:tp1")]


def needs_triton() -> None:
    if not triton_importable("the kernel tests skip"):
        pytest.skip("triton is not installed: checksums on CUDA use the torch path")


def test_every_launch_equals_the_cpu() -> None:
    needs_triton()
    for (share_c, on_cpu), (share_g, on_gpu) in zip(kernel_cases("cpu"), kernel_cases("cuda")):
        want = ck._sums_torch(share_c, ck._Views(share_c, on_cpu))
        views = ck._Views(share_g, on_gpu)
        got = ck._sums(share_g, views, use_kernel=None)
        assert share_g.launches is not None, "the kernel did not run"
        assert torch.equal(got.cpu(), want), (got.cpu() - want).nonzero()[:5].tolist()
        assert torch.equal(ck._sums_torch(share_g, views).cpu(), want)  # torch's CUDA path too


@pytest.mark.parametrize("model,src,dst", PLANS, ids=[f"{m}-{s}-{d}" for m, s, d in PLANS])
def test_both_ends_of_real_plans_equal_the_cpu(model: str, src: str, dst: str) -> None:
    needs_triton()
    spec = spec_of(model)
    r = make_plan(spec, src, dst, bucket_bytes=4096)
    canon = canonical(spec)
    for side, layout in ((Side.TRAINER, r.src), (Side.ENGINE, r.dst)):
        for rank in range(layout.world_size):
            want = share_checksums(r.plan, spec, r.src, r.dst, side, rank, cut(spec, layout, rank, canon))
            for scatter in (False, True):
                tensors = cut(spec, layout, rank, canon, scatter=scatter, device="cuda")
                assert share_checksums(r.plan, spec, r.src, r.dst, side, rank, tensors) == want, (side, rank, scatter)


def test_a_cached_launch_reads_the_values_of_now() -> None:
    needs_triton()
    spec = spec_of("tiny-qwen3-moe")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    tensors = cut(spec, r.dst, 0, canonical(spec, 1), device="cuda")
    first = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, tensors)
    for t in tensors.values():
        int_view(t).copy_(int_view(t).flip(0))
    want = share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, {n: t.cpu() for n, t in tensors.items()})
    assert share_checksums(r.plan, spec, r.src, r.dst, Side.ENGINE, 0, tensors) == want != first


def test_past_two_to_the_31_elements() -> None:
    """One FP8 tensor of 2**31 + 2**20 elements, all ones: the whole of it as a box (S1 = n,
    S2 = n (n + 1) / 2, mod 2**64), and its last 4096 elements as another, against the CPU."""
    needs_triton()
    n = 2 ** 31 + 2 ** 20
    big = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda")
    big.view(torch.int8).fill_(1)
    tail = torch.randint(-128, 128, (4096,), dtype=torch.int8)
    big.view(torch.int8)[-4096:] = tail.cuda()
    boxes = (ck.BoxBlocks(0, (n,), (Block("big", (0,), (0,), (n,)),)),
             ck.BoxBlocks(1, (4096,), (Block("big", (n - 4096,), (0,), (4096,)),)))
    share = ck.Share(None, {"big": LocalTensor("big", (n,), "float8_e4m3fn", ())}, boxes)  # type: ignore[arg-type]
    got = ck._sums(share, ck._Views(share, {"big": big}), use_kernel=None).tolist()
    assert share.launches is not None
    ones = n - 4096
    s1 = ones + int(tail.long().sum())
    s2 = ones * (ones + 1) // 2 + sum((ones + i + 1) * int(x) for i, x in enumerate(tail.tolist()))
    signed = [((v + 2 ** 63) % 2 ** 64) - 2 ** 63 for v in (s1, s2)]
    assert got[0] == signed
    small = ck.Share(None, {"t": LocalTensor("t", (4096,), "float8_e4m3fn", ())},  # type: ignore[arg-type]
                     (ck.BoxBlocks(0, (4096,), (Block("t", (0,), (0,), (4096,)),)),))
    want = ck._sums_torch(small, ck._Views(small, {"t": tail.view(torch.float8_e4m3fn)}))
    assert got[1] == want[0].tolist()
