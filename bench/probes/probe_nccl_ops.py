"""NCCL send/recv between two GPUs, both directions at once, with a step's bytes as one message or
cut into many messages in one group (the shape a wire takes when it is sent from and received into
tensors directly, piece by piece).  Two processes, cupy NCCL, like refit's transport.

Run: python bench/probes/probe_nccl_ops.py [--gib 13.5]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.multiprocessing as mp

MiB = 2**20


def worker(rank: int, uid: bytes, total: int, q) -> None:
    import cupy
    from cupy.cuda import nccl

    torch.cuda.set_device(rank)
    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(2, uid, rank)
    peer = 1 - rank
    sbuf = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=f"cuda:{rank}")
    rbuf = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{rank}")
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    # PROBE_ONE_WAY=1: rank 0 only sends, rank 1 only receives (the disaggregated case)
    one_way = ("send" if rank == 0 else "recv") if os.environ.get("PROBE_ONE_WAY") else ""
    cases = [(int(x.split(":")[0]) * MiB, int(x.split(":")[1]) * MiB) for x in os.environ.get(
        "PROBE_CASES", "256:256,1024:1024,1024:256,512:256,256:6,256:3").split(",")]
    for step_bytes, piece in cases:
        steps = total // step_bytes
        per = [piece] * (step_bytes // piece) + ([step_bytes % piece] if step_bytes % piece else [])

        def run() -> None:
            for _ in range(steps):
                nccl.groupStart()
                off = 0
                for n in per:
                    if one_way != "recv":
                        comm.send(sbuf.data_ptr() + off, n, nccl.NCCL_UINT8, peer, s)
                    off += n
                off = 0
                for n in per:
                    if one_way != "send":
                        comm.recv(rbuf.data_ptr() + off, n, nccl.NCCL_UINT8, peer, s)
                    off += n
                nccl.groupEnd()
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        sec = sorted(times)[1]
        if rank == 0:
            q.put(f"step {step_bytes // MiB:5d} MiB as {len(per):4d} messages of {piece / MiB:7.2f} MiB: "
                  f"{sec * 1e3:7.1f} ms for {steps * step_bytes / 2**30:.1f} GiB each way, "
                  f"{steps * step_bytes / sec / 1e9:6.1f} GB/s per GPU in" + (" (one way)" if one_way else ""))


def run_pair(target: Callable[..., None], *args: object) -> None:
    """``target(rank, uid, *args, queue)`` in a process per GPU (0 and 1) on one NCCL unique id;
    prints what they put on the queue."""
    from cupy.cuda import nccl

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    uid = nccl.get_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, uid, *args, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    while not q.empty():
        print(q.get(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=13.5)
    a = ap.parse_args()
    run_pair(worker, int(a.gib * 2**30))


if __name__ == "__main__":
    main()
