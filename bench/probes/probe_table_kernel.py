"""Variants of the descriptor-table copy kernel (`refit.executor.table_copy`), measured on the
copies a refit makes: both GPUs pushing qwen3-30b-moe's per-expert blocks into each other (SM
stores over NVLink) and each GPU copying them within itself (HBM), blocks as in
`probe_push_pull` (``pitched``: 768-byte rows out of 1536-byte rows; ``contig``: 1.5 MiB runs).

A variant is (loads in flight per thread, index width, threads per block, grid): the kernel in
the package is ``unroll 4, 64-bit, 512 threads``.  The 32-bit variants do the per-word row /
column division in 32 bits, which a table row allows (pieces are at most `PIECE_BYTES`).

Run: python bench/probes/probe_table_kernel.py [--blocks 3072] [--json]
"""

from __future__ import annotations

import json

import torch

from probe_push_pull import PITCH, ROWS, WIDTH, copies, setup, timed  # bench/probes/ is the script's folder
from refit.executor.table_copy import cupy_stream, kernel_source, table_rows

# (unroll, index type, threads, push grid, local grid)
VARIANTS = [
    (4, "unsigned long long", 512, 528, 132),  # the package's kernel
    (4, "unsigned int", 512, 528, 132),
    (8, "unsigned int", 512, 528, 132),
    (2, "unsigned int", 512, 528, 132),
    (4, "unsigned int", 256, 1056, 264),
    (4, "unsigned int", 1024, 264, 132),
    (4, "unsigned int", 512, 1056, 264),
    (8, "unsigned int", 256, 1056, 264),
]


class Variant:
    def __init__(self, unroll: int, idx: str, threads: int, devices: tuple[int, ...]) -> None:
        import cupy

        self.threads = threads
        src = kernel_source(unroll, idx)
        self.kernels = {}
        for g in devices:
            with cupy.cuda.Device(g):
                self.kernels[g] = cupy.RawKernel(src, "copy_table")

    def launcher(self, g: int, memcpys: list, grid: int):
        import cupy

        rows = table_rows(memcpys)
        with cupy.cuda.Device(g):
            table = cupy.asarray([v for row in rows for v in row], dtype=cupy.uint64)
            cupy.cuda.runtime.deviceSynchronize()
        n, blocks = len(rows), max(1, min(len(rows), grid))

        def launch(stream: int) -> None:
            with cupy.cuda.Device(g), cupy_stream(stream):
                self.kernels[g]((blocks,), (self.threads,), (table, cupy.int64(n)))
        return launch


def main() -> None:
    a, P, streams = setup(__doc__)
    results = []
    for unroll, idx, threads, push_grid, local_grid in VARIANTS:
        v = Variant(unroll, idx, threads, (0, 1))
        name = f"unroll {unroll}, {'32' if 'int' in idx and 'long' not in idx else '64'}-bit, {threads} threads"
        for kind, pitched in (("pitched", True), ("contig", False)):
            for where, grid in (("push", push_grid), ("local", local_grid)):
                # push: GPU g writes its blocks into the peer; local: GPU g copies within itself
                ms = {g: copies(P[g][0 if pitched else 1], P[1 - g if where == "push" else g][2], pitched) for g in (0, 1)}
                nbytes = sum(m.width * m.height for m in ms[0])
                launch = {g: v.launcher(g, ms[g], grid) for g in (0, 1)}
                for g in (0, 1):
                    P[g][2].zero_()
                sec = timed(launch, streams)
                ok = all(torch.equal(P[1 - g if where == "push" else g][2][0, :ROWS * WIDTH].view(ROWS, WIDTH).cpu(),
                                     (P[g][0][0, :ROWS * PITCH].view(ROWS, PITCH)[:, :WIDTH] if pitched
                                      else P[g][1][0, :ROWS * WIDTH].view(ROWS, WIDTH)).cpu()) for g in (0, 1))
                gbs = nbytes / sec / 1e9
                results.append({"variant": name, "grid": grid, "blocks": kind, "copy": where,
                                "ms": round(sec * 1e3, 2), "GB/s per GPU": round(gbs, 1), "ok": ok})
                print(f"{name:34s} grid {grid:5d} {kind:8s} {where:6s} {sec * 1e3:8.2f} ms {gbs:8.1f} GB/s per GPU  "
                      f"verified={ok}", flush=True)
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
