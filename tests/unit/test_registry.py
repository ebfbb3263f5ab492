"""The coordinator's records and checks (refit.control.registry): bounds on registrations before
anything is built, slots, versions, groups."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from refit.control import common
from refit.control.common import Conflict, Exhausted, Precondition, config_json, role_of, side_of_role
from refit.control.registry import (MAX_VERSION, MAX_VERSION_STEP, PlanEntry, Worker, build_registration,
                                    check_info, check_same_model, check_slot, check_version, group_members,
                                    holds_version)
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput, RefitError
from refit.sides import Side
from refit.spec import build_spec
from tests.harness.tiny import tiny_spec


def info(**kw) -> pb.WorkerInfo:
    spec = tiny_spec("tiny-qwen3-moe")
    base = dict(role=pb.ROLE_ENGINE, group="e", rank=0, host="h", layout="vllm:tp2", model_name=spec.name,
                model_digest=spec.digest(), model_config_json=config_json(spec.config), pid=7)
    return pb.WorkerInfo(**{**base, **kw})


def worker(i: pb.WorkerInfo) -> Worker:
    spec, layout = build_registration(i, {})
    return Worker(i, "s", spec, layout, send=None, task=None, version=i.version)  # type: ignore[arg-type]


def test_a_side_goes_by_one_name_in_each_layer() -> None:
    """`refit.sides.Side` is the one the control plane re-exports; the proto's roles map both ways."""
    assert common.Side is Side
    for side, role, end in ((Side.TRAINER, pb.ROLE_TRAINER, "src"), (Side.ENGINE, pb.ROLE_ENGINE, "dst")):
        assert role_of(side) == role and side_of_role(role) is side
        assert side.end == end and Side.of_end(end) is side and Side.named(side.value) is side
        assert side.other.other is side and side.other is not side
        assert f"{side}" == str(side) == side.value == side and side.plural == f"{side.value}s"
    assert (Side.TRAINER.with_article, Side.ENGINE.with_article) == ("a trainer", "an engine")
    plan = SimpleNamespace(src_layout="megatron:tp2", dst_layout="vllm:tp1")
    bucket = SimpleNamespace(sender=1, receiver=3)
    assert (Side.TRAINER.layout_of(plan), Side.ENGINE.layout_of(plan)) == ("megatron:tp2", "vllm:tp1")
    assert (Side.TRAINER.rank_in(bucket), Side.ENGINE.rank_in(bucket)) == (1, 3)
    with pytest.raises(InvalidInput, match="role must be ROLE_TRAINER or ROLE_ENGINE, not 0"):
        side_of_role(pb.ROLE_UNSPECIFIED)
    with pytest.raises(InvalidInput, match="role must be one of trainer, engine, not 'src'"):
        Side.named("src")
    with pytest.raises(InvalidInput, match="a side is src or dst, not 'trainer'"):
        Side.of_end("trainer")


def test_a_good_registration_builds_once_per_config() -> None:
    specs: dict = {}
    i = info()
    check_info(i)
    spec, layout = build_registration(i, specs)
    assert layout.describe().startswith("vllm:tp2") and len(specs) == 1
    assert build_registration(info(rank=1), specs)[0] is spec


@pytest.mark.parametrize("kw,match", [
    (dict(group="g" * 200), "group has 200 characters"),
    (dict(group="a/b"), "without '/'"),
    (dict(layout="x" * 10_000), "layout has 10000 characters"),
    (dict(model_config_json="{" * 70_000), "model_config_json has 70000 characters"),
    (dict(model_config_json="[1]"), "not a JSON object"),
    (dict(model_config_json="{nope"), "not JSON"),
    (dict(version=2**64 - 1), "is above"),
    (dict(rank=2**31), "beyond"),
    (dict(role=0), "role"),
])
def test_bad_fields_are_refused_before_building(kw, match) -> None:
    with pytest.raises(RefitError, match=match) as e:
        check_info(info(**kw))
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("field,value", [("num_layers", 30_000_000), ("num_experts", 10**6), ("vocab_size", -1),
                                         ("hidden_size", "32"), ("num_layers", True),
                                         # accepted before, then CreatePlan failed INTERNAL (KeyError,
                                         # ZeroDivisionError) and kept failing: the failure was cached
                                         ("dtype", "bf16"), ("dtype", ["bfloat16"]), ("head_dim", 0), ("num_kv_heads", 0)])
def test_model_config_is_bounded_before_a_spec_is_built(field, value, monkeypatch) -> None:
    import refit.control.common

    def built(*args, **kwargs):
        raise AssertionError("a spec was built for a registration refused by its fields")

    monkeypatch.setattr(refit.control.common, "build_spec", built)  # what spec_from_registration builds with
    cfg = json.loads(info().model_config_json)
    cfg[field] = value
    with pytest.raises(RefitError, match=field):
        check_info(info(model_config_json=json.dumps(cfg)))


def test_world_size_is_bounded() -> None:
    with pytest.raises(RefitError, match="at most 65536"):
        build_registration(info(role=pb.ROLE_TRAINER, layout="megatron:tp1dp4294967295"), {})


def test_a_live_slot_is_kept_from_other_processes() -> None:
    """Only the live worker's own process (its process key) takes its slot over: not a registration
    that claims its host and pid (public: ListWorkers shows them), nor one with no key."""
    w = worker(info())
    w.process_key = "k" * 32
    workers = {w.worker_id: w}
    check_slot(workers, info(), 10, "k" * 32)  # the same process may register again
    for key in ("", "x" * 32, "k" * 31):
        with pytest.raises(Conflict, match="held by a live worker"):
            check_slot(workers, info(), 10, key)  # same host and pid, not its key
    w.process_key = ""  # registered without a key: nobody proves to be it
    with pytest.raises(Conflict, match="held by a live worker"):
        check_slot(workers, info(), 10, "")
    w.connected = False
    check_slot(workers, info(pid=8), 10)  # once it left, anyone may
    with pytest.raises(Exhausted):
        check_slot(workers, info(group="other"), 1)


def test_versions_increase_within_bounds() -> None:
    e0, e1 = worker(info(version=3)), worker(info(rank=1, version=3))
    workers = {e0.worker_id: e0, e1.worker_id: e1}
    plan = SimpleNamespace(placement=SimpleNamespace(src_gpus=()))  # only what num_src reads: no trainers
    entry = PlanEntry("p", plan=plan, summary={}, src_group="t", dst_group="e", plan_json=b"",  # type: ignore[arg-type]
                      members=("e/0", "e/1"))
    with pytest.raises(Precondition, match="not above 3"):
        check_version(workers, entry, 3)
    check_version(workers, entry, 4)
    with pytest.raises(RefitError, match="jumps more than"):
        check_version(workers, entry, 3 + MAX_VERSION_STEP + 1)
    assert holds_version(workers, entry, 3) and not holds_version(workers, entry, 4)
    e1.stale = True
    assert not holds_version(workers, entry, 3)
    assert MAX_VERSION < 2**64 - 1


def test_group_members_names_the_missing_rank() -> None:
    w = worker(info())
    with pytest.raises(RefitError, match="rank 1 of vllm:tp2.* is not registered"):
        group_members({w.worker_id: w}, "e", Side.ENGINE)
    with pytest.raises(RefitError, match="no worker is registered in group 'x'"):
        group_members({w.worker_id: w}, "x", Side.ENGINE)


def test_rows_of_workers_gone_before_the_group_came_back_in_another_layout_are_left_out() -> None:
    """A group restarted with fewer ranks (vllm:tp2 -> tp1): the departed rank's row, kept
    (disconnected) for ListWorkers, no longer makes every plan of the group fail."""
    old1, new0 = worker(info(rank=1)), worker(info(layout="vllm:tp1", pid=8))
    old1.connected = False
    ws = {"e/0": new0, "e/1": old1}
    assert group_members(ws, "e", Side.ENGINE) == [new0]
    # A departed rank of the group's own layout still counts (a refit names it not connected) ...
    same = {"e/0": worker(info(pid=8)), "e/1": old1}
    assert group_members(same, "e", Side.ENGINE) == [same["e/0"], old1]
    # ... and a live rank of another layout is still refused.
    old1.connected = True
    with pytest.raises(RefitError, match="registered layout"):
        group_members(ws, "e", Side.ENGINE)


def test_a_model_mismatch_within_a_group_names_the_fields() -> None:
    """Two ranks of one group holding models of two vocab sizes: named by field and values, not
    by two digests."""
    base = tiny_spec("tiny-qwen3-moe")
    cfg = dataclasses.replace(base.config, vocab_size=base.config.vocab_size + 2)
    e0 = worker(info())
    e1 = worker(info(rank=1, model_digest=build_spec(base.name, cfg).digest(), model_config_json=config_json(cfg)))
    with pytest.raises(RefitError) as e:
        group_members({"e/0": e0, "e/1": e1}, "e", Side.ENGINE)
    assert f"group 'e': e/0 and e/1 hold different model configs: vocab_size {base.config.vocab_size} (e/0) vs " \
           f"{cfg.vocab_size} (e/1)" in str(e.value), str(e.value)


def test_a_model_mismatch_names_every_field_that_differs_and_both_values() -> None:
    """An fp32 trainer and a bf16 engine of two vocab sizes: the error named two digests
    ("'trainer' holds tiny (digest 83cabb0b...)"), which told the user nothing."""
    base = tiny_spec("tiny-qwen3-moe")
    cfg = dataclasses.replace(base.config, dtype="float32", vocab_size=base.config.vocab_size + 2)
    fp32 = build_spec(base.name, cfg)
    trainer = worker(info(role=pb.ROLE_TRAINER, group="trainer", layout="megatron:tp1", model_digest=fp32.digest(),
                          model_config_json=config_json(cfg)))
    engine = worker(info(group="engine"))
    with pytest.raises(RefitError) as e:
        check_same_model(trainer, engine)
    v = base.config.vocab_size
    assert str(e.value) == (f"groups 'trainer' and 'engine' hold different models: vocab_size {v + 2} (trainer) vs "
                            f"{v} (engine) (their dtypes differ too, which a plan casts)")
    assert check_same_model(worker(info(role=pb.ROLE_TRAINER, group="trainer", layout="megatron:tp1")), engine) == {}


def test_the_same_model_in_another_dtype_is_cast() -> None:
    """An fp32 trainer (verl's FSDP2 masters) and a bf16 engine: one model, cast on the way."""
    base = tiny_spec("tiny-qwen3-moe")
    cfg = dataclasses.replace(base.config, dtype="float32")
    fp32 = build_spec(base.name, cfg)
    trainer = worker(info(role=pb.ROLE_TRAINER, group="trainer", layout="megatron:tp1", model_digest=fp32.digest(),
                          model_config_json=config_json(cfg)))
    casts = check_same_model(trainer, worker(info(group="engine")))
    assert casts and set(casts.values()) == {"float32"} and all(base[n].dtype == "bfloat16" for n in casts)
