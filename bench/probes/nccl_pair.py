"""NCCL's own send/recv between two GPUs, each driven by a process that sees only its own GPU
(CUDA_VISIBLE_DEVICES set per process, as on two Ray nodes of one host): the reference for the
bytes `refit-bench --ray` moves across nodes.

    python3 bench/probes/nccl_pair.py --gpus 0,1 --bytes 16384000000 --chunk-mb 256 --iters 10 --json

Rank 0 sends ``--bytes`` to rank 1 in messages of ``--chunk-mb`` (refit's bucket size), one
buffer reused; a transfer's time is rank 1's, from a barrier to its stream being done.
``--backend gloo`` runs the same on CPU (to test this script without GPUs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: "mp.Queue[dict]") -> None:
    if args.backend == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus.split(",")[rank]  # before CUDA starts in this process
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chunk = int(args.chunk_mb * 2**20)
    sizes = [chunk] * (args.bytes // chunk) + ([args.bytes % chunk] if args.bytes % chunk else [])
    buf = torch.full((chunk,), 7 if rank == 0 else 0, dtype=torch.uint8, device=device)

    def once() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for n in sizes:
            (dist.send if rank == 0 else dist.recv)(buf[:n], 1 - rank)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()  # warm-up: communicator set-up, first connections
    seconds = [once() for _ in range(args.iters)]
    if rank == 1:
        assert int(buf[: sizes[-1]].min()) == 7, "rank 1 did not receive what rank 0 sent"
        median = statistics.median(seconds)
        out.put({"backend": args.backend, "gpus": args.gpus, "bytes": args.bytes, "chunk_bytes": chunk,
                 "messages": len(sizes), "seconds": {"median": median, "min": min(seconds), "all": seconds},
                 "gbps": args.bytes / median / 1e9})
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="0,1", help="the two GPUs (CUDA indices of this machine)")
    p.add_argument("--bytes", type=int, required=True, help="bytes per transfer (refit: the cross-node bytes per refit)")
    p.add_argument("--chunk-mb", type=float, default=256.0, help="message size in MiB (default 256)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        print(f"nccl_pair: a rank failed (exit codes {[proc.exitcode for proc in procs]})", file=sys.stderr)
        return 1
    result = out.get(timeout=10)
    print(json.dumps(result) if args.json else
          f"{args.backend} send/recv {args.gpus}: {result['bytes'] / 1e9:.2f} GB in {result['messages']} messages, "
          f"median {result['seconds']['median']:.4f} s, {result['gbps']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
