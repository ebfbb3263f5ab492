"""Quantization on the wire (`refit.executor.quantize`, many tensors at once in
`refit.executor.quantize_grouped`, the kernels of `refit.executor.quantize_triton`), bit for bit
against vLLM's own functions.

Every element is compared (FP8 values as their uint8 codes, scales with ``torch.equal``) with
``vllm.utils.deep_gemm.per_block_cast_to_fp8`` applied to each 2-D slice, and with
``mxfp8_utils._mxfp8_e4m3_quantize_torch``, on data made to reach the edges: normals of every
magnitude, outliers, whole zero blocks, blocks under the 1e-4 amax clamp, +-dtype max, values
around 448 and tiny (subnormal) ones.  ``per_block_cast_to_fp8`` is wrapped in ``torch.compile``,
which recompiles (seconds each) for every new dtype and stride pattern; the property tests call
the function it wraps (the same source, run eagerly) and one test calls the compiled function.
The Triton kernel runs in Triton's interpreter to check its indexing on the CPU;
its bits are checked on a GPU by tests/gpu/test_gpu_quantize.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.errors import InvalidInput
from refit.executor import quantize as qz
from refit.executor import quantize_grouped as qg
from refit.executor.quantize import (FP8_BLOCK, dequantize_fp8_blocks, fp8_scale_shape, quantize_fp8_blocks,
                                     quantize_mxfp8)
from refit.executor.quantize_grouped import quantize_fp8_blocks_many

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def vllm_block() -> object:
    """vLLM's per-block quantizer, eager (the body that ``torch.compile`` wraps)."""
    pytest.importorskip("vllm")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)


@pytest.fixture(scope="module")
def vllm_mx() -> object:
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    return _mxfp8_e4m3_quantize_torch


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def reference_blocks(ref: object, x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's function on every 2-D slice of ``x``, stacked back into ``x``'s leading dims."""
    r, c = x.shape[-2:]
    parts = [ref(s.clone(), block_size=list(block), use_ue8m0=False) for s in x.reshape(-1, r, c)]
    q = torch.stack([p[0] for p in parts]).view(x.shape)
    s = torch.stack([p[1] for p in parts]).view(fp8_scale_shape(x.shape, block))
    return q, s


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (rq, rs) = got, want
    assert q.dtype == rq.dtype == torch.float8_e4m3fn and q.shape == rq.shape
    assert s.dtype == rs.dtype and s.shape == rs.shape, (s.dtype, s.shape, rs.dtype, rs.shape)
    diff = codes(q) != codes(rq)
    assert not diff.any(), f"{int(diff.sum())} codes differ, first at {diff.nonzero()[0].tolist()}"
    assert torch.equal(s, rs), f"{int((s != rs).sum())} scales differ"


# ------------------------------------------------------------------------------------------------
# Test data: reaching every edge of the arithmetic


def edge_data(shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int], seed: int, features: frozenset[str],
              magnitude: int) -> torch.Tensor:
    """Normals times ``10**magnitude``, then the chosen edges written in (computed in float64,
    clamped to ``dtype``'s finite range: the bit-exact contract is for finite inputs)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** magnitude
    flat = x.view(-1)

    def some(k: int) -> torch.Tensor:
        return torch.randint(0, n, (max(1, k),), generator=g)

    def signs(k: int) -> torch.Tensor:
        return torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0).double()

    fmax = torch.finfo(dtype).max
    if "outliers" in features:
        i = some(n // 50)
        flat[i] *= 10.0 ** torch.randint(1, 6, (len(i),), generator=g).double()
    if "near448" in features:
        vals = torch.tensor([448.0, 447.9, 448.1, 449.0, 464.0, 480.0, 440.0, 456.0, 1.0, 0.5, 2 ** -9, 2 ** -10],
                            dtype=torch.float64)
        i = some(min(n, 24))
        flat[i] = vals[torch.randint(0, len(vals), (len(i),), generator=g)] * signs(len(i))
    if "tiny" in features:
        ti = torch.finfo(dtype)
        vals = torch.tensor([ti.tiny, ti.tiny * ti.eps, 1e-4, 9.9e-5, 1.01e-4, 1e-6, 1e-8, 3e-5], dtype=torch.float64)
        i = some(min(n, 24))
        flat[i] = vals[torch.randint(0, len(vals), (len(i),), generator=g)] * signs(len(i))
    if "dtypemax" in features:
        i = some(min(n, 6))
        flat[i] = fmax * signs(len(i))
    r, c = shape[-2:]
    bm, bn = block
    x3 = x.view(-1, r, c)
    nbr, nbc = -(-r // bm), -(-c // bn)
    if "zeroblocks" in features or "tinyblocks" in features:
        for _ in range(3):
            lead = int(torch.randint(0, x3.shape[0], (1,), generator=g))
            br, bc = int(torch.randint(0, nbr, (1,), generator=g)), int(torch.randint(0, nbc, (1,), generator=g))
            sl = x3[lead, br * bm:(br + 1) * bm, bc * bn:(bc + 1) * bn]
            if "zeroblocks" in features:
                sl.zero_()
                if torch.rand(1, generator=g) < 0.5:
                    sl[0, 0] = -0.0
            if "tinyblocks" in features:  # all under the amax clamp of 1e-4
                sl.copy_(torch.randn(sl.shape, generator=g, dtype=torch.float64) * 1e-6)
    return x.clamp(-fmax, fmax).to(dtype)


FEATURES = st.frozensets(st.sampled_from(["outliers", "near448", "tiny", "dtypemax", "zeroblocks", "tinyblocks"]))


@st.composite
def block_cases(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, int]]:
    block = draw(st.sampled_from([(128, 128), (4, 8), (8, 4), (3, 5), (16, 16), (1, 32)]))
    dtype = draw(st.sampled_from(DTYPES))
    bm, bn = block
    big = block == (128, 128)
    r = draw(st.integers(1, 300 if big else 6 * bm + 3))
    c = draw(st.integers(1, 300 if big else 6 * bn + 3))
    lead = draw(st.sampled_from([(), (1,), (2,), (3,)] if not big else [(), (2,)]))
    mag = draw(st.integers(-6, 3 if dtype == torch.float16 else 8))
    x = edge_data((*lead, r, c), dtype, block, draw(st.integers(0, 2 ** 31)), draw(FEATURES), mag)
    return x, block


# ------------------------------------------------------------------------------------------------
# Per-block FP8


@settings(max_examples=250, **SETTINGS)
@given(block_cases())
def test_blocks_equal_vllm_bit_for_bit(vllm_block: object, case: tuple[torch.Tensor, tuple[int, int]]) -> None:
    x, block = case
    got = quantize_fp8_blocks(x, block)
    assert got[1].shape == fp8_scale_shape(x.shape, block)
    assert_same(got, reference_blocks(vllm_block, x, block))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_finite_value_as_its_own_block(vllm_block: object, dtype: torch.dtype) -> None:
    """Blocks of 1x1 over every finite value of the dtype: each value is its block's amax, so
    every scale the dtype can produce is checked (and each value's code, +-448 or NaN-free 0)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits)].view(-1, 8)
    assert_same(quantize_fp8_blocks(x, (1, 1)), vllm_block(x, block_size=[1, 1], use_ue8m0=False))


def test_blocks_equal_vllm_compiled(vllm_block: object) -> None:
    """The function vLLM really runs is the ``torch.compile``d one: once, on bf16 with partial
    blocks (one compilation; the property tests cover its eager body)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    x = edge_data((2, 200, 300), torch.bfloat16, FP8_BLOCK, 7, frozenset(["outliers", "near448", "zeroblocks",
                                                                           "tinyblocks", "dtypemax"]), 0)
    assert_same(quantize_fp8_blocks(x), reference_blocks(per_block_cast_to_fp8, x, FP8_BLOCK))


def test_out_buffers_are_written_in_place(vllm_block: object) -> None:
    x = edge_data((3, 130, 257), torch.bfloat16, FP8_BLOCK, 1, frozenset(["outliers", "zeroblocks"]), 0)
    want = reference_blocks(vllm_block, x, FP8_BLOCK)
    # views into longer wire buffers holding garbage
    wire = torch.randint(0, 255, (x.numel() + 64,), dtype=torch.uint8)
    head = wire[:64].clone()
    out = wire[64:].view(torch.float8_e4m3fn).view(x.shape)
    sflat = torch.full((3 * 2 * 3 + 5,), float("nan"))
    scale_out = sflat[5:].view(3, 2, 3)
    q, s = quantize_fp8_blocks(x, out=out, scale_out=scale_out)
    assert q is out and s is scale_out
    assert q.data_ptr() == wire.data_ptr() + 64 and s.data_ptr() == sflat.data_ptr() + 5 * 4
    assert_same((q, s), want)
    assert torch.equal(wire[:64], head) and sflat[:5].isnan().all()
    # outputs whose leading dims do not flatten (written through a temporary)
    x2 = torch.stack([x, x])  # [2, 3, 130, 257]
    out_t = torch.empty((3, 2, 130, 257), dtype=torch.float8_e4m3fn).transpose(0, 1)
    s_t = torch.empty((3, 2, 2, 3)).transpose(0, 1)
    q, s = quantize_fp8_blocks(x2, out=out_t, scale_out=s_t)
    assert q is out_t and s is s_t
    for i in range(2):
        assert_same((q[i], s[i]), want)
    # a non-contiguous input
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert_same(quantize_fp8_blocks(xt), want)


def test_chunked_path_equals_whole(vllm_block: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path works in slabs of block rows (several slices per slab when slices are
    small): forced to many tiny slabs, and at the default size on a larger MoE-like tensor."""
    x = edge_data((5, 300, 260), torch.bfloat16, FP8_BLOCK, 2, frozenset(["outliers", "zeroblocks", "tiny"]), 0)
    small = edge_data((7, 21, 30), torch.float32, (4, 8), 3, frozenset(["outliers", "zeroblocks"]), -2)
    want, want_small = reference_blocks(vllm_block, x, FP8_BLOCK), reference_blocks(vllm_block, small, (4, 8))
    for budget in (1, 4096, 128 * 384 * 2, 1 << 30):
        monkeypatch.setattr(qz, "_CPU_CHUNK_ELEMS", budget)
        assert_same(quantize_fp8_blocks(x), want)
        assert_same(quantize_fp8_blocks(small, (4, 8)), want_small)
    monkeypatch.undo()
    big = edge_data((3, 1024, 1408), torch.bfloat16, FP8_BLOCK, 4, frozenset(["outliers", "zeroblocks"]), 0)
    assert big.numel() > qz._CPU_CHUNK_ELEMS >= 2 * 1024 * 1408  # two chunks: 2 slices, 1
    assert_same(quantize_fp8_blocks(big), reference_blocks(vllm_block, big, FP8_BLOCK))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_within_half_a_code(dtype: torch.dtype) -> None:
    x = edge_data((2, 150, 140), dtype, FP8_BLOCK, 5, frozenset(["outliers", "zeroblocks"]), 0)
    q, s = quantize_fp8_blocks(x)
    d = dequantize_fp8_blocks(q, s)
    assert d.dtype == torch.float32 and d.shape == x.shape
    sf = s.repeat_interleave(128, -2)[..., :150, :].repeat_interleave(128, -1)[..., :140]
    # e4m3: 3 mantissa bits (half a code is 2**-4 relative), subnormal step 2**-9 (times the scale)
    assert ((d - x.float()).abs() <= x.float().abs() * 2 ** -4 + sf * 2 ** -10).all()
    assert dequantize_fp8_blocks(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_empty_inputs() -> None:
    q, s = quantize_fp8_blocks(torch.empty(3, 0, 200, dtype=torch.bfloat16))
    assert q.shape == (3, 0, 200) and s.shape == (3, 0, 2)
    q, s = quantize_fp8_blocks(torch.empty(0, 5, 7))
    assert q.shape == (0, 5, 7) and s.shape == (0, 1, 1)


def test_refusals() -> None:
    x = torch.zeros(4, 130, 200, dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"input dtype torch.int32 is not one of"):
        quantize_fp8_blocks(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(InvalidInput, match=r"input dtype torch.float64"):
        quantize_fp8_blocks(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(InvalidInput, match=r"at least 2 dims, got shape \(7,\) \(1 dims\)"):
        quantize_fp8_blocks(torch.zeros(7))
    with pytest.raises(ValueError, match=r"block must be two positive ints, got \(0, 128\)"):
        quantize_fp8_blocks(x, (0, 128))
    with pytest.raises(ValueError, match=r"out must be torch.float8_e4m3fn of shape \(4, 130, 200\) on cpu, got "
                                         r"torch.float8_e4m3fn of shape \(4, 200, 130\)"):
        quantize_fp8_blocks(x, out=torch.empty(4, 200, 130, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"out must be .* got torch.uint8 of shape \(4, 130, 200\)"):
        quantize_fp8_blocks(x, out=torch.empty(4, 130, 200, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scale_out must be torch.float32 of shape \(4, 2, 2\) on cpu, got "
                                         r"torch.float32 of shape \(4, 1, 2\)"):
        quantize_fp8_blocks(x, scale_out=torch.empty(4, 1, 2))
    with pytest.raises(ValueError, match=r"scale_out must be .* got torch.bfloat16 of shape \(4, 2, 2\)"):
        quantize_fp8_blocks(x, scale_out=torch.empty(4, 2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"scale shape \(4, 2, 3\) does not fit values of shape \(4, 130, 200\)"):
        dequantize_fp8_blocks(torch.empty(4, 130, 200, dtype=torch.float8_e4m3fn), torch.empty(4, 2, 3))
    with pytest.raises(ValueError, match=r"last dim \(48\) must be a multiple of 32, shape \(3, 48\)"):
        quantize_mxfp8(torch.zeros(3, 48))
    with pytest.raises(ValueError, match=r"input dtype torch.int8"):
        quantize_mxfp8(torch.zeros(3, 32, dtype=torch.int8))


# ------------------------------------------------------------------------------------------------
# Many tensors at once


def many_inputs(block: tuple[int, int]) -> list[torch.Tensor]:
    """A mixed shard: repeated shapes, dtypes, 2-D and 3-D, partial blocks, a transposed
    (non-contiguous) member and an empty one."""
    bm, bn = block
    specs = [((2 * bm + 3, 3 * bn - 1), torch.bfloat16), ((2 * bm + 3, 3 * bn - 1), torch.bfloat16),
             ((3, 2 * bm, 2 * bn), torch.bfloat16), ((2 * bm, 2 * bn), torch.bfloat16),
             ((bm + 1, 2 * bn + 5), torch.float16), ((2, bm - 1, bn + 2), torch.float32), ((1, 1), torch.float32),
             ((2 * bm + 3, 3 * bn - 1), torch.float32)]
    xs = [edge_data(shape, dtype, block, i, frozenset(["outliers", "zeroblocks", "tiny", "near448"]), i % 3 - 1)
          for i, (shape, dtype) in enumerate(specs)]
    xs.append(xs[3].t().contiguous().t())  # the same values, column-major
    xs.append(torch.empty((0, 2 * bn), dtype=torch.bfloat16))
    return xs


def many_outputs(xs: list[torch.Tensor], block: tuple[int, int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and scales filled with garbage; the first member's are views into wire buffers."""
    outs = [torch.full(x.shape, 0.5).to(torch.float8_e4m3fn) for x in xs]
    scales = [torch.full(fp8_scale_shape(x.shape, block), -1.0) for x in xs]
    wire = torch.zeros(xs[0].numel() + 3, dtype=torch.uint8)
    outs[0] = wire[3:].view(torch.float8_e4m3fn).view(xs[0].shape)
    return outs, scales


@pytest.mark.parametrize("block", [FP8_BLOCK, (4, 8)])
def test_many_equals_per_tensor_calls(block: tuple[int, int]) -> None:
    xs = many_inputs(block)
    want = [quantize_fp8_blocks(x, block) for x in xs]
    outs, scales = many_outputs(xs, block)
    for _ in range(2):  # a second call into the same buffers
        assert quantize_fp8_blocks_many(xs, outs, scales, block) is None
        for i, (q, s) in enumerate(zip(outs, scales)):
            assert_same((q, s), want[i])
    # a non-contiguous output, and generators instead of lists
    outs_t = [torch.empty(x.shape[::-1], dtype=torch.float8_e4m3fn).transpose(-1, -2) if x.ndim == 2 else
              torch.empty(x.shape, dtype=torch.float8_e4m3fn) for x in xs]
    quantize_fp8_blocks_many(iter(xs), (o for o in outs_t), iter(scales), block)
    for i, q in enumerate(outs_t):
        assert_same((q, scales[i]), want[i])
    quantize_fp8_blocks_many([], [], [], block)


def test_many_refusals() -> None:
    xs = [torch.ones(130, 200, dtype=torch.bfloat16), torch.ones(2, 64, 300)]
    outs = [torch.zeros(130, 200, dtype=torch.float8_e4m3fn), torch.zeros(2, 64, 300, dtype=torch.float8_e4m3fn)]
    scales = [torch.zeros(2, 2), torch.zeros(2, 1, 3)]
    with pytest.raises(InvalidInput, match=r"2 inputs, 1 outs and 2 scales"):
        quantize_fp8_blocks_many(xs, outs[:1], scales)
    with pytest.raises(InvalidInput, match=r"block must be two positive ints"):
        quantize_fp8_blocks_many(xs, outs, scales, (128, -1))
    with pytest.raises(InvalidInput, match=r"xs\[1\]: input dtype torch.int32 is not one of"):
        quantize_fp8_blocks_many([xs[0], torch.zeros(2, 64, 300, dtype=torch.int32)], outs, scales)
    with pytest.raises(InvalidInput, match=r"xs\[0\]: input needs at least 2 dims, got shape \(7,\)"):
        quantize_fp8_blocks_many([torch.zeros(7), xs[1]], outs, scales)
    with pytest.raises(InvalidInput, match=r"xs\[1\]: expected a torch.Tensor, got list"):
        quantize_fp8_blocks_many([xs[0], [1.0]], outs, scales)
    with pytest.raises(InvalidInput, match=r"outs\[1\]: expected a torch.Tensor, got NoneType"):
        quantize_fp8_blocks_many(xs, [outs[0], None], scales)
    with pytest.raises(InvalidInput, match=r"outs\[1\] must be torch.float8_e4m3fn of shape \(2, 64, 300\) on cpu, "
                                           r"got torch.float8_e4m3fn of shape \(2, 300, 64\) on cpu"):
        quantize_fp8_blocks_many(xs, [outs[0], outs[1].transpose(1, 2)], scales)
    with pytest.raises(InvalidInput, match=r"outs\[0\] must be .* got torch.uint8 of shape \(130, 200\)"):
        quantize_fp8_blocks_many(xs, [outs[0].view(torch.uint8), outs[1]], scales)
    with pytest.raises(InvalidInput, match=r"scales\[1\] must be torch.float32 of shape \(2, 1, 3\) on cpu, got "
                                           r"torch.float32 of shape \(2, 1, 2\) on cpu"):
        quantize_fp8_blocks_many(xs, outs, [scales[0], torch.zeros(2, 1, 2)])
    with pytest.raises(InvalidInput, match=r"scales\[0\] must be .* got torch.bfloat16 of shape \(2, 2\)"):
        quantize_fp8_blocks_many(xs, outs, [scales[0].bfloat16(), scales[1]])
    with pytest.raises(InvalidInput, match=r"scales\[0\] must be .* on cpu, got torch.float32 of shape \(2, 2\) on meta"):
        quantize_fp8_blocks_many(xs, outs, [scales[0].to("meta"), scales[1]])
    # nothing was written: every check runs before the first member is quantized
    assert not any(o.view(torch.uint8).any() for o in outs) and not any(s.any() for s in scales)


def test_many_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan cache (used on CUDA): found again for the same tensor objects at the same
    addresses; not for a new object, a tensor moved to other memory (``set_``), a freed one, or
    another block; the oldest plan goes past a few."""
    monkeypatch.setattr(qg, "_many_cache", type(qg._many_cache)())
    xs, outs, scales = [torch.ones(4, 130, 200)], [torch.empty(4, 130, 200, dtype=torch.float8_e4m3fn)], \
        [torch.empty(4, 2, 2)]
    flat = [*xs, *outs, *scales]
    key = qg._many_key(FP8_BLOCK, flat)
    plan = qg._ManyPlan([], [])
    assert qg._many_lookup(key, flat) is None
    qg._many_remember(key, flat, plan)
    assert qg._many_lookup(qg._many_key(FP8_BLOCK, [*xs, *outs, *scales]), [*xs, *outs, *scales]) is plan
    assert qg._many_lookup(qg._many_key((4, 8), flat), flat) is None
    other = [xs[0].clone(), *outs, *scales]
    assert qg._many_lookup(qg._many_key(FP8_BLOCK, other), other) is None
    forged = (FP8_BLOCK, id(other[0]), *key[2:])  # an id reused by another object
    assert qg._many_lookup(forged, other) is None
    scales[0].set_(torch.empty(4, 2, 2))  # the same object, other memory
    assert qg._many_lookup(key, flat) is None
    keys = []
    for _ in range(qg._MANY_CACHE_SIZE + 1):
        ts = [torch.ones(2, 2), torch.empty(2, 2, dtype=torch.float8_e4m3fn), torch.empty(1, 1)]
        keys.append(qg._many_key(FP8_BLOCK, ts))
        qg._many_remember(keys[-1], ts, plan)
    assert list(qg._many_cache) == keys[1:]  # the oldest went
    del ts  # the last list's tensors freed: its plan is not found for new tensors under a reused key
    fresh = [torch.ones(2, 2), torch.empty(2, 2, dtype=torch.float8_e4m3fn), torch.empty(1, 1)]
    assert qg._many_lookup(keys[-1], fresh) is None
    assert qg._many_lookup(keys[-1], [None, None, None]) is None


# ------------------------------------------------------------------------------------------------
# MXFP8


@st.composite
def mx_cases(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = (*draw(st.sampled_from([(), (1,), (3,)])), draw(st.integers(1, 40)), 32 * draw(st.integers(1, 6)))
    mag = draw(st.integers(-6, 3 if dtype == torch.float16 else 8))
    return edge_data(shape, dtype, (1, 32), draw(st.integers(0, 2 ** 31)), draw(FEATURES), mag)


@settings(max_examples=150, **SETTINGS)
@given(mx_cases())
def test_mxfp8_equals_vllm_bit_for_bit(vllm_mx: object, x: torch.Tensor) -> None:
    q, s = quantize_mxfp8(x)
    rq, rs = vllm_mx(x, is_sf_swizzled_layout=False)
    assert s.dtype == rs.dtype == torch.uint8 and s.shape == rs.shape == (*x.shape[:-1], x.shape[-1] // 32)
    assert q.shape == x.shape and torch.equal(codes(q), codes(rq))
    assert torch.equal(s, rs)


def test_mxfp8_chunked_equals_vllm(vllm_mx: object, monkeypatch: pytest.MonkeyPatch) -> None:
    x = edge_data((4, 100, 256), torch.bfloat16, (1, 32), 9, frozenset(["outliers", "zeroblocks", "tiny"]), 0)
    rq, rs = vllm_mx(x, is_sf_swizzled_layout=False)
    monkeypatch.setattr(qz, "_CPU_CHUNK_ELEMS", 1000)
    q, s = quantize_mxfp8(x)
    assert torch.equal(codes(q), codes(rq)) and torch.equal(s, rs)


# ------------------------------------------------------------------------------------------------
# The Triton kernel's indexing, in Triton's interpreter

_INTERPRETED = """
import torch
from refit.executor import quantize as qz
cases = [((300, 260), (128, 128), torch.bfloat16), ((2, 256, 384), (128, 128), torch.bfloat16),
         ((2, 9, 13), (4, 8), torch.float32), ((10, 11), (3, 5), torch.float16),
         ((1, 300, 200), (256, 256), torch.float32)]
for i, (shape, block, dtype) in enumerate(cases):
    g = torch.Generator().manual_seed(i)
    x = (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-5, 4, shape, generator=g)).to(dtype)
    if len(shape) == 3:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided rows and columns
    q0, s0 = qz.quantize_fp8_blocks(x, block)
    q, s = torch.full_like(q0, 0.5), torch.full_like(s0, -1.0)
    qz._quantize_fp8_triton(x, block, q, s)
    assert torch.equal(s, s0), (shape, block, int((s != s0).sum()))
    a, b = q0.float(), q.float()
    ok = (a == b) | ((a - b).abs() <= a.abs() * 0.5) | (a.abs() <= 2 ** -9)
    assert ok.all(), (shape, block, int((~ok).sum()))
    assert (a == b).float().mean() > 0.85, (shape, block)
print("ok")
"""


def test_triton_kernel_indexing_in_the_interpreter() -> None:
    """The kernel's program ids, strides, masks, partial and two-pass blocks, run by Triton's
    interpreter on the CPU (a fresh process: triton reads TRITON_INTERPRET when it is imported).
    Scales must be equal; values too, but for the interpreter's own float8 conversion (a numpy
    emulation that drops the carry of a mantissa rounding up and flushes the smallest
    subnormals): on a GPU the bits are equal (tests/gpu/test_gpu_quantize.py)."""
    pytest.importorskip("triton")
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


_INTERPRETED_MANY = """
import torch
from refit.executor import quantize as qz
from refit.executor import quantize_grouped as qg
qg._MAX_PROGRAMS = 10  # several launches for most groups
g = torch.Generator().manual_seed(0)
def mk(shape, dtype):
    return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-5, 4, shape, generator=g)).to(dtype)
cases = [((128, 128), [((300, 260), torch.bfloat16), ((300, 260), torch.bfloat16), ((2, 256, 384), torch.bfloat16),
                       ((256, 384), torch.bfloat16), ((256, 384), torch.bfloat16), ((1, 129), torch.float32),
                       ((3, 2, 136), torch.float32), ((130, 140), torch.float16)]),
         ((4, 8), [((2, 9, 13), torch.float32), ((9, 13), torch.float32), ((10, 11), torch.float16)])]
for block, specs in cases:
    xs = [mk(s, d) for s, d in specs]
    want = [qz.quantize_fp8_blocks(x, block) for x in xs]
    outs = [torch.full_like(q, 0.5) for q, _ in want]
    unaligned = len(xs) > 4
    if unaligned:  # an output not 16-byte aligned: a group of its own
        wire = torch.zeros(xs[4].numel() + 1, dtype=torch.uint8)
        outs[4] = wire[1:].view(torch.float8_e4m3fn).view(xs[4].shape)
    scales = [torch.full_like(s, -1.0) for _, s in want]
    plan = qg._many_plan(xs, outs, scales, block, use_kernel=lambda x: True)
    # a group per dtype and 2-D shape, split further by alignment (the unaligned output, 3-D
    # members whose slices are not a multiple of 16 bytes long)
    assert not plan.loop and len(plan.groups) >= len({(x.dtype, x.shape[-2:]) for x in xs}) + unaligned
    assert sorted(i for gr in plan.groups for i in gr.members) == list(range(len(xs)))
    assert any(len(gr.launches) > 1 for gr in plan.groups)
    qg._many_run(plan, xs, outs, scales, block)
    for x, q, s, (q0, s0) in zip(xs, outs, scales, want):
        assert torch.equal(s, s0), (x.shape, block, int((s != s0).sum()))
        a, b = q0.float(), q.float()
        ok = (a == b) | ((a - b).abs() <= a.abs() * 0.5) | (a.abs() <= 2 ** -9)
        assert ok.all(), (x.shape, block, int((~ok).sum()))
        assert (a == b).float().mean() > 0.85, (x.shape, block)
print("ok")
"""


def test_grouped_kernel_in_the_interpreter() -> None:
    """The grouped kernel (`quantize_fp8_blocks_many` on CUDA) in Triton's interpreter: slices'
    offsets loaded from the int64 tables (in 16 bytes, or elements), 2-D and 3-D members of a group,
    partial blocks, an unaligned member, groups split over several launches.  Compared as the
    single kernel is above (scales equal, values but for the interpreter's float8 emulation)."""
    pytest.importorskip("triton")
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, "-c", _INTERPRETED_MANY], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
