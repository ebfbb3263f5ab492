"""What stands between a colocated 2-GPU refit and the link floor?

Times, on two GPUs (one process each, NCCL through torch.distributed on a private store):
  1. one-way send of N bytes in buckets              (the floor's own assumption)
  2. both directions at once                          (what a colocated refit does)
  3. both directions + concurrent same-GPU copies of the size a refit packs, unpacks and copies
     locally (HBM and SM contention with NCCL)
Run:  torchrun-free: python bench/probes/profile_floor.py  (spawns 2 processes; needs 2 GPUs)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GiB = 2**30


def worker(rank: int, port: int, total_gib: float, bucket_mib: int, copy_gib: float) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    n = int(bucket_mib * 2**20)
    k = int(total_gib * GiB // n)
    send = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    recv = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    src = torch.empty(int(copy_gib * GiB), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    side = torch.cuda.Stream()
    peer = 1 - rank

    def run(mode: str) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "copy":
            with torch.cuda.stream(side):
                dst.copy_(src)
        for i in range(k):
            ops = []
            if mode == "oneway":
                ops.append(dist.P2POp(dist.isend if rank == 0 else dist.irecv, send[i % 2] if rank == 0 else recv[i % 2], peer))
            else:
                ops += [dist.P2POp(dist.isend, send[i % 2], peer), dist.P2POp(dist.irecv, recv[i % 2], peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    results = {}
    for mode in ("oneway", "both", "copy"):
        run(mode)
        ts = sorted(run(mode) for _ in range(5))
        results[mode] = ts[2]
    dist.barrier()
    if rank == 0:
        moved = k * n
        print(f"bucket {bucket_mib} MiB, {moved / GiB:.1f} GiB per direction; concurrent copy {copy_gib} GiB")
        for mode, label in (("oneway", "one direction"), ("both", "both directions"),
                            ("copy", "both directions + same-GPU copy")):
            print(f"  {label:<34} {results[mode] * 1e3:7.1f} ms  {moved / results[mode] / 1e9:6.1f} GB/s per direction")
        t = time.perf_counter(); torch.cuda.synchronize()
        with torch.cuda.stream(side):
            pass
        t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); tc = time.perf_counter() - t0
        print(f"  same-GPU copy alone {copy_gib} GiB: {tc * 1e3:.1f} ms ({2 * copy_gib * GiB / tc / 1e12:.2f} TB/s read+write)")
    dist.destroy_process_group()


if __name__ == "__main__":
    total = float(sys.argv[1]) if len(sys.argv) > 1 else 13.5
    copy = float(sys.argv[3]) if len(sys.argv) > 3 else 42.0
    for bucket in (int(sys.argv[2]),) if len(sys.argv) > 2 else (256, 1024):
        mp.spawn(worker, args=(29511 + bucket % 1000, total, bucket, copy), nprocs=2)
