"""Trainer shards that cut FP8 blocks (`refit.layouts.quantized`, `refit.executor.shared_blocks`):
a block held by several trainer ranks is quantized with one shared scale — the maximum of the
ranks' partial amaxes — so the engine gets exactly what vLLM's ``per_block_cast_to_fp8`` of the
whole bfloat16 tensor gives, values and scales, every element compared.

* the layout: what a cutting trainer rank holds and derives, who sends which scale; the engine
  refusal and MXFP8's;
* property: random models and trainer layouts that cut blocks (FSDP2 torch.chunk rows, HSDP,
  Megatron with 64-row heads), planned and executed in process, each trainer rank's quantizer on a
  thread of its own running `share` (the members' code) with a real gloo MAX all-reduce;
* the real executor: `Member`s in threads over gloo, the all-reduce on the control group, two
  refits with the weights changed between.
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.errors import InvalidInput
from refit.executor.member import Budget, Member
from refit.executor.seating import connect
from refit.executor.shared_blocks import SharedQuantizer, allocate_derived, share
from refit.executor.topology import Topology
from refit.executor.values import TORCH_DTYPES
from refit.hf_checkpoint import load_spec
from refit.layouts import QuantizedLayout, resolve_layout
from refit.layouts.quantized import shared_scale_table
from refit.planners import make_plan
from refit.sides import Side
from refit.spec import ModelConfig, build_spec, quantize_spec
from tests.harness.cut_blocks import CONFIG, expected, fp8_spec, land, mismatches, trainer_tensors, weights
from tests.harness.procs import together


# ------------------------------------------------------------------------------------------ layout


def test_a_cutting_trainer_holds_its_shard_unquantized_and_derives_values_and_owned_scales() -> None:
    q = fp8_spec()  # k_proj 256 rows: fsdp:dp4 holds 64 of them a rank
    src = resolve_layout("fsdp:dp4", q, Side.TRAINER)
    assert isinstance(src, QuantizedLayout) and src.shares_blocks
    k = "model.layers.0.self_attn.k_proj.weight"
    held = {lt.name: lt for lt in src.local_tensors(q, 1)}
    assert held[k].dtype == "bfloat16" and held[k].pieces == () and k + "_scale_inv" not in held
    assert k not in src.scale_locals(q, 1)
    derived = {lt.name: lt for lt in src.derived_tensors(q, 1)}
    values = derived["refit.quantized." + k]
    assert values.dtype == "float8_e4m3fn" and values.shape == (64, 256)
    assert [(p.start, p.size) for p in values.pieces] == [((0, 64, 0), (1, 64, 256))]
    # rows [64, 128) touch block row 0, whose first row rank 0 holds: rank 1 sends no scale of it
    assert derived[f"refit.quantized.{k}_scale_inv.0"].pieces == ()
    owner = {lt.name: lt for lt in src.derived_tensors(q, 2)}[f"refit.quantized.{k}_scale_inv.0"]
    assert [(p.tensor, p.start, p.size, p.local_start) for p in owner.pieces] == \
        [("model.layers.*.self_attn.k_proj.weight_scale_inv", (0, 1, 0), (1, 1, 2), (0, 0, 0))]
    # uneven torch.chunk rows: fsdp:dp3 gives 86, 86, 84 rows; blocks whole on no rank
    three = resolve_layout("fsdp:dp3", q, Side.TRAINER)
    owned = [p for r in range(3) for sb in three.shared_blocks(q, r) if sb.source == k
             for lt in sb.scales for p in lt.pieces]
    assert sorted((p.start[1], p.size[1]) for p in owned) == [(0, 1), (1, 1)]  # each block row once


def test_engines_that_cut_blocks_and_mxfp8_trainers_that_cut_are_still_refused() -> None:
    q = fp8_spec(num_attention_heads=4)
    with pytest.raises(InvalidInput, match=r"vllm:tp4 rank 0: .*w13_weight holds rows \[0, 64\) of .*gate_proj.weight "
                                           r"\(256 rows\) at rows \[0, 64\) of its 128: that cuts fp8's blocks of "
                                           r"128 rows.*as vLLM requires"):
        make_plan(q, "megatron:tp1", "vllm:tp4")
    # MXFP8's 1x32 blocks lie along the input dim: torch TP's rowwise o_proj split of 96 columns cuts them
    dense = ModelConfig.from_hf({**CONFIG, "model_type": "qwen3", "head_dim": 48})
    mx = quantize_spec(build_spec("d", dense), "mxfp8")
    with pytest.raises(InvalidInput, match=r"fsdp:dp1tp2 rank 0: .*o_proj.weight holds columns \[0, 48\) of "
                                           r".*o_proj.weight \(96 columns\).*cuts mxfp8's blocks of 32 columns"
                                           r".*not mxfp8's 1x32"):
        make_plan(mx, "fsdp:dp1tp2", "vllm:tp1")


# ---------------------------------------------------------------------------------------- property


@st.composite
def cutting_cases(draw):
    """A model whose engine (vllm:tp1, or tp2 where its shards stay whole blocks) holds whole
    blocks, and a trainer layout that cuts them."""
    tp2 = draw(st.booleans())
    dense = draw(st.booleans())
    changes: dict[str, object] = dict(hidden_size=256 if tp2 else draw(st.sampled_from([256, 384])),
                                      num_hidden_layers=draw(st.integers(1, 2)))
    if dense:
        changes.update(model_type="qwen3", intermediate_size=draw(st.sampled_from([256, 512] if tp2 else [256, 384])))
    else:
        changes.update(moe_intermediate_size=256 if tp2 else draw(st.sampled_from([128, 256])),
                       num_experts=draw(st.sampled_from([2, 4])))
    # 64-row heads: Megatron's interleaved q, k, v cut blocks (an engine at tp2 would cut k's 128 rows)
    heads = (2, 2, 128) if tp2 else draw(st.sampled_from([(2, 2, 128), (4, 2, 64)]))
    changes.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2])
    q = fp8_spec(**changes)
    trainers = ["fsdp:dp2", "fsdp:dp3", "fsdp:dp4", "fsdp:dp5", "fsdp:dp8", "fsdp:dp3rep2", "megatron:tp1"]
    if heads[2] == 64:
        trainers.append("megatron:tp2")
    return q, draw(st.sampled_from(trainers)), "vllm:tp2" if tp2 else "vllm:tp1", \
        draw(st.sampled_from(["p2p", "broadcast"])), draw(st.integers(0, 2**16)), \
        draw(st.sampled_from([1 << 26, 1 << 14]))  # the quantizer's chunks: all at once, or a slice each


def all_reduce_max(store: dist.Store, rank: int, size: int) -> Callable[[torch.Tensor], None]:
    """A MAX all-reduce in place over ``size`` ranks (threads of this process) on a gloo group of
    its own, as `Member` runs it on its control group.  Made on the rank's own thread (its
    rendezvous waits for the others)."""
    group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=30))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return lambda t: group.allreduce([t], opts).wait()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cutting_cases())
def test_trainer_layouts_that_cut_blocks_refit_exactly_vllms_quantization(case) -> None:
    q, src_text, dst_text, planner, seed, chunk = case
    store = dist.HashStore()  # this example's own: the ranks' groups meet in it
    r = make_plan(q, src_text, dst_text, "disaggregated", planner, 1 << 16)
    src, dst = r.src, r.dst
    canon = weights(q, seed)
    sent = [trainer_tensors(q, src, s, canon) for s in range(src.world_size)]
    for s in range(src.world_size):
        sent[s].update(allocate_derived(q, src, s, torch.device("cpu")))
    table = shared_scale_table(q, src)
    quantizers = [SharedQuantizer(q, src, {s: sent[s]}, table, chunk) for s in range(src.world_size)]
    done = together([lambda s=s: share(quantizers[s], torch.device("cpu"), all_reduce_max(store, s, len(quantizers)))
                     for s in range(len(quantizers))], timeout=60.0)
    assert done == [None] * len(quantizers), done
    assert not mismatches(q, dst, land(q, r.plan, src, dst, sent), expected(q, canon))


def test_fsdp_dp8_plans_qwen3_30b_moe_into_an_ep_engine() -> None:
    """The issue's example, at one layer: FSDP2 dp8 cuts the 512-row k_proj into 64-row shards."""
    config = dataclasses.replace(load_spec("qwen3-30b-moe").config, num_layers=1, quantization="fp8")
    q = build_spec("qwen3-30b-moe-1l", config)
    r = make_plan(q, "fsdp:dp8", "vllm:tp8ep8")
    assert r.plan.quantization == ("fp8", "bfloat16") and r.src.shared_blocks(q, 0)
    # the wire carries the same bytes as for a trainer that cuts nothing: values once, each scale once
    assert r.summary["local_bytes"] + r.summary["remote_bytes"] == r.summary["total_bytes"]


# ---------------------------------------------------------------------------------------- executor


def test_members_share_block_scales_over_gloo_and_refit_twice_bit_exact() -> None:
    """fsdp:dp4 trainers (64 of k's 256 rows a rank) into vllm:tp2 engines, six members in threads,
    disaggregated (each drives its own "device", the bytes cross gloo): two refits, the
    trainers' weights rewritten in place between."""
    q = fp8_spec()
    r = make_plan(q, "fsdp:dp4", "vllm:tp2", "disaggregated", "p2p", 1 << 16)
    src, dst, plan = r.src, r.dst, r.plan
    topo = Topology.one_per_rank(plan.placement)
    canon = weights(q, 1)
    trainers = [trainer_tensors(q, src, s, canon) for s in range(src.world_size)]
    engines = [{lt.name: torch.zeros(lt.shape, dtype=TORCH_DTYPES[lt.dtype]) for lt in dst.local_tensors(q, d)}
               for d in range(dst.world_size)]
    eps = [(Side.TRAINER, s) for s in range(src.world_size)] + [(Side.ENGINE, d) for d in range(dst.world_size)]
    names = [f"{side} rank {i}" for side, i in eps]
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    session = uuid.uuid4().hex[:8]

    def member(m: int) -> Member:
        side, i = eps[m]
        own = {eps[m]: trainers[i] if side is Side.TRAINER else engines[i]}
        store = connect("127.0.0.1", master.port, session, 30.0)
        return Member(store, topo, m, "cpu", own, q, src, dst, names, Budget(30.0)).prepare(plan)

    members = together([lambda m=m: member(m) for m in range(len(eps))])
    assert all(isinstance(m, Member) for m in members), members
    try:
        for version in (1, 2):
            if version == 2:  # a training step: new weights, in place
                canon = weights(q, 2)
                for s, new in enumerate(trainer_tensors(q, src, s, canon) for s in range(src.world_size)):
                    for name, t in new.items():
                        trainers[s][name].copy_(t)
            out = together([lambda m=m: m.refit(Budget(30.0)) for m in members])
            assert all(isinstance(s, float) for s in out), out
            assert not mismatches(q, dst, engines, expected(q, canon, vllm=True))
    finally:
        for m in members:
            m.close()
