"""The agents' data plane: `refit.executor` driven by the control plane.

One agent is one endpoint (a trainer rank or an engine rank) in a process of the host framework,
holding *its own* tensors.  For each plan (and each rendezvous prefix the coordinator hands out —
a new one whenever a member re-registered or a refit failed) the agent builds, once, a
`refit.executor.member.Member` — the same set-up the bench's workers use — and every refit then
replays it: barrier, run, barrier.

Where members sit.  Each member publishes its device (``cuda:<index>@<host>`` or ``cpu``) in the
rendezvous store (`refit.executor.member.locate`).  On CUDA, endpoints on the same GPU share a
device (the engine drives it and maps its colocated trainer's tensors through CUDA IPC, tensor by
tensor, since a trainer's parameters are separate allocations); with every member on one host the
transport is ``ipc`` (each engine pulls its boxes out of the trainers' memory), otherwise NCCL.
On CPU every member is its own device and boxes travel over gloo.

Deadlines.  Every wait of a refit — barriers, gloo transfers, the end of GPU work — is bounded by
the refit's own ``ctx.remaining()``, which also raises as soon as the coordinator abandons the
refit (``ctx.cancelled``): a barrier gives up within 50 ms.  A barrier that times out names the
members that never reached it; a transfer names the peer it was waiting on.  Closing a member (an
older generation's, or all in `close`) does not wait for the barriers such a refit left posted.

Consistency.  Trainers synchronize their GPU before the start barrier, so the weights read are the
ones the training step wrote; nothing is written into an engine after the end barrier.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from refit.control.dataplane import RunContext
from refit.errors import RefitError
from refit.executor.member import Member, connect, locate
from refit.executor.topology import Endpoint
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan

log = logging.getLogger(__name__)


class ExecutorDataPlane:
    """`refit.control.dataplane.DataPlane` over `refit.executor` (gloo on CPU; CUDA IPC and NCCL
    on GPUs).  ``transport``: ``auto`` (ipc when every member is on one host with GPUs, else the
    communicator), ``ipc`` or ``comm``.  ``refit_hook`` (tests only) runs on a driver once its
    first transfer of a refit is posted."""

    inline = False
    refit_hook: Callable[[], None] | None = None

    def __init__(self, transport: str = "auto") -> None:
        if transport not in ("auto", "ipc", "comm"):
            raise ValueError(f"transport must be auto, ipc or comm, not {transport!r}")
        self.transport = transport
        self._members: dict[str, tuple[str, Member, int]] = {}  # plan_id -> (prefix, member, bytes)
        self._layouts: dict[str, Layout] = {}  # plan_id -> the plan's other side, resolved once

    def __call__(self, plan: Plan, role: str, rank: int, tensors: Mapping[str, torch.Tensor], version: int,
                 ctx: RunContext) -> tuple[int, float]:
        held = self._members.get(ctx.plan_id)
        if held is None or held[0] != ctx.rendezvous.prefix:
            if held is not None:  # an older generation: its peers have moved on
                held[1].close()
            self._members.pop(ctx.plan_id, None)
            member = self._setup(plan, role, rank, tensors, ctx)
            nbytes = sum(b.nbytes for b in plan.buckets if b.stage == 1 and (b.src if role == "trainer" else b.dst) == rank)
            held = self._members[ctx.plan_id] = (ctx.rendezvous.prefix, member, nbytes)
        hook = ctx.phase_hook
        on_phase = (lambda key: hook.landed(plan, key)) if hook is not None else None
        return held[2], held[1].refit(ctx.remaining, self.refit_hook, on_phase=on_phase)

    def _setup(self, plan: Plan, role: str, rank: int, tensors: Mapping[str, torch.Tensor], ctx: RunContext) -> Member:
        rdv = ctx.rendezvous
        me: Endpoint = ("src" if role == "trainer" else "dst", rank)
        eps = [("src", r) for r in range(len(plan.placement.src_gpus))] + \
              [("dst", r) for r in range(len(plan.placement.dst_gpus))]
        if len(eps) != rdv.world_size or eps[rdv.rank] != me:
            raise RefitError(f"rendezvous says member {rdv.rank} of {rdv.world_size}; the plan has "
                             f"{len(eps)} ranks and this is {me[0]} rank {rank}")
        names = [rdv.member(i) for i in range(len(eps))]
        store = connect(rdv.host, rdv.port, rdv.prefix, ctx.remaining())
        device = _device_name(tensors)
        topo, cuda, one_host = locate(store, rdv.rank, eps, device, ctx.host, names)
        ipc = cuda and one_host and self.transport != "comm"
        if self.transport == "ipc" and not ipc:
            raise RefitError("transport ipc needs every member on GPUs of one host")
        src, dst = self._sides(plan, role, ctx)
        local = {lt.name: tensors[lt.name] for lt in ctx.layout.local_tensors(ctx.spec, rank)}
        member = Member(store, topo, rdv.rank, device, {me: local}, ctx.spec, src, dst, names, ctx.remaining,
                        ipc=ipc, host=ctx.host)
        try:
            return member.prepare(plan)
        except BaseException:  # nobody else holds it: its groups and peers' maps go now, not never
            member.close()
            raise

    def _sides(self, plan: Plan, role: str, ctx: RunContext) -> tuple[Layout, Layout]:
        """(src, dst) resolved: this agent's own (``ctx.layout``) and the other, resolved once per plan."""
        other = self._layouts.get(ctx.plan_id)
        if other is None:
            text, side = (plan.dst_layout, "dst") if role == "trainer" else (plan.src_layout, "src")
            other = self._layouts[ctx.plan_id] = resolve_layout(text, ctx.spec, side)
        return (ctx.layout, other) if role == "trainer" else (other, ctx.layout)

    def close(self) -> None:
        for _, m, _ in self._members.values():
            m.close()
        self._members.clear()


def _device_name(tensors: Mapping[str, Any]) -> str:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise RefitError(f"local tensors sit on several devices ({sorted(map(str, devices))}); one device per rank")
    dev = devices.pop() if devices else torch.device("cpu")
    return f"cuda:{dev.index}" if dev.type == "cuda" else "cpu"
