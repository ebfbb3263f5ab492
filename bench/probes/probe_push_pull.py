"""Peer copies of framework-shaped blocks, pulled by the destination GPU or pushed by the source.

One process, two GPUs with peer access both ways; both directions at once (as in a colocated
refit, where every GPU both reads and is read).  Blocks are qwen3-30b-moe's per-expert pieces at
TP2: ``pitched`` = one expert's half of Megatron's fc2 (2048 rows of 768 B out of 1536 B rows) into
a contiguous vLLM w2 block; ``contig`` = a 1.5 MiB contiguous run.  Separate allocations per block
(framework style: nothing merges).  Ways: the refit's descriptor-table kernel (SM loads/stores) on
the destination (pull) or on the source (push); one cudaMemcpy2DAsync per block on the
destination's or the source's stream (copy engines).  For the 1.5 MiB runs also: all of them
pulled in one ``cudaMemcpyBatchAsync`` per GPU, and the two split — the source's table kernel
pushes a share while the destination's copy engines pull the rest in one batch call, on a second
stream (whether SM stores and copy-engine reads together go past what either reaches alone).

Run: python bench/probes/probe_push_pull.py [--blocks 3072] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from refit.executor.batch_memcpy import BatchMemcpy
from refit.executor.memcpys import Memcpy
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


def timed(launch: dict[int, Callable[[int], None]], streams: dict[int, torch.cuda.Stream], reps: int = 5) -> float:
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


def batch_pull(ms: list[Memcpy], src: int, dst: int) -> BatchMemcpy:
    """The 1-D copies ``ms`` as one copy-engine batch, issued by the destination GPU."""
    return BatchMemcpy([(m.dst, m.src, m.width * m.height) for m in ms], src, dst)


def split_ways(ms: dict[int, list[Memcpy]], second: dict[int, torch.cuda.Stream]) -> dict[str, dict[int, Callable[[int], None]]]:
    """Contiguous runs only: every run pulled by one batch call, and pushed/pulled splits."""
    ways = {"batch pull (dst stream)": {d: batch_pull(ms[d], 1 - d, d).launch for d in (0, 1)}}
    n = len(ms[0])
    for share in (0.9, 0.8, 0.7, 0.5):
        k = int(n * share)
        push = {d: TableCopy(ms[1 - d][:k], d) for d in (0, 1)}  # GPU d writes the first k into the peer
        pull = {d: batch_pull(ms[d][k:], 1 - d, d) for d in (0, 1)}  # and pulls the peer's rest

        def both(s: int, d: int, push=push, pull=pull) -> None:
            push[d].launch(s)
            pull[d].launch(second[d].cuda_stream)
        ways[f"table push {share:.0%} + batch pull"] = {d: (lambda s, d=d, both=both: both(s, d)) for d in (0, 1)}
    return ways


def main() -> None:
    a, P, streams = setup(__doc__)
    second = {g: torch.cuda.Stream(device=g) for g in (0, 1)}
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
        if not pitched:
            ways.update(split_ways(ms, second))
        for way, launch in ways.items():
            for d in (0, 1):
                P[d][2].zero_()
            sec = timed(launch, streams)
            ok = all(torch.equal(P[d][2][b, :ROWS * WIDTH].view(ROWS, WIDTH),
                                 (P[1 - d][0][b, :ROWS * PITCH].view(ROWS, PITCH)[:, :WIDTH] if pitched
                                  else P[1 - d][1][b, :ROWS * WIDTH].view(ROWS, WIDTH)).to(f"cuda:{d}"))
                     for d in (0, 1) for b in (0, a.blocks - 1))  # first block pushed, last pulled in a split
            gbs = nbytes / sec / 1e9
            results[f"{kind}: {way}"] = {"ms": round(sec * 1e3, 2), "GB/s per GPU in": round(gbs, 1), "ok": ok}
            print(f"{kind:8s} {way:30s} {sec * 1e3:8.2f} ms {gbs:7.1f} GB/s per GPU in  verified={ok}", flush=True)
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
