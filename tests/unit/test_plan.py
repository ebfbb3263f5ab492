"""Unit tests of refit.plan: placements, bucket packing, serialisation and the plan id."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.boxes import volume
from refit.dtypes import DTYPE_BYTES
from refit.errors import RefitError
from refit.hf_checkpoint import load_spec
from refit.plan import DEFAULT_BUCKET_BYTES, PLAN_FORMAT, Placement, Plan, Transfer, pack_buckets, summarize
from refit.spec import ModelConfig, build_spec

SETTINGS = settings(max_examples=150, deadline=None)
TENSORS = {"a": ("bfloat16", (6, 5)), "b": ("float32", (4, 3, 2)), "c": ("float8_e4m3fn", (9,))}


def test_placements():
    co = Placement.make("colocated", 8, 4)
    assert (co.src_gpus, co.dst_gpus, co.num_gpus) == (tuple(range(8)), (0, 1, 2, 3), 8)
    dis = Placement.make("disaggregated", 2, 3)
    assert (dis.src_gpus, dis.dst_gpus, dis.num_gpus) == ((0, 1), (2, 3, 4), 5)
    with pytest.raises(RefitError, match="unknown placement 'spread': colocated or disaggregated"):
        Placement.make("spread", 2, 2)


@st.composite
def transfers(draw):
    """Random transfers of boxes of TENSORS between up to 3 sources and 3 destinations."""
    out = []
    for _ in range(draw(st.integers(1, 8))):
        tensor = draw(st.sampled_from(sorted(TENSORS)))
        shape = TENSORS[tensor][1]
        start = tuple(draw(st.integers(0, n - 1)) for n in shape)
        size = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, start))
        stage = draw(st.sampled_from([0, 1, 1]))
        out.append(Transfer(stage, draw(st.integers(0, 2)), draw(st.integers(0, 2)), tensor, start, size))
    return out


@SETTINGS
@given(transfers(), st.sampled_from([4, 8, 24, 64, 4096]), st.sampled_from(["colocated", "disaggregated"]))
def test_pack_buckets_keeps_every_element_and_bounds_buckets(ts, bucket_bytes, kind):
    place = Placement.make(kind, 3, 3)
    out, buckets = pack_buckets(ts, TENSORS, bucket_bytes, place.src_gpus, place.dst_gpus)

    def coverage(items):
        # per (stage, src, dst, tensor): how often each element is moved
        cov = {}
        for t in items:
            key = (t.stage, t.sender, t.receiver, t.tensor)
            cov.setdefault(key, np.zeros(TENSORS[t.tensor][1], dtype=np.int32))
            cov[key][tuple(slice(s, s + z) for s, z in zip(t.start, t.size))] += 1
        return cov

    before, after = coverage(ts), coverage(out)
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    # buckets cover the transfers in order, each one (stage, src, dst) pair, within bucket_bytes
    assert [b.first for b in buckets] == [0] + list(np.cumsum([b.count for b in buckets]))[:-1]
    assert sum(b.count for b in buckets) == len(out)
    for b in buckets:
        inside = out[b.first:b.first + b.count]
        assert b.count >= 1 and {(t.stage, t.sender, t.receiver) for t in inside} == {(b.stage, b.sender, b.receiver)}
        assert b.nbytes == sum(volume(t.size) * DTYPE_BYTES[TENSORS[t.tensor][0]] for t in inside)
        assert b.nbytes <= bucket_bytes or (b.count == 1 and volume(inside[0].size) == 1)
    # stage 0 first; each (stage, src, dst) pair's transfers sit in consecutive buckets
    assert [b.stage for b in buckets] == sorted(b.stage for b in buckets)
    pairs = [(b.stage, b.sender, b.receiver) for b in buckets]
    for p in set(pairs):
        at = [i for i, q in enumerate(pairs) if q == p]
        assert at == list(range(at[0], at[-1] + 1)), p


def test_local_copies_go_first_then_rounds_of_gpu_distance():
    place = Placement.make("colocated", 4, 4)
    ts = [Transfer(1, s, d, "a", (0, 0), (1, 1)) for s in range(4) for d in range(4)]
    _, buckets = pack_buckets(ts, TENSORS, 4096, place.src_gpus, place.dst_gpus)
    distances = [(b.receiver - b.sender) % 4 for b in buckets]
    assert distances == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # in every round each GPU sends once and receives once
    for r in range(4):
        rnd = buckets[4 * r:4 * r + 4]
        assert sorted(b.sender for b in rnd) == sorted(b.receiver for b in rnd) == [0, 1, 2, 3]


def small_plan(kind: str = "disaggregated") -> Plan:
    place = Placement.make(kind, 2, 2)
    ts = [Transfer(0, 0, 1, "a", (0, 0), (3, 5)), Transfer(1, 0, 0, "a", (0, 0), (6, 5)),
          Transfer(1, 1, 1, "b", (0, 0, 0), (4, 3, 2)), Transfer(1, 1, 0, "c", (2,), (7,))]
    out, buckets = pack_buckets(ts, TENSORS, 32, place.src_gpus, place.dst_gpus)
    return Plan("m", "digest", "megatron:tp2", "vllm:tp2", place, "p2p", 32, dict(TENSORS), tuple(out), tuple(buckets))


def test_plan_facts():
    plan = small_plan()
    stage0 = next(t for t in plan.transfers if t.stage == 0)
    assert plan.transfer_bytes(stage0) == volume(stage0.size) * 2
    assert (plan.src_gpu(stage0), plan.dst_gpu(stage0)) == (0, 1)  # stage 0 lands on a source rank's GPU
    last = next(t for t in plan.transfers if t.tensor == "c")
    assert (plan.src_gpu(last), plan.dst_gpu(last), plan.is_local(last)) == (1, 2, False)
    co = small_plan("colocated")
    assert all(co.is_local(t) == (t.sender == t.receiver) for t in co.transfers)


def test_summary_adds_up():
    plan = small_plan()
    s = summarize(plan, load_spec("qwen3-8b"), dst_total_bytes=123, seconds=0.5)
    moved = sum(b.nbytes for b in plan.buckets)
    assert s["local_bytes"] + s["remote_bytes"] == moved
    assert s["local_bytes"] == 0  # disaggregated: stage 0 between GPUs 0 and 1, stage 1 across sides
    assert s["max_send_bytes"] == max(sum(b.nbytes for b in plan.buckets if plan.src_gpu(b) == g) for g in range(4))
    assert (s["num_gpus"], s["total_bytes"], s["plan_seconds"], s["bucket_bytes"]) == (4, 123, 0.5, 32)
    assert s["plan_hash"] == plan.plan_hash and "plan_id" not in s  # plan_id: the control plane's id


def test_round_trip_through_json_keeps_the_plan_and_its_id():
    plan = small_plan()
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.plan_hash == plan.plan_hash
    assert again.to_dict()["format"] == PLAN_FORMAT
    bad = {**plan.to_dict(), "format": PLAN_FORMAT + 1}
    with pytest.raises(RefitError, match=f"plan format {PLAN_FORMAT + 1} is not {PLAN_FORMAT}"):
        Plan.from_dict(bad)


@SETTINGS
@given(transfers(), st.sampled_from([4, 24, 4096]))
def test_plan_id_is_a_function_of_the_content(ts, bucket_bytes):
    place = Placement.make("colocated", 3, 3)
    out, buckets = pack_buckets(ts, TENSORS, bucket_bytes, place.src_gpus, place.dst_gpus)
    plan = Plan("m", "d", "s", "t", place, "p2p", bucket_bytes, dict(TENSORS), tuple(out), tuple(buckets))
    copy = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert copy == plan and copy.plan_hash == plan.plan_hash
    other = Plan("m", "d", "s", "t", place, "p2p", bucket_bytes + 1, dict(TENSORS), tuple(out), tuple(buckets))
    assert other.plan_hash != plan.plan_hash


@pytest.mark.parametrize("model,src,dst,placement,planner,plan_id", [
    # ids computed by refit before the issue 8 refactor: a plan id must not change across versions
    ("qwen3-8b", "tp2", "tp4", "colocated", "p2p", "04165890dabab426"),
    ("qwen3-30b-moe", "tp4ep8", "tp8", "colocated", "p2p", "abb41995074b2f8e"),
    ("qwen3-30b-moe", "tp4ep8", "tp8", "colocated", "broadcast", "7e4b25e5257ad4f2"),
    ("qwen3-30b-moe", "tp4ep8", "tp8dp2", "disaggregated", "p2p", "4487956ba7b428f4"),
])
def test_plan_ids_are_stable(model, src, dst, placement, planner, plan_id):
    from refit.planners import make_plan

    result = make_plan(load_spec(model), src, dst, placement, planner, DEFAULT_BUCKET_BYTES)
    assert result.plan.plan_hash == plan_id


def test_default_bucket_is_the_one_everyone_uses():
    import inspect

    import refit
    import refit.planners

    assert DEFAULT_BUCKET_BYTES == 256 * 2**20
    assert refit.make_plan is refit.planners.make_plan  # one make_plan, phase_layers and all
    for fn in (refit.planners.make_plan, refit.make_plan):
        assert inspect.signature(fn).parameters["bucket_bytes"].default == DEFAULT_BUCKET_BYTES
    tiny = build_spec("t", ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
                                                "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8}))
    assert refit.make_plan(tiny, "tp1", "tp1").plan.bucket_bytes == DEFAULT_BUCKET_BYTES


def test_planner_registry_is_like_the_layouts():
    from refit.planners import PLANNERS, BroadcastPlanner, P2PPlanner, make_plan, register_planner

    assert PLANNERS == {"p2p": P2PPlanner, "broadcast": BroadcastPlanner}
    assert list(PLANNERS) == ["p2p", "broadcast"]  # the order errors list them in
    with pytest.raises(ValueError, match="'p2p' is already registered"):
        register_planner(type("Another", (P2PPlanner,), {}))
    spec = load_spec("qwen3-8b")
    with pytest.raises(RefitError, match="unknown planner 'mine': p2p, broadcast$"):
        make_plan(spec, "tp2", "tp4", planner="mine")

    class Mine(P2PPlanner):
        name = "mine"

    assert register_planner(Mine) is Mine
    try:
        assert PLANNERS["mine"] is Mine
        mine = make_plan(spec, "tp2", "tp4", planner="mine").plan
        assert mine.planner == "mine" and mine.buckets == make_plan(spec, "tp2", "tp4").plan.buckets
    finally:
        del PLANNERS["mine"]


def _edited(edit) -> dict:
    d = json.loads(json.dumps(small_plan().to_dict()))
    edit(d)
    return d


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("buckets"), "malformed plan: KeyError 'buckets'"),
    (lambda d: d["transfers"][0].__setitem__(3, 7), "malformed plan: IndexError"),
    (lambda d: d["tensors"][0].__setitem__(1, "bfloat17"), "tensor a of bfloat17"),
    (lambda d: d["buckets"][0].__setitem__(5, d["buckets"][0][5] + 2), r"bucket 0 says \d+ bytes, its transfers add up"),
    (lambda d: d["buckets"][1].__setitem__(3, d["buckets"][1][3] + 1), "malformed plan: bucket 1"),
    (lambda d: d["buckets"].pop(), r"buckets cover \d+ of its \d+ transfers"),
    (lambda d: d["transfers"][-1][4].__setitem__(0, 5), r"transfer .* tensor shape \[4, 3, 2\]"),
    (lambda d: (d["transfers"][-1].__setitem__(2, 5), d["buckets"][-1].__setitem__(2, 5)), "malformed plan: bucket"),
    (lambda d: d["transfers"][-1].__setitem__(1, 0), r"malformed plan: transfer .* in bucket"),
    (lambda d: d.__setitem__("phases", [[0, 0]]), "malformed plan: phases"),
])
def test_a_malformed_plan_is_refused_naming_what_is_wrong(edit, message):
    """Before: a KeyError / IndexError escaped, or the plan was taken (a box past its tensor's end,
    a byte count that disagrees with the transfers, a rank the placement lacks) and failed, or
    wrote out of place, only once executed."""
    with pytest.raises(RefitError, match=message):
        Plan.from_dict(_edited(edit))


def test_plans_without_transfers_round_trip_phased_or_not():
    for layers in (0, 2):
        plan = Plan("m", "d", "vllm:tp1", "vllm:tp1", Placement.make("colocated", 1, 1), "p2p", 4096, dict(TENSORS),
                    (), (), phase_layers=layers)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_gathers_is_answered_once_per_plan():
    """The executor asks it per bucket and per transfer, and each answer scanned every bucket:
    compiling one member's share of qwen3-235b-moe tp4ep8 -> tp8 (37k buckets) took minutes."""
    plan = small_plan()
    assert plan.gathers  # it has stage-0 buckets
    object.__setattr__(plan, "buckets", ())  # a second scan would now answer False
    assert plan.gathers
