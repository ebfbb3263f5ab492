"""`refit plan --predict` against every GPU refit median in bench/RESULTS.md, and the big runs.

    python bench/predict_vs_measured.py [--json] [--big]

Each case's measured median and command are copied from the section of bench/RESULTS.md named in
its row (the newest figure of that section unless the row says otherwise); the plan is built with
the same arguments as the run (buckets of 256 MiB as refit-bench uses on GPUs unless the command
names --bucket-mb; colocated unless it says disaggregated; `--layers N` through
`refit.bench.smaller_specs.first_layers`), then predicted with the preset of the GPU it ran on.  No case is
tuned: one preset per GPU kind (refit/predict.py); the two live-vLLM cases are the runs the engine
cost (`refit.predict.ENGINES`) was fitted on, so they check the arithmetic, not the model.  Cases outside 15% carry a one-line reason.
``--big``: predict the runs no machine here can measure (docs/performance.md, "Predicted big runs").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from refit.bench.smaller_specs import first_layers
from refit.hf_checkpoint import load_spec
from refit.planners import make_plan
from refit.predict import engine_cost, hardware, predict
from refit.units import MiB

BAND = 0.15


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    src: str
    dst: str
    gpus: int
    measured_ms: float
    section: str  # where the median is in bench/RESULTS.md
    transport: str = "ipc"
    layers: int = 0
    placement: str = "colocated"
    planner: str = "p2p"
    bucket_mb: float = 256
    hw: str = "h200-nvl8"
    engine: str = ""  # a live engine's loop around the bytes (`refit.predict.ENGINES`)
    phase_layers: int = 0
    why: str = ""  # one line, for a case outside the band (what the model leaves out)


CTRL = "round trip through the coordinator and agents: the control plane's ~4-6 ms is not modelled"
BEFORE_TABLE = ("measured before 2026-11-27, when a one-GPU refit's same-GPU copies ran on the copy engines "
                "(966-1316 GB/s); the model's rate is the table kernel's since")
SAME_GPU = "Same-GPU refits at copy speed, 1× H200 (newest)"
CASES = [
    Case("q30 tp2ep2→tp2 ipc", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 40.35,
         "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC (newest, framework)"),
    Case("q30 tp2ep2→tp2 ipc --alloc arena", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 38.43,
         "same section, --alloc arena"),
    Case("q30 tp2ep2→tp2 nccl --bucket-mb 1024", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 47.58,
         "qwen3-30b-moe … 2× H200, NCCL (newest)", transport="nccl", bucket_mb=1024),
    Case("q30 tp2ep2→tp2 nccl (256 MiB buckets)", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 63.12,
         "same section, history 2026-11-23 (45ab304)", transport="nccl",
         why="NCCL runs 277 GB/s at 256 MiB messages, not the model's 303 (1 GiB); bucket size is not modelled"),
    Case("q30 tp2ep2→tp2 --via grpc, data", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 40.27,
         "qwen3-30b-moe … --via grpc (newest, data)"),
    Case("q30 tp2ep2→tp2 --via grpc, round trip", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 45.23,
         "qwen3-30b-moe … --via grpc (newest, round trip)", why=CTRL),
    Case("q30 tp2ep2→tp2 --via grpc nccl --bucket-mb 1024, data", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2",
         2, 48.86, "same section (newest, the agents over NCCL, shared-memory barriers)", transport="nccl",
         bucket_mb=1024),
    Case("q8 tp1→tp1 --via grpc, data", "qwen3-8b", "megatron:tp1", "vllm:tp1", 1, 8.67, SAME_GPU + ", --via grpc"),
    Case("q8 tp1→tp1 --via grpc, round trip", "qwen3-8b", "megatron:tp1", "vllm:tp1", 1, 14.25,
         "same section, --via grpc round trip", why=CTRL),
    Case("q8 tp1→tp1 one GPU", "qwen3-8b", "megatron:tp1", "vllm:tp1", 1, 8.52, SAME_GPU),
    Case("q30 tp1→tp1 one GPU", "qwen3-30b-moe", "megatron:tp1", "vllm:tp1", 1, 30.92, SAME_GPU),
    Case("q235 --layers 8 tp1→tp1 one GPU", "qwen3-235b-moe", "megatron:tp1", "vllm:tp1", 1, 21.60, SAME_GPU,
         layers=8),
    Case("q30 tp4ep4→tp4 ipc", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 30.52,
         "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, CUDA IPC (newest)"),
    Case("q30 tp4ep4→tp4 ipc --alloc arena", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 32.70,
         "same section, --alloc arena"),
    Case("q30 tp4ep4→tp4 broadcast", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 218.4,
         "same section, --vs broadcast", planner="broadcast", transport="nccl",
         why="the broadcast planner's stage 1 is an NCCL broadcast from each root (a ring through every "
             "GPU), not the point-to-point sends the model counts"),
    Case("q30 tp4ep4→tp4 --via grpc, data", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 30.70,
         "qwen3-30b-moe … 4× H200, --via grpc (newest, data)"),
    Case("q30 tp4ep4→tp4 --via grpc, round trip", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 36.22,
         "same section (newest, round trip)", why=CTRL),
    Case("q30 tp4ep4→tp4 nccl --bucket-mb 1200", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4, 35.74,
         "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, NCCL (newest)", transport="nccl", bucket_mb=1200),
    Case("q30 tp4ep4→tp4 --via grpc nccl --bucket-mb 1200, data", "qwen3-30b-moe", "megatron:tp4ep4", "vllm:tp4", 4,
         36.06, "qwen3-30b-moe … 4× H200, --via grpc: the agents over NCCL (shared-memory barriers)",
         transport="nccl", bucket_mb=1200),
    Case("q30 tp4ep4→tp4 --via grpc nccl --bucket-mb 1200, round trip", "qwen3-30b-moe", "megatron:tp4ep4",
         "vllm:tp4", 4, 40.85, "same table", transport="nccl", bucket_mb=1200, why=CTRL),
    Case("q235 --layers 20 tp2ep2→tp2 ipc", "qwen3-235b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 67.08,
         "qwen3-235b-moe --layers 20 … 2× H200 (newest, framework)", layers=20),
    Case("q235 --layers 20 tp2ep2→tp2 ipc --alloc arena", "qwen3-235b-moe", "megatron:tp2ep2", "vllm:tp2", 2,
         62.35, "same section, --alloc arena", layers=20),
    Case("q235 --layers 20 tp2ep2→tp2 nccl --bucket-mb 1024", "qwen3-235b-moe", "megatron:tp2ep2", "vllm:tp2", 2,
         86.32, "same section, --transport nccl --bucket-mb 1024", layers=20, transport="nccl", bucket_mb=1024,
         why="beside 20 layers of many small same-GPU copies NCCL kept 1.26-1.28x its own floor; "
             "the model counts no contention between the two"),
    Case("moonlight-16b tp2ep2→tp2 ipc", "moonlight-16b", "megatron:tp2ep2", "vllm:tp2", 2, 20.47,
         "Other architectures, tp2ep2 → tp2, 2× H200 (newest)"),
    Case("glm-4.5-air --layers 18 tp2ep2→tp2 ipc", "glm-4.5-air", "megatron:tp2ep2", "vllm:tp2", 2, 53.19,
         "same section (newest)", layers=18),
    Case("q30 tp1→tp1 disaggregated nccl", "qwen3-30b-moe", "megatron:tp1", "vllm:tp1", 2, 202.27,
         "One direction and one GPU: tp1 → tp1 (newest)", transport="nccl", placement="disaggregated"),
    Case("q8 tp1→tp1 disaggregated ipc", "qwen3-8b", "tp1", "tp1", 2, 43.6,
         "same section, 2026-11-22 (copy-engine executor)", placement="disaggregated"),
    Case("q30 --layers 20 tp1→tp1 one GPU (2026-11-24)", "qwen3-30b-moe", "megatron:tp1", "vllm:tp1", 1, 27.08,
         "same section, 2026-11-24", layers=20, why=BEFORE_TABLE),
    Case("q8 tp1→tp2 colocated ipc", "qwen3-8b", "megatron:tp1", "vllm:tp2", 2, 24.2,
         "same section, 2026-11-22 (copy-engine executor)"),
    Case("q8 --layers 8 hf→hf, Client.refit (H100)", "qwen3-8b", "hf", "hf", 1, 9.23,
         "Dtype casts: … one H100 (bf16 trainer)", layers=8, hw="h100-nvl8", why=CTRL),
    Case("q30 --layers 8 hf→hf, Client.refit (H100)", "qwen3-30b-moe", "hf", "hf", 1, 13.80,
         "same section (bf16 trainer)", layers=8, hw="h100-nvl8", why=CTRL),
    Case("q30 tp2ep2→tp2 --ray auto", "qwen3-30b-moe", "megatron:tp2ep2", "vllm:tp2", 2, 49.1,
         "Ray, 2× H200 (2026-11-22)",
         why="measured 2026-11-22, before the executor's fixes of 11-22/23 (the direct bench ran 49.0 ms "
             "that day, 40.35 now)"),
    Case("q8 into live vLLM 0.26, loop calls", "qwen3-8b", "hf", "vllm:tp1", 1, 15.26,
         "refit against vLLM's own weight transfer, vLLM 0.26, one H200 (newest)", engine="vllm"),
    Case("q30 --layers 16 into live vLLM 0.26, loop calls (phases of 1 layer)", "qwen3-30b-moe", "hf", "vllm:tp1",
         1, 33.98, "same section (newest)", layers=16, engine="vllm", phase_layers=1),
    Case("q8 tp1→tp1 two Ray nodes, nccl", "qwen3-8b", "megatron:tp1", "vllm:tp1", 2, 52.9,
         "Ray, 2× H200 (2026-11-22)", transport="nccl", placement="disaggregated"),
]

# The big runs (docs/performance.md): layouts of bench/RESULTS.md's "Planning at 1T scale".
BIG = [
    ("qwen3-235b-moe", "megatron:tp4ep8", "vllm:tp8", "colocated", None),
    ("kimi-k2", "megatron:tp1pp16ep16etp1dp16first4last1", "vllm:tp16dp8", "disaggregated", None),
    ("kimi-k2", "megatron:tp1pp16ep16etp1dp16first4last1", "vllm:tp16ep128dp8", "disaggregated", None),
    ("deepseek-v3", "megatron:tp8pp16ep16etp1dp2first4last1", "vllm:tp16dp8", "disaggregated", None),
    ("deepseek-v3", "megatron:tp8pp16ep16etp1dp2first4last1", "vllm:tp16ep128dp8", "disaggregated", None),
]


def run_case(c: Case) -> dict:
    spec = load_spec(c.model)
    if c.layers:
        spec = first_layers(spec, c.layers)
    result = make_plan(spec, c.src, c.dst, c.placement, c.planner, int(c.bucket_mb * MiB), c.phase_layers)
    if result.plan.placement.num_gpus != c.gpus:
        raise SystemExit(f"{c.name}: the plan has {result.plan.placement.num_gpus} GPUs, the run {c.gpus}")
    p = predict(result.plan, hardware(c.hw), c.transport, engine_cost(c.engine) if c.engine else None)
    ratio = p.seconds * 1e3 / c.measured_ms
    inside = abs(ratio - 1) <= BAND
    return {"case": c.name, "gpus": c.gpus, "hardware": c.hw, "transport": c.transport,
            "measured_ms": c.measured_ms, "predicted_ms": round(p.seconds * 1e3, 2), "ratio": round(ratio, 3),
            "inside": inside, "bottleneck": p.bottleneck, "why": "" if inside else (c.why or "(no reason given)"),
            "section": c.section}


def run_big() -> list[dict]:
    rows = []
    for model, src, dst, placement, transport in BIG:
        result = make_plan(load_spec(model), src, dst, placement)
        p = predict(result.plan, hardware("h200-nvl8"), transport)
        rows.append({"model": model, "src": result.src.describe(), "dst": result.dst.describe(),
                     "placement": placement, "gpus": result.plan.placement.num_gpus, "hosts": p.num_hosts,
                     "transport": p.transport, "predicted_s": round(p.seconds, 4), "bottleneck": p.bottleneck,
                     "remote_bytes": result.summary["remote_bytes"], "total_bytes": result.summary["total_bytes"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--big", action="store_true", help="also predict the big runs (8 GPUs; 256 -> 128 GPUs)")
    args = ap.parse_args(argv)
    rows = [run_case(c) for c in CASES]
    big = run_big() if args.big else []
    if args.json:
        print(json.dumps({"cases": rows, "big": big}, indent=2))
        return 0
    print("| case | GPUs | measured median | predicted | ratio | bottleneck | outside 15%: why |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gpu = "H100" if r["hardware"].startswith("h100") else "H200"
        print(f"| {r['case']} | {r['gpus']}× {gpu} | {r['measured_ms']:.2f} ms | {r['predicted_ms']:.2f} ms | "
              f"{r['ratio']:.2f} | {r['bottleneck']} | {r['why'] if not r['inside'] else ''} |")
    n_in = sum(r["inside"] for r in rows)
    print(f"\n{n_in} of {len(rows)} within 15%")
    if big:
        print("\n| model | src → dst | placement | GPUs (hosts) | transport | predicted | bottleneck |")
        print("|---|---|---|---|---|---|---|")
        for b in big:
            print(f"| {b['model']} | `{b['src']} → {b['dst']}` | {b['placement']} | {b['gpus']} ({b['hosts']}) | "
                  f"{b['transport']} | {b['predicted_s']:.3f} s | {b['bottleneck']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
