"""``refit-bench``: plan a refit, run it for real on one process per rank, time it, verify it.

Every source rank holds its shard filled with canonical values (`refit.executor.values`), every
destination rank its destination tensors (starting as a sentinel pattern).  After warm-up, N
timed refits run with all processes synchronised at the start and end of each; a refit's time
is the slowest process's.  After the last refit every destination element is checked bit-exact.

On GPUs the model runs at full size, source rank i and destination rank i on GPU i (colocated).
Without GPUs (or with ``--cpu``) the same processes run on CPU over gloo and shared memory, with
the model at a *reduced width*: same architecture and head / kv-head / expert counts, so the
layouts are the same, but hidden size, head_dim, intermediate sizes, vocab and layer count shrunk
so that dozens of processes on a laptop finish in seconds.  The output says so.

Transport between devices (``--transport``): ``nccl`` (GPU) / ``gloo`` (CPU) pack buckets into
staging buffers and send them; ``ipc`` has each device's driver read the other devices' source
shards directly (CUDA IPC + peer copies on GPU, shared memory on CPU), no staging.  ``auto``
(default) is ``ipc`` on GPUs when every pair of the GPUs used can access each other (one host,
``torch.cuda.can_device_access_peer``), else ``nccl``; on CPU it is ``gloo``.  ``ipc`` applies to
every p2p bucket and to the gathers (stage 0) of a broadcast plan; a broadcast plan's stage 1
still goes over the communicator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
from typing import Any

from refit.errors import RefitError
from refit.layouts import resolve_layout
from refit.spec import DTYPE_BYTES, ModelSpec, build_spec, load_spec

MiB = 2**20


# ---------------------------------------------------------------------------------------------
# Reduced width for CPU runs


def reduce_spec(spec: ModelSpec, src: str, dst: str) -> tuple[ModelSpec, dict[str, list[int]]]:
    """The smallest variant of ``spec`` (same counts of heads, kv heads, experts) that both
    layouts still accept; returns it and ``{field: [full, reduced]}`` for what changed."""
    c = spec.config
    layer_options = sorted({n for n in (4, 8, 12, 16, 24, 32) if n < c.num_layers} | {c.num_layers})
    for layers in layer_options:
        for mult in (1, 2, 4, 8, 16):
            moe_layers = tuple(l for l in c.moe_layers if l < layers)
            cfg = dataclasses.replace(
                c, num_layers=layers, moe_layers=moe_layers,
                hidden_size=min(c.hidden_size, 128), head_dim=min(c.head_dim, 16),
                intermediate_size=min(c.intermediate_size, 128 * mult),
                moe_intermediate_size=min(c.moe_intermediate_size, 64 * mult),
                vocab_size=min(c.vocab_size, 2000))
            small = build_spec(spec.name, cfg)
            try:
                resolve_layout(src, small, "src")
                resolve_layout(dst, small, "dst")
            except RefitError:
                continue
            changed = {f.name: [getattr(c, f.name), getattr(cfg, f.name)] for f in dataclasses.fields(c)
                       if f.name != "moe_layers" and getattr(c, f.name) != getattr(cfg, f.name)}
            return small, changed
    return spec, {}


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="refit-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="catalog name (qwen3-30b-moe, ...) or model directory")
    p.add_argument("--src", required=True, help="source layout, e.g. tp4ep8 (megatron:...), fsdp:dp8")
    p.add_argument("--dst", required=True, help="destination layout, e.g. tp8 (vllm:...), vllm:tp4ep4")
    p.add_argument("--placement", default="colocated", choices=["colocated", "disaggregated"])
    p.add_argument("--planner", default="p2p", choices=["p2p", "broadcast"])
    p.add_argument("--iters", type=int, default=5, help="timed refits (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed refits first (default 1)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (default 256 on GPU, 1 on CPU)")
    p.add_argument("--vs", choices=["broadcast", "p2p"], default=None, help="also run this planner and compare")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "ipc"],
                   help="between devices: auto (default: ipc on one host's peer-capable GPUs, else "
                        "nccl; gloo on CPU), nccl/gloo (the communicator of the device kind), ipc")
    p.add_argument("--via", default="direct", choices=["direct", "grpc"],
                   help="direct (default): the bench starts the workers and times the data plane; grpc: "
                        "each rank embeds a refit agent, a loopback coordinator runs the refits as an RL "
                        "loop would (refit.Client), and the control plane's share of each refit is reported")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo, reduced width) even if GPUs exist")
    p.add_argument("--link-mb", type=float, default=None, help="link measurement message (default 1024 GPU, 16 CPU)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take (default 120)")
    p.add_argument("-v", "--verbose", action="store_true", help="worker logs at INFO")
    a = p.parse_args(argv)
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    if a.via == "grpc" and a.vs:
        p.error("--vs compares planners on the direct bench; with --via grpc run each planner on its own")
    return a


def _gpu_count(cpu: bool) -> int:
    if cpu:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _peer_access(gpus: int) -> bool:
    """Whether every pair of GPUs 0..gpus-1 can access each other.  Asked in a child process: the
    parent of a run never initialises CUDA."""
    if gpus <= 1:
        return True
    import subprocess

    code = ("import torch, sys; n = int(sys.argv[1]); sys.exit(0 if all(torch.cuda.can_device_access_peer(i, j) "
            "for i in range(n) for j in range(n) if i != j) else 1)")
    try:
        return subprocess.run([sys.executable, "-c", code, str(gpus)], timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def choose_transport(requested: str, device: str, gpus: int) -> str:
    """What ``--transport`` means here: "ipc", "nccl" or "gloo" (the last two: the communicator)."""
    comm = "nccl" if device == "cuda" else "gloo"
    if requested in ("nccl", "gloo"):
        return comm
    if device == "cpu":
        return "ipc" if requested == "ipc" else comm
    peers = _peer_access(gpus)
    if requested == "ipc" and not peers:
        raise RefitError(f"--transport ipc needs peer access between all {gpus} GPUs "
                         "(torch.cuda.can_device_access_peer is false for some pair); use nccl")
    return "ipc" if peers else comm


def _kill_hook() -> tuple[str, int, int] | None:
    """``REFIT_TEST_KILL=dst2@1``: destination rank 2 dies during refit 1 (tests of failure paths)."""
    import os
    import re

    m = re.fullmatch(r"(src|dst)(\d+)@(\d+)", os.environ.get("REFIT_TEST_KILL", ""))
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from planners import make_plan
    from refit.executor import Job, Phase, Refit, Topology, run_job

    spec = load_spec(args.model)
    gpus = _gpu_count(args.cpu)
    device = "cuda" if gpus else "cpu"
    reduced: dict[str, list[int]] | None = None
    if device == "cpu":
        spec, reduced = reduce_spec(spec, args.src, args.dst)
    bucket = int((args.bucket_mb if args.bucket_mb is not None else (256 if device == "cuda" else 1)) * MiB)
    planners = [args.planner] + ([args.vs] if args.vs and args.vs != args.planner else [])
    plans = [make_plan(spec, args.src, args.dst, args.placement, p, bucket) for p in planners]
    first = plans[0]
    need = first.plan.placement.num_gpus
    if device == "cuda" and need > gpus:
        raise RefitError(f"placement {args.placement} of {first.src.describe()} -> {first.dst.describe()} needs "
                         f"{need} GPUs, this machine has {gpus} (use --cpu for a reduced-width CPU run)")
    transport = choose_transport(args.transport, device, need)
    if args.via == "grpc":
        from refit.bench_grpc import run_grpc

        return run_grpc(args, spec, first, device == "cuda", "ipc" if transport == "ipc" else "comm", reduced, bucket)
    phases = []
    for i, r in enumerate(plans):
        refits = [Refit(seed=i + 1, timed=False) for _ in range(args.warmup)]
        refits += [Refit(seed=i + 1, timed=True, verify=(k == args.iters - 1)) for k in range(args.iters)]
        phases.append(Phase(r.plan, tuple(refits)))
    topo = Topology.one_per_rank(first.plan.placement)
    link_mb = args.link_mb if args.link_mb is not None else (1024 if device == "cuda" else 16)
    job = Job("", spec, first.src, first.dst, topo, tuple(phases), device=device, timeout_s=args.timeout,
              link_bytes=int(link_mb * MiB), kill=_kill_hook(),
              log_level=logging.INFO if args.verbose else logging.WARNING,
              transport="ipc" if transport == "ipc" else "comm")

    try:
        from tqdm import tqdm
    except ImportError:  # a progress bar is a nicety, not a dependency
        results = run_job(job)
    else:
        total = len(topo.members) * (1 + sum(len(p.refits) for p in phases))
        with tqdm(total=total, file=sys.stderr, desc="refit-bench", unit="step", leave=False) as bar:
            def progress(member: int, what: str) -> None:
                if what == "setup" or what.endswith("done"):
                    bar.update(1)
            results = run_job(job, on_progress=progress)
    timed = [[rf.timed for rf in ph.refits] for ph in phases]
    return report(spec, plans, timed, results, device, reduced, len(topo.members), int(link_mb * MiB), transport)


def report(spec: ModelSpec, plans: list[Any], timed: list[list[bool]], results: list[Any], device: str,
           reduced: dict[str, list[int]] | None, processes: int, link_bytes: int,
           transport: str | None = None) -> dict[str, Any]:
    """Everything the table prints, as one JSON-able dict."""
    link_s = next((w.link_seconds for w in results if w.link_seconds), None)
    link_gbps = link_bytes / link_s / 1e9 if link_s else None
    first = plans[0]
    itemsize = DTYPE_BYTES[spec.config.dtype]
    out: dict[str, Any] = {
        "model": spec.name, "src": first.src.describe(), "dst": first.dst.describe(),
        "placement": first.plan.placement.kind, "device": device, "gpus_used": first.plan.placement.num_gpus,
        "transport": transport or ("nccl" if device == "cuda" else "gloo"),
        "reduced": reduced if device == "cpu" else None, "processes": processes,
        "params": spec.num_params, "model_bytes": spec.nbytes,
        "link": {"bytes": link_bytes, "seconds": link_s, "gbps": link_gbps,
                 "what": ("NCCL" if device == "cuda" else "gloo") + " send/recv between the first two devices"},
        "runs": [],
    }
    for i, r in enumerate(plans):
        s = r.summary
        phase = [w.phases[i] for w in results]
        per_refit = [max(p.seconds[k] for p in phase) for k, t in enumerate(timed[i]) if t]
        verdicts = [v for p in phase for vs in p.verdicts.values() for v in vs]
        dst_eps = {name for p in phase for name in p.verdicts}
        moved = s["remote_bytes"] + s["local_bytes"]
        median = statistics.median(per_refit)
        floor_bytes = max(s["max_send_bytes"], s["max_recv_bytes"])
        floor = floor_bytes / (link_gbps * 1e9) if link_gbps and floor_bytes else None
        peaks = [p.peak_extra_bytes for p in phase if p.peak_extra_bytes is not None]
        staging = max(p.staging_bytes + p.gather_bytes for p in phase)
        out["runs"].append({
            "planner": s["planner"], "plan_id": s["plan_id"], "bucket_bytes": s["bucket_bytes"],
            "seconds": {"median": median, "min": min(per_refit), "max": max(per_refit), "all": per_refit},
            "moved_bytes": moved, "remote_bytes": s["remote_bytes"], "local_bytes": s["local_bytes"],
            "dst_bytes": s["total_bytes"], "gbps": moved / median / 1e9,
            "dst_gbps": s["total_bytes"] / median / 1e9,
            "floor_bytes": floor_bytes, "floor_seconds": floor, "x_floor": median / floor if floor else None,
            "peak_extra_bytes": max(peaks) if peaks else staging,
            "peak_extra_what": "CUDA allocator peak minus own shards" if peaks else "staging + gather buffers allocated",
            "staging_bytes": max(p.staging_bytes for p in phase), "gather_bytes": max(p.gather_bytes for p in phase),
            "copies": sum(p.copies for p in phase), "blocks": sum(p.blocks for p in phase),
            "memcpys": sum(p.memcpys for p in phase),
            # every destination rank checked, every element of every piece, nothing wrong
            "verified": (all(v.ok for v in verdicts) and len(dst_eps) == len(first.plan.placement.dst_gpus)
                         and sum(v.checked for v in verdicts) * itemsize == s["total_bytes"]),
            "checked_elements": sum(v.checked for v in verdicts),
            "mismatches": sum(v.mismatches for v in verdicts), "stray": sum(v.stray for v in verdicts),
            "first_mismatch": next((v.first for v in verdicts if v.first), None),
        })
    runs = out["runs"]
    out["speedup"] = runs[1]["seconds"]["median"] / runs[0]["seconds"]["median"] if len(runs) > 1 else None
    out["verified"] = all(r["verified"] for r in runs)
    return out


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def table(r: dict[str, Any]) -> str:
    lines = [f"refit-bench  {r['model']}  {r['src']} -> {r['dst']}  {r['placement']}  "
             f"({r['gpus_used']} devices, {r['processes']} processes)  transport {r['transport']}"]
    ipc = r["transport"] == "ipc"
    if r["device"] == "cpu":
        shrunk = ", ".join(f"{k} {a}->{b}" for k, (a, b) in r["reduced"].items()) or "nothing"
        how = "direct reads of every process's shared memory" if ipc else "gloo + shared memory"
        lines.append(f"device: CPU, {how}, REDUCED WIDTH (same layouts): {shrunk}")
    else:
        lines.append("device: CUDA (" + ("CUDA IPC peer reads between GPUs, no staging; NCCL only for "
                                         "broadcast stage 1" if ipc else "NCCL between GPUs")
                     + ", CUDA IPC within a GPU), full size")
    link = r["link"]
    lines.append(f"link: {link['gbps']:.2f} GB/s ({link['what']}, {_size(link['bytes'])} messages)" if link["gbps"]
                 else "link: not measured (no remote bytes between two devices)")
    lines.append("")
    head = f"{'planner':<10} {'median s':>9} {'min s':>9} {'max s':>9} {'GB/s':>8} {'floor s':>9} {'x floor':>8} {'extra mem/proc':>15}  verified"
    lines.append(head)
    for run in r["runs"]:
        sec = run["seconds"]
        floor = f"{run['floor_seconds']:.4f}" if run["floor_seconds"] else "-"
        xf = f"{run['x_floor']:.1f}x" if run["x_floor"] else "-"
        lines.append(f"{run['planner']:<10} {sec['median']:>9.4f} {sec['min']:>9.4f} {sec['max']:>9.4f} "
                     f"{run['gbps']:>8.2f} {floor:>9} {xf:>8} {_size(run['peak_extra_bytes']):>15}  "
                     f"{'yes' if run['verified'] else 'NO: ' + str(run['first_mismatch'])}")
    if r["speedup"]:
        a, b = r["runs"][0], r["runs"][1]
        lines.append(f"speedup of {a['planner']} over {b['planner']}: {r['speedup']:.1f}x (median seconds)")
    lines.append("")
    for run in r["runs"]:
        lines.append(f"{run['planner']}: moves {_size(run['moved_bytes'])} per refit (remote {_size(run['remote_bytes'])}, "
                     f"local {_size(run['local_bytes'])}) for {_size(run['dst_bytes'])} of destination weights; "
                     f"largest per-device remote volume {_size(run['floor_bytes'])}; "
                     f"{run['blocks']} blocks -> {run['copies']} copies per refit"
                     + (f" ({run['memcpys']} copy-engine memcpys)" if run.get("memcpys") else ""))
    lines.append("GB/s = plan bytes moved (remote + local, each byte once) / median seconds; floor = largest "
                 "per-device remote bytes (send or receive) / link GB/s measured in this run; extra mem = "
                 + r["runs"][0]["peak_extra_what"] + ", largest process"
                 + ("; transport ipc: the floor still uses the communicator's measured link, and buckets "
                    "between devices are direct peer reads (no staging)" if r["transport"] == "ipc" else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    from refit.executor import WorkerFailure

    try:
        result = run(args)
    except RefitError as e:
        print(f"refit-bench: {e}", file=sys.stderr)
        return 2
    except WorkerFailure as e:
        print(f"refit-bench: {e}", file=sys.stderr)
        return 3
    if result.get("via") == "grpc":
        from refit.bench_grpc import table_grpc

        print(json.dumps(result) if args.json else table_grpc(result))
    else:
        print(json.dumps(result) if args.json else table(result))
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
