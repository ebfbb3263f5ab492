"""CPU TRANSPORT — a stopgap data plane over gloo, to be replaced by `refit.executor`.

It lets the control plane run real refits between processes on one CPU machine.  Per plan it
builds (once, cached by the rendezvous prefix) a `ProcessGroupGloo` of its own — never the
trainer's default group — on the coordinator's TCPStore, spanning source ranks then destination
ranks.  Wire format: bucket ``i`` of the plan goes from its source to its destination as one
message with tag ``i``: the bucket's transfers in plan order, each its box row-major (offsets
aligned to the element size; with one dtype that is plain concatenation).  Every send and receive
of a worker is posted at once, so no order of blocking calls can deadlock; that also means a
worker holds its whole share in buffers at once — fine for tests, not for a 61 GB model (the
executor streams buckets with bounded memory).  Stage-0 transfers (the broadcast planner) are
refused.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from refit.errors import RefitError
from refit.layouts import Layout
from refit.plan import Plan
from refit.regions import PieceIndex, Region, slices
from refit.spec import ModelSpec
from refit.control.dataplane import RunContext

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class _Item:
    """One transfer of a bucket: its box's bytes at ``offset`` of the message."""

    tensor: str
    size: tuple[int, ...]
    offset: int
    nbytes: int
    dtype: torch.dtype
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class _Bucket:
    tag: int
    peer: int  # group rank of the other end
    nbytes: int
    items: tuple[_Item, ...]


def schedule(plan: Plan, spec: ModelSpec, layout: Layout, role: str, rank: int) -> list[_Bucket]:
    """This worker's buckets, in plan order, with the local regions of every box."""
    num_src = len(plan.placement.src_gpus)
    index = PieceIndex(layout.local_tensors(spec, rank))
    out = []
    for i, b in enumerate(plan.buckets):
        if b.stage != 1:
            raise RefitError(f"the CPU transport runs stage-1 transfers only; plan has a stage-{b.stage} "
                             f"bucket (planner {plan.planner})")
        if role == "trainer" and b.src == rank:
            peer = num_src + b.dst
        elif role == "engine" and b.dst == rank:
            peer = b.src
        else:
            continue
        items, off = [], 0
        for t in plan.transfers[b.first:b.first + b.count]:
            dtype = TORCH_DTYPES[plan.tensors[t.tensor][0]]
            off = -(-off // dtype.itemsize) * dtype.itemsize
            regions = tuple(index.regions(t.tensor, (t.start, t.size)))
            covered = sum(_numel(r.size) for r in regions)
            if covered != t.numel:
                raise RefitError(f"{role} rank {rank} holds {covered} of the {t.numel} elements of "
                                 f"{t.tensor} {list(t.start)}+{list(t.size)} the plan moves through it")
            items.append(_Item(t.tensor, t.size, off, t.numel * dtype.itemsize, dtype, regions))
            off += items[-1].nbytes
        out.append(_Bucket(i, peer, off, tuple(items)))
    return out


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


class GlooDataPlane:
    """`refit.control.dataplane.DataPlane` over gloo send/recv on CPU tensors."""

    inline = False

    def __init__(self) -> None:
        self._schedules: dict[tuple[str, str, int], list[_Bucket]] = {}
        self._groups: dict[str, tuple[str, dist.ProcessGroup]] = {}  # plan_id -> (prefix, group)

    def __call__(self, plan: Plan, role: str, rank: int, tensors: Mapping[str, torch.Tensor], version: int,
                 ctx: RunContext) -> tuple[int, float]:
        t0 = time.perf_counter()
        key = (ctx.plan_id, role, rank)
        if key not in self._schedules:
            self._schedules[key] = schedule(plan, ctx.spec, ctx.layout, role, rank)
        buckets = self._schedules[key]
        group = self._group(ctx)
        views = _LocalViews(tensors)
        if role == "trainer":
            moved = self._send(group, buckets, views, ctx)
        else:
            moved = self._recv(group, buckets, views, ctx)
        return moved, time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------
    def _group(self, ctx: RunContext) -> dist.ProcessGroup:
        """The plan's communicator for this rendezvous prefix, built on first use."""
        cached = self._groups.get(ctx.plan_id)
        if cached and cached[0] == ctx.rendezvous.prefix:
            return cached[1]
        self._groups.pop(ctx.plan_id, None)  # an older generation: its peers have moved on
        rdv = ctx.rendezvous
        timeout = datetime.timedelta(seconds=ctx.remaining())
        store = dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timeout, wait_for_workers=False)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ctx.host)]
        opts._timeout = timeout
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(rdv.prefix, store), rdv.rank, rdv.world_size, opts)
        except RuntimeError as e:
            raise RuntimeError(f"building the gloo group {rdv.prefix!r} of {rdv.world_size} members: "
                               f"{_first_line(e)}") from None
        log.info("gloo group %s: rank %d of %d", rdv.prefix, rdv.rank, rdv.world_size)
        self._groups[ctx.plan_id] = (rdv.prefix, group)
        return group

    def _send(self, group: dist.ProcessGroup, buckets: list[_Bucket], views: "_LocalViews", ctx: RunContext) -> int:
        works = []
        for b in buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            for it in b.items:
                box = buf[it.offset:it.offset + it.nbytes].view(it.dtype).view(it.size)
                for r in it.regions:
                    box[slices(r.box_start, r.size)].copy_(views.get(r.local, len(it.size))[slices(r.local_start, r.size)])
            works.append((b, group.send([buf], b.peer, b.tag)))
        for b, w in works:
            self._wait(w, b, "send to", ctx)
        return sum(b.nbytes for b in buckets)

    def _recv(self, group: dist.ProcessGroup, buckets: list[_Bucket], views: "_LocalViews", ctx: RunContext) -> int:
        posted = []
        for b in buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            posted.append((b, buf, group.recv([buf], b.peer, b.tag)))
        for b, buf, w in posted:
            self._wait(w, b, "receive from", ctx)
            ctx.remaining()  # raises once cancelled: never write after the coordinator gave up
            for it in b.items:
                box = buf[it.offset:it.offset + it.nbytes].view(it.dtype).view(it.size)
                for r in it.regions:
                    views.get(r.local, len(it.size))[slices(r.local_start, r.size)].copy_(box[slices(r.box_start, r.size)])
        return sum(b.nbytes for b in buckets)

    @staticmethod
    def _wait(work: dist.Work, b: _Bucket, what: str, ctx: RunContext) -> None:
        try:
            work.wait(datetime.timedelta(seconds=ctx.remaining()))
        except RuntimeError as e:
            raise RuntimeError(f"bucket {b.tag}: {what} {ctx.rendezvous.member(b.peer)}: {_first_line(e)}") from None


class _LocalViews:
    """Local tensors viewed with the canonical number of dimensions (see `refit.layouts.base`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.cache: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, name: str, ndim: int) -> torch.Tensor:
        key = (name, ndim)
        if key not in self.cache:
            t = self.tensors[name]
            self.cache[key] = t.view((1,) * (ndim - t.dim()) + tuple(t.shape))
        return self.cache[key]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
