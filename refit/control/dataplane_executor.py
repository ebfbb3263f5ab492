"""The agents' data plane: `refit.executor` driven by the control plane.

One agent is one endpoint (a trainer rank or an engine rank) in a process of the host framework,
holding *its own* tensors.  For each plan (and each rendezvous prefix the coordinator hands out —
a new one whenever a member re-registered) the agent builds, once, what `refit.executor.worker`
builds for the bench: a `Topology` of all members, the devices they sit on, the control group for
barriers, the data communicator over the device drivers, and its compiled, bound program.  Every
refit then replays it: barrier, run, barrier.

Where members sit.  Each member publishes its device (``cuda:<index>@<host>`` or ``cpu``) in the
rendezvous store.  On CUDA, endpoints on the same GPU share a device (the engine drives it and
maps its colocated trainer's tensors through CUDA IPC, tensor by tensor, since a trainer's
parameters are separate allocations); with every member on one host the transport is ``ipc``
(each engine pulls its boxes out of the trainers' memory, `refit.executor.program`), otherwise
NCCL.  On CPU every member is its own device and boxes travel over gloo.

Consistency.  Trainers synchronize their GPU before the start barrier, so the weights read are the
ones the training step wrote; nothing is written into an engine after the end barrier.  A member
that dies breaks the barriers and the communicator: the others raise, naming what they saw, and
the coordinator names the dead member.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from typing import Mapping

import torch
import torch.distributed as dist

from refit.control.dataplane import RunContext
from refit.errors import RefitError
from refit.executor.device import Device, enable_peer_access, make_device
from refit.executor.program import Bound, bind, compile_program
from refit.executor.shards import allocate
from refit.executor.topology import Endpoint, Topology
from refit.executor.transports import Comm, PeerError, first_line, gloo_group, make_comm
from refit.executor.worker import run_refit
from refit.layouts import resolve_layout
from refit.plan import Plan

log = logging.getLogger(__name__)


class ExecutorDataPlane:
    """`refit.control.dataplane.DataPlane` over `refit.executor` (gloo on CPU; CUDA IPC and NCCL
    on GPUs).  ``transport``: ``auto`` (ipc when every member is on one host with GPUs, else the
    communicator), ``ipc`` or ``comm``."""

    inline = False

    def __init__(self, transport: str = "auto") -> None:
        if transport not in ("auto", "ipc", "comm"):
            raise ValueError(f"transport must be auto, ipc or comm, not {transport!r}")
        self.transport = transport
        self._members: dict[str, _Member] = {}  # plan_id -> its member state, for one prefix

    def __call__(self, plan: Plan, role: str, rank: int, tensors: Mapping[str, torch.Tensor], version: int,
                 ctx: RunContext) -> tuple[int, float]:
        member = self._members.get(ctx.plan_id)
        if member is None or member.prefix != ctx.rendezvous.prefix:
            if member is not None:  # an older generation: its peers have moved on
                member.close()
            self._members.pop(ctx.plan_id, None)
            member = _Member(plan, role, rank, tensors, ctx, self.transport)
            self._members[ctx.plan_id] = member
        return member.refit(ctx)

    def close(self) -> None:
        for m in self._members.values():
            m.close()
        self._members.clear()


def _device_name(tensors: Mapping[str, torch.Tensor]) -> str:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise RefitError(f"local tensors sit on several devices ({sorted(map(str, devices))}); one device per rank")
    dev = devices.pop() if devices else torch.device("cpu")
    return f"cuda:{dev.index}" if dev.type == "cuda" else "cpu"


class _Member:
    """One agent's state for one plan and rendezvous prefix."""

    def __init__(self, plan: Plan, role: str, rank: int, tensors: Mapping[str, torch.Tensor], ctx: RunContext,
                 transport: str) -> None:
        rdv = ctx.rendezvous
        self.prefix = rdv.prefix
        self.plan, self.spec = plan, ctx.spec
        self.ep: Endpoint = ("src" if role == "trainer" else "dst", rank)
        num_src = len(plan.placement.src_gpus)
        eps = [("src", r) for r in range(num_src)] + [("dst", r) for r in range(len(plan.placement.dst_gpus))]
        if len(eps) != rdv.world_size or eps[rdv.rank] != self.ep:
            raise RefitError(f"rendezvous says member {rdv.rank} of {rdv.world_size}; the plan has "
                             f"{len(eps)} ranks and this is {self.ep[0]} rank {rank}")
        self.member = rdv.rank
        self.names = [rdv.member(i) for i in range(len(eps))]
        timeout = datetime.timedelta(seconds=ctx.remaining())
        store = dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timeout, wait_for_workers=False)
        self.store = dist.PrefixStore(rdv.prefix, store)

        # Where everyone sits.
        mine = _device_name(tensors)
        self.store.set(f"device/{self.member}", f"{mine}@{ctx.host}")
        where = [self.store.get(f"device/{m}").decode() for m in range(len(eps))]
        cuda = all(w.startswith("cuda:") for w in where)
        if not cuda and any(w.startswith("cuda:") for w in where):
            raise RefitError(f"members mix CPU and GPU tensors: {dict(zip(self.names, where))}")
        one_host = len({w.split("@", 1)[1] for w in where}) == 1
        if cuda:
            ids: dict[str, int] = {}
            for w in where:
                ids.setdefault(w, int(w.split(":")[1].split("@")[0]) if one_host else len(ids))
            devices = tuple((ep, ids[w]) for ep, w in zip(eps, where))
        else:
            devices = tuple((ep, i) for i, ep in enumerate(eps))  # every CPU member its own device
        self.topo = Topology(tuple((ep,) for ep in eps), devices)
        ipc = cuda and one_host and transport != "comm"
        if transport == "ipc" and not ipc:
            raise RefitError("transport ipc needs every member on GPUs of one host")
        self.device: Device = make_device("cuda" if cuda else "cpu", torch.device(mine).index or 0)
        self.cuda = cuda
        driven = set(self.topo.driven_devices(self.member))
        my_dev = self.topo.device_of[self.ep]

        # Share what others read: a colocated trainer's tensors (its device's driver reads them),
        # and with ipc every trainer's tensors (every driver pulls from them).
        local = {lt.name: tensors[lt.name] for lt in ctx.layout.local_tensors(ctx.spec, rank)}
        if cuda and (my_dev not in driven or (ipc and self.ep[0] == "src")):
            from torch.multiprocessing.reductions import reduce_tensor

            self.store.set(f"tensors/{self.member}", pickle.dumps({n: reduce_tensor(t) for n, t in local.items()}))
        self.tensors: dict[Endpoint, dict[str, torch.Tensor]] = {self.ep: local}
        wanted = [ep for ep, d in devices if d in driven and ep != self.ep]
        if ipc and driven:
            wanted += [ep for ep, d in devices if ep[0] == "src" and d not in driven]
            for d in sorted({d for ep, d in devices if ep[0] == "src"} - driven):
                enable_peer_access(my_dev, d)
                enable_peer_access(d, my_dev)
        for ep in wanted:
            handles = pickle.loads(self.store.get(f"tensors/{self.topo.member_of[ep]}"))
            self.tensors[ep] = {n: rebuild(*args) for n, (rebuild, args) in handles.items()}

        try:
            self.ctl = gloo_group(dist.PrefixStore("ctl", self.store), self.member, len(eps), ctx.remaining(), ctx.host)
        except RuntimeError as e:
            raise PeerError(f"building the control group of {len(eps)} members: {first_line(e)}") from None
        self.comm: Comm | None = None
        if self.member in self.topo.drivers and len(self.topo.drivers) > 1:
            names = [self.names[m] for m in self.topo.drivers]
            self.comm = make_comm("cuda" if cuda else "cpu", dist.PrefixStore("data", self.store),
                                  self.topo.comm_rank(self.member), len(self.topo.drivers), self.device,
                                  ctx.remaining(), names)
        self.bound: Bound | None = None
        if self.member in self.topo.drivers:
            spec = ctx.spec
            src = resolve_layout(plan.src_layout, spec, "src")
            dst = resolve_layout(plan.dst_layout, spec, "dst")
            program = compile_program(plan, spec, src, dst, self.topo, self.member, ipc=ipc)
            bound_tensors = {ep: dict(t) for ep, t in self.tensors.items()}
            self.gathers = []
            for ep, lts in program.gather.items():  # a broadcast plan's root gathers full tensors
                g = allocate(lts, self.device.torch)
                self.gathers.append(g)
                bound_tensors[ep].update(g.tensors)
            self.bound = bind(program, bound_tensors, self.device.torch)
        self.nbytes = sum(b.nbytes for b in plan.buckets if b.stage == 1 and
                          (b.src if self.ep[0] == "src" else b.dst) == rank)
        log.info("%s: member %d of %s, device %s, %s, drives %s", self.names[self.member], self.member,
                 rdv.prefix, mine, "ipc" if ipc else "communicator", sorted(driven) or "nothing")

    def barrier(self, what: str, ctx: RunContext) -> None:
        try:
            self.ctl.allreduce([torch.zeros(1)]).wait(datetime.timedelta(seconds=max(ctx.remaining(), 0.001)))
        except RuntimeError as e:
            raise PeerError(f"lost contact with another member at the {what} barrier (a worker died?): "
                            f"{first_line(e)}") from None

    def refit(self, ctx: RunContext) -> tuple[int, float]:
        if self.cuda:
            self.device.synchronize()  # a trainer's step, or an engine's last use, is finished
        self.barrier("refit start", ctx)
        t0 = time.perf_counter()
        if self.bound is not None:
            run_refit(self.bound, self.comm, self.device, ctx.remaining())
        seconds = time.perf_counter() - t0
        self.barrier("refit end", ctx)
        return self.nbytes, seconds

    def close(self) -> None:
        self.bound = None
        self.tensors.clear()
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception as e:  # closing after a failure may fail too; nothing to save
                log.info("closing the communicator: %s", e)
        self.comm = None

