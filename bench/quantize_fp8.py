"""What quantizing on the wire costs on a GPU: `refit.executor.quantize.quantize_fp8_blocks`
(bf16 -> FP8 e4m3fn, one float32 scale per 128x128 block) against a device-to-device copy.

For each shape, with the outputs preallocated (as the executor keeps its wire buffers):

* the kernel's time, CUDA events around each call, median of ``--iters`` runs; its effective
  bandwidth = (input bytes + FP8 bytes + scale bytes) / time;
* the reference, measured in the same run: ``torch`` copying the input's bytes to another buffer
  on the same GPU, bandwidth = 2 x input bytes / time (read and write);
* the ratio kernel GB/s / copy GB/s (the target: >= 0.8 on large inputs).

Both are timed twice: ``eager`` (one launch between two events, what a caller pays, host launch
overhead included when the GPU outruns the host) and ``graph`` (``--reps`` launches captured in a
CUDA graph and replayed, the device time alone).  The ratio is reported for both.  Then the
result on a slice (the first expert, or the first block rows) is compared bit for bit with the
torch path run on the CPU; a mismatch exits 1.

Default shapes: [4096, 4096] bf16, [128, 1536, 2048] bf16 (qwen3-30b-a3b's experts w13, one
layer), [8192, 8192] bf16.  Needs only torch and triton (without triton the torch path is timed).

    python bench/quantize_fp8.py                      # GPU 0, the three shapes, a table
    python bench/quantize_fp8.py --json               # the same as JSON on stdout
    python bench/quantize_fp8.py --shape 256x7168x2048 --num-warps 4 --iters 50
    python bench/quantize_fp8.py --require-ratio 0.8  # exit 1 if a graph ratio is below 0.8
    python bench/quantize_fp8.py --case many          # 1536 separate [768, 2048] tensors only

The ``many`` case (``--case many|all``): ``--many-count`` tensors of ``--many-shape`` allocated
one by one (default 1536 x [768, 2048] bf16, ~4.8 GB: one layer group of a MoE trainer's shard),
timed eager through `quantize_fp8_blocks_many` (one grouped launch), through a loop of
`quantize_fp8_blocks` (one launch each) and against one device copy of the same total bytes;
also the cold call (checks and address tables built) and a warm call's host time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from refit.executor import quantize as qz  # noqa: E402
from refit.executor import quantize_grouped as qg  # noqa: E402
from refit.executor import quantize_triton as qt  # noqa: E402

log = logging.getLogger("quantize_fp8")
DEFAULT_SHAPES = ["4096x4096", "128x1536x2048", "8192x8192"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is dims joined by x (4096x4096), got {text!r}") from None
    if len(shape) < 2 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"a shape needs at least 2 positive dims, got {text!r}")
    return shape


def time_eager(fn: Callable[[], Any], iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls, CUDA events around each."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def time_graph(fn: Callable[[], Any], iters: int, reps: int) -> list[float]:
    """Seconds per call of ``reps`` calls captured in one CUDA graph, each of ``iters`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return [t / reps for t in time_eager(graph.replay, iters)]


def check_slice(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], rows: int) -> dict[str, Any]:
    """The GPU's result on a slice against the torch path on the CPU: the first 2-D slice, its
    first ``rows`` rows (whole block rows, so its blocks are the full tensor's)."""
    lead = (0,) * (x.ndim - 2)
    bm = block[0]
    r = min(x.shape[-2], max(bm, rows // bm * bm))
    xs = x[lead][:r].cpu()
    want_q = torch.empty(xs.shape, dtype=qz.FP8_DTYPE)
    want_s = torch.empty(qz.fp8_scale_shape(xs.shape, block))
    qz._quantize_fp8_torch(xs, block, want_q, want_s)
    got_q, got_s = q[lead][:r].cpu(), s[lead][:want_s.shape[0]].cpu()
    codes = int((got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
    scales = int((got_s != want_s).sum())
    return {"slice": f"{list(lead) if lead else ''}[:{r}]", "elements": xs.numel(), "codes_differ": codes,
            "scales_differ": scales, "equal": codes == 0 and scales == 0}


def bench_shape(shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int], args: argparse.Namespace,
                dev: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(shape, dtype=torch.float32, device=dev, generator=gen).to(dtype)
    # outliers and a zero block, as real weights have
    x.view(-1)[::9973] *= 300
    x[(0,) * (x.ndim - 2)][:block[0], :block[1]] = 0
    q = torch.empty(shape, dtype=qz.FP8_DTYPE, device=dev)
    s = torch.empty(qz.fp8_scale_shape(shape, block), dtype=torch.float32, device=dev)
    copy_dst = torch.empty_like(x)
    triton_path = dev.type == "cuda" and qt._triton_usable(dev)
    if triton_path:
        def quantize() -> None:
            qz._quantize_fp8_triton(x, block, q, s, num_warps=args.num_warps)
    else:
        log.warning("the triton kernel is not usable here: timing the torch path")

        def quantize() -> None:
            qz.quantize_fp8_blocks(x, block, out=q, scale_out=s)

    def copy() -> None:
        copy_dst.copy_(x)

    for _ in range(args.warmup):  # compile, then warm
        quantize()
        copy()
    torch.cuda.synchronize(dev)
    in_bytes, q_bytes, s_bytes = x.numel() * x.element_size(), q.numel(), s.numel() * 4
    moved = in_bytes + q_bytes + s_bytes
    res: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "block": list(block),
                           "path": "triton" if triton_path else "torch", "bytes_in": in_bytes, "bytes_fp8": q_bytes,
                           "bytes_scales": s_bytes, "bytes_copy": 2 * in_bytes, "iters": args.iters}
    modes = ["eager"] + ([] if args.no_graph else ["graph"])
    for mode in modes:
        t_q = statistics.median(time_eager(quantize, args.iters) if mode == "eager"
                                else time_graph(quantize, args.iters, args.reps))
        t_c = statistics.median(time_eager(copy, args.iters) if mode == "eager"
                                else time_graph(copy, args.iters, args.reps))
        gbps_q, gbps_c = moved / t_q / 1e9, 2 * in_bytes / t_c / 1e9
        res[mode] = {"quantize_us": round(t_q * 1e6, 2), "quantize_gbps": round(gbps_q, 1),
                     "copy_us": round(t_c * 1e6, 2), "copy_gbps": round(gbps_c, 1), "ratio": round(gbps_q / gbps_c, 3)}
        log.info("%-16s %-6s %-5s quantize %9.1f us %7.1f GB/s | copy %9.1f us %7.1f GB/s | ratio %.3f",
                 "x".join(map(str, shape)), res["path"], mode, t_q * 1e6, gbps_q, t_c * 1e6, gbps_c, gbps_q / gbps_c)
    quantize()
    torch.cuda.synchronize(dev)
    res["check"] = check_slice(x, q, s, block, args.check_rows)
    log.info("%-16s check %s: %s", "x".join(map(str, shape)), res["check"]["slice"],
             "bit-exact" if res["check"]["equal"] else
             f"{res['check']['codes_differ']} codes and {res['check']['scales_differ']} scales differ")
    return res


def bench_many(count: int, shape: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int],
               args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """``count`` tensors of ``shape`` allocated one by one (a MoE shard's expert weights):
    `quantize_fp8_blocks_many` (one launch) against a loop of `quantize_fp8_blocks` (one launch
    each) and against one device copy of the same total bytes, eager only (CUDA events around the
    call: the host's launch and Python overhead are part of what a refit pays)."""
    import time

    gen = torch.Generator(device=dev).manual_seed(0)
    xs, outs, scales = [], [], []
    for _ in range(count):
        x = torch.randn(shape, dtype=torch.float32, device=dev, generator=gen).to(dtype)
        x.view(-1)[::9973] *= 300
        xs.append(x)
        outs.append(torch.empty(shape, dtype=qz.FP8_DTYPE, device=dev))
        scales.append(torch.empty(qz.fp8_scale_shape(shape, block), dtype=torch.float32, device=dev))
    total = count * xs[0].numel()
    copy_src = torch.empty(total, dtype=dtype, device=dev)
    copy_dst = torch.empty_like(copy_src)

    def many() -> None:
        qg.quantize_fp8_blocks_many(xs, outs, scales, block)

    def loop() -> None:
        for x, q, s in zip(xs, outs, scales):
            qz.quantize_fp8_blocks(x, block, out=q, scale_out=s)

    def copy() -> None:
        copy_dst.copy_(copy_src)

    for _ in range(args.warmup):
        many()
        loop()
        copy()
    torch.cuda.synchronize(dev)
    qg._many_cache.clear()  # a cold call: checks, grouping, the address tables built and copied over
    t0 = time.perf_counter()
    many()
    torch.cuda.synchronize(dev)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    many()  # host time of a warm call (the launch is asynchronous)
    host = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    in_bytes = total * xs[0].element_size()
    moved = in_bytes + total + sum(s.numel() for s in scales) * 4
    t_many = statistics.median(time_eager(many, args.iters))
    t_loop = statistics.median(time_eager(loop, max(5, args.iters // 5)))
    t_copy = statistics.median(time_eager(copy, args.iters))
    g_many, g_loop, g_copy = moved / t_many / 1e9, moved / t_loop / 1e9, 2 * in_bytes / t_copy / 1e9
    res: dict[str, Any] = {
        "case": "many", "count": count, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
        "block": list(block), "path": "triton" if qt._triton_usable(dev) else "torch", "bytes_in": in_bytes,
        "iters": args.iters,
        "eager": {"many_ms": round(t_many * 1e3, 3), "many_gbps": round(g_many, 1),
                  "loop_ms": round(t_loop * 1e3, 3), "loop_gbps": round(g_loop, 1),
                  "copy_ms": round(t_copy * 1e3, 3), "copy_gbps": round(g_copy, 1),
                  "ratio": round(g_many / g_copy, 3), "loop_ratio": round(g_loop / g_copy, 3),
                  "speedup_vs_loop": round(t_loop / t_many, 1),
                  "cold_call_ms": round(cold * 1e3, 2), "warm_host_ms": round(host * 1e3, 3)}}
    e = res["eager"]
    log.info("many %dx%s: grouped %.2f ms %.1f GB/s | loop %.2f ms %.1f GB/s | copy %.2f ms %.1f GB/s | ratio %.3f "
             "(loop %.3f), %.1fx the loop; cold call %.1f ms, warm call's host time %.2f ms", count,
             "x".join(map(str, shape)), e["many_ms"], g_many, e["loop_ms"], g_loop, e["copy_ms"], g_copy, e["ratio"],
             e["loop_ratio"], e["speedup_vs_loop"], e["cold_call_ms"], e["warm_host_ms"])
    many()
    torch.cuda.synchronize(dev)
    checks = [check_slice(xs[i], outs[i], scales[i], block, args.check_rows) for i in (0, count // 2, count - 1)]
    res["check"] = {"members": [0, count // 2, count - 1], "equal": all(c["equal"] for c in checks),
                    "codes_differ": sum(c["codes_differ"] for c in checks),
                    "scales_differ": sum(c["scales_differ"] for c in checks)}
    log.info("many check (members 0, %d, %d): %s", count // 2, count - 1,
             "bit-exact" if res["check"]["equal"] else "MISMATCH")
    return res


def device_info(dev: torch.device) -> dict[str, Any]:
    p = torch.cuda.get_device_properties(dev)
    info: dict[str, Any] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                            "memory_gib": round(p.total_memory / 2 ** 30, 1), "torch": torch.__version__}
    clock, width = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    if clock and width:  # kHz and bits: DDR, two transfers a clock
        info["nominal_gbps"] = round(2 * clock * 1e3 * width / 8 / 1e9, 1)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", dest="shapes", type=parse_shape, action="append",
                   help="a shape to measure, dims joined by x; repeat for several "
                        f"(default: {', '.join(DEFAULT_SHAPES)})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="input dtype (default bfloat16)")
    p.add_argument("--block", type=parse_shape, default=qz.FP8_BLOCK, help="block, e.g. 128x128 (the default)")
    p.add_argument("--iters", type=int, default=50, help="timed runs per measurement, the median is reported (>= 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (the first compiles the kernel)")
    p.add_argument("--reps", type=int, default=10, help="launches per CUDA graph in graph mode")
    p.add_argument("--no-graph", action="store_true", help="eager timing only")
    p.add_argument("--num-warps", type=int, default=None, help="override the kernel's warps per block (tuning)")
    p.add_argument("--check-rows", type=int, default=1024, help="rows of the first 2-D slice checked against the CPU")
    p.add_argument("--case", choices=["shapes", "many", "all"], default="all",
                   help="shapes: one tensor per shape (--shape); many: --many-count separate tensors of "
                        "--many-shape through quantize_fp8_blocks_many; all (the default): both")
    p.add_argument("--many-count", type=int, default=1536,
                   help="tensors of the many case (default 1536: a MoE shard's layer group, ~4.8 GB of bf16)")
    p.add_argument("--many-shape", type=parse_shape, default=(768, 2048), help="their shape (default 768x2048)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--require-ratio", type=float, default=None,
                   help="exit 1 if a ratio (graph mode, eager with --no-graph) is below this")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (the log goes to stderr)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.iters < 20:
        p.error(f"--iters must be at least 20 for a stable median, got {args.iters}")
    if len(args.block) != 2:
        p.error(f"--block needs two dims, got {args.block}")
    if not torch.cuda.is_available():
        log.error("no CUDA device: this benchmark measures the GPU kernel "
                  "(tests/unit/test_quantize.py covers the CPU path)")
        return 2
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    info = device_info(dev)
    log.info("%s (sm_%s, %d SMs), torch %s, triton %s", info["name"], info["capability"].replace(".", ""), info["sms"],
             info["torch"], info["triton"])
    shapes = args.shapes or [parse_shape(s) for s in DEFAULT_SHAPES]
    results = []
    if args.case in ("shapes", "all"):
        for shape in shapes:
            results.append(bench_shape(shape, DTYPES[args.dtype], tuple(args.block), args, dev))
            torch.cuda.empty_cache()  # the shape's buffers died with bench_shape's frame
    if args.case in ("many", "all"):
        results.append(bench_many(args.many_count, tuple(args.many_shape), DTYPES[args.dtype], tuple(args.block),
                                  args, dev))
        torch.cuda.empty_cache()
    out = {"device": info, "results": results}
    mode = "eager" if args.no_graph else "graph"
    ok = all(r["check"]["equal"] for r in results)
    if args.require_ratio is not None:
        low = [r for r in results if r[mode if mode in r else "eager"]["ratio"] < args.require_ratio]
        for r in low:
            m = mode if mode in r else "eager"
            log.error("%s: ratio %.3f < %.3f (%s)", r["shape"], r[m]["ratio"], args.require_ratio, m)
        ok = ok and not low
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{'shape':<16} {'path':<6} {'mode':<5} {'quantize us':>11} {'GB/s':>8} {'copy us':>9} {'GB/s':>8} "
              f"{'ratio':>6}  check")
        for r in results:
            if r.get("case") == "many":
                e = r["eager"]
                print(f"many {r['count']}x{'x'.join(map(str, r['shape']))} eager: grouped {e['many_ms']:.2f} ms "
                      f"{e['many_gbps']:.1f} GB/s | loop {e['loop_ms']:.2f} ms {e['loop_gbps']:.1f} GB/s | copy "
                      f"{e['copy_ms']:.2f} ms {e['copy_gbps']:.1f} GB/s | ratio {e['ratio']:.3f} (loop "
                      f"{e['loop_ratio']:.3f}) | {e['speedup_vs_loop']}x the loop | cold {e['cold_call_ms']} ms  "
                      f"{'bit-exact' if r['check']['equal'] else 'MISMATCH'}")
                continue
            for m in ("eager", "graph"):
                if m in r:
                    print(f"{'x'.join(map(str, r['shape'])):<16} {r['path']:<6} {m:<5} {r[m]['quantize_us']:>11.1f} "
                          f"{r[m]['quantize_gbps']:>8.1f} {r[m]['copy_us']:>9.1f} {r[m]['copy_gbps']:>8.1f} "
                          f"{r[m]['ratio']:>6.3f}  {'bit-exact' if r['check']['equal'] else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
