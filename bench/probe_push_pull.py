"""Peer copies of framework-shaped blocks, pulled by the destination GPU or pushed by the source.

One process, two GPUs with peer access both ways; both directions at once (as in a colocated
refit, where every GPU both reads and is read).  Blocks are qwen3-30b-moe's per-expert pieces at
TP2: ``pitched`` = one expert's half of Megatron's fc2 (2048 rows of 768 B out of 1536 B rows) into
a contiguous vLLM w2 block; ``contig`` = a 1.5 MiB contiguous run.  Separate allocations per block
(framework style: nothing merges).  Ways: the refit's descriptor-table kernel (SM loads/stores) on
the destination (pull) or on the source (push); one cudaMemcpy2DAsync per block on the
destination's or the source's stream (copy engines).

Run: python bench/probe_push_pull.py [--blocks 3072] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from refit.executor.copies import Memcpy
from refit.executor.device import enable_peer_access
from refit.executor.table_copy import TableCopy

ROWS, WIDTH, PITCH = 2048, 768, 1536


def pools(g: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pitched sources, contiguous sources, destinations) on GPU ``g``, random bytes."""
    gen = torch.Generator(device=f"cuda:{g}").manual_seed(g)
    src_p = torch.randint(0, 256, (n, ROWS * PITCH + 4096), dtype=torch.uint8, device=f"cuda:{g}", generator=gen)
    src_c = torch.randint(0, 256, (n, ROWS * WIDTH + 4096), dtype=torch.uint8, device=f"cuda:{g}", generator=gen)
    dst = torch.zeros((n, ROWS * WIDTH + 4096), dtype=torch.uint8, device=f"cuda:{g}")
    return src_p, src_c, dst


def copies(src: torch.Tensor, dst: torch.Tensor, pitched: bool) -> list[Memcpy]:
    out = []
    for i in range(src.shape[0]):
        s, d = src[i].data_ptr(), dst[i].data_ptr()
        out.append(Memcpy(d, WIDTH, s, PITCH, WIDTH, ROWS) if pitched else Memcpy(d, ROWS * WIDTH, s, ROWS * WIDTH, ROWS * WIDTH, 1))
    return out


def timed(launch: dict[int, callable], streams: dict[int, torch.cuda.Stream], reps: int = 5) -> float:
    """Median wall seconds of running every launcher (one per GPU, on its stream) together."""
    times = []
    for _ in range(reps + 1):
        for g in streams:
            torch.cuda.synchronize(g)
        t0 = time.perf_counter()
        for g, fn in launch.items():
            fn(streams[g].cuda_stream)
        for g in streams:
            torch.cuda.synchronize(g)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[reps // 2]


def memcpy2d(ms: list[Memcpy], stream: int) -> None:
    from cupy.cuda import runtime
    for m in ms:
        runtime.memcpy2DAsync(m.dst, m.dpitch, m.src, m.spitch, m.width, m.height, runtime.memcpyDefault, stream)


def setup(doc: str) -> tuple[argparse.Namespace, dict[int, tuple[torch.Tensor, ...]], dict[int, torch.cuda.Stream]]:
    """The probes' command line (``--blocks``, ``--json``), peer access both ways, that many
    blocks of each kind on both GPUs and a stream per GPU."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=3072)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    enable_peer_access(0, 1)
    enable_peer_access(1, 0)
    return a, {g: pools(g, a.blocks) for g in (0, 1)}, {g: torch.cuda.Stream(device=g) for g in (0, 1)}


def main() -> None:
    a, P, streams = setup(__doc__)
    results = {}
    for kind, pitched in (("pitched", True), ("contig", False)):
        # into GPU d out of GPU s = 1 - d
        ms = {d: copies(P[1 - d][0 if pitched else 1], P[d][2], pitched) for d in (0, 1)}
        nbytes = sum(m.width * m.height for m in ms[0])
        pull_t = {d: TableCopy(ms[d], d) for d in (0, 1)}       # runs on the destination
        push_t = {d: TableCopy(ms[1 - d], d) for d in (0, 1)}   # GPU d writes into the peer
        ways = {
            "table pull": {d: pull_t[d].launch for d in (0, 1)},
            "table push": {d: push_t[d].launch for d in (0, 1)},
            "memcpy2D pull (dst stream)": {d: (lambda s, d=d: memcpy2d(ms[d], s)) for d in (0, 1)},
            "memcpy2D push (src stream)": {d: (lambda s, d=d: memcpy2d(ms[1 - d], s)) for d in (0, 1)},
        }
        for way, launch in ways.items():
            for d in (0, 1):
                P[d][2].zero_()
            sec = timed(launch, streams)
            ok = all(torch.equal(P[d][2][0, :ROWS * WIDTH].view(ROWS, WIDTH),
                                 (P[1 - d][0][0, :ROWS * PITCH].view(ROWS, PITCH)[:, :WIDTH] if pitched
                                  else P[1 - d][1][0, :ROWS * WIDTH].view(ROWS, WIDTH)).to(f"cuda:{d}"))
                     for d in (0, 1))
            gbs = nbytes / sec / 1e9
            results[f"{kind}: {way}"] = {"ms": round(sec * 1e3, 2), "GB/s per GPU in": round(gbs, 1), "ok": ok}
            print(f"{kind:8s} {way:30s} {sec * 1e3:8.2f} ms {gbs:7.1f} GB/s per GPU in  verified={ok}", flush=True)
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
