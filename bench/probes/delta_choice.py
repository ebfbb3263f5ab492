"""Would choosing a delta refit's encoding per transfer, not per bucket, send fewer bytes?

    python bench/probes/delta_choice.py [--lrs 1e-5 1e-6 1e-7] [--bucket-mib 1 16] [--json]

A small Qwen3 (transformers, float32 masters) takes real AdamW steps on random tokens drawn from a
quarter of its vocabulary (as an RL batch uses few of the tokens: embedding rows of the others only
decay), and each step's bfloat16 words are compared before and after, tensor by tensor.  The
tensors, in the order of their state dict, are cut into buckets of the given size (a tensor may
span buckets, as the planner splits one); each piece of a tensor in a bucket is a transfer.
`refit.executor.delta.payload_bytes` sizes each encoding; per bucket: the cheapest encoding of
the whole bucket (what refit sends); per transfer: the cheapest for each transfer, plus 16 bytes a
transfer to say which.  Everything on the CPU.
"""

from __future__ import annotations

import argparse
import json

import torch

from refit.executor.delta import FULL, INDEX, MASK, payload_bytes


def model(seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).float()


def changed_words(m: torch.nn.Module, lr: float, steps: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Per parameter, the flags of its bfloat16 words that the last of ``steps`` AdamW steps changed."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01)
    vocab = m.config.vocab_size
    before: list[torch.Tensor] = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab // 4, (4, 64), generator=g)
        before = [p.detach().to(torch.bfloat16).view(torch.int16).flatten().clone() for p in m.parameters()]
        loss = m(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(n, p.detach().to(torch.bfloat16).view(torch.int16).flatten() != b)
            for (n, p), b in zip(m.named_parameters(), before)]


def cheapest(words: int, changed: int) -> int:
    modes = [FULL, MASK] + ([INDEX] if words < 2 ** 31 else [])
    return min(payload_bytes(mode, words, changed, 2) for mode in modes)


def compare(flags: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, float]:
    """Bytes sent per bucket and per transfer, over buckets of ``bucket_bytes`` (bfloat16 words)."""
    per_word = bucket_bytes // 2
    buckets: list[list[int]] = [[]]  # each: changed counts of its transfers, with their word counts
    sizes: list[list[int]] = [[]]
    room = per_word
    for _, f in flags:
        at = 0
        while at < f.numel():
            take = min(room, f.numel() - at)
            buckets[-1].append(int(f[at:at + take].sum()))
            sizes[-1].append(take)
            at, room = at + take, room - take
            if room == 0:
                buckets.append([])
                sizes.append([])
                room = per_word
    pairs = [(c, s) for c, s in zip(buckets, sizes) if s]
    full = sum(2 * sum(s) for _, s in pairs)
    bucket = sum(cheapest(sum(s), sum(c)) for c, s in pairs)
    transfer = sum(sum(cheapest(w, k) + 16 for k, w in zip(c, s)) for c, s in pairs)
    return {"buckets": len(pairs), "transfers": sum(len(s) for _, s in pairs), "full_bytes": full,
            "per_bucket_bytes": bucket, "per_transfer_bytes": transfer, "per_transfer_vs_bucket": transfer / bucket}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="*", default=[1e-5, 1e-6, 1e-7])
    p.add_argument("--bucket-mib", type=float, nargs="*", default=[1, 16])
    p.add_argument("--steps", type=int, default=3, help="AdamW steps; the last one is measured")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = []
    for lr in a.lrs:
        flags = changed_words(model(0), lr, a.steps, seed=1)
        total = sum(f.numel() for _, f in flags)
        spread = sorted(float(f.float().mean()) for _, f in flags)
        for mib in a.bucket_mib:
            rows.append({"lr": lr, "bucket_mib": mib, "changed": sum(int(f.sum()) for _, f in flags) / total,
                         "tensor_changed_min": spread[0], "tensor_changed_max": spread[-1],
                         **compare(flags, int(mib * 2 ** 20))})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'lr':>7} {'bucket':>7} {'changed':>8} {'per tensor':>15} {'buckets':>8} {'transfers':>9} "
          f"{'per bucket':>11} {'per transfer':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['lr']:>7g} {r['bucket_mib']:>5g}Mi {r['changed']:>8.4f} "
              f"{r['tensor_changed_min']:>7.4f}-{r['tensor_changed_max']:<7.4f} {r['buckets']:>8} {r['transfers']:>9} "
              f"{r['per_bucket_bytes'] / r['full_bytes']:>11.4f} {r['per_transfer_bytes'] / r['full_bytes']:>13.4f} "
              f"{r['per_transfer_vs_bucket']:>6.3f}")


if __name__ == "__main__":
    main()
