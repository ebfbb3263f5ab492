"""FP8 quantization on the wire, on CUDA (`refit.executor.quantize`, `refit.executor.quantize_grouped`,
`refit.executor.quantize_triton`): `make test-gpu`.

The Triton kernel must produce the bits of the torch path run on the CPU (which
tests/unit/test_quantize.py checks against vLLM's own functions): every FP8 code and every scale,
on data with outliers, whole zero blocks, blocks under the amax clamp, +-dtype max, values around
448, partial blocks, 2-D and 3-D (MoE-shaped) inputs, bf16, fp16 and fp32.  Without a CUDA device
every test skips with its reason.
"""

from __future__ import annotations

import pytest
import torch

from refit.executor.triton_support import triton_importable
from refit.executor import quantize as qz
from refit.executor import quantize_grouped as qg
from refit.executor import quantize_triton as qt
from refit.executor.quantize import FP8_BLOCK, fp8_scale_shape, quantize_fp8_blocks
from tests.unit.test_quantize import edge_data

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]

EDGES = frozenset(["outliers", "near448", "tiny", "dtypemax", "zeroblocks", "tinyblocks"])
CASES = [  # (shape, block)
    ((4096, 4096), FP8_BLOCK),
    ((300, 260), FP8_BLOCK),
    ((1, 129), FP8_BLOCK),
    ((3, 1536, 2048), FP8_BLOCK),  # qwen3-30b experts w13, 3 of them
    ((5, 200, 333), FP8_BLOCK),
    ((2, 37, 45), (4, 8)),
    ((70, 50), (3, 5)),
    ((2, 300, 520), (256, 256)),  # blocks larger than a register tile: two passes
]


def needs_triton() -> None:
    if not triton_importable("the kernel tests skip"):
        pytest.skip("triton is not installed: quantize_fp8_blocks uses the torch path on CUDA")
    if not qt._triton_usable(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("this GPU has no FP8 conversion (compute capability < 8.9): the torch path runs instead")


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    (q, s), (rq, rs) = (t.cpu() for t in got), want
    diff = q.view(torch.uint8) != rq.view(torch.uint8)
    first = diff.nonzero()[0].tolist() if diff.any() else None
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} codes differ, first at {first}"
    assert torch.equal(s, rs), f"{what}: {int((s != rs).sum())} of {s.numel()} scales differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape,block", CASES, ids=[f"{'x'.join(map(str, s))}-b{b[0]}x{b[1]}" for s, b in CASES])
@pytest.mark.parametrize("magnitude", [0, -5, 3])
def test_triton_equals_torch_cpu(shape: tuple[int, ...], block: tuple[int, int], dtype: torch.dtype,
                                 magnitude: int) -> None:
    needs_triton()
    x = edge_data(shape, dtype, block, hash((shape, block, magnitude)) % 2 ** 31, EDGES, magnitude)
    want = quantize_fp8_blocks(x, block)  # CPU: the torch path
    assert_same(quantize_fp8_blocks(x.cuda(), block), want, f"{shape} {block} {dtype}")


def test_in_place_strided_and_non_flattenable() -> None:
    """Outputs written in place into views of wire buffers; a transposed input; outputs whose
    leading dims do not flatten; a second device-side call reusing the buffers."""
    needs_triton()
    x = edge_data((4, 384, 520), torch.bfloat16, FP8_BLOCK, 11, EDGES, 0)
    want = quantize_fp8_blocks(x)
    dev = torch.device("cuda")
    wire = torch.zeros(x.numel() + 256, dtype=torch.uint8, device=dev)
    out = wire[256:].view(torch.float8_e4m3fn).view(x.shape)
    sflat = torch.full((7 + 4 * 3 * 5,), -1.0, device=dev)
    scale_out = sflat[7:].view(fp8_scale_shape(x.shape))
    for _ in range(2):
        q, s = quantize_fp8_blocks(x.to(dev), out=out, scale_out=scale_out)
        assert q is out and s is scale_out
        assert_same((q, s), want, "wire buffers")
    assert not wire[:256].any() and (sflat[:7] == -1).all()
    xt = x.to(dev).transpose(1, 2).contiguous().transpose(1, 2)
    assert_same(quantize_fp8_blocks(xt), want, "transposed input")
    x2 = torch.stack([x, x]).to(dev)
    out_t = torch.empty((4, 2, 384, 520), dtype=torch.float8_e4m3fn, device=dev).transpose(0, 1)
    s_t = torch.empty((4, 2, 3, 5), device=dev).transpose(0, 1)
    q, s = quantize_fp8_blocks(x2, out=out_t, scale_out=s_t)
    for i in range(2):
        assert_same((q[i], s[i]), want, "non-flattenable outputs")


def test_torch_path_on_cuda_equals_cpu() -> None:
    """The fallback (no triton, or a GPU without FP8 conversion) gives the same bits on CUDA."""
    x = edge_data((3, 300, 260), torch.bfloat16, FP8_BLOCK, 12, EDGES, 0)
    want = quantize_fp8_blocks(x)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(fp8_scale_shape(x.shape), device="cuda")
    qz._quantize_fp8_torch(x.cuda(), FP8_BLOCK, q, s)
    assert_same((q, s), want, "torch path on CUDA")


def test_mxfp8_on_cuda_equals_vllm_on_cuda() -> None:
    """MXFP8 runs torch's operations: equal to vLLM's function on the same device."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    x = edge_data((3, 100, 256), torch.bfloat16, (1, 32), 13, EDGES, 0).cuda()
    q, s = qz.quantize_mxfp8(x)
    rq, rs = _mxfp8_e4m3_quantize_torch(x, is_sf_swizzled_layout=False)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


# ------------------------------------------------------------------------------------------------
# Many tensors at once: the grouped kernel


def many_shard(dtype: torch.dtype) -> list[torch.Tensor]:
    """300 small tensors of 3 shapes (allocated one by one, as a trainer's shard holds them), a few
    big ones, 3-D members, partial blocks: made on the CPU with every edge, copied to the GPU."""
    shapes = [(256, 384), (130, 200), (2, 128, 136)] * 100 + [(4096, 4096), (3, 1536, 2048), (2048, 768),
                                                              (300, 260)]
    return [edge_data(shape, dtype, FP8_BLOCK, i, EDGES if i % 7 == 0 else frozenset(["outliers", "zeroblocks"]), 0)
            for i, shape in enumerate(shapes)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_many_equals_torch_cpu(dtype: torch.dtype) -> None:
    needs_triton()
    xs = many_shard(dtype)
    want = [quantize_fp8_blocks(x) for x in xs]  # CPU: the torch path
    dev = torch.device("cuda")
    xd = [x.to(dev) for x in xs]
    xd.append(xd[0].t().contiguous().t())  # non-contiguous: quantized on its own
    want.append(want[0])
    outs = [torch.full(x.shape, 7.0, device=dev).to(qz.FP8_DTYPE) for x in xd]
    scales = [torch.full(fp8_scale_shape(x.shape), -1.0, device=dev) for x in xd]
    built = qg._many_stats["tables_built"]
    qg.quantize_fp8_blocks_many(xd, outs, scales)
    assert qg._many_stats["tables_built"] - built >= 7  # one group per shape (alignment may split one)
    for i, (q, s) in enumerate(zip(outs, scales)):
        assert_same((q, s), want[i], f"member {i} {tuple(xs[min(i, len(xs) - 1)].shape)} {dtype}")


def test_many_cache_builds_tables_once() -> None:
    """The executor quantizes into the same buffers every refit: the second call with the same
    tensors finds its plan (no new table), new values give new bits, other buffers a new plan."""
    needs_triton()
    dev = torch.device("cuda")
    xs = [torch.randn(256, 384, device=dev, dtype=torch.bfloat16) for _ in range(50)]
    outs = [torch.empty(x.shape, dtype=qz.FP8_DTYPE, device=dev) for x in xs]
    scales = [torch.empty(fp8_scale_shape(x.shape), device=dev) for x in xs]
    qg.quantize_fp8_blocks_many(xs, outs, scales)
    built = qg._many_stats["tables_built"]
    for x in xs:
        x.mul_(3)
    qg.quantize_fp8_blocks_many(xs, outs, scales)
    assert qg._many_stats["tables_built"] == built
    for x, q, s in zip(xs, outs, scales):
        assert_same((q, s), quantize_fp8_blocks(x.cpu()), "second call")
    qg.quantize_fp8_blocks_many(xs[:10], outs[:10], scales[:10])  # another list: another plan
    assert qg._many_stats["tables_built"] == built + 1
    qg.quantize_fp8_blocks_many(xs, outs, scales)  # the first still cached (LRU of a few)
    assert qg._many_stats["tables_built"] == built + 1
