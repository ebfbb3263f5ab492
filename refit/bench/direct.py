"""The direct bench: the parent starts one worker process per rank (`refit.bench.launch`), each
runs its share of every refit through `refit.executor` (`refit.bench.worker`); the report and the
table `refit-bench` prints."""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from typing import Any, Callable

from refit.bench.launch import run_job
from refit.bench.worker import Job, PlanRun, Refit
from refit.executor.delta import DeltaStats
from refit.executor.topology import Topology
from refit.sides import Side
from refit.spec import ModelSpec
from refit.units import MiB, fmt_bytes



def run_direct(args: argparse.Namespace, spec: ModelSpec, plans: list[Any], device: str,
               reduced: dict[str, list[int]] | None, transport: str, kill: tuple[Side, int, int] | None = None,
               hang: bool = False) -> dict[str, Any]:
    first = plans[0]
    delta, step_lr = args.delta, args.step_lr
    every = delta or step_lr is not None  # a delta refit builds on the last: every one is verified
    runs = []
    for i, r in enumerate(plans):
        refits = [Refit(seed=i + 1, timed=False) for _ in range(args.warmup)]
        refits += [Refit(seed=i + 1, timed=True, verify=every or k == args.iters - 1) for k in range(args.iters)]
        runs.append(PlanRun(r.plan, tuple(refits)))
    topo = Topology.one_per_rank(first.plan.placement)
    link_mb = args.link_mb if args.link_mb is not None else (1024 if device == "cuda" else 16)
    job = Job("", spec, first.src, first.dst, topo, tuple(runs), device=device, timeout_s=args.timeout,
              link_bytes=int(link_mb * MiB), kill=kill, hang=hang,
              log_level=logging.INFO if args.verbose else logging.WARNING,
              transport="ipc" if transport == "ipc" else "comm", alloc=args.alloc, delta=delta, step_lr=step_lr,
              wire_gbps=args.wire_gbps)
    # The primitives move the run's bucket size per pair, at least 256 MiB, unless --link-mb says
    # otherwise: the nccl transport's messages are its buckets and NCCL's rate grows with the
    # message size (354 GB/s per GPU at 1 GiB, 277 at 256 MiB on 2x H200); smaller buckets must
    # not lower the floor.
    # The copy engines move at least `a2a_floor.CE_MIN_BYTES` per pair unless --link-mb says
    # otherwise: the ipc transport's peer copies are GBs in one go.
    a2a_mb = args.link_mb if args.link_mb is not None else max(256, first.plan.bucket_bytes / MiB)
    a2a = _measure_a2a(first.plan.placement.num_gpus, a2a_mb, args.link_mb) if device == "cuda" else {}
    copy = measure_copy() if device == "cuda" else {}

    try:
        from tqdm import tqdm
    except ImportError:  # a progress bar is a nicety, not a dependency
        results = run_job(job)
    else:
        total = len(topo.members) * (1 + sum(len(p.refits) for p in runs))
        with tqdm(total=total, file=sys.stderr, desc="refit-bench", unit="step", leave=False) as bar:
            def progress(member: int, what: str) -> None:
                if what == "setup" or what.endswith("done"):
                    bar.update(1)
            results = run_job(job, on_progress=progress)
    timed = [[rf.timed for rf in ph.refits] for ph in runs]
    return report(spec, plans, timed, results, device, reduced, len(topo.members), int(link_mb * MiB), transport,
                  a2a, args.alloc, copy, delta=delta, step_lr=step_lr, wire_gbps=args.wire_gbps)


def _measure_a2a(gpus: int, pair_mb: float, ce_pair_mb: float | None) -> dict[str, Any]:
    """The all-to-all primitives among the run's GPUs (`refit.bench.a2a_floor`), ``pair_mb`` (NCCL) and
    ``ce_pair_mb`` (copy engines; None: `a2a_floor.ce_pair_bytes`) from every GPU to every other,
    measured in this process before the workers start; empty on one GPU or without cupy."""
    from refit.bench.a2a_floor import REPS, ce_pair_bytes, measure

    nbytes = int(pair_mb * MiB)
    ce_nbytes = int(ce_pair_mb * MiB) if ce_pair_mb is not None else ce_pair_bytes(nbytes)
    try:
        gbps = measure(list(range(gpus)), nbytes, ce_nbytes=ce_nbytes)
    except ImportError:
        return {}
    return {"bytes_per_pair": nbytes, "ce_bytes_per_pair": ce_nbytes, "gbps": gbps, "stat": f"best of {REPS}"} \
        if gbps else {}


COPY_BYTES = 4 << 30  # the device copy of the same-GPU floor: GiBs, the size of a refit's shards
COPY_REPS = 5


def measure_copy(nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """One device-to-device copy within GPU 0 (``torch`` ``copy_`` of ``nbytes``, best of
    `COPY_REPS`): the primitive a same-GPU refit is measured against — each byte read once and
    written once, bytes copied per second.  Halved until it fits the free memory."""
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    while nbytes > 64 << 20 and 2 * nbytes > free * 0.8:
        nbytes //= 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_(0, 256)
    dst = torch.empty_like(src)
    times = []
    for _ in range(COPY_REPS + 1):  # the first warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    best = min(times[1:])
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9, "stat": f"best of {COPY_REPS}"}


def same_gpu_bytes(plan: Any) -> int:
    """The most bytes any one GPU copies within itself in ``plan`` (colocated source and destination)."""
    from refit.predict import gpu_bytes

    per_gpu = gpu_bytes(plan, gpus_per_host=max(1, plan.placement.num_gpus))
    return max((g.same_gpu for g in per_gpu), default=0)


def report(spec: ModelSpec, plans: list[Any], timed: list[list[bool]], results: list[Any], device: str,
           reduced: dict[str, list[int]] | None, processes: int, link_bytes: int,
           transport: str | None = None, a2a: dict[str, Any] | None = None, alloc: str = "arena",
           copy: dict[str, Any] | None = None, delta: bool = False, step_lr: float | None = None,
           wire_gbps: float | None = None) -> dict[str, Any]:
    """Everything the table prints, as one JSON-able dict.  The floor is the largest per-device
    remote volume over the best all-to-all primitive measured among the run's GPUs (``a2a``: copy
    engines in rounds, NCCL), else over the link between the first two devices (CPU).  ``copy``
    (`measure_copy`): the device copy a GPU's same-GPU bytes are held against; on one GPU, where
    nothing crosses a link, that is the floor.  ``delta``/``step_lr``: the job's (`Job`); with
    either, each run says what its wires carried (`delta_report`)."""
    link_s = next((w.link_seconds for w in results if w.link_seconds), None)
    link_gbps = link_bytes / link_s / 1e9 if link_s else None
    best = max(a2a["gbps"].values()) if a2a else None
    floor_gbps = best or link_gbps
    first = plans[0]
    # every element every destination rank holds (padding aside; models mix dtypes, so count elements)
    dst_elements = sum(math.prod(p.size) for r in range(len(first.plan.placement.dst_gpus))
                       for lt in first.dst.local_tensors(spec, r) for p in lt.pieces)
    out: dict[str, Any] = {
        "model": spec.name, "src": first.src.describe(), "dst": first.dst.describe(),
        "placement": first.plan.placement.kind, "device": device, "gpus_used": first.plan.placement.num_gpus,
        "transport": transport or ("nccl" if device == "cuda" else "gloo"),
        "reduced": reduced if device == "cpu" else None, "processes": processes,
        "params": spec.num_params, "model_bytes": spec.nbytes,
        "link": {"bytes": link_bytes, "seconds": link_s, "gbps": link_gbps,
                 "what": ("NCCL" if device == "cuda" else "gloo") + " send/recv between the first two devices"},
        "a2a": a2a or None, "floor_gbps": floor_gbps, "copy": copy or None,
        "floor_what": "best all-to-all primitive among the run's GPUs" if best else "link between the first two devices",
        "alloc": alloc, "quantization": spec.config.quantization or None,
        "delta_mode": delta, "step_lr": step_lr, "runs": [],
        "wire_gbps_emulated": wire_gbps,
    }
    for i, r in enumerate(plans):
        s = r.summary
        per_worker = [w.runs[i] for w in results]  # this plan run, as every worker saw it
        # a quantizing plan's refit: the trainers quantize, then (after the start barrier) the shares
        counted = [k for k, t in enumerate(timed[i]) if t]
        quantize = [max(p.quantize_seconds[k] for p in per_worker) for k in counted]
        per_refit = [q + max(p.seconds[k] for p in per_worker) for q, k in zip(quantize, counted)]
        verdicts = [v for p in per_worker for vs in p.verdicts.values() for v in vs]
        dst_eps = {name for p in per_worker for name in p.verdicts}
        # refits verified (the last; every timed one with delta or step-lr): as many on every endpoint
        checks = {len(vs) for p in per_worker for vs in p.verdicts.values()}
        rounds = checks.pop() if len(checks) == 1 else 0
        moved = s["remote_bytes"] + s["local_bytes"]
        median = statistics.median(per_refit)
        floor_bytes = max(s["max_send_bytes"], s["max_recv_bytes"])
        floor = floor_bytes / (floor_gbps * 1e9) if floor_gbps and floor_bytes else None
        own_floor = transport_floor(a2a, out["transport"], floor_bytes)
        local = same_gpu_bytes(r.plan) if copy else 0
        copy_floor = local / (copy["gbps"] * 1e9) if local else None
        if not floor_bytes and copy_floor:  # one GPU: the refit is a copy within it
            floor_bytes, floor = local, copy_floor
        peaks = [p.peak_extra_bytes for p in per_worker if p.peak_extra_bytes is not None]
        staging = max(p.staging_bytes + p.gather_bytes for p in per_worker)
        out["runs"].append({
            "planner": s["planner"], "plan_hash": s["plan_hash"], "bucket_bytes": s["bucket_bytes"],
            "seconds": {"median": median, "min": min(per_refit), "max": max(per_refit), "all": per_refit},
            "moved_bytes": moved, "remote_bytes": s["remote_bytes"], "local_bytes": s["local_bytes"],
            "dst_bytes": s["total_bytes"], "gbps": moved / median / 1e9,
            "dst_gbps": s["total_bytes"] / median / 1e9,
            "floor_bytes": floor_bytes, "floor_seconds": floor, "x_floor": median / floor if floor else None,
            "transport_floor_seconds": own_floor, "x_transport_floor": median / own_floor if own_floor else None,
            "same_gpu_bytes": local, "copy_floor_seconds": copy_floor,
            "x_copy_floor": median / copy_floor if copy_floor else None,
            "peak_extra_bytes": max(peaks) if peaks else staging,
            "peak_extra_what": "CUDA allocator peak minus own shards" if peaks else "staging + gather buffers allocated",
            "staging_bytes": max(p.staging_bytes for p in per_worker),
            "direct_wire_bytes": sum(p.direct_bytes for p in per_worker), "gather_bytes": max(p.gather_bytes for p in per_worker),
            "copies": sum(p.copies for p in per_worker), "blocks": sum(p.blocks for p in per_worker),
            "memcpys": sum(p.memcpys for p in per_worker),
            "quantized_on_landing": sum(p.quantized_on_landing for p in per_worker),
            # every destination rank checked, every element of every piece, each refit verified, nothing wrong
            "verified": (all(v.ok for v in verdicts) and len(dst_eps) == len(first.plan.placement.dst_gpus)
                         and rounds > 0 and sum(v.checked for v in verdicts) == rounds * dst_elements),
            "verified_refits": rounds,
            "checked_elements": sum(v.checked for v in verdicts),
            "mismatches": sum(v.mismatches for v in verdicts), "stray": sum(v.stray for v in verdicts),
            "first_mismatch": next((v.first for v in verdicts if v.first), None),
        })
        if spec.config.quantization:  # the trainers' quantizing, inside each refit's seconds
            out["runs"][-1]["quantize_seconds"] = {"median": statistics.median(quantize), "all": quantize}
        if delta or step_lr is not None:
            out["runs"][-1]["delta"] = delta_report([[p.deltas[k] for p in per_worker] for k in counted])
    runs = out["runs"]
    out["speedup"] = runs[1]["seconds"]["median"] / runs[0]["seconds"]["median"] if len(runs) > 1 else None
    out["verified"] = all(r["verified"] for r in runs)
    return out


def delta_report(per_refit: list[list[DeltaStats]]) -> dict[str, Any]:
    """What the wires carried, from every timed refit's `Member.last_delta` of every worker
    (``per_refit[k]``: refit k's, one per worker).  Each member counts the buckets it sends, so a
    refit's is the sum over workers; the figures are medians over the timed refits of those sums
    (each field on its own), ``per_refit`` the sums themselves.  A full refit (no --delta) counts
    every word sent as changed."""
    sums = [sum(workers, DeltaStats()) for workers in per_refit]

    def median(value: Callable[[DeltaStats], float]) -> Any:
        return statistics.median(value(d) for d in sums)

    return {"changed_fraction": round(median(lambda d: d.changed_fraction), 6),
            "wire_bytes": median(lambda d: d.wire_bytes), "full_bytes": median(lambda d: d.full_bytes),
            "delta_buckets": median(lambda d: d.delta_buckets), "buckets": median(lambda d: d.buckets),
            "per_refit": [d.as_json() for d in sums]}


_PRIMITIVE = {"ipc": "ce_rounds", "nccl": "nccl"}  # the a2a primitive each GPU transport is built on


def transport_floor(a2a: dict[str, Any] | None, transport: str, floor_bytes: int) -> float | None:
    """Seconds for ``floor_bytes`` over the all-to-all primitive of the run's own transport (ipc:
    copy engines in rounds; nccl: NCCL send/recv), printed beside the floor of the best one."""
    gbps = a2a["gbps"].get(_PRIMITIVE.get(transport, "")) if a2a else None
    return floor_bytes / (gbps * 1e9) if gbps and floor_bytes else None


def _size(n: float | None) -> str:
    return "-" if n is None else fmt_bytes(n)


def delta_line(d: dict[str, Any], delta: bool, step_lr: float | None) -> str:
    """One line on what a run's wires carried per refit (medians): ``delta: 3.1% of words changed,
    wire 1.2 MiB of 40.0 MiB full (0.031x)``."""
    step = f"; a synthetic step of lr {step_lr:g} before each refit" if step_lr is not None else \
        "; weights unchanged between refits (no --step-lr)"
    if not d["buckets"]:
        return f"no bucket crosses a wire (same-device copies and IPC pulls move whole tensors){step}"
    if not delta:
        return f"full refits: wire {_size(d['full_bytes'])} per refit{step} (--delta sends only the changed words)"
    ratio = d["wire_bytes"] / d["full_bytes"] if d["full_bytes"] else 0.0
    return (f"delta: {d['changed_fraction']:.1%} of words changed, wire {_size(d['wire_bytes'])} of "
            f"{_size(d['full_bytes'])} full ({ratio:.3g}x), {d['delta_buckets']:g} of {d['buckets']:g} buckets "
            f"sent as deltas{step}")


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
    link, copy = r["link"], r.get("copy")
    lines.append(f"link: {link['gbps']:.2f} GB/s ({link['what']}, {_size(link['bytes'])} messages)" if link["gbps"]
                 else "link: not measured (no remote bytes between two devices)")
    if copy:
        lines.append(f"device copy within GPU 0: {copy['gbps']:.0f} GB/s (torch copy_ of {_size(copy['bytes'])}, "
                     f"{copy['stat']}); the floor of same-GPU bytes")
    if r.get("a2a"):
        g = r["a2a"]["gbps"]
        lines.append(f"all-to-all among the {r['gpus_used']} GPUs, per GPU in, {r['a2a']['stat']}: copy engines "
                     f"in rounds {g['ce_rounds']:.1f} GB/s ({_size(r['a2a']['ce_bytes_per_pair'])} per pair), "
                     f"NCCL {g['nccl']:.1f} GB/s ({_size(r['a2a']['bytes_per_pair'])} per pair); the floor uses "
                     f"the faster")
    lines.append(f"shards allocated {'as frameworks do (one buffer per parameter set, reverse order, gaps)' if r.get('alloc') == 'framework' else 'packed in one arena per endpoint'}")
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
    for run in r["runs"]:
        if "quantize_seconds" in run:
            lines.append(f"{run['planner']}: weights quantized to {r['quantization']} on the trainers before each "
                         f"refit's start barrier: median {run['quantize_seconds']['median'] * 1e3:.2f} ms, counted in "
                         f"every refit's time; extra memory includes the wire shards (values and scales)")
    for run in r["runs"]:
        if run.get("x_copy_floor"):
            lines.append(f"{run['planner']}: the busiest GPU copies {_size(run['same_gpu_bytes'])} within itself; "
                         f"one device copy of those bytes takes {run['copy_floor_seconds'] * 1e3:.2f} ms: "
                         f"{run['x_copy_floor']:.2f}x that")
    for run in r["runs"]:
        if run.get("x_transport_floor") and run["transport_floor_seconds"] != run["floor_seconds"]:
            lines.append(f"{run['planner']}: {run['x_transport_floor']:.2f}x the floor of its own transport's "
                         f"primitive ({r['transport']}: {run['transport_floor_seconds'] * 1e3:.1f} ms), "
                         f"{run['x_floor']:.2f}x the best primitive's")
    for run in r["runs"]:
        if "delta" in run:
            lines.append(f"{run['planner']}: {delta_line(run['delta'], r.get('delta_mode', False), r.get('step_lr'))}")
    if r["speedup"]:
        a, b = r["runs"][0], r["runs"][1]
        lines.append(f"speedup of {a['planner']} over {b['planner']}: {r['speedup']:.1f}x (median seconds)")
    lines.append("")
    for run in r["runs"]:
        lines.append(f"{run['planner']}: moves {_size(run['moved_bytes'])} per refit (remote {_size(run['remote_bytes'])}, "
                     f"local {_size(run['local_bytes'])}) for {_size(run['dst_bytes'])} of destination weights; "
                     f"largest per-device remote volume {_size(run['floor_bytes'])}; "
                     f"{run['blocks']} blocks -> {run['copies']} copies per refit"
                     + (f" ({run['memcpys']} copy-engine memcpys)" if run.get("memcpys") else "")
                     + (f"; {run['quantized_on_landing']} blocks quantized on landing (the trainers' unquantized "
                        f"weights straight into the engines')" if run.get("quantized_on_landing") else "")
                     + (f"; {fmt_bytes(run['direct_wire_bytes'])} of wire ends sent from / received into tensors "
                        f"directly (no staging)" if run.get("direct_wire_bytes") else ""))
    lines.append("GB/s = plan bytes moved (remote + local, each byte once) / median seconds; floor = largest "
                 f"per-device remote bytes (send or receive) / {r.get('floor_what', 'link')} measured in this run "
                 f"(on one GPU: its same-GPU bytes / the device copy); "
                 "extra mem = " + r["runs"][0]["peak_extra_what"] + ", largest process"
                 + ("; transport ipc: buckets between devices are direct peer reads (no staging)"
                    if r["transport"] == "ipc" else ""))
    return "\n".join(lines)


