"""`refit.executor.fused_quantize`: same-device moves of float8 values quantized on landing land
the very bytes of the unfused refit (the trainer quantizing into wire shards, then copies), and
only where the blocks allow it."""

from __future__ import annotations

import pytest
import torch

from refit.executor.bound import bind, run_refit
from refit.executor.device import CpuDevice
from refit.executor.fused_quantize import fuse_program, unquantized_views, wire_reads
from refit.executor.quantize_grouped import quantize_many
from refit.executor.schedule import compile_program
from refit.executor.topology import Topology
from refit.executor.values import TORCH_DTYPES
from refit.planners import make_plan
from refit.sides import Side
from refit.spec import ModelConfig, base_spec, build_spec, quantize_spec

# head_dim 128: every trainer piece on 128-row block boundaries (none cut across ranks)
CONFIG = ModelConfig(arch="qwen3_moe", hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=128,
                     intermediate_size=512, vocab_size=300, qk_norm=True, num_experts=4, moe_intermediate_size=256,
                     moe_layers=(1,))
SPEC = quantize_spec(build_spec("fused-quantize", CONFIG), "fp8")


def _random(shape: tuple[int, ...], dtype: str, gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * 3.0
    return t.to(TORCH_DTYPES[dtype]) if "float8" not in dtype else t.clamp(-400, 400).to(TORCH_DTYPES[dtype])


def _run(src: str, dst: str, bucket: int, fused: bool) -> tuple[dict, int, dict]:
    """Every engine tensor after one refit of a single-member program (fused or not), the
    number of quantize moves, and the trainer tensors skipped from the wire."""
    r = make_plan(SPEC, src, dst, "colocated", "p2p", bucket)
    topo = Topology.single(r.plan.placement)
    program = compile_program(r.plan, SPEC, r.src, r.dst, topo, 0)
    gen = torch.Generator().manual_seed(7)
    tensors: dict = {}
    for ep, _ in topo.devices:
        layout = r.src if ep[0] is Side.TRAINER else r.dst
        tensors[ep] = {lt.name: _random(lt.shape, lt.dtype, gen) for lt in layout.local_tensors(SPEC, ep[1])}
        if ep[0] is Side.TRAINER:  # the wire shard: quantized from what the trainer holds
            held = {lt.name: _random(lt.shape, lt.dtype, gen)
                    for lt in r.src.inner.local_tensors(base_spec(SPEC), ep[1])}
            scales = r.src.scale_locals(SPEC, ep[1])
            quantize_many("fp8", [held[n] for n in scales], [tensors[ep][n] for n in scales],
                          [tensors[ep][s] for s in scales.values()])
            for n, t in held.items():
                if n not in scales:
                    tensors[ep][n].copy_(t)
            tensors[ep].update(unquantized_views(held))
    skipped: dict = {}
    if fused:
        sources = {ep: set(r.src.scale_locals(SPEC, ep[1])) for ep, _ in topo.devices if ep[0] is Side.TRAINER}
        program, took = fuse_program(program, SPEC, r.dst, sources)
        reads = wire_reads(program)
        skipped = {ep: names - reads.get(ep, set()) for ep, names in took.items()}
    run_refit(bind(program, tensors, torch.device("cpu")), None, CpuDevice(), lambda: 60.0)
    engines = {(ep, n): t.view(torch.uint8).clone() for ep, ts in tensors.items() if ep[0] is Side.ENGINE
               for n, t in ts.items()}
    return engines, sum(len(st.quantizes) for st in program.stages), skipped


@pytest.mark.parametrize("src,dst", [("tp1", "tp1"), ("tp2ep2", "tp2"), ("fsdp:dp2", "tp2")])
def test_quantizing_on_landing_lands_the_bytes_of_the_wire_refit(src: str, dst: str) -> None:
    plain, none, _ = _run(src, dst, 1 << 20, fused=False)
    landed, quantizes, skipped = _run(src, dst, 1 << 20, fused=True)
    assert none == 0 and quantizes > 0
    assert plain.keys() == landed.keys()
    for key in plain:
        assert torch.equal(plain[key], landed[key]), key
    assert any(skipped.values())


def test_blocks_off_the_grid_stay_copies_of_the_wire() -> None:
    """Small buckets cut the weights off their 128-row blocks: nothing is fused, nothing
    skipped, and the refit is the wire's."""
    plain, _, _ = _run("tp1", "tp1", 40_000, fused=False)
    landed, quantizes, skipped = _run("tp1", "tp1", 40_000, fused=True)
    assert quantizes == 0 and not any(skipped.values())
    assert all(torch.equal(plain[k], landed[k]) for k in plain)


def test_a_trainer_tensor_still_read_from_the_wire_is_not_skipped() -> None:
    """fsdp:dp2 -> vllm:tp2, one member per rank: trainer rank 0's rows of ``o_proj`` feed
    engine rank 1 too (vLLM splits its columns), over the wire; its driver fuses their landing
    on its own GPU, yet they stay on the wire.  Its rows of ``gate_proj`` go to engine rank 0
    alone: fused and skipped."""
    r = make_plan(SPEC, "fsdp:dp2", "tp2", "colocated", "p2p", 1 << 20)
    topo = Topology.one_per_rank(r.plan.placement)
    member = topo.driver_of[topo.device_of[(Side.TRAINER, 0)]]
    program = compile_program(r.plan, SPEC, r.src, r.dst, topo, member)
    sources = {(Side.TRAINER, 0): set(r.src.scale_locals(SPEC, 0))}
    fused, took = fuse_program(program, SPEC, r.dst, sources)
    took, reads = took[(Side.TRAINER, 0)], wire_reads(fused)[(Side.TRAINER, 0)]
    assert "model.layers.0.self_attn.o_proj.weight" in took & reads
    assert "model.layers.0.mlp.gate_proj.weight" in took - reads
