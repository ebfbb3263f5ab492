"""Test data for per-transfer checksums (`refit.executor.checksum`): canonical tensors of random
bits cut per layout, and boxes stored in local tensors every which way (padded, permuted,
misaligned), on any device.  Used by tests/unit/test_checksum.py and tests/gpu/test_gpu_checksum.py."""

from __future__ import annotations

import torch

from refit.executor import checksum as ck
from refit.executor import checksum_triton as ckt
from refit.executor.values import TORCH_DTYPES, int_view
from refit.layouts import Layout, LocalTensor
from refit.planners import make_plan
from refit.regions import Block, slices
from refit.sides import Side
from refit.spec import ModelConfig, ModelSpec, build_spec, quantize_spec
from tests.harness.tiny import tiny_spec

INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32}
WIDTHS = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
         "vocab_size": 300, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def spec_of(name: str) -> ModelSpec:
    if name == "tiny-qwen3":
        return build_spec(name, ModelConfig.from_hf(QWEN3))
    if name.endswith("/fp8"):  # the engines hold FP8 weights and float32 scales (the trainers quantize)
        return quantize_spec(tiny_spec(name.removesuffix("/fp8")), "fp8")
    return tiny_spec(name)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infinities and negative zeros among them)."""
    w = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(-2 ** (8 * w - 1), 2 ** (8 * w - 1), shape, generator=gen, dtype=torch.int64)
    return bits.to(INTS[w]).view(dtype)


def canonical(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: random_bits(t.shape, TORCH_DTYPES[t.dtype], gen) for t in spec.tensors}


def cut(spec: ModelSpec, layout: Layout, rank: int, canon: dict[str, torch.Tensor], scatter: bool = False,
        device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A rank's local tensors filled from the canonical ones; ``scatter``: stored unlike a fresh
    tensor (every other one column-major, others one element past an aligned address)."""
    out = {}
    for i, lt in enumerate(layout.local_tensors(spec, rank)):
        t = torch.zeros(lt.shape, dtype=TORCH_DTYPES[lt.dtype], device=device)
        for p in lt.pieces:
            view = int_view(t).view(lt.view_shape(len(p.size)))
            view[slices(p.local_start, p.size)] = int_view(canon[p.tensor])[slices(p.start, p.size)].to(device)
        out[lt.name] = restride(t, i) if scatter else t
    return out


def restride(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t``'s values in other storage: column-major (i odd, 2+ dims) or one element off."""
    if t.dim() >= 2 and i % 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    int_view(out).copy_(int_view(t))
    return out


def store(x: torch.Tensor, pad: tuple[int, ...], at: tuple[int, ...], order: tuple[int, ...],
          misalign: bool, device: str | torch.device = "cpu") -> torch.Tensor:
    """A local tensor holding ``x`` at ``at`` amid zero padding, its dimensions laid out in memory
    in ``order`` (outermost first), optionally one element past an aligned address."""
    shape = tuple(n + p for n, p in zip(x.shape, pad))
    stored = tuple(shape[d] for d in order)
    flat = torch.zeros(int(torch.tensor(shape).prod()) + misalign, dtype=x.dtype, device=device)
    t = flat[int(misalign):].view(stored).permute(*[order.index(d) for d in range(len(shape))])
    int_view(t)[slices(at, tuple(x.shape))] = int_view(x).to(device)
    return t


def synthetic(boxes_and_blocks: list[tuple[torch.Tensor, list[tuple[tuple[int, ...], tuple[int, ...], dict]]]],
              device: str | torch.device = "cpu") -> tuple[ck.Share, dict[str, torch.Tensor]]:
    """A `Share` of the given boxes, each cut into blocks ((box start, size, `store` arguments))
    kept in local tensors of their own."""
    locals_, tensors, out = {}, {}, []
    for n, (box, blocks) in enumerate(boxes_and_blocks):
        made = []
        for k, (start, size, how) in enumerate(blocks):
            name = f"t{n}.{k}"
            t = store(box[slices(start, size)], **how, device=device)
            dtype = str(box.dtype).removeprefix("torch.")
            locals_[name], tensors[name] = LocalTensor(name, tuple(t.shape), dtype, ()), t
            made.append(Block(name, how["at"], start, size))
        out.append(ck.BoxBlocks(n, tuple(box.shape), tuple(made)))
    return ck.Share(None, locals_, tuple(out)), tensors  # type: ignore[arg-type]


def kernel_cases(device: str | torch.device = "cpu") -> list[tuple[ck.Share, dict[str, torch.Tensor]]]:
    """Boxes that reach every launch of the kernel: element widths 1, 2 and 4; strided columns,
    unit stride, aligned 16-byte rows; one row or several; a row longer than one item."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for width, dtype in WIDTHS.items():
        block = 32 * ckt._CONFIG["num_warps"] * 16 // width
        long = ckt._ITEM_CHUNKS * block + 3 * block + 5
        plain = {"pad": (0, 0), "at": (0, 0), "order": (0, 1), "misalign": False}
        cases = [
            (random_bits((1, 50), dtype, gen), [((0, 0), (1, 50), {**plain, "pad": (1, 0), "order": (1, 0)})]),
            (random_bits((5, 70), dtype, gen), [((0, 0), (5, 70), {**plain, "order": (1, 0)})]),  # column-major
            (random_bits((1, 300), dtype, gen), [((0, 0), (1, 300), {**plain, "misalign": True})]),
            (random_bits((3, 5, 70), dtype, gen), [((0, 0, 0), (3, 5, 70), {"pad": (1, 1, 2), "at": (1, 1, 2),
                                                                            "order": (0, 1, 2), "misalign": False})]),
            (random_bits((1, long), dtype, gen), [((0, 0), (1, long), plain)]),
            (random_bits((8, 64), dtype, gen), [((0, 0), (8, 32), {**plain, "pad": (0, 96)}),
                                                ((0, 32), (8, 32), plain)]),  # contiguous here, not in the box
        ]
        out.append(synthetic(cases, device))
    spec = spec_of("tiny-qwen3-moe")
    r = make_plan(spec, "megatron:tp2", "vllm:tp1", bucket_bytes=4096)
    canon = canonical(spec)
    for side, layout in ((Side.TRAINER, r.src), (Side.ENGINE, r.dst)):
        share = ck._make_share(r.plan, spec, r.src, r.dst, side, 0)
        out.append((share, cut(spec, layout, 0, canon, scatter=side is Side.ENGINE, device=device)))
    return out
