"""Delta codec throughput (`refit.executor.delta`) on one device, next to a device copy.

    python bench/probes/delta_codec.py                     # CUDA, 256 MiB bfloat16 buckets
    python bench/probes/delta_codec.py --mib 64 --cpu      # the CPU path the tests run

Each row is one bucket of bfloat16 weights: ``last`` what was sent before, ``new`` after a step.
Steps are either a fraction of words picked at random, or a synthetic Adam-like step of size LR
on float32 masters of N(0, 0.02) cast to bfloat16 (``--lrs``), which also shows how many
bfloat16 values such a step changes.  Timed: ``encode`` (compare, count, gather: what a sender
does per bucket, including its one host sync), ``decode`` (what a receiver does), and keeping
the cache (a copy).  Rates: bytes of the bucket per second; the copy's row is a device-to-device
copy of the bucket (each byte read once and written once): the floor a full refit's unpack
runs at.  Encode reads two buckets (``new`` and ``last``): at memory speed it takes about as long
as the copy.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from refit.executor.delta import FULL, MODES, decode, encode


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds of ``iters`` calls, each ending synchronized."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def adam_step(words: int, lr: float, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, last) bucket bytes: masters ~ N(0, 0.02) in float32, moved by lr * (±(0.5..1.5))."""
    master = torch.randn(words, generator=g, device=device) * 0.02
    last = master.to(torch.bfloat16)
    u = (torch.rand(words, generator=g, device=device) + 0.5) * torch.sign(torch.randn(words, generator=g, device=device))
    new = (master - lr * u).to(torch.bfloat16)
    return new.view(torch.uint8), last.view(torch.uint8)


def random_step(words: int, fraction: float, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    last = torch.randint(-2**15, 2**15, (words,), dtype=torch.int16, generator=g, device=device)
    new = last.clone()
    pick = torch.rand(words, generator=g, device=device) < fraction
    new[pick] ^= 0x0101
    return new.view(torch.uint8), last.view(torch.uint8)


def row(name: str, new: torch.Tensor, last: torch.Tensor, device: torch.device, iters: int,
        copy_s: float) -> dict[str, object]:
    out = torch.empty_like(new)
    mode, nbytes, changed = encode(new, last, 2, out)
    enc_s = timed(lambda: encode(new, last, 2, out), device, iters)
    cur = last.clone()
    if mode != FULL and changed:
        decode(out[:nbytes], mode, changed, 2, cur)
        assert torch.equal(cur, new), name
        dec_s = timed(lambda: decode(out[:nbytes], mode, changed, 2, cur), device, iters)
    else:
        dec_s = copy_s  # a FULL bucket lands as a full refit's does
    keep = torch.empty_like(new)
    keep_s = timed(lambda: keep.copy_(new), device, iters)
    n = new.numel()
    return {"step": name, "changed_fraction": changed / (n // 2), "mode": MODES[mode],
            "payload_vs_full": nbytes / n, "encode_ms": enc_s * 1e3, "decode_ms": dec_s * 1e3,
            "keep_ms": keep_s * 1e3, "encode_gbps": n / enc_s / 1e9, "decode_gbps": n / dec_s / 1e9,
            "encode_vs_copy": enc_s / copy_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=256, help="bucket size in MiB (default 256: a GPU bucket)")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.001, 0.01, 0.03, 0.1, 0.3])
    p.add_argument("--lrs", type=float, nargs="*", default=[1e-5, 1e-6, 1e-7])
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    device = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    words = int(a.mib * 2**20) // 2
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.empty(words * 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, a.iters)
    rows = [row(f"random {f:g}", *random_step(words, f, device, g), device, a.iters, copy_s) for f in a.fractions]
    rows += [row(f"adam lr {lr:g}", *adam_step(words, lr, device, g), device, a.iters, copy_s) for lr in a.lrs]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "bucket_bytes": words * 2, "copy_ms": copy_s * 1e3,
              "copy_gbps_read_plus_write": 2 * words * 2 / copy_s / 1e9, "rows": rows}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{name}: bucket {words * 2 / 2**20:.0f} MiB bfloat16; device copy {copy_s * 1e3:.3f} ms "
          f"({report['copy_gbps_read_plus_write']:.0f} GB/s read+write)")
    print(f"{'step':<16} {'changed':>8} {'mode':>6} {'payload':>8} {'encode ms':>10} {'x copy':>7} {'decode ms':>10} {'keep ms':>8}")
    for r in rows:
        print(f"{r['step']:<16} {r['changed_fraction']:>8.4f} {r['mode']:>6} {r['payload_vs_full']:>8.4f} "
              f"{r['encode_ms']:>10.3f} {r['encode_vs_copy']:>7.2f} {r['decode_ms']:>10.3f} {r['keep_ms']:>8.3f}")


if __name__ == "__main__":
    main()
