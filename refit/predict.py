"""A refit's time predicted from its plan: per-GPU bytes over per-link rates (`refit plan --predict`).

The model.  A plan says, bucket by bucket, how many bytes go from which GPU to which (`Plan.buckets`
with `Plan.placement`).  Every GPU's bytes fall into five terms:

* ``same-GPU``: buckets whose source and destination share the GPU (colocated trainer and engine),
  copied at ``same_gpu_gbs`` (bytes moved per second: each read once and written once);
* ``NVLink in`` / ``NVLink out``: bytes received from / sent to another GPU of the same host, at the
  transport's link rate (``ipc_link_gbs`` for CUDA IPC copies, ``nccl_link_gbs`` for NCCL);
* ``NIC in`` / ``NIC out``: bytes received from / sent to a GPU of another host (GPU g is on host
  g // gpus_per_host), at ``nic_gbs`` per GPU per direction (one NIC per GPU).

A GPU's time is the largest of its five terms' bytes / rate — the copy engines, the NVLink ports
in each direction and the NIC in each direction all run at once, and refit's executor keeps them
busy side by side (the same-GPU copies on a stream of their own, peers in rounds).  The refit's time
is the slowest GPU's, plus a fixed ``overhead_s`` (launches, barriers).  Stage-0 buckets (the
broadcast planner gathers whole tensors on source roots first) are a phase of their own, run
before stage 1: the two phases' times add.

Why this model.  Measured refits on one host are bound by the busiest GPU's busiest link: on 2 and
4 H200s the remote bytes of a refit flow at 0.87-0.97 of the all-to-all primitive over CUDA IPC
and at NCCL's own send/recv rate over NCCL, with the same-GPU copies hidden beside them; on one GPU
a refit is its same-GPU copy (bench/RESULTS.md).  A max over independent resources, plus a constant,
fitted those runs within ~10% (`bench/predict_vs_measured.py` prints the comparison).

The engine around the bytes (``--engine vllm``).  A live refit through an engine's own calls adds
a fixed time per refit — the RL loop's calls through the engine (vLLM's engine-core RPCs for
``start_weight_update``, ``update_weights``, ``finish_weight_update``) and refit's control plane
(the coordinator's dispatch, the members' barriers, the outcome) — and, for a plan cut into phases
(an engine that stages one window of layers: MoE experts on CUDA, every GEMM on CPU), a time per
phase, in which the engine re-runs vLLM's processing of what landed before the next phase starts
(`EngineCost`).  Both are measured on one H200 with vLLM 0.26 (bench/vllm_gpu.py ``--trace``).

What it leaves out: contention between NVLink and the NICs (PCIe, the GPU's memory) beyond the max;
the host's CPU time but for the fixed term (control plane, Python, launching thousands of small
copies: a model with tens of thousands of small tensors copies slower than ``same_gpu_gbs``);
the NCCL rate's dependence on bucket size (calibrated at 1 GiB buckets); quantizing or casting on
the trainers (but a same-GPU bucket's float8 weights, quantized on landing, count as the bytes that
reads and writes); switches and checksums.  The NIC rates of the presets are not measured here: they
are the NICs' line rate times an assumed efficiency (`NIC_EFFICIENCY`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.plan import Bucket, Plan
from refit.quantization import is_quantized

Transport = Literal["ipc", "nccl"]
TRANSPORTS: tuple[str, ...] = ("ipc", "nccl")
TERMS: tuple[str, ...] = ("same-GPU", "NVLink in", "NVLink out", "NIC in", "NIC out")
GB = 1e9  # rates are in GB/s: 10^9 bytes per second (a 400 Gb/s NIC is 50 GB/s)
# RDMA NICs move about this share of their line rate in large transfers (assumed, not measured here).
NIC_EFFICIENCY = 0.9


@dataclass(frozen=True)
class Hardware:
    """Every knob of the model for one kind of machine; rates in GB/s (10^9 bytes/s), per GPU and
    per direction, as measured inside refits (not the primitives' peaks)."""

    name: str
    gpus_per_host: int
    ipc_link_gbs: float  # a GPU's NVLink in (or out) inside a refit over CUDA IPC
    nccl_link_gbs: float  # the same over NCCL (its own send/recv rate, 1 GiB buckets)
    nic_gbs: float  # a GPU's share of the host's NICs, in (or out), across hosts
    same_gpu_gbs: float  # bytes moved per second by copies within one GPU
    overhead_s: float  # fixed per refit: launches, barriers, the last copy's tail
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 1:
            raise InvalidInput(f"hardware {self.name}: gpus per host must be a positive integer, "
                               f"got {self.gpus_per_host!r}")
        for f in ("ipc_link_gbs", "nccl_link_gbs", "nic_gbs", "same_gpu_gbs"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
                raise InvalidInput(f"hardware {self.name}: {f.removesuffix('_gbs')} rate must be a positive "
                                   f"number of GB/s, got {v!r}")
        if not isinstance(self.overhead_s, (int, float)) or not self.overhead_s >= 0:
            raise InvalidInput(f"hardware {self.name}: overhead must be >= 0 seconds, got {self.overhead_s!r}")

    def link_gbs(self, transport: str) -> float:
        return self.ipc_link_gbs if transport == "ipc" else self.nccl_link_gbs


# Calibrated on 2x and 4x H200 (bench/RESULTS.md, docs/performance.md): copy engines in rounds
# 383-390 GB/s inbound per GPU; a refit's remote bytes over CUDA IPC at 338-376 GB/s per GPU
# (0.87-0.97 of it: 360 taken); over NCCL 297-305 GB/s beside the refit's own copies (303 taken;
# 277 with 256 MiB buckets, not modelled); same-GPU copies inside one-GPU refits, one table
# kernel since 2026-11-27, 1923-1975 GB/s (qwen3-8b, qwen3-30b-moe, qwen3-235b-moe's shapes,
# framework allocations) against 2088-2125 GB/s for one big device copy in the same runs: 1950
# taken (before, on the copy engines, 966-1316 GB/s).  Where peer copies run beside them, the
# peer term sets the time.  NICs: 8x 400 Gb/s per host, one per GPU, 50 GB/s line rate, x NIC_EFFICIENCY.
# Overhead: the 2- and 4-GPU refits end ~0.3 ms after their last peer copy.
H200_NVL8 = Hardware(
    name="h200-nvl8", gpus_per_host=8, ipc_link_gbs=360.0, nccl_link_gbs=303.0,
    nic_gbs=50.0 * NIC_EFFICIENCY, same_gpu_gbs=1950.0, overhead_s=0.3e-3,
    notes="8x H200 per host, NVLink 4 (NV18) between them, 8x 400 Gb/s NICs per host")
# H100 SXM: the same NVLink 4 and NICs (link rates taken from the H200 runs, not measured on H100);
# HBM3 at 3.35 TB/s against the H200's 4.8, so same-GPU copies scaled by 3.35 / 4.8.
H100_NVL8 = Hardware(
    name="h100-nvl8", gpus_per_host=8, ipc_link_gbs=360.0, nccl_link_gbs=303.0,
    nic_gbs=50.0 * NIC_EFFICIENCY, same_gpu_gbs=round(1950.0 * 3.35 / 4.8, 1), overhead_s=0.3e-3,
    notes="8x H100 SXM per host, NVLink 4 (NV18) between them, 8x 400 Gb/s NICs per host")
HARDWARE: dict[str, Hardware] = {h.name: h for h in (H200_NVL8, H100_NVL8)}


@dataclass(frozen=True)
class EngineCost:
    """What an inference engine adds around the bytes of a live refit (module docstring)."""

    name: str
    loop_s: float  # fixed per refit: the loop's calls through the engine plus refit's control plane
    phase_s: float  # per phase of a phased plan: the landing between phases
    notes: str = ""

    def seconds(self, plan: Plan) -> float:
        return self.loop_s + (self.phase_s * len(plan.phase_ranges()) if plan.phase_layers else 0.0)


# vLLM 0.26 on one H200, 2026-11-29 (bench/RESULTS.md, "refit against vLLM's own weight transfer"):
# qwen3-8b's refit took 15.26 ms of which the bytes 8.61 ms (engine member between its barriers),
# so 6.65 ms is the loop's three calls (~3 ms of vLLM RPC) and refit's control (~3.5 ms).  qwen3-30b-moe
# (16 layers), phased a layer at a time: 33.98 ms over 19 phases; less the loop, the fixed overhead and
# the modelled bytes (10.86 ms), 0.85 ms a phase (the trace: ~0.6 ms re-running vLLM's expert
# processing between phases, the rest the phase's barriers and launches).  Fitted on those two runs.
ENGINES: dict[str, EngineCost] = {e.name: e for e in (
    EngineCost("vllm", loop_s=6.65e-3, phase_s=0.85e-3,
               notes="vLLM 0.26 on one H200: the loop's three calls and refit's control plane; per phase the "
                     "engine re-processes what landed"),
)}


def engine_cost(name: str) -> EngineCost:
    if name not in ENGINES:
        raise InvalidInput(f"unknown engine {name!r}: {', '.join(ENGINES)}")
    return ENGINES[name]


def hardware(name: str, link_gbs: float | None = None, nic_gbs: float | None = None) -> Hardware:
    """The preset ``name``, with the link rate (both transports') and the NIC rate overridden where
    given (GB/s); `InvalidInput` for an unknown name or a rate that is not positive."""
    if name not in HARDWARE:
        raise InvalidInput(f"unknown hardware {name!r}: {', '.join(HARDWARE)}")
    hw = HARDWARE[name]
    changes: dict[str, Any] = {}
    if link_gbs is not None:
        changes.update(ipc_link_gbs=link_gbs, nccl_link_gbs=link_gbs)
    if nic_gbs is not None:
        changes["nic_gbs"] = nic_gbs
    for label, v in (("--link-gbps", link_gbs), ("--nic-gbps", nic_gbs)):
        if v is not None and (not isinstance(v, (int, float)) or not v > 0 or v == float("inf")):
            raise InvalidInput(f"{label} must be a positive rate in GB/s, got {v!r}")
    return dataclasses.replace(hw, **changes) if changes else hw


@dataclass(frozen=True)
class GpuBytes:
    """One GPU's bytes in one phase, by term (`TERMS`)."""

    gpu: int
    same_gpu: int = 0
    peer_in: int = 0
    peer_out: int = 0
    nic_in: int = 0
    nic_out: int = 0

    def by_term(self) -> dict[str, int]:
        return dict(zip(TERMS, (self.same_gpu, self.peer_in, self.peer_out, self.nic_in, self.nic_out)))


def gpu_bytes(plan: Plan, gpus_per_host: int, stage: int = 1) -> list[GpuBytes]:
    """Every GPU's bytes in ``stage``'s buckets (stage 0: the gathers among sources), by term."""
    n = plan.placement.num_gpus
    acc = [[0] * 5 for _ in range(n)]  # same, peer in, peer out, nic in, nic out
    src_gpus = plan.placement.src_gpus
    dst_gpus = src_gpus if stage == 0 else plan.placement.dst_gpus
    for b in plan.buckets:
        if b.stage != stage:
            continue
        sg, dg = src_gpus[b.sender], dst_gpus[b.receiver]
        if sg == dg:
            acc[sg][0] += b.nbytes + _landing_extra(plan, b)
        elif sg // gpus_per_host == dg // gpus_per_host:
            acc[dg][1] += b.nbytes
            acc[sg][2] += b.nbytes
        else:
            acc[dg][3] += b.nbytes
            acc[sg][4] += b.nbytes
    return [GpuBytes(g, *a) for g, a in enumerate(acc)]


def _landing_extra(plan: Plan, b: Bucket) -> int:
    """A same-GPU bucket of a quantized plan: its float8 weights are quantized on landing
    (`refit.executor.fused_quantize`), reading q bytes an element of the dtype quantized from and
    writing 1 where a copy reads and writes 1 — as a copy of (q + 1) / 2 bytes an element: this
    many bytes more than the bucket's."""
    if not plan.quantization or b.stage != 1:
        return 0
    extra = (DTYPE_BYTES[plan.quantization[1]] - 1) / 2
    values = sum(t.numel for t in plan.transfers[b.first:b.first + b.count] if is_quantized(t.tensor))
    return int(values * extra)


@dataclass(frozen=True)
class Term:
    """One GPU's one term: its bytes, the rate they move at, and the seconds that makes."""

    phase: str
    gpu: int
    term: str
    nbytes: int
    rate_gbs: float
    seconds: float

    def describe(self) -> str:
        return f"gpu {self.gpu}: {self.term}, {self.nbytes / GB:.1f} GB at {self.rate_gbs:.0f} GB/s"

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "term": self.term, "bytes": self.nbytes, "rate_gbs": self.rate_gbs,
                "seconds": self.seconds}


@dataclass(frozen=True)
class Phase:
    """One phase's prediction: its slowest GPU's slowest term, and each term's largest over GPUs."""

    name: str
    seconds: float
    bottleneck: Term | None  # None: the phase moves nothing
    largest: dict[str, Term]  # term -> the GPU where it is largest


@dataclass(frozen=True)
class Prediction:
    seconds: float
    bottleneck: str  # "gpu 3: NVLink in, 6.5 GB at 366 GB/s" (or "nothing moves")
    phases: tuple[Phase, ...]
    hardware: Hardware
    transport: str
    num_hosts: int
    engine: EngineCost | None = None
    engine_seconds: float = 0.0  # what the engine adds (included in ``seconds``)

    def to_dict(self) -> dict[str, Any]:
        """``predicted_seconds``, ``bottleneck``, and the per-term breakdown (each term's largest per
        phase, with its GPU, bytes, rate and seconds)."""
        return {
            "predicted_seconds": self.seconds,
            "bottleneck": self.bottleneck,
            "hardware": dataclasses.asdict(self.hardware),
            "transport": self.transport,
            "num_hosts": self.num_hosts,
            "overhead_seconds": self.hardware.overhead_s,
            "engine": None if self.engine is None else {**dataclasses.asdict(self.engine),
                                                        "seconds": self.engine_seconds},
            "phases": [{"phase": p.name, "seconds": p.seconds,
                        "bottleneck": p.bottleneck.describe() if p.bottleneck else None,
                        "terms": {t: term.to_dict() for t, term in p.largest.items()}} for p in self.phases],
        }


def _phase(name: str, per_gpu: list[GpuBytes], rates: dict[str, float]) -> Phase:
    largest: dict[str, Term] = {}
    for g in per_gpu:
        for term, nbytes in g.by_term().items():
            if nbytes and (term not in largest or nbytes > largest[term].nbytes):
                largest[term] = Term(name, g.gpu, term, nbytes, rates[term], nbytes / (rates[term] * GB))
    # ties (a GPU's out is another's in): the earlier term of `TERMS`, then the lower GPU
    worst = max(largest.values(), key=lambda t: (t.seconds, -TERMS.index(t.term), -t.gpu), default=None)
    return Phase(name, worst.seconds if worst else 0.0, worst, largest)


def predict(plan: Plan, hw: Hardware = H200_NVL8, transport: str | None = None,
            engine: EngineCost | None = None) -> Prediction:
    """The refit's predicted seconds and what sets them (module docstring).  ``transport``: ipc or
    nccl; None: ipc when the plan's GPUs fit one host, else nccl (CUDA IPC does not cross hosts).
    ``engine``: what a live engine adds around the bytes (`ENGINES`); None: the bytes alone."""
    n = plan.placement.num_gpus
    hosts = -(-n // hw.gpus_per_host)
    if transport is None:
        transport = "ipc" if hosts == 1 else "nccl"
    if transport not in TRANSPORTS:
        raise InvalidInput(f"unknown transport {transport!r}: {', '.join(TRANSPORTS)}")
    if transport == "ipc" and hosts > 1:
        raise InvalidInput(f"transport ipc reaches the GPUs of one host only; this plan's {n} GPUs span {hosts} "
                           f"hosts of {hw.gpus_per_host}: use nccl")
    link = hw.link_gbs(transport)
    rates = dict(zip(TERMS, (hw.same_gpu_gbs, link, link, hw.nic_gbs, hw.nic_gbs)))
    phases = []
    if any(b.stage == 0 for b in plan.buckets):
        phases.append(_phase("gather (stage 0)", gpu_bytes(plan, hw.gpus_per_host, 0), rates))
    phases.append(_phase("refit (stage 1)", gpu_bytes(plan, hw.gpus_per_host, 1), rates))
    around = engine.seconds(plan) if engine is not None else 0.0
    seconds = sum(p.seconds for p in phases) + hw.overhead_s + around
    worst = max(phases, key=lambda p: p.seconds)
    label = worst.bottleneck.describe() if worst.bottleneck else "nothing moves"
    if worst.bottleneck and len(phases) > 1:
        label += f" ({worst.name})"
    return Prediction(seconds, label, tuple(phases), hw, transport, hosts, engine, around)
