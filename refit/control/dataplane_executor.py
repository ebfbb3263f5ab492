"""The agents' data plane: `refit.executor` driven by the control plane.

One agent is one endpoint (a trainer rank or an engine rank) in a process of the host framework,
holding *its own* tensors.  For each plan (and each rendezvous prefix the coordinator hands out —
a new one whenever a member re-registered or a refit failed) the agent builds, once, a
`refit.executor.member.Member` — the same set-up the bench's workers use — and every refit then
replays it: barrier, run, barrier.

Where members sit.  Each member publishes its device (``cuda:<index>@<host>`` or ``cpu``) in the
rendezvous store (`refit.executor.seating.locate`).  On CUDA, endpoints on the same GPU share a
device (the engine drives it and maps its colocated trainer's tensors through CUDA IPC, tensor by
tensor, since a trainer's parameters are separate allocations); with every member on one host the
transport is ``ipc`` (each engine pulls its boxes out of the trainers' memory), otherwise NCCL.
On CPU every member is its own device and boxes travel over gloo.

Tensors that move.  An agent that follows its model (``tensors`` a callable, read at every refit)
may hand over tensors whose storage changed since the member was built (``model.float();
model.bfloat16()``, an offload and reload): the member's bound copies and its peers' maps would
read the old memory.  The member then raises a flag in the refit's start barrier — the barrier is
an all-reduce, so every member learns it in the same step, at no cost when nothing moved — and
every member builds its member again (under a sub-prefix of the rendezvous) within the same refit.

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
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from refit.control.dataplane import BaseDataPlane, RunContext, Tensors
from refit.control.trainer_wire import TrainerWire
from refit.errors import InvalidInput, RefitFailed
from refit.executor.checksum import share_checksums
from refit.executor.delta import DeltaStats
from refit.executor.member import Member, Rebuild
from refit.executor.seating import locate
from refit.executor.topology import Endpoint, endpoint_name, endpoints
from refit.layouts import Layout, QuantizedLayout, resolve_layout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec

log = logging.getLogger(__name__)


Where = tuple[tuple[str, Any], ...]  # each tensor's place: name, (device, address, dtype, shape, strides)


def where(tensors: Mapping[str, torch.Tensor]) -> Where:
    return tuple((n, (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())) for n, t in tensors.items())


@dataclass
class Held:
    """A plan's member, as built for one rendezvous prefix and one set of tensors."""

    prefix: str
    store: dist.Store  # the member's rendezvous store, kept referenced while torch's groups built on
    # it live (a Python store whose last reference went answers torch with "pure virtual function")
    member: Member
    nbytes: int
    tensors: Mapping[str, torch.Tensor]  # the mapping it was built from (the same one again: not moved)
    where: Where  # where those tensors lay
    rebuilds: int = 0

    def close(self) -> None:
        self.member.close()
        close_store(self.store)


class ExecutorDataPlane(BaseDataPlane):
    """`refit.control.dataplane.DataPlane` over `refit.executor` (gloo on CPU; CUDA IPC and NCCL
    on GPUs).  ``transport``: ``auto`` (ipc when every member is on one host with GPUs, else the
    communicator), ``ipc`` or ``comm``.  ``refit_hook`` (tests only) runs on a driver once its
    first transfer of a refit is posted."""

    reports_start = True  # calls ctx.starting() before the start barrier
    verifies = True  # gives its transfers' checksums after a refit (`checksums`)
    refit_hook: Callable[[], None] | None = None

    def __init__(self, transport: str = "auto") -> None:
        if transport not in ("auto", "ipc", "comm"):
            raise InvalidInput(f"transport must be auto, ipc or comm, not {transport!r}")
        self.transport = transport
        self._members: dict[str, Held] = {}  # by plan_id
        # plan hash -> (the spec this seat runs it with, src, dst), resolved by `prepare`
        self._resolved: dict[str, tuple[ModelSpec, Layout, Layout]] = {}
        self.wire = TrainerWire()  # a trainer's tensors cast and quantized for the wire, per plan
        # plan hash -> the tensors its last `run` moved (a trainer's as the wire carries them), for `checksums`
        self._moved: dict[str, Tensors] = {}
        self.last_delta: DeltaStats | None = None  # what the last refit sent over wires (`Member.last_delta`)
        self.delta_fallback = ""  # why the last delta refit went in full here, if it did
        # plan hash -> checksums an engine took phase by phase in its last verified `run` (its
        # phase hook re-uses one staging for every phase: summed before each phase is applied)
        self._phase_sums: dict[str, dict[int, int]] = {}
        # plan hash -> the rank this seat plays in it: its own, or, for a replica of an elastic
        # engine group, its place among the replicas the plan was made for (`prepare`)
        self._played: dict[str, int] = {}

    def prepare(self, plan: Plan, rank: int | None = None) -> None:
        """Resolve the plan's layouts once (a trainer's own against the spec it runs the plan
        with: its own, with the plan's casts applied), and check that this seat is in it, as its
        own rank or as ``rank`` of the plan's layout (a replica the agent checked holds the
        same tensors: `refit.control.membership`)."""
        seat = self.seat
        trainer = seat.side is Side.TRAINER
        ranks = len(plan.placement.src_gpus if trainer else plan.placement.dst_gpus)
        played = self._played[plan.plan_hash] = seat.rank if rank is None else rank
        if played >= ranks:
            raise InvalidInput(f"plan {plan.plan_hash} has {ranks} {seat.side.plural}; this is rank {played}")
        if plan.plan_hash in self._resolved:
            return
        spec = plan.spec_for(seat.spec, trainer)
        other_side = seat.side.other
        own_text = seat.side.layout_of(plan)
        if own_text != seat.layout.describe():  # a replica playing a rank of the plan's replica count
            mine = resolve_layout(own_text, spec, seat.side)
        elif spec is not seat.spec:
            mine = resolve_layout(seat.layout, spec, seat.side)
        else:
            mine = seat.layout
        other = resolve_layout(other_side.layout_of(plan), spec, other_side)
        self._resolved[plan.plan_hash] = (spec, mine, other) if trainer else (spec, other, mine)
        if spec is not seat.spec:  # this rank's local tensors whose dtype the wire changes
            held = {lt.name: lt.dtype for lt in seat.layout.local_tensors(seat.spec, seat.rank)}
            wire = mine.local_tensors(spec, seat.rank)
            scales = mine.scale_locals(spec, seat.rank) if isinstance(mine, QuantizedLayout) else {}
            shapes = {lt.name: lt.shape for lt in wire}
            # a weight the plan quantizes is cast first to the dtype it is quantized from (float32
            # masters rounded to bfloat16, as writing a checkpoint would): `TrainerWire.cast`
            want = {lt.name: plan.quantization[1] if lt.name in scales else lt.dtype for lt in wire if lt.name in held}
            self.wire.add(plan.plan_hash, {name: dtype for name, dtype in want.items() if held[name] != dtype},
                          (plan.quantization, {w: (s, shapes[s]) for w, s in scales.items()}) if scales else None)

    def run(self, plan: Plan, tensors: Tensors, ctx: RunContext) -> tuple[int, float]:
        if plan.plan_hash not in self._resolved:
            self.prepare(plan)
        held = self._members.get(ctx.plan_id)
        building = held is None or held.prefix != ctx.rendezvous.prefix
        # weights the drivers quantize on landing, as the member this refit runs was built to know;
        # a new build learns them anew: until then, every weight goes into the wire
        skipped = set() if building else self.wire.landed.get(plan.plan_hash, set())
        if self.wire.changes(plan.plan_hash):
            tensors = self.wire.cast(plan.plan_hash, tensors, skipped)  # before the start barrier: trainer-side work
        self._moved[plan.plan_hash] = tensors
        if building:
            if held is not None:  # an older generation: its peers have moved on
                held.close()
            self._members.pop(ctx.plan_id, None)
            held = self._build(plan, tensors, ctx, 0)
        moved = tensors is not held.tensors and self._where(plan.plan_hash, tensors) != held.where
        self.delta_fallback = ""
        on_phase = self._on_phase(plan, tensors, ctx)
        ctx.starting()
        try:
            seconds = held.member.refit(ctx.remaining, self.refit_hook, on_phase=on_phase, rebuild=moved,
                                        delta=ctx.delta, base=ctx.delta_base)
        except Rebuild:  # some member's tensors moved: every member builds again, in this refit
            if ctx.delta:
                self.delta_fallback = ("a member's tensors moved since the plan's members were built (an atomic "
                                       "refit's first staging, an offload, a trainer's FP8 wire buffers let go for "
                                       "weights quantized on landing): built again within the refit")
            log.info("%s: rebuilding for plan %s: a member's tensors moved", rendezvous_name(ctx), ctx.plan_id)
            held.close()
            del self._members[ctx.plan_id]
            held = self._build(plan, tensors, ctx, held.rebuilds + 1)
            if skipped - self.wire.landed.get(plan.plan_hash, set()):
                # built on wire buffers that hold nothing (placeholders) for weights its drivers now
                # read from the wire: fail this refit; the next one builds on whole buffers
                held.close()
                del self._members[ctx.plan_id]
                raise RefitFailed(f"{rendezvous_name(ctx)}: the weights quantized on landing changed between two "
                                  f"builds of plan {ctx.plan_id}; the next refit builds it again")
            seconds = held.member.refit(ctx.remaining, self.refit_hook, on_phase=on_phase, delta=ctx.delta,
                                        base=False)  # built again: nothing kept to start from
        # what was sent includes what the executor derived (a trainer's FP8 blocks cut across ranks)
        derived = held.member.tensors.get((self.seat.side, self._rank(plan)), {})
        self._moved[plan.plan_hash] = {**derived, **tensors}
        self.last_delta = held.member.last_delta
        return held.nbytes, seconds

    def _where(self, plan_hash: str, tensors: Tensors) -> Where:
        """Where ``tensors`` lie, and the weights a quantizing trainer's were quantized from (a
        driver may read those: quantizing on landing)."""
        return where(tensors) + where(self.wire.unquantized.get(plan_hash, {}))

    def _on_phase(self, plan: Plan, tensors: Tensors, ctx: RunContext) -> Callable[[int], None] | None:
        """What runs as each phase landed: the engine's phase hook, after (verify) the checksums
        of that phase's transfers, taken before the hook re-uses the staging they landed in."""
        hook = ctx.phase_hook
        self._phase_sums.pop(plan.plan_hash, None)
        if hook is None:
            return None
        if not ctx.verify:
            return lambda key: hook.landed(plan, key)
        sums = self._phase_sums[plan.plan_hash] = {}

        def landed(key: int) -> None:
            sums.update(self._sums(plan, tensors, key))
            hook.landed(plan, key)
        return landed

    def checksums(self, plan: Plan, tensors: Tensors | None = None) -> dict[int, int]:
        """This seat's checksum of every stage-1 transfer it sends or receives, by transfer index
        (`refit.executor.checksum`).  Without ``tensors``: of the refit `run` just finished — a
        trainer's over the tensors it sent (cast and quantized: the wire's), an engine's over the
        tensors it received into (phase by phase where a phase hook re-uses its staging).  With
        ``tensors``: of those as they are now (a trainer's cast and quantized first), nothing moved."""
        if tensors is not None:
            if self.seat.side is Side.TRAINER and self.wire.changes(plan.plan_hash):
                tensors = self.wire.cast(plan.plan_hash, tensors, buffers={})  # the refits' buffers stay as built
                spec, src, _ = self._run_view(plan)
                if getattr(src, "derived_tensors", None) and src.derived_tensors(spec, self._rank(plan)):
                    raise InvalidInput(f"{self.seat.side.value} rank {self._rank(plan)} cuts FP8 blocks whose scales "
                                       f"it shares with other ranks at each refit: it cannot be checked in place "
                                       f"(refit with verify=True checks what it sends)")
            return self._sums(plan, tensors)
        if plan.plan_hash in self._phase_sums:
            return self._phase_sums[plan.plan_hash]
        moved = self._moved.get(plan.plan_hash)
        if moved is None:
            raise InvalidInput(f"plan {plan.plan_hash} has not run on this seat: no checksums to give")
        return self._sums(plan, self.wire.as_sent(plan.plan_hash, moved))

    def _sums(self, plan: Plan, tensors: Tensors, phase: int | None = None) -> dict[int, int]:
        if plan.plan_hash not in self._resolved:
            self.prepare(plan)
        spec, src, dst = self._run_view(plan)
        return share_checksums(plan, spec, src, dst, self.seat.side, self._rank(plan), tensors, phase)

    def _build(self, plan: Plan, tensors: Tensors, ctx: RunContext, rebuilds: int) -> Held:
        store = ctx.open_store(ctx.remaining())
        if rebuilds:  # keys under a sub-prefix: the coordinator's store does it itself (see `Held.store`)
            within = getattr(store, "within", None)
            if within is None:
                store = dist.PrefixStore(f"rebuild{rebuilds}/", store)
            else:
                base, store = store, within(f"rebuild{rebuilds}/")
                base.close()
        try:
            member = self._setup(store, plan, tensors, ctx)
        except BaseException:
            close_store(store)
            raise
        side, rank = self.seat.side, self._rank(plan)
        if side is Side.TRAINER and self.wire.quantizes(plan.plan_hash):
            try:  # what this build's drivers quantize on landing: the next refits leave it out of the wire
                self.wire.landed[plan.plan_hash] = member.fused_sources((side, rank), ctx.remaining)
            except BaseException:
                member.close()
                close_store(store)
                raise
        nbytes = sum(b.nbytes for b in plan.buckets if b.stage == 1 and side.rank_in(b) == rank)
        held = self._members[ctx.plan_id] = Held(ctx.rendezvous.prefix, store, member, nbytes, tensors,
                                                 self._where(plan.plan_hash, tensors), rebuilds)
        return held

    def _setup(self, store: dist.Store, plan: Plan, tensors: Tensors, ctx: RunContext) -> Member:
        rdv, seat, rank = ctx.rendezvous, self.seat, self._rank(plan)
        me: Endpoint = (seat.side, rank)
        eps = endpoints(plan.placement)
        if len(eps) != rdv.world_size or eps[rdv.rank] != me:
            raise InvalidInput(f"rendezvous says member {rdv.rank} of {rdv.world_size}; the plan has "
                             f"{len(eps)} ranks and this is {endpoint_name(me)}")
        names = [rdv.member(i) for i in range(len(eps))]
        device = _device_name(tensors)
        topo, cuda, one_host = locate(store, rdv.rank, eps, device, seat.host, names)
        ipc = cuda and one_host and self.transport != "comm"
        if self.transport == "ipc" and not ipc:
            raise InvalidInput("transport ipc needs every member on GPUs of one host")
        spec, src, dst = self._run_view(plan)
        mine = src if seat.side is Side.TRAINER else dst
        local = {lt.name: tensors[lt.name] for lt in mine.local_tensors(spec, rank)}
        # a colocated driver may quantize this trainer's weights on landing: it reads them as held
        unquantized = {me: self.wire.unquantized[plan.plan_hash]} if cuda and plan.plan_hash in self.wire.unquantized \
            else None
        member = Member(store, topo, rdv.rank, device, {me: local}, spec, src, dst, names, ctx.remaining,
                        ipc=ipc, host=seat.host, unquantized=unquantized)
        try:
            return member.prepare(plan)
        except BaseException:  # nobody else holds it: its groups and peers' maps go now, not never
            member.close()
            raise

    def _rank(self, plan: Plan) -> int:
        """The rank this seat plays in ``plan`` (`prepare`)."""
        return self._played.get(plan.plan_hash, self.seat.rank)

    def _run_view(self, plan: Plan) -> tuple[ModelSpec, Layout, Layout]:
        """(the spec this seat runs ``plan`` with, its src and dst layouts), as `prepare` resolved them."""
        return self._resolved[plan.plan_hash]

    def close(self) -> None:
        for held in self._members.values():
            held.close()
        self._members.clear()
        self.wire.clear()
        self._moved.clear()


def close_store(store: dist.Store) -> None:
    """Close a rendezvous store that holds a connection of its own (the coordinator's; torch's
    TCPStore clients close when dropped)."""
    close = getattr(store, "close", None)
    if close is not None:
        close()


def rendezvous_name(ctx: RunContext) -> str:
    return ctx.rendezvous.member(ctx.rendezvous.rank)


def _device_name(tensors: Mapping[str, Any]) -> str:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise InvalidInput(f"local tensors sit on several devices ({sorted(map(str, devices))}); one device per rank")
    dev = devices.pop() if devices else torch.device("cpu")
    return f"cuda:{dev.index}" if dev.type == "cuda" else "cpu"
