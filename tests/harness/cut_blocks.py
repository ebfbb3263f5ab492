"""Helpers for trainer layouts that cut FP8 blocks (tests/unit/test_shared_blocks.py,
tests/gpu/test_gpu_shared_blocks.py): a small FP8 model, bfloat16 weights with outliers, what a
trainer's data plane hands the executor, an in-process run of a plan's transfers, and the
element-by-element comparison with the quantization of each whole tensor."""

from __future__ import annotations

import math

import torch

from refit.executor.quantize import quantize, quantize_fp8_blocks
from refit.executor.values import TORCH_DTYPES
from refit.layouts import QuantizedLayout, sent_tensors
from refit.quantization import is_quantized
from refit.regions import PieceIndex, slices
from refit.spec import ModelConfig, ModelSpec, base_spec, build_spec, quantize_spec

CONFIG = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 256,
          "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "torch_dtype": "bfloat16"}


def fp8_spec(**changes: object) -> ModelSpec:
    return quantize_spec(build_spec("q", ModelConfig.from_hf({**CONFIG, **changes})), "fp8")


def reference(x: torch.Tensor, vllm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization of the whole tensor: vLLM's ``per_block_cast_to_fp8`` of every 2-D slice
    (``vllm``, where vLLM is installed: it compiles per shape, seconds each), or refit's CPU
    quantizer, checked bit for bit against it in test_quantize.py."""
    if not vllm:
        return quantize_fp8_blocks(x)
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except ImportError:
        return quantize_fp8_blocks(x)
    flat = x.reshape(-1, *x.shape[-2:])
    pairs = [per_block_cast_to_fp8(m, [128, 128], use_ue8m0=False) for m in flat]
    q = torch.stack([v for v, _ in pairs]).view(x.shape)
    return q, torch.stack([s for _, s in pairs]).view(*x.shape[:-2], *pairs[0][1].shape)


def weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """bfloat16 canonical tensors: random, with outliers up to 3e4 and tiny values (no zeros)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in base_spec(spec).tensors:
        x = torch.randn(t.shape, generator=g) * 0.02
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), generator=g)
        picks = torch.tensor([300.0, -300.0, 1e4, -3e4, 1e-3, 448.0, -448.0, 1e-6])
        flat[idx] = picks[torch.randint(0, len(picks), idx.shape, generator=g)]
        out[t.name] = x.to(torch.bfloat16)
    return out


def expected(spec: ModelSpec, canon: dict[str, torch.Tensor], vllm: bool = False) -> dict[str, torch.Tensor]:
    out = dict(canon)
    for name, x in canon.items():
        if is_quantized(name):
            out[name], out[name + "_scale_inv"] = reference(x, vllm)
    return out


def trainer_tensors(spec: ModelSpec, src: QuantizedLayout, rank: int, canon: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """What a trainer's data plane hands the executor: its shard, the weights it can quantize
    alone quantized (values and scales), those that cut blocks as they are (bfloat16)."""
    base = base_spec(spec)
    held = {}
    for lt in src.inner.local_tensors(base, rank):
        x = torch.zeros(lt.shape, dtype=TORCH_DTYPES[lt.dtype])
        for p in lt.pieces:
            x.view(lt.view_shape(len(base[p.tensor].shape)))[slices(p.local_start, p.size)] = \
                canon[p.tensor][slices(p.start, p.size)]
        held[lt.name] = x
    scales = src.scale_locals(spec, rank)
    out = {lt.name: held[lt.name] for lt in src.local_tensors(spec, rank) if lt.name in held}
    for name, scale in scales.items():
        out[name], out[scale] = quantize("fp8", held[name])
    return out


def land(spec: ModelSpec, plan, src, dst, sent: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Every transfer of ``plan`` read from the trainers' sent tensors into fresh engine tensors
    (stage 0 of a gathering plan into canonical-shaped staging on its root, which stage 1 reads
    too; a receiver of a whole gathered tensor keeps what its pieces cover)."""
    ndim = {t.name: len(t.shape) for t in spec.tensors}
    out = [{lt.name: torch.zeros(lt.shape, dtype=TORCH_DTYPES[lt.dtype]) for lt in dst.local_tensors(spec, d)}
           for d in range(dst.world_size)]
    s_index = [PieceIndex(sent_tensors(spec, src, r)) for r in range(src.world_size)]
    d_index = [PieceIndex(dst.local_tensors(spec, d)) for d in range(dst.world_size)]
    staged: dict[tuple[int, str], torch.Tensor] = {}  # (root, tensor) -> what stage 0 gathered there

    def read(rank: int, tensor: str, start, size) -> torch.Tensor:
        box = torch.empty(size, dtype=TORCH_DTYPES[spec[tensor].dtype])
        got = 0
        for b in s_index[rank].regions(tensor, (start, size)):
            view = sent[rank][b.local].view(s_index[rank].tensors[b.local].view_shape(ndim[tensor]))
            box[slices(b.box_start, b.size)] = view[slices(b.local_start, b.size)]
            got += math.prod(b.size)
        if got != math.prod(size):  # the rest was gathered here in stage 0
            box = staged[rank, tensor][slices(start, size)].clone()
            for b in s_index[rank].regions(tensor, (start, size)):
                view = sent[rank][b.local].view(s_index[rank].tensors[b.local].view_shape(ndim[tensor]))
                box[slices(b.box_start, b.size)] = view[slices(b.local_start, b.size)]
        return box

    for t in sorted(plan.transfers, key=lambda t: t.stage):
        box = read(t.sender, t.tensor, t.start, t.size)
        if t.stage == 0:
            root = staged.setdefault((t.receiver, t.tensor), torch.zeros(spec[t.tensor].shape,
                                                                     dtype=TORCH_DTYPES[spec[t.tensor].dtype]))
            root[slices(t.start, t.size)] = box
            continue
        for b in d_index[t.receiver].regions(t.tensor, (t.start, t.size)):
            view = out[t.receiver][b.local].view(d_index[t.receiver].tensors[b.local].view_shape(ndim[t.tensor]))
            view[slices(b.local_start, b.size)] = box[slices(b.box_start, b.size)]
    return out


def mismatches(spec: ModelSpec, dst, got: list[dict[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> list[str]:
    """Every element of every engine piece, bit for bit."""
    bad = []
    for d in range(dst.world_size):
        for lt in dst.local_tensors(spec, d):
            for p in lt.pieces:
                a = got[d][lt.name].view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)]
                e = want[p.tensor][slices(p.start, p.size)]
                if a.dtype != e.dtype or not torch.equal(a.contiguous().view(torch.uint8),
                                                         e.contiguous().view(torch.uint8)):
                    bad.append(f"dst {d} {lt.name} <- {p.tensor} {p.start}")
    return bad
