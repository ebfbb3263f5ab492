"""What the coordinator knows and what changes it outside a refit's own steps: the workers
(registrations, disconnects, their answers to the runs under way), the plans (made once on a
thread and kept; an elastic plan pointed at the replicas there now) and the refits waiting on
busy members or watched (WatchRefits).

`CoordinatorState` is the base of `refit.control.coordinator.Coordinator`, which runs refits on
it (dispatch, collect, commit, an atomic refit's switch): a refit's steps read as one story
there, and everything here is what they consult and what the members' streams change.  Both run
on the coordinator's one event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable

from refit.control.common import PLACEMENT_NAMES, Exhausted, NotFound, short
from refit.control.events import EventHub
from refit.control.membership import View, engine_view
from refit.control.refits import Run, add_delta, failed_response
from refit.control.registry import (PlanEntry, Worker, build_registration, check_claimed_version, check_fits_group,
                                    check_info, check_joinable, check_same_model, control_plan_id, group_members,
                                    plan_json, prune_gone)
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.plan import DEFAULT_BUCKET_BYTES
from refit.planners import PLANNERS, make_plan
from refit.sides import Side
from refit.spec import ModelSpec

log = logging.getLogger("refit.control.coordinator")  # the coordinator's story reads in one logger

MAX_WORKERS = 16_384  # registrations held at once
MAX_GONE = 256  # rows of disconnected workers kept for ListWorkers; older ones are pruned
MAX_PLANS = 1_024
DROP_AFTER = 30.0  # seconds an elastic group's engine may be gone before refits run without its replica


class CoordinatorState:
    """The coordinator's workers, plans and waiters (see the module docstring)."""

    def __init__(self, drop_after: float | None = DROP_AFTER) -> None:
        """``drop_after``: `refit.control.coordinator.Coordinator`'s."""
        self.drop_after = drop_after
        self.workers: dict[str, Worker] = {}
        self.plans: dict[str, PlanEntry] = {}
        self.events = EventHub()
        self._gone: dict[str, None] = {}  # disconnected worker ids, oldest first
        self._plan_keys: dict[tuple, asyncio.Future] = {}
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        self._runs: dict[str, Run] = {}  # by refit id, while members run
        self._switching: dict[str, Run] = {}  # atomic refits whose engines are told to switch, by refit id
        self._waiters: set[asyncio.Future] = set()

    # ------------------------------------------------------------------ workers
    async def register(self, info: pb.WorkerInfo, send: Callable, task: asyncio.Task | None,
                       process_key: str = "") -> Worker:
        """Check and record a registration.  Raises `RefitError` (bad fields), `Conflict` (a live
        worker of another process holds the slot: ``process_key``, the registering process's
        `refit.control.common.process_key`, differs from that worker's) or `Exhausted` (too many
        workers)."""
        check_info(info)
        check_joinable(self.workers, info, MAX_WORKERS, process_key)
        spec, layout = await asyncio.to_thread(build_registration, info, self._specs)
        check_joinable(self.workers, info, MAX_WORKERS, process_key)  # the world may have changed meanwhile
        check_claimed_version(self.workers, self.plans, info)
        w = Worker(info, uuid.uuid4().hex[:12], spec, layout, send, task, version=info.version, stale=info.stale,
                   process_key=process_key)
        check_fits_group(self.workers, w)
        old = self.workers.get(w.worker_id)
        if old is not None and old.connected:
            log.warning("%s re-registered by its own process (session %s replaces %s)", w.worker_id, w.session,
                        old.session)
            old.replaced = True
            self.disconnected(old, "replaced by a new registration of the same process")
            if old.task is not None and old.task is not task:
                old.task.cancel()
        self._gone.pop(w.worker_id, None)
        self.workers[w.worker_id] = w
        log.info("registered %s %s %s on %s (pid %d)", w.role, w.worker_id, layout.describe(), info.host, info.pid)
        self._notify()
        if self.events:
            self.events.publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_WORKER_JOINED, member=w.status()))
        return w

    def disconnected(self, w: Worker, why: str = "its stream ended") -> None:
        if not w.connected:
            return
        w.connected, w.left_at = False, time.monotonic()
        run = self._runs.get(w.busy)
        w.busy = ""
        if run is not None:
            self._resolve(run, w, pb.WorkerResult(outcome=pb.WORKER_OUTCOME_DISCONNECTED, error=f"disconnected: {why}"))
        for switching in list(self._switching.values()):
            if switching.by_id.get(w.worker_id) is w:
                self.switched(w, pb.Switched(refit_id=switching.refit_id, ok=False, error=f"disconnected: {why}"))
        log.warning("%s disconnected: %s", w.worker_id, why)
        if self.events:
            self.events.publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_WORKER_LEFT, member=w.status()))
        if self.workers.get(w.worker_id) is w:
            self._gone[w.worker_id] = None
            prune_gone(self.workers, self._gone, MAX_GONE)
        self._notify()

    def result(self, w: Worker, res: pb.RunResult) -> None:
        run = self._runs.get(res.refit_id)
        if run is None or run.by_id.get(w.worker_id) is not w:
            if w.busy == res.refit_id:  # a late answer: the worker is free again
                w.busy = ""
                self._notify()
            log.info("%s: late result for refit %s (ok=%s)", w.worker_id, short(res.refit_id), res.ok)
            return
        run.answered.add(w.worker_id)
        run.before_start |= res.before_start and not res.ok
        if run.verify and res.ok:
            run.checksums[w.worker_id] = dict(res.checksums)
        if run.delta and res.ok and res.HasField("delta"):
            add_delta(run.delta_stats, res.delta)
        outcome = pb.WORKER_OUTCOME_OK if res.ok else pb.WORKER_OUTCOME_ERROR
        self._resolve(run, w, pb.WorkerResult(outcome=outcome, bytes=res.bytes, seconds=res.seconds,
                                              error=res.error[:4096]))

    def switched(self, w: Worker, msg: pb.Switched) -> None:
        """An engine's answer to the commit of an atomic refit (`Coordinator._switch`)."""
        run = self._switching.get(msg.refit_id)
        if run is None or run.by_id.get(w.worker_id) is not w or w.worker_id in run.switched:
            log.info("%s: late switch answer for refit %s (ok=%s)", w.worker_id, short(msg.refit_id), msg.ok)
            return
        run.switched[w.worker_id] = msg
        if run.wake is not None and not run.wake.done() and \
                len(run.switched) == len(run.members) - run.entry.num_src:
            run.wake.set_result(None)

    def _resolve(self, run: Run, w: Worker, res: pb.WorkerResult) -> None:
        if w.connected is False and res.outcome == pb.WORKER_OUTCOME_DISCONNECTED:
            run.answered.add(w.worker_id)
        if run.resolve(w, res) and self.events:
            self.events.publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_WORKER_DONE, refit_id=run.refit_id,
                                              plan_id=run.entry.plan_id, version=run.version, done=run.done,
                                              total=len(run.members), worker=res))

    def list_workers(self, group: str = "", role: int = pb.ROLE_UNSPECIFIED) -> list[pb.WorkerStatus]:
        ws = sorted(self.workers.values(), key=lambda w: (w.info.group, w.info.rank))
        return [w.status() for w in ws if (not group or w.info.group == group) and (not role or w.info.role == role)]

    async def _send(self, w: Worker, msg: pb.CoordinatorMessage) -> None:
        try:
            await w.send(msg)
        except Exception as e:  # the stream broke under us: the worker is gone
            self.disconnected(w, f"send failed: {e}")

    # ------------------------------------------------------------------ plans
    async def create_plan(self, src_group: str, dst_group: str, opts: pb.PlanOptions) -> tuple[PlanEntry, bool]:
        if not src_group or not dst_group:
            raise InvalidInput("src_group and dst_group are required")
        if opts.placement not in PLACEMENT_NAMES:
            raise InvalidInput(f"unknown placement {opts.placement}")
        planner = opts.planner or "p2p"
        if planner not in PLANNERS:
            raise InvalidInput(f"unknown planner {short(planner)}: {', '.join(PLANNERS)}")
        src = group_members(self.workers, src_group, Side.TRAINER)
        dst = group_members(self.workers, dst_group, Side.ENGINE)
        casts = check_same_model(src[0], dst[0])
        # A plan that casts is made on the engines' spec: the wire carries their dtypes (`refit.casts`).
        spec, placement = dst[0].spec, PLACEMENT_NAMES[opts.placement]
        bucket = opts.bucket_bytes or DEFAULT_BUCKET_BYTES
        phase_layers = dst[0].info.phase_layers  # group_members checked that every engine rank agrees
        base = (src_group, dst_group, src[0].info.model_name, src[0].info.model_config_json,
                dst[0].info.model_config_json, src[0].layout_str, placement, planner, bucket, phase_layers)
        args = (spec, src[0].layout, placement, planner, bucket, phase_layers, casts)
        engines, dst_layout = dst, dst[0].layout
        if dst[0].elastic:  # planned for the whole replicas registered now; re-planned as they change
            view = engine_view(dst, spec, self.drop_after)
            engines, dst_layout = list(view.engines), view.layout
        key = base + (dst_layout.describe(),)
        cached = key in self._plan_keys
        result = await self._planned(key, args, dst_layout)
        # An elastic group's plan id names the groups and options, not one set of replicas.
        plan_id = control_plan_id(f"elastic:{base}" if dst[0].elastic else result.plan.plan_hash, src_group, dst_group)
        if plan_id not in self.plans:
            members = tuple(w.worker_id for w in src + engines)
            self.plans[plan_id] = PlanEntry(plan_id, result.plan, result.summary, src_group, dst_group,
                                            plan_json(result.plan), members, src_digest=src[0].info.model_digest,
                                            dst_shape=dst[0].shape if dst[0].elastic else "",
                                            replan=(base, args) if dst[0].elastic else None)
            log.info("plan %s: %s -> %s, %d transfers", plan_id, src_group, dst_group, len(result.plan.transfers))
        return self.plans[plan_id], cached

    def _planned(self, key: tuple, args: tuple, dst_layout: Any) -> "asyncio.Future":
        """The plan of ``key`` (`make_plan` of ``args`` with the destination layout inserted), made
        once on a thread and kept: an awaitable, done at once for a plan made before."""
        if key not in self._plan_keys:
            if len(self._plan_keys) >= MAX_PLANS:
                raise Exhausted(f"the coordinator holds {MAX_PLANS} plans, its limit")
            spec, src_layout, *rest = args
            fut = self._plan_keys[key] = asyncio.ensure_future(
                asyncio.to_thread(make_plan, spec, src_layout, dst_layout, *rest))
            # a failed plan is not kept: a later request plans again
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self._plan_keys.pop(key, None))
        return asyncio.shield(self._plan_keys[key])

    def get_plan(self, plan_id: str) -> PlanEntry:
        if not plan_id:
            raise InvalidInput("plan_id is required")
        entry = self.plans.get(plan_id)
        if entry is None:
            hashed = [e.plan_id for e in self.plans.values() if e.plan.plan_hash == plan_id]
            if hashed:  # what `refit plan` prints: say which id to pass instead
                raise NotFound(f"{short(plan_id)} is a plan hash (what `refit plan` prints), not a plan id: Refit "
                               f"takes the plan_id that CreatePlan returned ({', '.join(sorted(hashed))})")
            raise NotFound(f"unknown plan {short(plan_id)}")
        return entry

    def _check_stages(self, entry: PlanEntry) -> None:
        """An atomic refit needs every engine of the plan to stage what it receives."""
        direct = [m for m in entry.members[entry.num_src:] if m in self.workers and not self.workers[m].info.stages]
        if direct:
            raise InvalidInput(f"atomic refit of plan {entry.plan_id}: {', '.join(direct[:4])}"
                               f"{' …' if len(direct) > 4 else ''} write in place and cannot stage a whole version "
                               f"(a vLLM engine needs init_info staging 'atomic'); refit without atomic, or "
                               f"register those engines again with staging")

    # ------------------------------------------------------------------ elastic plans' replicas
    def _behind(self, entry: PlanEntry, version: int) -> frozenset[int]:
        """The replicas of an elastic plan, all ranks connected, that hold a version below
        ``version`` — the version the plan committed last: they joined, or were replaced, since.
        A catch-up refit brings them to it from the trainers, which must still hold it (the
        caller's word; `refit.control.membership`).  Not engines torn by a later failed refit:
        they hold ``version`` stale, and the trainers have moved on to the one that failed."""
        if not entry.dst_shape or version != entry.version:
            return frozenset()
        try:
            view = self._view(entry)
        except InvalidInput:
            return frozenset()
        return frozenset(idx for idx, engines in view.by_replica().items()
                         if any(w.version < version for w in engines) and all(w.connected for w in engines))

    def _view(self, entry: PlanEntry, only: frozenset[int] | None = None) -> View:
        """The whole replicas of an elastic plan's engine group (`refit.control.membership`)."""
        rows = [w for w in self.workers.values() if w.info.group == entry.dst_group and w.shape == entry.dst_shape]
        if not rows:
            raise InvalidInput(f"no engine of plan {entry.plan_id}'s group {entry.dst_group!r} is registered")
        return engine_view(rows, rows[0].spec, self.drop_after, only)

    async def _take_view(self, run: Run, deadline: float) -> pb.RefitResponse | None:
        """Point an elastic plan at the replicas there now (planning their layout the first time
        it is seen); a failed response when there is none or planning fails."""
        entry = run.entry
        try:
            view = self._view(entry, run.catch_up)
            base, args = entry.replan
            planned = self._planned(base + (view.layout.describe(),), args, view.layout)
            if not planned.done():
                await asyncio.wait((planned,), timeout=max(0.0, deadline - time.monotonic()))
                view = self._view(entry, run.catch_up)  # replicas may have come or gone meanwhile
                planned = self._planned(base + (view.layout.describe(),), args, view.layout)
            if not planned.done():
                raise InvalidInput(f"planning {view.layout.describe()} did not end within the timeout")
            result = planned.result()
        except InvalidInput as e:
            results = {m: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_NOT_CONNECTED, error=str(e))
                       for m in entry.members[entry.num_src:]}
            return failed_response(entry, run.refit_id, run.version, run.t0, results)
        members = entry.members[:entry.num_src] + view.members
        if members != entry.members or result.plan is not entry.plan:
            if view.left_out and run.catch_up is None:
                log.warning("plan %s runs for replicas %s of group %s; left out: %s", entry.plan_id,
                            list(view.replicas), entry.dst_group, ", ".join(view.left_out))
            entry.members, entry.plan, entry.summary = members, result.plan, result.summary
            entry.plan_json = plan_json(result.plan)
        return None

    def _view_moved(self, run: Run) -> bool:
        """Whether an elastic plan's replicas changed while its run waited for busy members."""
        try:
            return self._view(run.entry, run.catch_up).members != run.entry.members[run.entry.num_src:]
        except InvalidInput:
            return True

    # ------------------------------------------------------------------ waiters and events
    async def _wait_free(self, entry: PlanEntry, deadline: float) -> bool:
        """Wait until no member is busy (absent members count as free: the caller checks them)."""
        loop = asyncio.get_running_loop()
        while any(m in self.workers and self.workers[m].connected and self.workers[m].busy for m in entry.members):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait((fut,), timeout=left)
            finally:
                self._waiters.discard(fut)
        return True

    def watch(self, plan_id: str) -> asyncio.Queue:
        if plan_id:
            self.get_plan(plan_id)
        return self.events.watch(plan_id)

    def unwatch(self, q: asyncio.Queue) -> None:
        self.events.unwatch(q)

    def _notify(self) -> None:
        """Wake refits waiting for busy or absent workers (cheap when none wait: the common case)."""
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()
