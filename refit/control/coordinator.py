"""The coordinator: registrations, cached plans, and running a refit across its members.

Everything here runs on one asyncio event loop, so state changes need no locks.  A refit:

1. refuse an unknown plan (`NotFound`) or a version not above what the engines hold (`Precondition`);
2. fail at once (status FAILED, nothing touched) when a member is not connected; wait, within the
   timeout, for members still busy with an earlier refit;
3. mark members busy and the engines stale, send every member ``RunRefit`` (the plan itself only
   the first time a registration takes part in it), with a timeout a little shorter than ours so
   that a member blocked on a hung peer reports *which* peer before we give up;
4. collect results: all OK → commit the version to the engines; the first failure → wait a short
   grace for the rest (a killed process shows up both as its own disconnect and as its peers'
   errors; the disconnect is the cause and is named first), then report FAILED and tell the
   members to abandon it.  Past the timeout, members without a result are TIMED_OUT.

A member stays busy until it answers (or disconnects), so a refit never starts on a worker that
may still be writing a previous one.  After a failure the plan's communicator is rebuilt.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from refit.control.common import NotFound, Precondition
from refit.control.registry import (PlanEntry, Worker, check_group_role, check_registration, check_same_model,
                                    group_members, plan_json)
from refit.control.v1 import refit_pb2 as pb
from refit.errors import RefitError
from refit.spec import ModelSpec

log = logging.getLogger(__name__)

PLACEMENTS = {pb.PLACEMENT_UNSPECIFIED: "colocated", pb.PLACEMENT_COLOCATED: "colocated",
              pb.PLACEMENT_DISAGGREGATED: "disaggregated"}
DEFAULT_BUCKET_BYTES = 256 * 2**20
# Worst first: the cause of a failure before its consequences.
SEVERITY = [pb.WORKER_OUTCOME_DISCONNECTED, pb.WORKER_OUTCOME_TIMED_OUT, pb.WORKER_OUTCOME_NOT_CONNECTED,
            pb.WORKER_OUTCOME_BUSY, pb.WORKER_OUTCOME_ERROR, pb.WORKER_OUTCOME_UNSPECIFIED]


@dataclass(eq=False)
class _Run:
    refit_id: str
    entry: PlanEntry
    version: int
    members: list[Worker]
    results: dict[str, pb.WorkerResult] = field(default_factory=dict)
    by_id: dict[str, Worker] = field(default_factory=dict)
    done: int = 0
    member_deadline: float = 0.0
    failed: bool = False
    wake: asyncio.Future | None = None


class Coordinator:
    def __init__(self, store_host: str, store_port: int, default_timeout: float = 60.0, grace: float = 0.25) -> None:
        """``store_host:store_port``: the TCPStore the members' data planes meet on (handed out in
        every RunRefit); ``grace``: how long a failed refit waits for further failures to
        arrive, so that the cause (a disconnect) is named before its symptoms (peers' errors)."""
        self.store_host, self.store_port = store_host, store_port
        self.default_timeout, self.grace = default_timeout, grace
        self.workers: dict[str, Worker] = {}
        self.plans: dict[str, PlanEntry] = {}
        self._plan_keys: dict[tuple, asyncio.Future] = {}
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        self._runs: dict[str, _Run] = {}
        self._waiters: set[asyncio.Future] = set()
        self._watchers: list[tuple[str, asyncio.Queue]] = []
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ workers
    def register(self, info: pb.WorkerInfo, send: Callable, task: asyncio.Task | None) -> Worker:
        spec, layout = check_registration(info, self._specs)
        check_group_role(self.workers, info)
        w = Worker(info, uuid.uuid4().hex[:12], spec, layout, send, task, version=info.version, stale=info.stale)
        old = self.workers.get(w.worker_id)
        if old is not None:
            log.info("%s re-registered (session %s replaces %s)", w.worker_id, w.session, old.session)
            old.replaced = True
            self.disconnected(old, "replaced by a new registration")
            if old.task is not None and old.task is not task:
                old.task.cancel()
        self.workers[w.worker_id] = w
        log.info("registered %s %s %s on %s (pid %d)", w.role, w.worker_id, layout.describe(), info.host, info.pid)
        self._notify()
        return w

    def disconnected(self, w: Worker, why: str = "its stream ended") -> None:
        if not w.connected:
            return
        w.connected = False
        run = self._runs.get(w.busy)
        w.busy = ""
        if run is not None:
            self._resolve(run, w, pb.WorkerResult(outcome=pb.WORKER_OUTCOME_DISCONNECTED, error=f"disconnected: {why}"))
        log.warning("%s disconnected: %s", w.worker_id, why)
        self._notify()

    def result(self, w: Worker, res: pb.RunResult) -> None:
        if w.busy == res.refit_id:
            w.busy = ""
            self._notify()
        run = self._runs.get(res.refit_id)
        if run is None:
            log.info("%s: late result for refit %s (ok=%s)", w.worker_id, res.refit_id, res.ok)
            return
        outcome = pb.WORKER_OUTCOME_OK if res.ok else pb.WORKER_OUTCOME_ERROR
        self._resolve(run, w, pb.WorkerResult(outcome=outcome, bytes=res.bytes, seconds=res.seconds, error=res.error))

    def _resolve(self, run: _Run, w: Worker, res: pb.WorkerResult) -> None:
        if w.worker_id in run.results or run.by_id.get(w.worker_id) is not w:
            return
        res.worker_id, res.role, res.rank = w.worker_id, w.info.role, w.info.rank
        run.results[w.worker_id] = res
        run.done += 1
        if res.outcome != pb.WORKER_OUTCOME_OK:
            run.failed = True
        if run.wake is not None and not run.wake.done() and (run.failed or run.done == len(run.members)):
            run.wake.set_result(None)
        if self._watchers:
            self._publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_WORKER_DONE, refit_id=run.refit_id,
                                        plan_id=run.entry.plan_id, version=run.version, done=run.done,
                                        total=len(run.members), worker=res))

    def list_workers(self, group: str = "", role: int = pb.ROLE_UNSPECIFIED) -> list[pb.WorkerStatus]:
        ws = sorted(self.workers.values(), key=lambda w: (w.info.group, w.info.rank))
        return [w.status() for w in ws if (not group or w.info.group == group) and (not role or w.info.role == role)]

    # ------------------------------------------------------------------ plans
    async def create_plan(self, src_group: str, dst_group: str, opts: pb.PlanOptions) -> tuple[PlanEntry, bool]:
        from planners import PLANNERS, make_plan

        if not src_group or not dst_group:
            raise RefitError("src_group and dst_group are required")
        if opts.placement not in PLACEMENTS:
            raise RefitError(f"unknown placement {opts.placement}")
        planner = opts.planner or "p2p"
        if planner not in PLANNERS:
            raise RefitError(f"unknown planner {planner!r}: {', '.join(PLANNERS)}")
        src = group_members(self.workers, src_group, pb.ROLE_TRAINER)
        dst = group_members(self.workers, dst_group, pb.ROLE_ENGINE)
        check_same_model(src[0], dst[0])
        spec = src[0].spec
        bucket = opts.bucket_bytes or DEFAULT_BUCKET_BYTES
        key = (src_group, dst_group, src[0].info.model_name, src[0].info.model_config_json,
               src[0].layout_str, dst[0].layout_str, PLACEMENTS[opts.placement], planner, bucket)
        cached = key in self._plan_keys
        if not cached:
            self._plan_keys[key] = asyncio.ensure_future(asyncio.to_thread(
                make_plan, spec, src[0].layout, dst[0].layout, PLACEMENTS[opts.placement], planner, bucket))
        try:
            result = await asyncio.shield(self._plan_keys[key])
        except RefitError:
            self._plan_keys.pop(key, None)
            raise
        plan_id = _plan_id(result.plan.plan_id, src_group, dst_group)
        if plan_id not in self.plans:
            members = tuple(w.worker_id for w in src + dst)
            self.plans[plan_id] = PlanEntry(plan_id, result.plan, result.summary, src_group, dst_group,
                                            plan_json(result.plan), members)
            log.info("plan %s: %s -> %s, %d transfers", plan_id, src_group, dst_group, len(result.plan.transfers))
        return self.plans[plan_id], cached

    def get_plan(self, plan_id: str) -> PlanEntry:
        if not plan_id:
            raise RefitError("plan_id is required")
        entry = self.plans.get(plan_id)
        if entry is None:
            raise NotFound(f"unknown plan {plan_id!r}")
        return entry

    # ------------------------------------------------------------------ refits
    async def refit(self, plan_id: str, version: int, timeout: float) -> pb.RefitResponse:
        if version <= 0:
            raise RefitError("version must be > 0")
        if timeout < 0:
            raise RefitError(f"timeout_seconds must be >= 0, got {timeout}")
        entry = self.get_plan(plan_id)
        self._check_version(entry, version)
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.default_timeout)
        refit_id = f"{plan_id[:8]}-{next(self._ids)}"

        def fail(outcomes: dict[str, pb.WorkerResult]) -> pb.RefitResponse:
            return self._failed(entry, refit_id, version, t0, outcomes)

        absent = self._absent(entry)
        if absent:
            return fail(absent)
        if not await self._wait_free(entry, deadline):
            busy = {w: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_BUSY, error=f"still running refit {self.workers[w].busy}")
                    for w in entry.members if self.workers[w].busy}
            return fail(busy or self._absent(entry))
        absent = self._absent(entry)
        if absent:
            return fail(absent)
        self._check_version(entry, version)
        members = [self.workers[m] for m in entry.members]
        self._check_members(entry, members)
        run = _Run(refit_id, entry, version, members)
        for w in members:
            w.busy = refit_id
            run.by_id[w.worker_id] = w
            if w.info.role == pb.ROLE_ENGINE:
                w.stale = True
        self._runs[refit_id] = run
        try:
            await self._dispatch(run, deadline)
            results = await self._collect(run, deadline)
        finally:
            del self._runs[refit_id]
        return await self._finish(run, t0, results)

    def _check_version(self, entry: PlanEntry, version: int) -> None:
        held = [(entry.version, f"plan {entry.plan_id}")]
        held += [(self.workers[m].version, m) for m in entry.members[entry.num_src:] if m in self.workers]
        top, who = max(held)
        if version <= top:
            raise Precondition(f"version {version} is not above {top}, the version {who} holds; versions must increase")

    @staticmethod
    def _check_members(entry: PlanEntry, members: list[Worker]) -> None:
        """Workers re-registered since the plan was made must still hold what it was made for."""
        plan = entry.plan
        for i, w in enumerate(members):
            want = plan.src_layout if i < entry.num_src else plan.dst_layout
            if w.layout_str != want or w.info.model_digest != plan.model_digest:
                raise Precondition(f"plan {entry.plan_id} was made for {want} of model {plan.model_digest}; "
                                   f"{w.worker_id} now holds {w.layout_str} of {w.info.model_digest}: create a new plan")

    def _absent(self, entry: PlanEntry) -> dict[str, pb.WorkerResult]:
        return {m: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_NOT_CONNECTED, error="not connected")
                for m in entry.members if m not in self.workers or not self.workers[m].connected}

    async def _wait_free(self, entry: PlanEntry, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        while not all(m in self.workers and not self.workers[m].busy for m in entry.members):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return False
            finally:
                self._waiters.discard(fut)
        return True

    async def _dispatch(self, run: _Run, deadline: float) -> None:
        entry = run.entry
        sessions = tuple(w.session for w in run.members)
        if entry.broken or sessions != entry.sessions:
            entry.generation += 1
            entry.sessions, entry.broken = sessions, False
        prefix = f"{entry.plan_id}/{entry.generation}/"
        remaining = deadline - time.monotonic()
        # Members give up a little before we do, so that one blocked on a hung peer reports that peer.
        member_timeout = max(0.0, remaining - min(0.5, 0.2 * remaining))
        run.member_deadline = time.monotonic() + member_timeout
        sends = []
        for i, w in enumerate(run.members):
            rdv = pb.Rendezvous(host=self.store_host, port=self.store_port, prefix=prefix,
                                world_size=len(run.members), rank=i)
            if prefix not in w.sent_prefixes:
                rdv.members.extend(entry.members)  # names for error messages, once per generation
                w.sent_prefixes.add(prefix)
            msg = pb.CoordinatorMessage(run=pb.RunRefit(
                refit_id=run.refit_id, plan_id=entry.plan_id, version=run.version, timeout_seconds=member_timeout,
                rendezvous=rdv, plan_json=b"" if entry.plan_id in w.sent_plans else entry.plan_json))
            w.sent_plans.add(entry.plan_id)
            sends.append(self._send(run, w, msg))
        await asyncio.gather(*sends)
        self._publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_STARTED, refit_id=run.refit_id, plan_id=entry.plan_id,
                                    version=run.version, total=len(run.members)))

    async def _send(self, run: _Run, w: Worker, msg: pb.CoordinatorMessage) -> None:
        try:
            await w.send(msg)
        except Exception as e:  # the stream broke under us: the worker is gone
            self.disconnected(w, f"send failed: {e}")

    async def _collect(self, run: _Run, deadline: float) -> dict[str, pb.WorkerResult]:
        loop = asyncio.get_running_loop()
        limit, total, graced = deadline, len(run.members), False
        while run.done < total:
            if run.failed and not graced:
                graced = True
                now = time.monotonic()
                # Failures at the members' own timeout are symptoms of a hung member: wait for the
                # deadline to name it.  Earlier failures (a death, an error): a short grace.
                if now < run.member_deadline - 0.05:
                    limit = min(deadline, now + self.grace)
            left = limit - time.monotonic()
            if left <= 0:
                break
            run.wake = loop.create_future()  # one future, woken by _resolve: O(1) per result
            await asyncio.wait((run.wake,), timeout=left)
        timed_out = time.monotonic() >= deadline - 1e-3
        out = {}
        for wid in run.by_id:
            if wid in run.results:
                out[wid] = run.results[wid]
            elif timed_out:
                out[wid] = pb.WorkerResult(outcome=pb.WORKER_OUTCOME_TIMED_OUT,
                                           error="no result within the timeout")
            else:
                out[wid] = pb.WorkerResult(outcome=pb.WORKER_OUTCOME_UNSPECIFIED,
                                           error="still running when the refit failed")
        return out

    async def _finish(self, run: _Run, t0: float, results: dict[str, pb.WorkerResult]) -> pb.RefitResponse:
        entry = run.entry
        if any(r.outcome != pb.WORKER_OUTCOME_OK for r in results.values()):
            resp = self._failed(entry, run.refit_id, run.version, t0, results)
            outcome = pb.Outcome(refit_id=run.refit_id, committed=False, version=run.version, error=resp.error)
            targets = run.members
        else:
            entry.version = run.version
            for w in run.members[entry.num_src:]:
                w.version, w.stale = run.version, False
            resp = self._response(entry, run.refit_id, run.version, t0, results, pb.REFIT_STATUS_OK, "")
            outcome = pb.Outcome(refit_id=run.refit_id, committed=True, version=run.version)
            targets = run.members[entry.num_src:]
        msg = pb.CoordinatorMessage(outcome=outcome)
        # Off the caller's path: the response does not wait for the engines to hear the outcome.
        for w in targets:
            if w.connected:
                asyncio.ensure_future(self._send(run, w, msg))
        self._publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_FINISHED, refit_id=run.refit_id, plan_id=entry.plan_id,
                                    version=run.version, done=run.done, total=len(run.members), result=resp))
        return resp

    def _failed(self, entry: PlanEntry, refit_id: str, version: int, t0: float,
                results: dict[str, pb.WorkerResult]) -> pb.RefitResponse:
        entry.broken = True
        touched = any(r.outcome not in (pb.WORKER_OUTCOME_NOT_CONNECTED, pb.WORKER_OUTCOME_BUSY)
                      for r in results.values())
        if touched:  # some member ran: the engines' weights may be half written
            for m in entry.members[entry.num_src:]:
                if m in self.workers:
                    self.workers[m].stale = True
        bad = sorted((r for r in results.items() if r[1].outcome != pb.WORKER_OUTCOME_OK),
                     key=lambda kv: (SEVERITY.index(kv[1].outcome), entry.members.index(kv[0])))
        names = "; ".join(f"{wid} {_OUTCOME_TEXT[r.outcome]}: {r.error}" for wid, r in bad)
        error = f"refit {refit_id} of plan {entry.plan_id} (version {version}) failed: {names}"
        log.warning("%s", error)
        full = {m: results.get(m, pb.WorkerResult(outcome=pb.WORKER_OUTCOME_UNSPECIFIED, error="not started"))
                for m in entry.members}
        return self._response(entry, refit_id, version, t0, full, pb.REFIT_STATUS_FAILED, error)

    def _response(self, entry: PlanEntry, refit_id: str, version: int, t0: float,
                  results: dict[str, pb.WorkerResult], status: int, error: str) -> pb.RefitResponse:
        workers = []
        for m in entry.members:
            r = results[m]
            if not r.worker_id:
                group, _, rank = m.rpartition("/")
                r.worker_id, r.rank = m, int(rank)
                r.role = pb.ROLE_TRAINER if group == entry.src_group else pb.ROLE_ENGINE
            workers.append(r)
        received = sum(r.bytes for r in workers if r.role == pb.ROLE_ENGINE)
        return pb.RefitResponse(refit_id=refit_id, plan_id=entry.plan_id, version=version, status=status,
                                error=error, seconds=time.monotonic() - t0, total_bytes=received, workers=workers)

    # ------------------------------------------------------------------ events
    def watch(self, plan_id: str, maxsize: int = 10_000) -> asyncio.Queue:
        if plan_id:
            self.get_plan(plan_id)
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self._watchers.append((plan_id, q))
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers = [(p, w) for p, w in self._watchers if w is not q]

    def _publish(self, event: pb.RefitEvent) -> None:
        if not self._watchers:
            return
        event.unix_time = time.time()
        for plan_id, q in list(self._watchers):
            if plan_id and plan_id != event.plan_id:
                continue
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a watcher that does not read loses its stream, not our memory
                self.unwatch(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)  # tells the stream to end (RESOURCE_EXHAUSTED)
                log.warning("dropping a WatchRefits stream that fell %d events behind", q.maxsize)

    def _notify(self) -> None:
        """Wake refits waiting for busy or absent workers (cheap when none wait: the common case)."""
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()


_OUTCOME_TEXT = {pb.WORKER_OUTCOME_DISCONNECTED: "disconnected", pb.WORKER_OUTCOME_TIMED_OUT: "timed out",
                 pb.WORKER_OUTCOME_NOT_CONNECTED: "not connected", pb.WORKER_OUTCOME_BUSY: "busy",
                 pb.WORKER_OUTCOME_ERROR: "error", pb.WORKER_OUTCOME_UNSPECIFIED: "abandoned",
                 pb.WORKER_OUTCOME_OK: "ok"}


def _plan_id(plan_hash: str, src_group: str, dst_group: str) -> str:
    """Control-plane id of (plan, groups): two engine groups of one layout share a plan hash."""
    import hashlib

    return hashlib.sha256(f"{plan_hash}:{src_group}:{dst_group}".encode()).hexdigest()[:16]
