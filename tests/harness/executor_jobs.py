"""End-to-end executor jobs for tests: tiny models, a `Job` of both planners with verified
refits, and the check of what the workers verified (tests/integration/test_executor.py on CPU,
tests/gpu/ on CUDA)."""

from __future__ import annotations

import math
from typing import Any

from refit.bench.worker import Job, PlanRun, Refit
from refit.executor.topology import Topology
from refit.planners import make_plan
from refit.spec import ModelConfig, ModelSpec, build_spec

MOE = build_spec("tiny-moe", ModelConfig(
    arch="qwen3_moe", hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=32, vocab_size=300, qk_norm=True, num_experts=8, moe_intermediate_size=16,
    moe_layers=(1, 2, 3)))  # layer 0 dense: both MLP kinds
DENSE = build_spec("tiny-dense", ModelConfig(
    arch="qwen2", hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=8,
    intermediate_size=64, vocab_size=250, qkv_bias=True, tie_embeddings=True, dtype="float32"))
BUCKET = 4096  # small buckets: many steps, both buffer sets, split transfers


def job(spec: ModelSpec, src: str, dst: str, placement: str, planners: tuple[str, ...] = ("p2p", "broadcast"),
        topology: str = "per-rank", kill: tuple[str, int, int] | None = None, refits: int = 2,
        transport: str = "comm", device: str = "cpu", phase_layers: int = 0,
        alloc: str = "framework") -> tuple[Job, list[Any]]:
    """A job running each planner's plan ``refits`` times, a new source seed each, verified after each."""
    plans = [make_plan(spec, src, dst, placement, p, BUCKET, phase_layers=phase_layers) for p in planners]
    runs = tuple(PlanRun(r.plan, tuple(Refit(seed=10 * i + k, verify=True) for k in range(refits)))
                   for i, r in enumerate(plans))
    place = plans[0].plan.placement
    topo = Topology.single(place) if topology == "single" else Topology.one_per_rank(place)
    return Job("", spec, plans[0].src, plans[0].dst, topo, runs, device=device, timeout_s=30, kill=kill,
               transport=transport, alloc=alloc), plans


def check(results: list[Any], plans: list[Any], spec: ModelSpec, refits: int = 2) -> None:
    """Every destination rank verified every refit of every plan, and every element was checked."""
    dst = plans[0].dst
    expected = sum(math.prod(p.size) for r in range(dst.world_size) for lt in dst.local_tensors(spec, r) for p in lt.pieces)
    for i, r in enumerate(plans):
        verdicts = {}
        for w in results:
            verdicts.update(w.runs[i].verdicts)
        assert sorted(verdicts) == sorted(f"engine rank {d}" for d in range(dst.world_size)), r.plan.planner
        for k in range(refits):
            got = [vs[k] for vs in verdicts.values()]
            assert all(v.ok for v in got), (r.plan.planner, k, [v.first for v in got if not v.ok])
            assert sum(v.checked for v in got) == expected
