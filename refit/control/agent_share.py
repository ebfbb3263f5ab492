"""An agent's share of a refit: the plan it runs (fetched, prepared, its rank played), the share
itself, run through the data plane on the agent's share thread, a Check's checksums, and an atomic
refit's staging and switch.

`AgentShare` is the data-plane half of `refit.control.agent.Agent`, on top of its stream
(`refit.control.agent_stream.AgentStream`: plans are fetched and switches answered over it).  Kept
apart from the agent's handling of commands (which run, when, and what their outcomes make of the
weights it holds), which is loop-side bookkeeping: everything here touches the rank's tensors or the
data plane.  `Agent` sets what it works on (the attributes declared on the class).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from typing import ClassVar

import torch

from refit.control.agent_state import Holding
from refit.control.agent_stream import AgentStream
from refit.control.dataplane import DataPlane, PhaseHook, RunContext, Tensors, TensorSource, check_tensors
from refit.control.membership import interchangeable
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput, RefitFailed
from refit.executor.values import copy_bits, int_view
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec
from refit.timeline import mark

log = logging.getLogger("refit.control.agent")  # an agent's story reads in one logger


class AgentShare(AgentStream):
    """Runs a worker rank's share of each refit through its data plane (see the module docstring)."""

    # Set by `refit.control.agent.Agent` (its class and its __init__, which documents them).
    role: ClassVar[Side]
    serves_its_tensors: bool
    spec: ModelSpec
    layout: Layout
    rank: int
    data_plane: DataPlane
    phase_hook: PhaseHook | None
    stages: bool
    holding: Holding
    _source: TensorSource
    _names: frozenset[str]
    _stage_buffers: dict[str, torch.Tensor]
    _staging_current: bool
    _staged: tuple[str, int, Tensors, Tensors] | None
    _plans: dict[str, Plan]
    _plays: dict[str, int]
    _pool: concurrent.futures.ThreadPoolExecutor

    # ------------------------------------------------------------------ tensors
    @property
    def tensors(self) -> Tensors:
        """This rank's local tensors now (a callable source read, and checked against the layout;
        a mapping checked to still hold every name, cheaply: its tensors were checked at start)."""
        if callable(self._source):
            return self._read_tensors()
        missing = self._names - self._source.keys()
        if missing:
            raise RefitFailed(f"{self.worker_id}: tensor {min(missing)!r} ({len(missing)} in all) was removed from "
                              f"the tensors this agent was given; rank {self.rank} of {self.layout.describe()} "
                              f"holds it: give it back (or the agent a callable that reads the model)")
        return self._source

    def _read_tensors(self) -> Tensors:
        tensors = self._source() if callable(self._source) else self._source
        check_tensors(self.spec, self.layout, self.rank, tensors)
        return tensors

    # ------------------------------------------------------------------ plans
    async def _plan(self, run: pb.RunRefit) -> Plan:
        """The plan of a command: sent along the first time, cached, else fetched with GetPlan."""
        plan = self._plans.get(run.plan_id)
        if plan is not None and not run.plan_json:
            return plan
        data = run.plan_json
        if not data:
            resp = await self._stub.GetPlan(pb.GetPlanRequest(plan_id=run.plan_id, include_plan=True), metadata=self._md)
            data = resp.plan_json
        plan = Plan.from_dict(json.loads(data))
        plan.spec_for(self.spec, self.role is Side.TRAINER)  # the same model (dtype casts aside)
        if self.role.layout_of(plan) == self.layout.describe():
            self.data_plane.prepare(plan)
        self._plans[run.plan_id] = plan
        return plan

    def _play(self, plan: Plan, member: int) -> None:
        """Take this worker's rank in ``plan``: its own, or — a replica of an elastic engine group
        (`refit.control.membership`) — the one its place among the replicas gives (``member``: its
        rendezvous rank), once checked that it holds the very tensors of that rank."""
        rank = member - (len(plan.placement.src_gpus) if self.role is Side.ENGINE else 0)
        mine = self.role.layout_of(plan)
        played = self._plays.get(plan.plan_hash)
        if played == rank:
            return
        own = mine == self.layout.describe() and rank == self.rank
        if not own:
            other = resolve_layout(mine, self.spec, self.role) if mine != self.layout.describe() else self.layout
            if not interchangeable(self.spec, self.layout, self.rank, other, rank):
                raise InvalidInput(f"plan is for {plan.model_digest} {mine} and has this worker play its rank {rank}; "
                                   f"this worker holds {self.spec.digest()} {self.layout.describe()} rank {self.rank}, "
                                   f"whose tensors differ")
        if not own or played is not None:  # `_plan` prepared its own rank; another was played since
            self.data_plane.prepare(plan, rank)
        self._plays[plan.plan_hash] = rank

    # ------------------------------------------------------------------ the share, on the share thread
    def _execute(self, plan: Plan, ctx: RunContext) -> pb.WorkerMessage:
        in_plane = False
        try:
            ctx.remaining()
            if self.phase_hook is not None:  # a refusal: nothing moves (we never reach the start barrier)
                self.phase_hook.check(plan)
            if ctx.verify and not self.data_plane.verifies:
                raise InvalidInput(f"verify: {type(self.data_plane).__name__} computes no checksums of its transfers")
            if ctx.check_only:
                return self._checksums_now(plan, ctx)
            tensors = live = self.tensors
            if ctx.atomic and self.role is Side.ENGINE:
                if not self.stages:
                    raise InvalidInput(f"{self.worker_id} writes in place and cannot take an atomic refit")
                tensors = self._staging(live, refresh=ctx.delta and not self._staging_current)
            self._staging_current = False  # until this refit switches: staging and live may differ
            in_plane = True
            mark(f"{self.role.value}: data plane entered")
            nbytes, seconds = self.data_plane.run(plan, tensors, ctx)
            mark(f"{self.role.value}: data plane left")
            checksums = self.data_plane.checksums(plan) if ctx.verify else {}
            if ctx.atomic and self.role is Side.ENGINE:
                self._staged = (ctx.refit_id, ctx.version, tensors, live)
        except Exception as e:
            log.warning("%s: refit %s failed: %s: %s", self.worker_id, ctx.refit_id, type(e).__name__, e)
            # Only a data plane that says when it reaches the start barrier can prove it did not.
            before = not in_plane or (self.data_plane.reports_start and not ctx.reached_start.is_set())
            return pb.WorkerMessage(result=pb.RunResult(refit_id=ctx.refit_id, ok=False, error=f"{type(e).__name__}: {e}",
                                                        before_start=before))
        stats = self.data_plane.last_delta if ctx.delta and self.role is Side.TRAINER else None
        delta = pb.DeltaStats(buckets=stats.buckets, delta_buckets=stats.delta_buckets, words=stats.words,
                              changed=stats.changed, wire_bytes=stats.wire_bytes, full_bytes=stats.full_bytes,
                              fallback=self.data_plane.delta_fallback) if stats is not None else None
        return pb.WorkerMessage(result=pb.RunResult(refit_id=ctx.refit_id, ok=True, bytes=nbytes, seconds=seconds,
                                                    checksums=checksums, delta=delta))

    def _checksums_now(self, plan: Plan, ctx: RunContext) -> pb.WorkerMessage:
        """A Check: the checksums of this worker's tensors as they are, nothing moved."""
        if not self.serves_its_tensors:
            raise InvalidInput(f"{self.worker_id} re-processes the weights it receives: what it serves is not in "
                               f"the layout refit writes, so it cannot be checked in place (refit with verify=True "
                               f"checks the bytes as they arrive)")
        t0 = time.perf_counter()
        checksums = self.data_plane.checksums(plan, self.tensors)
        return pb.WorkerMessage(result=pb.RunResult(refit_id=ctx.refit_id, ok=True, checksums=checksums,
                                                    seconds=time.perf_counter() - t0))

    # ------------------------------------------------------------------ atomic refits
    @property
    def staging_bytes(self) -> int:
        """Bytes this engine holds to stage atomic refits (its shard, once one ran; else 0)."""
        return sum(t.numel() * t.element_size() for t in self._stage_buffers.values())

    def _staging(self, live: Tensors, refresh: bool = False) -> Tensors:
        """Where an atomic refit writes instead of ``live``: a copy of each tensor, made once and
        kept for later atomic refits (one more shard of memory, for the agent's life).  Copies,
        not empty buffers: elements no refit writes (padding) must switch in unchanged.
        ``refresh``: copy ``live`` into it again (a delta refit starts from what the engine holds,
        and a refit since the last switch may have written live only)."""
        bufs = self._stage_buffers
        for name, t in live.items():
            b = bufs.get(name)
            if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
                with torch.no_grad():
                    bufs[name] = t.detach().clone()
            elif refresh:
                with torch.no_grad():
                    int_view(b).copy_(int_view(t))
        for name in set(bufs) - set(live):
            del bufs[name]
        return dict(bufs)

    def _switch(self, staged: Tensors, live: Tensors) -> None:
        """Put an atomic refit's staged version in place: one batched copy, finished before the
        agent answers `Switched` (so that the caller of the refit finds the tensors switched)."""
        copy_bits(live, staged)
        self._staging_current = True

    async def _switch_and_answer(self, refit_id: str, version: int, staged: Tensors, live: Tensors) -> None:
        """The commit of an atomic refit reached this engine: switch, on the share thread (never
        beside a share), then answer the coordinator."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._switch, staged, live)
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, which names us
            log.error("%s: could not switch to version %d of refit %s: %s", self.worker_id, version, refit_id, e)
            self.holding.pin_stale()
            answer = pb.Switched(refit_id=refit_id, ok=False, error=f"{type(e).__name__}: {e}")
        else:
            h = self.holding
            h.version, h.stale = version, h.pinned
            answer = pb.Switched(refit_id=refit_id, ok=True)
            log.info("%s: switched to version %d (refit %s)", self.worker_id, version, refit_id)
        try:
            await self._write(pb.WorkerMessage(switched=answer))
        except Exception as e:  # the stream is gone; the coordinator counts us out
            log.info("%s: could not answer the switch of refit %s: %s", self.worker_id, refit_id, e)
