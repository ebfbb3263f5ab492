"""Pictures of a refit: each GPU's timeline from a `REFIT_TRACE=1` log, and the GPU×GPU traffic
matrix of a plan.  Needs matplotlib (not a refit dependency).

    python bench/plot_refit.py timeline LOG [LOG...] --out timeline.png [--title T]
    python bench/plot_refit.py matrix --model qwen3-30b-moe --src megatron:tp4ep4 --dst vllm:tp4 --out matrix.png
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

TRACE = re.compile(r"trace cuda:(\d+) (\w+) (?:CopyBatch|WireStep)\(.*?(\d+) bytes\): starts ([\d.]+) ms, takes ([\d.]+) ms")
REFIT = re.compile(r"trace cuda:(\d+) refit of ")
# lanes of one GPU's row: same-GPU moves beside the pipeline, pack/unpack (or moves, ipc), wire, peer copies
LANES = {"local": ("tab:olive", "same-GPU moves (beside the wire)"), "copy": ("tab:green", "local copies / pack, unpack"),
         "wire": ("tab:red", "NCCL steps (bytes received)"), "pull": ("tab:blue", "peer copies (pull or push)")}


def last_refit(lines: list[str]) -> dict[int, list[tuple[str, float, float, int]]]:
    """Per GPU, the batches of the last refit in the log (each refit's lines start with a "refit
    of N batches" line; older logs without it: with its first copy)."""
    per_gpu: dict[int, list[tuple[str, float, float, int]]] = defaultdict(list)
    headed = any(REFIT.search(line) for line in lines)
    for line in lines:
        h = REFIT.search(line)
        if h:
            per_gpu[int(h[1])] = []
            continue
        m = TRACE.search(line)
        if not m:
            continue
        gpu, kind, nbytes, start, took = int(m[1]), m[2], int(m[3]), float(m[4]), float(m[5])
        if not headed and kind == "copy" and any(k == "copy" for k, *_ in per_gpu[gpu]):
            per_gpu[gpu] = []  # a new refit begins
        per_gpu[gpu].append((kind, start, took, nbytes))
    return per_gpu


def timeline(logs: list[str], out: str, title: str) -> None:
    import matplotlib.pyplot as plt

    lines = [line for path in logs for line in open(path, errors="replace")]
    per_gpu = last_refit(lines)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.8 * len(per_gpu)))
    used = [k for k in LANES if any(kind == k for batches in per_gpu.values() for kind, *_ in batches)]
    height = 0.8 / max(len(used), 1)
    for row, gpu in enumerate(sorted(per_gpu)):
        for kind, start, took, nbytes in per_gpu[gpu]:
            y = row + 0.4 - height * (used.index(kind) + 0.5) if kind in used else row
            ax.barh(y, took, left=start, height=height * 0.9, color=LANES.get(kind, ("gray",))[0], edgecolor="black")
            if took > 1.5:  # label what is wide enough to read
                ax.text(start + took / 2, y, f"{nbytes / 2**30:.1f} GiB", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(per_gpu)), [f"cuda:{g}" for g in sorted(per_gpu)])
    ax.set_xlabel("ms from the refit's start (CUDA events)")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=LANES[k][0]) for k in used],
              labels=[LANES[k][1] for k in used], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def matrix(model: str, src: str, dst: str, placement: str, out: str) -> None:
    import matplotlib.pyplot as plt

    from refit.hf_checkpoint import load_spec
    from refit.planners import make_plan

    spec = load_spec(model)
    plan = make_plan(spec, src, dst, placement).plan
    n = plan.placement.num_gpus
    grid = [[0.0] * n for _ in range(n)]
    for b in plan.buckets:
        s = plan.placement.src_gpus[b.sender]
        d = plan.placement.dst_gpus[b.receiver] if b.stage == 1 else plan.placement.src_gpus[b.receiver]
        grid[s][d] += b.nbytes / 2**30
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * n, 1 + 0.8 * n))
    im = ax.imshow(grid, cmap="viridis")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("destination GPU")
    ax.set_ylabel("source GPU")
    ax.set_title(f"{model} {src} -> {dst}: GiB per refit")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("timeline")
    t.add_argument("logs", nargs="+")
    t.add_argument("--out", required=True)
    t.add_argument("--title", default="refit timeline")
    m = sub.add_parser("matrix")
    m.add_argument("--model", required=True)
    m.add_argument("--src", required=True)
    m.add_argument("--dst", required=True)
    m.add_argument("--placement", default="colocated")
    m.add_argument("--out", required=True)
    a = p.parse_args()
    if a.cmd == "timeline":
        timeline(a.logs, a.out, a.title)
    else:
        matrix(a.model, a.src, a.dst, a.placement, a.out)


if __name__ == "__main__":
    main()
