"""Checksum throughput on CUDA (`refit.executor.checksum`): every stage-1 box of one rank of a
plan, read once, next to a device-to-device copy of as many bytes.

    python bench/probes/checksum_speed.py                                   # qwen3-8b tp1 -> tp1, both ends
    python bench/probes/checksum_speed.py --model qwen3-30b-moe --side src  # 12k expert tensors

GB/s are bytes of the boxes read per second (the copy's: bytes copied per second, each read once
and written once).  The first call builds the launch table (and compiles the kernel); the timed
calls reuse it, as a verified refit does every step.  Other launch configurations
(``--configs warps,stages ...``) are checked to give the same checksums, then timed.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from refit import load_spec, make_plan
from refit.executor import checksum as ck
from refit.executor import checksum_triton as ckt
from refit.executor.values import TORCH_DTYPES, int_view
from refit.sides import Side


def timed(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of ``iters`` calls (each ends synchronized: checksums end in ``tolist``)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def allocate(spec, layout, rank: int) -> dict[str, torch.Tensor]:
    """The rank's local tensors on the GPU, one allocation each, filled with random bits."""
    out = {}
    for lt in layout.local_tensors(spec, rank):
        t = torch.empty(lt.shape, dtype=TORCH_DTYPES[lt.dtype], device="cuda")
        bits = 8 * t.element_size()
        int_view(t).random_(-2 ** (bits - 1), 2 ** (bits - 1))
        out[lt.name] = t
    return out


def copy_rate(nbytes: int, iters: int) -> tuple[float, int]:
    """GB/s of one device-to-device copy of ``nbytes`` (less where two buffers do not fit)."""
    free, _ = torch.cuda.mem_get_info()
    n = min(nbytes, int(free * 0.45)) // 16 * 16
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), iters)
    del a, b
    return n / s / 1e9, n


def one_side(args: argparse.Namespace, spec, r, end: str) -> None:
    side = Side.of_end(end)  # --side keeps the plan's words, src/dst
    layout = r.src if side is Side.TRAINER else r.dst
    tensors = allocate(spec, layout, args.rank)
    share = ck._share(r.plan, spec, r.src, r.dst, side, args.rank)
    nbytes = sum(r.plan.transfer_bytes(r.plan.transfers[b.index]) for b in share.boxes)
    blocks = sum(len(b.blocks) for b in share.boxes)

    def run() -> dict[int, int]:
        return ck.share_checksums(r.plan, spec, r.src, r.dst, side, args.rank, tensors)

    t0 = time.perf_counter()
    want = run()
    first = time.perf_counter() - t0
    items = share.launches.items.shape[0] if share.launches is not None else 0
    print(f"{end} rank {args.rank} ({layout.describe()}): {len(tensors)} tensors, {len(share.boxes)} boxes in "
          f"{blocks} blocks, {nbytes / 1e9:.2f} GB, {items} kernel items; first call {first * 1e3:.0f} ms")
    base = dict(ckt._CONFIG)
    for cfg in args.configs:
        warps, stages = (int(x) for x in cfg.split(","))
        ckt._CONFIG.update(num_warps=warps, num_stages=stages)
        share.launches = None  # items depend on the block size
        same = run() == want
        s = timed(run, args.iters)
        print(f"  kernel warps={warps} stages={stages}: {s * 1e3:8.2f} ms  {nbytes / s / 1e9:7.1f} GB/s"
              f"  {'same checksums' if same else 'CHECKSUMS DIFFER'}")
    ckt._CONFIG.update(base)
    share.launches = None
    views = ck._Views(share, tensors)
    s = timed(lambda: ck._sums_torch(share, views).tolist(), max(1, args.iters // 5))
    print(f"  torch path:            {s * 1e3:8.2f} ms  {nbytes / s / 1e9:7.1f} GB/s")
    del tensors, views
    torch.cuda.empty_cache()
    rate, n = copy_rate(nbytes, args.iters)
    print(f"  device-to-device copy of {n / 1e9:.2f} GB: {rate:7.1f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--src", default="tp1")
    p.add_argument("--dst", default="tp1")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--side", choices=["src", "dst", "both"], default="both")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--configs", nargs="*", default=["4,1", "8,1", "4,2"], help="warps,stages of the kernel's launch")
    args = p.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    spec = load_spec(args.model)
    r = make_plan(spec, args.src, args.dst)
    print(f"{args.model} {r.src.describe()} -> {r.dst.describe()}: {len(r.plan.transfers)} transfers")
    for side in (["src", "dst"] if args.side == "both" else [args.side]):
        one_side(args, spec, r, side)


if __name__ == "__main__":
    main()
