"""Planner speed: how long `make_plan` takes from layout strings to a finished, summarised plan.

Each measurement is cold: the holdings cache is cleared first, so layouts are expanded and boxes
merged every time, as in a fresh process.  Planning is single-threaded Python: one core.

    taskset -c 1 python bench/plan_speed.py [--repeat 7] [--json] [--only kimi-k2,deepseek-v3]

Wall time is what the targets are about; CPU time (``process_time``) is printed next to it, and a
fixed pure-Python loop before and after (the CPU reference), because this project's shared VM
runs 1-10x slower when other work shares its two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refit.layouts import all_holdings  # noqa: E402
from refit.hf_checkpoint import load_spec  # noqa: E402
from refit.layouts.vllm import clear_caches  # noqa: E402
from refit.planners import make_plan  # noqa: E402

# (model, src, dst, placement, planner, target seconds or None)
CASES = [
    ("qwen3-30b-moe", "tp4ep8", "tp8", "colocated", "p2p", 0.050),
    ("qwen3-235b-moe", "megatron:tp4pp4ep16", "vllm:tp8dp8", "colocated", "p2p", 1.0),
    ("qwen3-30b-moe", "tp2ep2", "tp2", "colocated", "p2p", None),
    ("qwen3-30b-moe", "tp4ep8", "vllm:tp4ep4", "disaggregated", "p2p", None),
    ("qwen3-30b-moe", "tp4ep8", "tp8", "colocated", "broadcast", None),
    ("llama3.1-70b", "megatron:tp8pp4vpp5", "vllm:tp8dp4", "colocated", "p2p", None),
    # 1T scale (issue 14): Kimi-K2 256 -> 128 GPUs, DeepSeek-V3 NeMo-RL-style 256 -> 256 GPUs.  61 layers on
    # pp16: 4 on the first stage, 1 on the last, 4 on each other.  Without vLLM expert parallel every
    # engine rank holds a slice of every expert (the largest plans); with it, whole experts.
    ("kimi-k2", "megatron:pp16ep16first4last1", "vllm:tp16dp8", "colocated", "p2p", 3.0),
    ("deepseek-v3", "megatron:tp8pp16ep16first4last1", "vllm:tp32dp8", "colocated", "p2p", 3.0),
    ("kimi-k2", "megatron:pp16ep16first4last1", "vllm:tp16ep128dp8", "disaggregated", "p2p", None),
    ("deepseek-v3", "megatron:tp8pp16ep16first4last1", "vllm:tp32ep256dp8", "colocated", "p2p", None),
]


def measure(model: str, src: str, dst: str, placement: str, planner: str, repeat: int) -> dict:
    spec = load_spec(model)
    times, cpu = [], []
    for _ in range(repeat):
        all_holdings.cache_clear()
        clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        result = make_plan(spec, src, dst, placement, planner)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    s = result.summary
    return {"model": model, "src": s["src"], "dst": s["dst"], "placement": placement, "planner": planner,
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "cpu_median_s": statistics.median(cpu), "cpu_min_s": min(cpu), "num_transfers": s["num_transfers"],
            "num_buckets": s["num_buckets"], "plan_json_bytes": s["plan_json_bytes"],
            "plan_hash": s["plan_hash"]}


def cpu_reference_ms() -> float:
    """Time of a fixed pure-Python loop (best of 5): this VM's speed drifts by 2x over minutes, so
    every planner timing is printed next to it."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        sum(range(1_000_000))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated model names: run only their cases")
    args = ap.parse_args()
    only = {m for m in args.only.split(",") if m}
    cases = [c for c in CASES if not only or c[0] in only]
    # Warm up (the VM's CPU runs slower for the first second of a busy process): one untimed pass.
    for model, src, dst, placement, planner, _ in cases:
        measure(model, src, dst, placement, planner, 1)
    ref_before = cpu_reference_ms()
    rows = []
    for model, src, dst, placement, planner, target in cases:
        r = measure(model, src, dst, placement, planner, args.repeat)
        r["target_s"] = target
        r["ok"] = None if target is None else r["median_s"] <= target
        rows.append(r)
    ref = {"before_ms": ref_before, "after_ms": cpu_reference_ms()}
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "cpu_reference": ref,
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeat": args.repeat,
                          "cases": rows}, indent=2))
    else:
        print(f"{'model':<16}{'src':<46}{'dst':<20}{'placement':<15}{'planner':<10}{'median':>9}{'min':>9}"
              f"{'cpu min':>9}{'transfers':>10}{'plan MB':>9}  target")
        for r in rows:
            tgt = "" if r["target_s"] is None else f"<= {r['target_s'] * 1e3:.0f} ms {'ok' if r['ok'] else 'MISSED'}"
            print(f"{r['model']:<16}{r['src']:<46}{r['dst']:<20}{r['placement']:<15}{r['planner']:<10}"
                  f"{r['median_s'] * 1e3:>7.1f}ms{r['min_s'] * 1e3:>7.1f}ms{r['cpu_min_s'] * 1e3:>7.1f}ms"
                  f"{r['num_transfers']:>10}"
                  f"{r['plan_json_bytes'] / 1e6:>9.1f}  {tgt}")
        print(f"cpu reference (sum(range(10**6)), best of 5): {ref['before_ms']:.1f} ms before, "
              f"{ref['after_ms']:.1f} ms after")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
