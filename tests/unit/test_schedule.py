"""`refit.executor.schedule`: a plan compiled into per-member steps, as pure data (no torch)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from refit.boxes import volume
from refit.executor.schedule import compile_program, pullable
from refit.executor.topology import Topology
from refit.planners import make_plan
from refit.sides import Side
from refit.spec import ModelConfig, build_spec

MOE = build_spec("tiny-moe", ModelConfig(
    arch="qwen3_moe", hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=32, vocab_size=300, qk_norm=True, num_experts=8, moe_intermediate_size=16,
    moe_layers=(1, 2, 3)))


def test_importing_the_schedule_does_not_import_torch() -> None:
    code = ("import sys, refit.executor.schedule, refit.executor.topology, refit.executor; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("planner", ["p2p", "broadcast"])
def test_every_bucket_once_sends_match_receives(planner: str) -> None:
    r = make_plan(MOE, "tp2ep2", "tp2", "disaggregated", planner, 4096)
    topo = Topology.one_per_rank(r.plan.placement)
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for m in topo.drivers:
        prog = compile_program(r.plan, MOE, r.src, r.dst, topo, m)
        keys = [s.key for st in prog.stages for s in st.steps]
        assert keys == sorted(keys)  # every member walks the steps in key order
        for st in prog.stages:
            for step in st.steps:
                assert len({w.peer for w in step.sends}) == len(step.sends)  # one peer per step and way
                for w in step.sends:
                    sends[(w.bucket, topo.comm_rank(m), w.peer, step.key)] += 1
                    assert w.ep[0] is Side.TRAINER
                for w in step.recvs:
                    recvs[(w.bucket, w.peer, topo.comm_rank(m), step.key)] += 1
        assert prog.staging_bytes <= 4 * r.plan.bucket_bytes
    # disaggregated: every bucket crosses devices, sent once and received once, in the same step
    assert sends == recvs and len(sends) == len(r.plan.buckets)
    assert all(n == 1 for n in sends.values())


def test_wire_blocks_cover_each_sent_box_exactly() -> None:
    r = make_plan(MOE, "tp2ep2etp2", "tp4", "disaggregated", "p2p", 4096)
    topo = Topology.one_per_rank(r.plan.placement)
    for m in topo.drivers:
        for st in compile_program(r.plan, MOE, r.src, r.dst, topo, m).stages:
            for step in st.steps:
                for w in step.sends + step.recvs:
                    assert sum(volume(b.size) for wt in w.transfers for b in wt.blocks) == \
                        sum(volume(wt.box) for wt in w.transfers)
                    assert w.nbytes == r.plan.buckets[w.bucket].nbytes


def test_single_member_moves_only_and_gathers_are_facts_of_the_plan() -> None:
    p2p = make_plan(MOE, "tp2pp2", "tp4", "colocated", "p2p", 4096)
    prog = compile_program(p2p.plan, MOE, p2p.src, p2p.dst, Topology.single(p2p.plan.placement), 0)
    assert prog.num_steps == 0 and prog.staging_bytes == 0 and all(st.moves for st in prog.stages)
    assert not p2p.plan.gathers and all(pullable(p2p.plan, b) for b in p2p.plan.buckets)
    bc = make_plan(MOE, "tp2pp2", "tp4", "colocated", "broadcast", 4096)
    assert bc.plan.gathers
    assert [pullable(bc.plan, b) for b in bc.plan.buckets] == [b.stage == 0 for b in bc.plan.buckets]
    prog = compile_program(bc.plan, MOE, bc.src, bc.dst, Topology.single(bc.plan.placement), 0)
    assert prog.gather_bytes > 0 and [st.stage for st in prog.stages] == [0, 1]



def test_a_plan_for_another_model_layout_or_run_is_refused_before_binding() -> None:
    """A plan for a vocab of 300 compiled against a model of 302: every box it names is held on
    both ends, so it compiled, and the destination's last vocab rows were never written."""
    from refit.errors import RefitError
    from refit.layouts import resolve_layout

    r = make_plan(MOE, "tp2", "tp2", "disaggregated", "p2p", 4096)
    topo = Topology.single(r.plan.placement)
    other = build_spec("tiny-moe", ModelConfig(
        arch="qwen3_moe", hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=32, vocab_size=302, qk_norm=True, num_experts=8, moe_intermediate_size=16,
        moe_layers=(1, 2, 3)))
    src2, dst2 = resolve_layout("tp2", other, Side.TRAINER), resolve_layout("tp2", other, Side.ENGINE)
    with pytest.raises(RefitError, match="plan is for model tiny-moe .digest"):
        compile_program(r.plan, other, src2, dst2, topo, 0)
    with pytest.raises(RefitError, match="plan is for destination layout vllm:tp2, this run's is vllm:tp1"):
        compile_program(r.plan, MOE, r.src, resolve_layout("tp1", MOE, Side.ENGINE), topo, 0)
    small = Topology((((Side.TRAINER, 0), (Side.ENGINE, 0)),), (((Side.TRAINER, 0), 0), ((Side.ENGINE, 0), 0)))
    with pytest.raises(RefitError, match="no device for trainer rank 1, engine rank 1"):
        compile_program(r.plan, MOE, r.src, r.dst, small, 0)


def test_a_destination_missing_part_of_a_box_is_told_it_must_receive_it() -> None:
    """Before: a destination holding too little of a box was told it 'must send' it."""
    from refit.errors import RefitError
    from refit.executor import schedule
    from refit.layouts.base import LocalTensor, Piece
    from refit.plan import Transfer
    from refit.regions import PieceIndex

    index = PieceIndex([LocalTensor("x", (2, 4), "bfloat16", (Piece("a", (0, 0), (2, 4), (0, 0)),))])
    t = Transfer(1, 0, 3, "a", (0, 0), (4, 4))
    with pytest.raises(RefitError, match=r"engine rank 3 holds 8 of the 16 elements of a \[0, 0\]\+\[4, 4\] it must receive"):
        schedule.box_blocks(index, t, (Side.ENGINE, 3), whole=True, sending=False)
    with pytest.raises(RefitError, match="trainer rank 0 holds 8 of the 16 elements .* it must send"):
        schedule.box_blocks(index, t, (Side.TRAINER, 0), whole=True, sending=True)
