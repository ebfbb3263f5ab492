"""``refit-bench``: plan a refit, run it for real on one process per rank, time it, verify it.

(This module: the command line, the device and transport choice.  `refit.bench.smaller_specs`
cuts the model (``--layers``, the reduced width), `refit.bench.direct` runs and reports the direct
bench, `refit.bench.via_grpc` the one through the control plane.)

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
import json
import sys
from typing import Any

from refit import settings
from refit.bench.smaller_specs import first_layers, reduce_spec
from refit.entrypoint import run_main, setup_logging
from refit.errors import InvalidInput
from refit.layouts import LAYOUT_HELP, resolve_layout
from refit.layouts.quantized import shared_scale_table
from refit.hf_checkpoint import load_spec
from refit.planners import MIN_BUCKET_BYTES, make_plan
from refit.quantization import FORMATS
from refit.sides import Side
from refit.spec import ModelSpec, quantize_spec
from refit.units import MiB


DESCRIPTION = ("refit-bench: plan a refit, run it for real on one process per rank, time it, verify every "
               "destination element bit-exact.  On GPUs the model runs at full size; without GPUs (or with "
               "--cpu) at a reduced width (same layouts, smaller tensors), over gloo.")
EPILOG = f"""\
{LAYOUT_HELP}

exit status:
  0  every destination element verified   1  a mismatch
  2  bad input (one line on stderr)        3  a worker failed (named)

examples:
  refit-bench --model qwen3-30b-moe --src tp4ep8 --dst tp8
  refit-bench --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --vs broadcast --json
  refit-bench --model qwen3-235b-moe --layers 20 --src megatron:tp2ep2 --dst vllm:tp2
  refit-bench --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --delta --step-lr 1e-6
  refit-bench --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --via grpc
  refit-bench --model qwen3-30b-moe --src megatron:tp2ep2 --dst vllm:tp2 --ray auto
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="refit-bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="catalog name (qwen3-30b-moe, ...) or model directory")
    p.add_argument("--src", required=True, help="source layout, e.g. tp4ep8 (megatron:...), fsdp:dp8")
    p.add_argument("--dst", required=True, help="destination layout, e.g. tp8 (vllm:...), vllm:tp4ep4")
    p.add_argument("--placement", default="colocated", choices=["colocated", "disaggregated"],
                   help="colocated (default): source rank i and destination rank i share device i; "
                        "disaggregated: each side on devices of its own")
    p.add_argument("--planner", default="p2p", choices=["p2p", "broadcast"],
                   help="p2p (default): shard to shard; broadcast: the full-tensor baseline")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep only the model's first N decoder layers, at full width: a big model's real "
                        "shapes on fewer GPUs (e.g. --model qwen3-235b-moe --layers 20 on 2x H200)")
    p.add_argument("--iters", type=int, default=5, help="timed refits (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed refits first (default 1)")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size in MiB (default 256 on GPU, 1 on CPU)")
    p.add_argument("--vs", choices=["broadcast", "p2p"], default=None, help="also run this planner and compare")
    p.add_argument("--dst-dtype", metavar="FORMAT", choices=sorted(FORMATS), default=None,
                   help="engines hold the model quantized: fp8 = float8 e4m3 with 128x128 block scales; mxfp8 = "
                        "1x32 blocks, e8m0 scales. The "
                        "trainers quantize their shards each refit (timed inside the refit) and the wire "
                        "carries the float8 bytes; every element and scale is verified against quantizing "
                        "the canonical values.  Compare with the same command without it")
    p.add_argument("--delta", action="store_true",
                   help="delta refits: each bucket sent over a wire carries only the words changed since the "
                        "last refit (positions or a bit mask, and the new values; the whole bucket when that is "
                        "no smaller); same-device copies and CUDA-IPC pulls stay full.  The first refit of each "
                        "planner is full.  Every timed refit is verified; the report adds per run the fraction "
                        "of words changed and the wire bytes against a full refit's.  Without --step-lr the "
                        "weights do not change between refits: a delta refit sends headers only")
    p.add_argument("--step-lr", type=float, default=None, metavar="LR",
                   help="before each refit (untimed) the trainers' weights take one synthetic Adam-like step "
                        "of size LR on float32 masters (each master moves by LR times a hashed update of "
                        "magnitude about 1, as Adam's normalised update), cast to the engine dtype: at RL "
                        "learning rates (typically 1e-5 to 1e-7) few bfloat16 values change.  Every timed "
                        "refit is verified against the masters.  Compare with and without --delta")
    p.add_argument("--wire-gbps", type=float, default=None, metavar="G",
                   help="emulate a slower wire between devices: every step over the communicator takes at least "
                        "its bytes / G GB/s (trainers and engines on different hosts: 25-50 GB/s per GPU), "
                        "where delta refits pay; the report says the wire was emulated. Not with --transport ipc "
                        "(no wire)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--alloc", default="framework", choices=["framework", "arena"],
                   help="how shards are allocated: framework (default: as Megatron/vLLM leave parameters, so "
                        "blocks of neighbouring tensors do not merge) or arena (packed, merges into few copies)")
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "gloo", "ipc"],
                   help="between devices: auto (default: ipc on one host's peer-capable GPUs, else "
                        "nccl; gloo on CPU), nccl/gloo (the communicator of the device kind), ipc")
    p.add_argument("--via", default="direct", choices=["direct", "grpc"],
                   help="direct (default): the bench starts the workers and times the data plane; grpc: "
                        "each rank embeds a refit agent, a loopback coordinator runs the refits as an RL "
                        "loop would (refit.Client), and the control plane's share of each refit is reported")
    p.add_argument("--atomic", action="store_true",
                   help="with --via grpc: all-or-none refits (Client.refit(atomic=True)): every engine receives "
                        "into a staging copy of its shard and switches when all are ready; the report adds the "
                        "staging bytes per engine.  Compare with the same command without it")
    p.add_argument("--verify", action="store_true",
                   help="with --via grpc: verified refits (Client.refit(verify=True)): both ends checksum every "
                        "transfer and the coordinator compares them; the report counts the transfers checked")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run every rank (source and destination) as a Ray actor placed across the cluster's nodes "
                        "(colocated: source rank i and destination rank i in one bundle, one GPU; disaggregated: "
                        "a placement group per side), each running the same worker as the direct bench, verified "
                        "the same way; the report adds the bytes moved within each node and across nodes.  "
                        "ADDRESS: host:port of a running Ray cluster (this process joins it as a driver: the "
                        "actors reach a store it serves), or auto: the cluster "
                        "$RAY_ADDRESS names (or this process already joined), else a new local one.  "
                        "GPU or CPU follows the cluster (--cpu: CPU anyway).  Transports: gloo on CPU; on GPUs, "
                        "with every rank on one node, CUDA IPC peer pulls as direct (--transport nccl: Ray's "
                        "per-actor GPU isolation and NCCL), across nodes NCCL")
    p.add_argument("--ray-strategy", default=None, choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="Ray placement group strategy (default: STRICT_PACK on GPUs when one node has them all, "
                        "PACK on GPUs otherwise, SPREAD on CPU so that ranks sit on several nodes)")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo, reduced width) even if GPUs exist")
    p.add_argument("--link-mb", type=float, default=None,
                   help="message size of the link and all-to-all measurements in MiB (default: link 1024 on "
                        "GPU, 16 on CPU; all-to-all per pair: NCCL the bucket size, at least 256, copy engines "
                        "at least 1024)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take (default 120)")
    p.add_argument("-v", "--verbose", action="store_true", help="worker logs at INFO")
    a = p.parse_args(argv)
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    # Refused here, before any process starts (a worker would die on them, status 3, traceback).
    if not a.timeout > 0:
        p.error(f"--timeout must be more than 0 seconds, got {a.timeout:g}")
    if a.link_mb is not None and not a.link_mb > 0:
        p.error(f"--link-mb must be more than 0, got {a.link_mb:g}")
    if (a.atomic or a.verify) and a.via != "grpc":
        p.error("--atomic and --verify are options of Client.refit: run them with --via grpc")
    if a.via == "grpc" and a.vs:
        p.error("--vs compares planners on the direct bench; with --via grpc run each planner on its own")
    if a.ray is not None and a.via == "grpc":
        p.error("--ray runs the direct bench on Ray actors; --via grpc on Ray is not supported (use "
                "refit.integrations.ray in your own actors for the agents' path)")
    if a.ray_strategy and a.ray is None:
        p.error("--ray-strategy needs --ray")
    _check_delta(p, a)
    return a


def _check_delta(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse what ``--delta`` and ``--step-lr`` do not run with yet (before any process starts)."""
    if a.step_lr is not None and not a.step_lr > 0:
        p.error(f"--step-lr must be more than 0, got {a.step_lr:g}")
    if a.wire_gbps is not None and not a.wire_gbps > 0:
        p.error(f"--wire-gbps must be more than 0, got {a.wire_gbps:g}")
    if a.wire_gbps is not None and (a.via == "grpc" or a.ray is not None or a.transport == "ipc"):
        p.error("--wire-gbps emulates the communicator of the direct bench: not with --via grpc, --ray or "
                "--transport ipc")
    given = " and ".join(o for o, on in (("--delta", a.delta), ("--step-lr", a.step_lr is not None)) if on)
    if not given:
        return
    if a.via == "grpc":
        p.error(f"{given}: not supported with --via grpc yet (run the direct bench)")
    if a.ray is not None:
        p.error(f"{given}: not supported with --ray yet (run the direct bench)")
    if a.step_lr is not None and a.dst_dtype:
        p.error("--step-lr with --dst-dtype is not supported yet: the synthetic step runs on unquantized "
                "weights (run --dst-dtype without it)")


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
        raise InvalidInput(f"--transport ipc needs peer access between all {gpus} GPUs "
                         "(torch.cuda.can_device_access_peer is false for some pair); use nccl")
    return "ipc" if peers else comm


def _kill_hook() -> tuple[tuple[Side, int, int] | None, bool]:
    """``REFIT_TEST_KILL=dst2@1``: destination rank 2 dies during refit 1; ``dst2@1:stop``: it
    stops itself (SIGSTOP) instead, a hung worker (tests of failure paths)."""
    import re

    m = re.fullmatch(r"(src|dst)(\d+)@(\d+)(:stop)?", settings.current().test_kill)
    return ((Side.of_end(m.group(1)), int(m.group(2)), int(m.group(3))), bool(m.group(4))) if m else (None, False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = load_spec(args.model)
    if args.layers is not None:
        spec = first_layers(spec, args.layers)
    if args.ray is not None:
        return _run_ray(args, spec)
    gpus = _gpu_count(args.cpu)
    device = "cuda" if gpus else "cpu"
    reduced: dict[str, list[int]] | None = None
    if device == "cpu":
        spec, reduced = reduce_spec(spec, args.src, args.dst, args.dst_dtype)
    if args.dst_dtype:
        if args.via == "grpc":
            raise InvalidInput("--dst-dtype runs in the direct bench (not --via grpc yet)")
        spec = quantize_spec(spec, args.dst_dtype)
    bucket = int((args.bucket_mb if args.bucket_mb is not None else (256 if device == "cuda" else 1)) * MiB)
    planners = [args.planner] + ([args.vs] if args.vs and args.vs != args.planner else [])
    plans = [make_plan(spec, args.src, args.dst, args.placement, p, bucket) for p in planners]
    first = plans[0]
    cut = shared_scale_table(spec, first.src)
    if cut:  # the workers' shards are arenas, which the shared-scale quantization does not take yet
        raise InvalidInput(f"--dst-dtype {args.dst_dtype}: {first.src.describe()} cuts {args.dst_dtype} blocks on the "
                           f"trainers ({', '.join(sorted(cut))[:200]}); refit's agents share those blocks' scales, "
                           f"the bench does not yet: choose trainer degrees that keep blocks whole")
    need = first.plan.placement.num_gpus
    if device == "cuda" and need > gpus:
        raise InvalidInput(f"placement {args.placement} of {first.src.describe()} -> {first.dst.describe()} needs "
                         f"{need} GPUs, this machine has {gpus} (use --cpu for a reduced-width CPU run)")
    if args.via == "grpc" and device == "cpu" and args.transport == "ipc":
        raise InvalidInput("--via grpc on CPU runs its agents over gloo; --transport ipc is refused there "
                         "(the direct bench has it on CPU)")
    transport = choose_transport(args.transport, device, need)
    if args.via == "grpc":
        from refit.bench.via_grpc import run_grpc

        return run_grpc(args, spec, first, device == "cuda", "ipc" if transport == "ipc" else "comm", reduced, bucket)
    from refit.bench.direct import run_direct

    return run_direct(args, spec, plans, device, reduced, transport, *_kill_hook())


def _run_ray(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    """``--ray``: the device follows the cluster (its GPUs), not this machine."""
    from refit.bench.on_ray import connect

    ranks = (resolve_layout(args.src, spec, Side.TRAINER).world_size
             + resolve_layout(args.dst, spec, Side.ENGINE).world_size)
    # What is wrong whatever the cluster: said before joining one (``auto`` may start a local one).
    if args.bucket_mb is not None:
        _check_bucket(args.bucket_mb)
    if args.cpu and args.transport == "ipc":
        raise InvalidInput("--ray on CPU runs over gloo: Ray nodes share no memory, so --transport ipc is refused")
    import ray

    started = connect(args.ray, ranks, args.timeout, args.verbose)
    try:
        return _run_ray_connected(args, spec)
    finally:
        if started:
            ray.shutdown()


def _check_bucket(bucket_mb: float) -> None:
    if int(bucket_mb * MiB) < MIN_BUCKET_BYTES:
        raise InvalidInput(f"--bucket-mb {bucket_mb:g}: bucket size {int(bucket_mb * MiB)} bytes is too small "
                         f"(at least {MIN_BUCKET_BYTES})")


def _run_ray_connected(args: argparse.Namespace, spec: ModelSpec) -> dict[str, Any]:
    import ray

    from refit.bench.on_ray import run_on_ray

    cuda = not args.cpu and ray.cluster_resources().get("GPU", 0) > 0
    reduced = None
    if not cuda:
        spec, reduced = reduce_spec(spec, args.src, args.dst)
    bucket = int((args.bucket_mb if args.bucket_mb is not None else (256 if cuda else 1)) * MiB)
    planners = [args.planner] + ([args.vs] if args.vs and args.vs != args.planner else [])
    plans = [make_plan(spec, args.src, args.dst, args.placement, p, bucket) for p in planners]
    return run_on_ray(args, spec, plans, cuda, reduced, _kill_hook())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    return run_main(lambda: _main(args), "refit-bench")


def _main(args: argparse.Namespace) -> int:
    from refit.bench.launch import WorkerFailure

    try:
        result = run(args)
    except WorkerFailure as e:  # a worker died or failed: not bad input, its own exit status
        print(f"refit-bench: {e}", file=sys.stderr)
        return 3
    if result.get("via") == "grpc":
        from refit.bench.via_grpc import table_grpc

        print(json.dumps(result) if args.json else table_grpc(result))
    else:
        from refit.bench.direct import table

        text = table(result)
        if "ray" in result:
            from refit.bench.on_ray import table_ray

            text += "\n" + table_ray(result)
        print(json.dumps(result) if args.json else text)
    return 0 if result["verified"] else 1

if __name__ == "__main__":
    sys.exit(main())
