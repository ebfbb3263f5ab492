"""The physical floor of a refit among the GPUs of one host: an all-to-all measured, not assumed.

A colocated refit is an all-to-all: every GPU reads its share from every other.  Its floor is the
largest per-GPU inbound volume over the per-GPU inbound bandwidth of the *best primitive* for an
all-to-all among exactly those GPUs — not a send/recv between the first two.  Measured here, in one
process that sees all of them, before the refit's workers start:

* ``ce_rounds``: copy engines in rounds (round k: GPU i pulls from GPU (i+k) mod N, one stream per
  GPU) — what the ipc transport does;
* ``nccl``: NCCL send/recv of every pair in one group — what the nccl transport does.

Measured on 4x H200 (`bench/probes/a2a_probe.py`, 1 GiB per pair): 389 GB/s per GPU in rounds, 349 over
NCCL, 197 for copy engines pulling from all peers at once.
"""

from __future__ import annotations

import time
from typing import Sequence


CE_MIN_BYTES = 1 << 30  # per pair: the ipc transport's peer copy is one stream of GBs, not 256 MiB pieces
REPS = 5


def ce_pair_bytes(nbytes: int) -> int:
    """What the copy engines move per pair by default when NCCL moves ``nbytes``."""
    return max(nbytes, CE_MIN_BYTES)


def measure(devices: Sequence[int], nbytes: int = 256 << 20, reps: int = REPS,
            ce_nbytes: int | None = None) -> dict[str, float]:
    """Per-GPU inbound GB/s of each primitive among ``devices`` (CUDA indices, one host): NCCL
    with ``nbytes`` from every GPU to every other (its messages: the run's buckets), copy engines
    with ``ce_nbytes`` (default: at least `CE_MIN_BYTES`).  The best of ``reps`` runs: a floor is
    what the hardware can do, and a short run's median carried host jitter (2x H200, 256 MiB per
    pair, median of 3: 334-378 GB/s from one call to the next).  Empty with fewer than two devices."""
    import cupy
    from cupy.cuda import nccl, runtime

    n = len(devices)
    if n < 2:
        return {}
    ce_nbytes = ce_nbytes or ce_pair_bytes(nbytes)
    # Two buffers of n pair slots per GPU (16 GiB on 8 GPUs at 1 GiB a pair), freed before the
    # refit's workers start.
    size = max(nbytes, ce_nbytes)
    src, dst, streams = [], [], []
    for d in devices:
        with cupy.cuda.Device(d):
            src.append(cupy.empty(n * size, dtype=cupy.uint8))
            dst.append(cupy.empty(n * size, dtype=cupy.uint8))
            streams.append(cupy.cuda.Stream(non_blocking=True))
    for i, a in enumerate(devices):
        with cupy.cuda.Device(a):
            for b in devices:
                if b != a:
                    try:
                        runtime.deviceEnablePeerAccess(b)
                    except runtime.CUDARuntimeError as e:
                        if "AlreadyEnabled" not in str(e):
                            raise

    def sync() -> None:
        for d in devices:
            with cupy.cuda.Device(d):
                runtime.deviceSynchronize()

    def ce_rounds() -> None:
        for k in range(1, n):
            for i, d in enumerate(devices):
                j = (i + k) % n
                with cupy.cuda.Device(d):
                    runtime.memcpyAsync(dst[i].data.ptr + j * size, src[j].data.ptr + i * size, ce_nbytes,
                                        runtime.memcpyDefault, streams[i].ptr)

    comms = nccl.NcclCommunicator.initAll(list(devices))

    def nccl_all() -> None:
        nccl.groupStart()
        for i, d in enumerate(devices):
            with cupy.cuda.Device(d):
                for j in range(n):
                    if j != i:
                        comms[i].send(src[i].data.ptr + j * size, nbytes, nccl.NCCL_UINT8, j, streams[i].ptr)
                        comms[i].recv(dst[i].data.ptr + j * size, nbytes, nccl.NCCL_UINT8, j, streams[i].ptr)
        nccl.groupEnd()

    out = {}
    for name, fn, per_pair in (("ce_rounds", ce_rounds, ce_nbytes), ("nccl", nccl_all, nbytes)):
        fn()
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        out[name] = (n - 1) * per_pair / min(times) / 1e9
    for c in comms:
        c.destroy()
    src.clear()  # drop the buffers before the pool frees them
    dst.clear()
    for d in devices:
        with cupy.cuda.Device(d):
            cupy.get_default_memory_pool().free_all_blocks()
    return out
