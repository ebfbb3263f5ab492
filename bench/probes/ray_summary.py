"""Summarise bench/probes/gpu_ray.sh's JSON files: (a) `refit-bench` direct vs ``--ray`` on one node,
(b) refit over NCCL between two Ray nodes vs NCCL's own send/recv of the same bytes.

    python3 bench/probes/ray_summary.py $OUT      # prints the comparison, writes $OUT/summary.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _load(out: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"{name}: missing or unreadable ({e})")
        return None


def summarise(out: str) -> dict[str, Any]:
    s: dict[str, Any] = {}
    direct, on_ray = _load(out, "a-direct.json"), _load(out, "a-ray.json")
    if direct and on_ray:
        d, r = direct["runs"][0]["seconds"]["median"], on_ray["runs"][0]["seconds"]["median"]
        s["a"] = {"direct_s": d, "ray_s": r, "ray_over_direct": r / d, "within_5pct": abs(r / d - 1) <= 0.05,
                  "verified": direct["verified"] and on_ray["verified"],
                  "transports": [direct["transport"], on_ray["transport"]],
                  "ray_nodes": len(on_ray["ray"]["nodes"])}
        print(f"(a) {direct['model']} {direct['src']} -> {direct['dst']}: direct {d:.4f} s ({direct['transport']}), "
              f"--ray {r:.4f} s ({on_ray['transport']}, {s['a']['ray_nodes']} node): {r / d:.3f}x "
              f"({'within' if s['a']['within_5pct'] else 'NOT within'} 5%), verified {s['a']['verified']}")
    cross, nccl = _load(out, "b-ray.json"), _load(out, "b-nccl.json")
    if cross and nccl:
        run, ray_run = cross["runs"][0], cross["ray"]["runs"][0]
        across, sec = ray_run["across_nodes"], run["seconds"]["median"]
        s["b"] = {"across_bytes": across, "refit_s": sec, "refit_gbps": across / sec / 1e9,
                  "nccl_s": nccl["seconds"]["median"], "nccl_gbps": nccl["gbps"], "nccl_bytes": nccl["bytes"],
                  "refit_over_nccl_time": sec / nccl["seconds"]["median"], "verified": cross["verified"],
                  "transport": cross["transport"], "ray_nodes": len(cross["ray"]["nodes"])}
        print(f"(b) {cross['model']} {cross['src']} -> {cross['dst']} over {s['b']['ray_nodes']} Ray nodes "
              f"({cross['transport']}): {across / 1e9:.2f} GB across nodes in {sec:.4f} s = "
              f"{s['b']['refit_gbps']:.1f} GB/s; NCCL send/recv of {nccl['bytes'] / 1e9:.2f} GB: "
              f"{nccl['seconds']['median']:.4f} s = {nccl['gbps']:.1f} GB/s; refit takes "
              f"{s['b']['refit_over_nccl_time']:.2f}x NCCL's time, verified {cross['verified']}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    return s


if __name__ == "__main__":
    summarise(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "bench/out"))
