"""One refit as the coordinator tracks it (`Run`), and how its outcome becomes a `RefitResponse`.
Pure bookkeeping on protobuf messages: no I/O, no event loop (failures are logged)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Mapping

from refit.control.common import role_of
from refit.control.registry import PlanEntry, Worker
from refit.control.v1 import refit_pb2 as pb
from refit.sides import Side

log = logging.getLogger("refit.control.coordinator")  # a refit's story reads in one logger

# Worst first: the cause of a failure before its consequences.  A member that never answered
# (TIMED_OUT) ranks above members that reported an error: when one member hangs, its peers
# report their own timeouts, and the silent one is the cause.
SEVERITY = [pb.WORKER_OUTCOME_DISCONNECTED, pb.WORKER_OUTCOME_TIMED_OUT, pb.WORKER_OUTCOME_NOT_CONNECTED,
            pb.WORKER_OUTCOME_BUSY, pb.WORKER_OUTCOME_ERROR, pb.WORKER_OUTCOME_UNSPECIFIED]
OUTCOME_TEXT = {pb.WORKER_OUTCOME_DISCONNECTED: "disconnected", pb.WORKER_OUTCOME_TIMED_OUT: "timed out",
                pb.WORKER_OUTCOME_NOT_CONNECTED: "not connected", pb.WORKER_OUTCOME_BUSY: "busy",
                pb.WORKER_OUTCOME_ERROR: "error", pb.WORKER_OUTCOME_UNSPECIFIED: "abandoned",
                pb.WORKER_OUTCOME_OK: "ok"}


@dataclass(eq=False)
class Run:
    """A refit of one plan for one version, from its reservation to its response.  ``ended``
    resolves with the response: callers asking for the same version join it."""

    refit_id: str
    entry: PlanEntry
    version: int
    t0: float
    ended: asyncio.Future
    members: list[Worker] = field(default_factory=list)
    results: dict[str, pb.WorkerResult] = field(default_factory=dict)
    by_id: dict[str, Worker] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)  # members whose own answer (or disconnect) arrived
    done: int = 0
    member_deadline: float = 0.0
    failed: bool = False
    before_start: bool = False  # a member failed before the start barrier: nothing moved
    stale_before: dict[str, bool] = field(default_factory=dict)  # engines' staleness before this refit
    version_before: dict[str, int] = field(default_factory=dict)  # engines' versions before this refit
    dispatched: bool = False
    wake: asyncio.Future | None = None
    atomic: bool = False  # all or none: engines stage, and switch only once every member succeeded
    verify: bool = False  # members checksum every transfer (`verify_checksums`)
    check: bool = False  # Check: members checksum their tensors as they are; nothing moves, nothing commits
    checksums: dict[str, dict[int, int]] = field(default_factory=dict)  # verify: by member, by transfer
    switched: dict[str, pb.Switched] = field(default_factory=dict)  # atomic: engines' answers to the commit
    catch_up: frozenset[int] | None = None  # a catch-up of an elastic plan: the replicas it brings to its version
    delta: bool = False  # asked for a delta refit
    delta_base: bool = False  # trainers may start from what they last sent (`delta_fallback` says why not)
    delta_fallback: str = ""
    delta_stats: pb.DeltaStats = field(default_factory=pb.DeltaStats)  # summed over the trainers' results

    def resolve(self, w: Worker, res: pb.WorkerResult) -> bool:
        """Record a member's result (the first one counts); True when it was new."""
        if w.worker_id in self.results or self.by_id.get(w.worker_id) is not w:
            return False
        res.worker_id, res.role, res.rank = w.worker_id, w.info.role, w.info.rank
        self.results[w.worker_id] = res
        self.done += 1
        if res.outcome != pb.WORKER_OUTCOME_OK:
            self.failed = True
        if self.wake is not None and not self.wake.done() and (self.failed or self.done == len(self.members)):
            self.wake.set_result(None)
        return True

    def reserve(self, members: list[Worker]) -> None:
        """These workers run this refit: busy with it, and its engines stale while it runs (their
        weights may be half written; not in an atomic refit: they stage, and serve what they held
        until the switch), what they held remembered (`settle`)."""
        self.members = members
        for w in members:
            w.busy = self.refit_id
            self.by_id[w.worker_id] = w
            if w.role is Side.ENGINE:
                self.stale_before[w.worker_id] = w.stale
                self.version_before[w.worker_id] = w.version
                w.stale = w.stale or not (self.atomic or self.check)

    def settle(self, committed: bool, registered: Mapping[str, Worker]) -> None:
        """What each engine of this refit holds once it ended — the one place that decides it.
        Committed: the new version, whole.  Failed before any byte moved (`before_start`), or an
        atomic refit failed (nothing live was written): what it held before.  Failed after: stale,
        also under a registration that replaced it meanwhile (``registered``: the coordinator's
        workers by id), until a refit lands whole."""
        engines = self.members[self.entry.num_src:]
        if committed:
            for w in engines:
                w.version, w.stale = self.version, False
        elif self.untouched:
            for w in engines:
                w.stale = self.stale_before.get(w.worker_id, w.stale)
        else:
            for w in engines + [registered[m] for m in self.entry.members[self.entry.num_src:] if m in registered]:
                w.stale = True

    def free_answered(self) -> None:
        """Members that answered are free; a silent one stays busy until it answers or leaves."""
        for w in self.members:
            if w.busy == self.refit_id and w.worker_id in self.answered:
                w.busy = ""

    @property
    def untouched(self) -> bool:
        """Whether a failure of this refit left every engine's live weights as they were."""
        return self.before_start or self.atomic

    def final_results(self, timed_out: bool) -> dict[str, pb.WorkerResult]:
        """Every member's result; those without one timed out, or were abandoned after a failure."""
        out = {}
        for wid in self.by_id:
            if wid in self.results:
                out[wid] = self.results[wid]
            elif timed_out:
                out[wid] = pb.WorkerResult(outcome=pb.WORKER_OUTCOME_TIMED_OUT, error="no result within the timeout")
            else:
                out[wid] = pb.WorkerResult(outcome=pb.WORKER_OUTCOME_UNSPECIFIED,
                                           error="still running when the refit failed")
        return out


def response(entry: PlanEntry, refit_id: str, version: int, t0: float, results: dict[str, pb.WorkerResult],
             status: int, error: str) -> pb.RefitResponse:
    workers = []
    for m in entry.members:
        r = results[m]
        if not r.worker_id:
            group, _, rank = m.rpartition("/")
            r.worker_id, r.rank = m, int(rank)
            r.role = role_of(Side.TRAINER if group == entry.src_group else Side.ENGINE)
        workers.append(r)
    received = sum(r.bytes for r in workers if r.role == role_of(Side.ENGINE))
    return pb.RefitResponse(refit_id=refit_id, plan_id=entry.plan_id, version=version, status=status,
                            error=error, seconds=time.monotonic() - t0, total_bytes=received, workers=workers)


def commands(run: Run, member_timeout: float) -> list[tuple[Worker, pb.CoordinatorMessage]]:
    """The ``RunRefit`` each member of ``run`` is sent; a member is sent the plan and the members'
    names (for its error messages) once per plan and generation."""
    entry, out = run.entry, []
    for i, w in enumerate(run.members):
        rdv = pb.Rendezvous(prefix=entry.prefix, world_size=len(run.members), rank=i)
        if entry.prefix not in w.sent_prefixes:
            rdv.members.extend(entry.members)
            w.sent_prefixes = {entry.prefix}
        out.append((w, pb.CoordinatorMessage(run=pb.RunRefit(
            refit_id=run.refit_id, plan_id=entry.plan_id, version=run.version, timeout_seconds=member_timeout,
            rendezvous=rdv, plan_json=b"" if w.sent_plans.get(entry.plan_id) == entry.plan.plan_hash else entry.plan_json,
            atomic=run.atomic, verify=run.verify, check_only=run.check, delta=run.delta,
            delta_base=run.delta_base))))
        w.sent_plans[entry.plan_id] = entry.plan.plan_hash
    return out


FAILED = -1  # `PlanEntry.delta_version` after a failed refit


def delta_fallback(run: Run, rebuilt: bool, workers: Mapping[str, Worker]) -> str:
    """Why a delta refit must send in full (empty: trainers may start from what they last sent,
    which every engine holds exactly).  Anything that may have changed an engine's bytes since the
    last delta refit of the plan committed, or emptied a trainer's record of them, is a reason."""
    entry = run.entry
    if not entry.delta_version:
        return "no delta refit of this plan has committed yet (this one sends in full and keeps what it sends)"
    if entry.delta_version == FAILED:
        return "the last refit of this plan failed (the trainers may have kept what no engine holds)"
    if entry.delta_version != entry.version:
        return f"the last refit of this plan (version {entry.version}) was not a delta refit"
    if rebuilt or entry.delta_generation != entry.generation:
        return "the plan's members were built again (a worker registered again, or a refit failed)"
    if run.catch_up:
        return "replicas are catching up to the plan's version"
    for m in entry.members[entry.num_src:]:
        w = workers.get(m)
        if w is None or not w.info.takes_delta:
            return f"{m} re-processes what it receives (WorkerInfo.takes_delta is false)"
        stale, version = run.stale_before.get(m, w.stale), run.version_before.get(m, w.version)  # before this refit
        if stale or version != entry.delta_version:
            return f"{m} holds version {version}{' (stale)' if stale else ''}, " \
                   f"not {entry.delta_version}, which the trainers last sent"
    return ""


def add_delta(total: pb.DeltaStats, one: pb.DeltaStats) -> None:
    """``total += one``: every count field summed (as the proto declares them), the first
    fallback reason kept."""
    for f in pb.DeltaStats.DESCRIPTOR.fields:
        if f.name == "fallback":
            total.fallback = total.fallback or one.fallback
        else:
            setattr(total, f.name, getattr(total, f.name) + getattr(one, f.name))


def busy_results(entry: PlanEntry, refit_id: str) -> dict[str, pb.WorkerResult]:
    """Every member of ``entry`` BUSY with refit ``refit_id`` (a caller's timeout ran out waiting)."""
    return {m: pb.WorkerResult(outcome=pb.WORKER_OUTCOME_BUSY, error=f"still running refit {refit_id}")
            for m in entry.members}


def verify_checksums(run: Run) -> tuple[int, dict[str, pb.WorkerResult]]:
    """Compare the two ends' checksums of every transfer of a verified refit: (transfers that
    matched, an ERROR result for the receiving member of each mismatch or missing checksum,
    naming the tensor, the box and both ranks; the first few per member)."""
    entry, plan = run.entry, run.entry.plan
    names = entry.members
    bad: dict[str, list[str]] = {}
    matched = 0
    for i, t in enumerate(plan.transfers):
        if t.stage != 1:
            continue
        sender, receiver = names[t.sender], names[entry.num_src + t.receiver]
        sent, got = run.checksums.get(sender, {}).get(i), run.checksums.get(receiver, {}).get(i)
        if sent is not None and sent == got:
            matched += 1
            continue
        box = ", ".join(f"{a}:{a + n}" for a, n in zip(t.start, t.size))
        what = "no checksum" if sent is None or got is None else f"checksum {got:#x} != sent {sent:#x}"
        bad.setdefault(receiver, []).append(f"{t.tensor}[{box}] from {sender} to {receiver}: {what}")
    out = {}
    for wid, lines in bad.items():
        more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
        out[wid] = pb.WorkerResult(outcome=pb.WORKER_OUTCOME_ERROR,
                                   error=f"verify: {len(lines)} transfer(s) differ: {'; '.join(lines[:3])}{more}")
    return matched, out


def stopped_response(run: Run) -> pb.RefitResponse:
    """FAILED because the coordinator stopped (SIGTERM) while ``run`` was under way: its callers
    are answered with that reason, not a cancelled call."""
    entry = run.entry
    error = (f"refit {run.refit_id} of plan {entry.plan_id} (version {run.version}) failed: the coordinator stopped "
             f"before it ended (engines may hold it in part, stale): refit again once a coordinator is back")
    full = {m: run.results.get(m, pb.WorkerResult(outcome=pb.WORKER_OUTCOME_UNSPECIFIED, error="coordinator stopped"))
            for m in entry.members}
    log.warning("%s", error)
    return response(entry, run.refit_id, run.version, run.t0, full, pb.REFIT_STATUS_FAILED, error)


def failed_response(entry: PlanEntry, refit_id: str, version: int, t0: float,
                    results: dict[str, pb.WorkerResult]) -> pb.RefitResponse:
    """FAILED, naming the members at fault, worst first (then in plan order); logged."""
    bad = sorted((r for r in results.items() if r[1].outcome != pb.WORKER_OUTCOME_OK),
                 key=lambda kv: (SEVERITY.index(kv[1].outcome), entry.members.index(kv[0])))
    names = "; ".join(f"{wid} {OUTCOME_TEXT[r.outcome]}: {r.error}" for wid, r in bad)
    error = f"refit {refit_id} of plan {entry.plan_id} (version {version}) failed: {names}"
    full = {m: results.get(m, pb.WorkerResult(outcome=pb.WORKER_OUTCOME_UNSPECIFIED, error="not started"))
            for m in entry.members}
    log.warning("%s", error)
    return response(entry, refit_id, version, t0, full, pb.REFIT_STATUS_FAILED, error)
