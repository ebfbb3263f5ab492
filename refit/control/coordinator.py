"""The coordinator: running a refit across its members, on the registrations and cached plans of
`refit.control.coordinator_state`.

Everything here runs on one asyncio event loop, so state changes need no locks (heavy work —
building a registration's model spec, planning — runs on threads).  A refit of a plan:

1. refuse an unknown plan (`NotFound`) or a version at or below what the engines hold
   (`Precondition`) — except the two idempotent cases: the version of the refit of this plan under
   way (the caller *joins* it and gets its response) and the version this plan committed last while
   its engines still hold it (the committed response again);
2. one refit of a plan at a time, end to end: a later version waits (within its timeout) for the
   one under way to end, then is checked again;
3. fail at once (FAILED, nothing touched) when a member is not connected; wait, within the timeout,
   for members still busy with a refit of another plan, or still silent after an earlier failure;
4. mark members busy and the engines stale, open the generation's rendezvous space
   (`refit.control.rendezvous`), send every member ``RunRefit`` with a timeout a little shorter
   than ours, so that a member blocked on a hung peer reports *which* peer before we give up;
5. collect results: all OK → commit the version to the engines; the first failure → wait a short
   grace for the rest (a killed process shows up both as its own disconnect and as its peers'
   errors; the disconnect is the cause and is named first), then report FAILED, abort the
   rendezvous space (members still waiting in it for a peer leave at once) and tell the members
   to abandon it; the next refit meets under a new prefix.  Past the timeout, members without a
   result are TIMED_OUT, and named before members that reported errors (theirs are the symptoms).
   A refit that failed before some member reached the start barrier moved nothing (the barrier
   needs every member): the engines keep the version and staleness they had.

A member stays busy until the refit has ended *and* it answered (or left): a refit never starts on
a worker that may still be writing a previous one, and an outcome only ever applies to its refit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import Any

from refit.control.common import Precondition
from refit.control.coordinator_state import DROP_AFTER, CoordinatorState
from refit.control.refits import (FAILED, Run, busy_results, commands, delta_fallback, failed_response, response,
                                  stopped_response, verify_checksums)
from refit.control.registry import MAX_VERSION, absent_members, check_plan_members, check_version, holds_version
from refit.control.rendezvous import RendezvousStore
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.timeline import mark

log = logging.getLogger(__name__)


class Coordinator(CoordinatorState):
    """Runs refits on the workers and plans of `CoordinatorState` (see the module docstring)."""

    def __init__(self, default_timeout: float = 60.0, grace: float = 0.25, drop_after: float | None = DROP_AFTER) -> None:
        """``grace``: how long a failed refit waits for further failures to arrive, so that the
        cause (a disconnect) is named before its symptoms (peers' errors).  ``drop_after``: how long
        an engine of an elastic group may be gone before its plans' refits run without its replica
        (`refit.control.membership`; None: never)."""
        super().__init__(drop_after)
        self.default_timeout, self.grace = default_timeout, grace
        self.store = RendezvousStore()  # where members' data planes meet (the Store* calls)
        self._tasks: set[asyncio.Task] = set()  # refits and sends under way (see _spawn)
        self._ids = itertools.count(1)
        self.epoch = secrets.token_hex(3)  # refit ids differ across coordinator restarts

    async def refit(self, plan_id: str, version: int, timeout: float, atomic: bool = False,
                    verify: bool = False, delta: bool = False) -> pb.RefitResponse:
        """Run plan ``plan_id`` for ``version`` (see the module docstring).  ``atomic``: all or none
        across the engines (`_switch`); ``verify``: compare both ends' checksum of every transfer;
        ``delta``: trainers send only what changed since what they last sent, where every engine
        holds exactly that (`refits.delta_fallback` says when not)."""
        mark("coordinator: Refit received")
        if not 0 < version <= MAX_VERSION:
            raise InvalidInput(f"version must be in [1, {MAX_VERSION}], got {version}")
        if timeout < 0:
            raise InvalidInput(f"timeout_seconds must be >= 0, got {timeout}")
        entry = self.get_plan(plan_id)
        if atomic:
            self._check_stages(entry)
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.default_timeout)
        while True:  # no await between these checks and the reservation below
            run = entry.running
            if run is not None and run.version == version:
                return await self._join(run, deadline, t0)
            behind = self._behind(entry, version) if run is None else frozenset()
            if behind:  # replicas that joined (or came back) after the plan committed this version
                break
            done = entry.committed
            if done is not None and done.version == version and holds_version(self.workers, entry, version):
                return done
            if run is not None and version < run.version:
                raise Precondition(f"version {version} is below {run.version}, which refit {run.refit_id} "
                                   f"of plan {entry.plan_id} is running; versions must increase")
            check_version(self.workers, entry, version)
            if run is None:
                break
            await asyncio.wait((run.ended,), timeout=max(0.0, deadline - time.monotonic()))
            if not run.ended.done():
                return failed_response(entry, f"{plan_id[:8]}-{self.epoch}-{next(self._ids)}", version, t0,
                                       busy_results(entry, run.refit_id))
        run = entry.running = Run(f"{plan_id[:8]}-{self.epoch}-{next(self._ids)}", entry, version, t0,
                                  asyncio.get_running_loop().create_future(), atomic=atomic, verify=verify,
                                  catch_up=behind or None, delta=delta)
        if behind:
            log.info("refit %s of plan %s: catching replicas %s up to version %d", run.refit_id, plan_id,
                     sorted(behind), version)
        run.ended.add_done_callback(lambda f: f.cancelled() or f.exception())  # joiners may be none
        # Not in the caller's task: a caller gone (RPC cancelled) must not cut the refit short for all.
        self._spawn(self._own(run, deadline))
        return await asyncio.shield(run.ended)

    async def check(self, plan_id: str, timeout: float) -> pb.RefitResponse:
        """Compare what the plan's engines hold now with the trainers' weights (the Check call):
        members checksum their tensors, nothing moves; after a refit of the plan under way."""
        if timeout < 0:
            raise InvalidInput(f"timeout_seconds must be >= 0, got {timeout}")
        entry = self.get_plan(plan_id)
        t0 = time.monotonic()
        deadline = t0 + (timeout or self.default_timeout)
        while entry.running is not None:
            await asyncio.wait((entry.running.ended,), timeout=max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                running = entry.running.refit_id if entry.running else "?"
                return failed_response(entry, f"{plan_id[:8]}-{self.epoch}-{next(self._ids)}", entry.version, t0,
                                       busy_results(entry, running))
        run = Run(f"{plan_id[:8]}-{self.epoch}-{next(self._ids)}-check", entry, entry.version, t0,
                  asyncio.get_running_loop().create_future(), verify=True, check=True)
        return await self._run(run, deadline)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)  # held until it ends: the loop keeps only weak references
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _own(self, run: Run, deadline: float) -> None:
        """Run ``run`` to its end; ``run.ended`` gets its response (or exception) for every caller."""
        try:
            run.ended.set_result(await self._run(run, deadline))
        except Exception as e:
            run.ended.set_exception(e)
        except BaseException:  # the coordinator is closing: its callers are told so (not cancelled)
            run.ended.set_result(stopped_response(run))
            raise
        finally:  # before any caller resumes (they wake on the next loop iteration)
            run.entry.running = None
            self._notify()

    async def _join(self, run: Run, deadline: float, t0: float) -> pb.RefitResponse:
        """Wait for the refit under way for the same version and answer with its response."""
        await asyncio.wait((run.ended,), timeout=max(0.0, deadline - time.monotonic()))
        if run.ended.done():
            return run.ended.result()  # raises as the refit itself did
        results = busy_results(run.entry, run.refit_id)
        error = f"refit {run.refit_id} of plan {run.entry.plan_id} (version {run.version}) did not end within the timeout"
        return response(run.entry, run.refit_id, run.version, t0, results, pb.REFIT_STATUS_FAILED, error)

    async def _run(self, run: Run, deadline: float) -> pb.RefitResponse:
        entry = run.entry
        while True:
            # An elastic plan's members change only here, once the members of its last run are free.
            if entry.dst_shape and not await self._wait_free(entry, deadline):
                return self._busy_response(run)
            if entry.dst_shape:
                failed = await self._take_view(run, deadline)
                if failed is not None:
                    return failed
            absent = absent_members(self.workers, entry)
            if absent:
                return failed_response(entry, run.refit_id, run.version, run.t0, absent)
            if not await self._wait_free(entry, deadline):
                return self._busy_response(run)
            if not entry.dst_shape or not self._view_moved(run):
                break
        absent = absent_members(self.workers, entry)
        if absent:
            return failed_response(entry, run.refit_id, run.version, run.t0, absent)
        if run.atomic:
            self._check_stages(entry)
        if not run.check and not run.catch_up:
            check_version(self.workers, entry, run.version)  # an engine may have re-registered meanwhile
        members = [self.workers[m] for m in entry.members]
        check_plan_members(entry, members)
        run.reserve(members)
        self._runs[run.refit_id] = run
        try:
            mark("coordinator: dispatching")
            await self._dispatch(run, deadline)
            mark("coordinator: dispatched")
            results = await self._collect(run, deadline)
            mark("coordinator: every result in")
        finally:
            del self._runs[run.refit_id]
        return await self._finish(run, results, deadline)

    def _busy_response(self, run: Run) -> pb.RefitResponse:
        entry = run.entry
        busy = {m: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_BUSY, error=f"still running refit {self.workers[m].busy}")
                for m in entry.members if m in self.workers and self.workers[m].busy}
        return failed_response(entry, run.refit_id, run.version, run.t0, busy or absent_members(self.workers, entry))

    async def _dispatch(self, run: Run, deadline: float) -> None:
        entry = run.entry
        sessions = tuple(w.session for w in run.members)
        rebuilt = entry.broken or sessions != entry.sessions or not entry.prefix
        if run.delta:
            run.delta_fallback = delta_fallback(run, rebuilt, self.workers)
            run.delta_base = not run.delta_fallback
        if rebuilt:
            entry.generation += 1
            entry.sessions, entry.broken = sessions, False
            if entry.prefix:
                self.store.drop(entry.prefix, f"plan {entry.plan_id} moved on to generation {entry.generation}")
            # Unguessable: only members (told over the authenticated stream) can name the keys.
            entry.prefix = f"{secrets.token_hex(16)}/{entry.generation}/"
            self.store.open(entry.prefix)
        remaining = deadline - time.monotonic()
        # Members give up a little before we do, so that one blocked on a hung peer reports that peer.
        member_timeout = max(0.0, remaining - min(0.5, 0.2 * remaining))
        run.member_deadline = time.monotonic() + member_timeout
        sends = [self._spawn(self._send(w, msg)) for w, msg in commands(run, member_timeout)]
        if not run.check:  # the events are those of refits
            self.events.publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_STARTED, refit_id=run.refit_id,
                                              plan_id=entry.plan_id, version=run.version, total=len(run.members)))
        # A stopped worker's full flow-control window blocks the write until keepalive drops it: _collect names it.
        await asyncio.wait(sends, timeout=max(0.0, deadline - time.monotonic()))

    async def _collect(self, run: Run, deadline: float) -> dict[str, pb.WorkerResult]:
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
            run.wake = loop.create_future()  # one future, woken by Run.resolve: O(1) per result
            await asyncio.wait((run.wake,), timeout=left)
        return run.final_results(timed_out=time.monotonic() >= deadline - 1e-3)

    async def _finish(self, run: Run, results: dict[str, pb.WorkerResult], deadline: float) -> pb.RefitResponse:
        entry = run.entry
        verified = 0
        if run.verify and all(r.outcome == pb.WORKER_OUTCOME_OK for r in results.values()):
            verified, mismatches = await asyncio.to_thread(verify_checksums, run)
            for wid, res in mismatches.items():
                res.worker_id, res.role, res.rank = wid, results[wid].role, results[wid].rank
                res.bytes, res.seconds = results[wid].bytes, results[wid].seconds
                results[wid] = res
        if run.check:
            return self._checked(run, results, verified)
        if any(r.outcome != pb.WORKER_OUTCOME_OK for r in results.values()):
            resp = failed_response(entry, run.refit_id, run.version, run.t0, results)
            # Members still waiting in the rendezvous for a peer that failed leave now, not at
            # the deadline; whatever the space holds is half a set-up (and a communicator may be
            # mid-collective): the next refit starts over.
            self.store.abort(entry.prefix, resp.error[:1024])
            entry.broken = True
            run.settle(committed=False, registered=self.workers)
            entry.delta_version = FAILED  # the trainers' record of what landed may be ahead of the engines
            outcome = pb.Outcome(refit_id=run.refit_id, committed=False, version=run.version, error=resp.error[:4096],
                                 untouched=run.untouched)
            targets = run.members
        else:
            entry.version = run.version
            run.settle(committed=True, registered=self.workers)
            resp = response(entry, run.refit_id, run.version, run.t0, results, pb.REFIT_STATUS_OK, "")
            resp.verified_transfers = verified
            if run.delta and not run.catch_up:  # a catch-up's members are built again for the next refit
                entry.delta_version, entry.delta_generation = run.version, entry.generation
            if run.delta:
                resp.delta.CopyFrom(run.delta_stats)
                resp.delta_fallback = run.delta_fallback or run.delta_stats.fallback
            if not run.catch_up:  # a catch-up brings replicas to the version committed already
                entry.committed = resp
            outcome = pb.Outcome(refit_id=run.refit_id, committed=True, version=run.version)
            targets = run.members[entry.num_src:]
        log.info("refit %s of plan %s (version %d): %s in %.3f s, %d bytes", run.refit_id, entry.plan_id, run.version,
                 "committed" if resp.status == pb.REFIT_STATUS_OK else "failed", resp.seconds, resp.total_bytes)
        run.free_answered()
        msg = pb.CoordinatorMessage(outcome=outcome)
        # Engines hear the outcome before the caller does (sent, not acknowledged); a stalled
        # stream cannot hold the response up past the deadline (the RPC's own has 50 ms more).
        if run.atomic and outcome.committed:
            resp = await self._switch(run, msg, resp, deadline)
        else:
            sends = [self._spawn(self._send(w, msg)) for w in targets if w.connected]
            if sends:
                await asyncio.wait(sends, timeout=min(1.0, max(0.02, deadline - time.monotonic())))
        mark("coordinator: outcome sent")
        resp.atomic = run.atomic
        self.events.publish(pb.RefitEvent(kind=pb.RefitEvent.KIND_FINISHED, refit_id=run.refit_id,
                                          plan_id=entry.plan_id, version=run.version, done=run.done,
                                          total=len(run.members), result=resp))
        return resp

    def _checked(self, run: Run, results: dict[str, pb.WorkerResult], verified: int) -> pb.RefitResponse:
        """The end of a Check: members that answered are free; nothing to commit or abandon."""
        run.free_answered()
        self._notify()
        if any(r.outcome != pb.WORKER_OUTCOME_OK for r in results.values()):
            return failed_response(run.entry, run.refit_id, run.version, run.t0, results)
        log.info("check %s of plan %s: %d transfers equal at both ends", run.refit_id, run.entry.plan_id, verified)
        resp = response(run.entry, run.refit_id, run.version, run.t0, results, pb.REFIT_STATUS_OK, "")
        resp.verified_transfers = verified
        return resp

    async def _switch(self, run: Run, msg: pb.CoordinatorMessage, resp: pb.RefitResponse,
                      deadline: float) -> pb.RefitResponse:
        """The second half of an atomic refit: every engine staged the version; tell them all to
        switch and wait for each to answer (`switched`).  An engine that cannot (its switch raised,
        it left, it did not answer in time) is stale, and the refit fails naming it; the others
        hold the new version (a switch is a local copy: the one step after which no failure can
        be undone)."""
        entry = run.entry
        engines = run.members[entry.num_src:]
        self._switching[run.refit_id] = run
        run.wake = asyncio.get_running_loop().create_future()
        try:
            for w in engines:
                if w.connected:
                    self._spawn(self._send(w, msg))
                else:
                    run.switched[w.worker_id] = pb.Switched(refit_id=run.refit_id, ok=False, error="disconnected")
            if len(run.switched) < len(engines):
                # a switch is a copy of the engine's shard: at least a few seconds, past a deadline nearly spent
                await asyncio.wait((run.wake,), timeout=max(5.0, deadline - time.monotonic()))
        finally:
            del self._switching[run.refit_id]
        failed = {w.worker_id: run.switched.get(w.worker_id, pb.Switched(ok=False, error="no answer to the switch"))
                  for w in engines if not run.switched.get(w.worker_id, pb.Switched()).ok}
        if not failed:
            return resp
        for w in engines:
            if w.worker_id in failed:  # torn: stale, at the version it held before (as it reports itself)
                w.version, w.stale = run.version_before.get(w.worker_id, w.version), True
        names = "; ".join(f"{wid}: {s.error}" for wid, s in failed.items())
        error = (f"refit {run.refit_id} of plan {entry.plan_id} committed version {run.version}, but "
                 f"{len(failed)} engine(s) did not switch to it and hold torn weights (stale): {names}")
        log.warning("%s", error)
        entry.committed = None
        for r in resp.workers:
            if r.worker_id in failed:
                r.outcome, r.error = pb.WORKER_OUTCOME_ERROR, f"switch: {failed[r.worker_id].error}"[:4096]
        resp.status, resp.error = pb.REFIT_STATUS_FAILED, error
        return resp

    async def close(self) -> None:
        """End what is still under way (refits, sends, waits for busy members): the server stopped."""
        self._notify()
        self.store.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
