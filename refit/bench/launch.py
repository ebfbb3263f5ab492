"""The parent of a run: starts one process per member, watches them, collects their results.

The parent hosts the rendezvous store (a ``TCPStore`` on an ephemeral port: no fixed ports, no
environment contract) and never touches a device.  It is also the watchdog that makes failures
fast and legible: the first worker that exits without reporting (killed, ``os._exit``, crash)
is named as the cause, the others get a moment to report what they saw, then every remaining
worker is killed.  A run with no progress for ``timeout`` seconds (and a grace for the workers to
report their own timeouts first) is killed the same way.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import multiprocessing as mp
import os
import signal
import time
import uuid
from multiprocessing.connection import wait
from typing import Any, Callable

import torch.distributed as dist

from refit import settings
from refit.bench.worker import Job, WorkerResult, worker_main
from refit.errors import RefitFailed

log = logging.getLogger("refit.bench")

GRACE_S = 1.0  # how long survivors may take to report after the first death
MAX_REPORTS = 4  # survivors' reports quoted in a failure message (the rest are echoes)


class WorkerFailure(RefitFailed):
    """A run failed; the message names the worker(s) that died first, then what others saw."""

    def __init__(self, message: str, dead: list[str]) -> None:
        super().__init__(message)
        self.dead = dead


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_job(job: Job, start_method: str | None = None,
            on_progress: Callable[[int, str], None] | None = None) -> list[WorkerResult]:
    """Run ``job`` on one process per member; return their results in member order, or raise
    `WorkerFailure`.

    Workers start from a *forkserver* that has imported torch and refit once: as cheap as fork
    (no per-worker ``import torch``), but forked from a process without threads — forking the
    parent itself, whose store server thread may hold a lock at fork time, can deadlock a child.
    ``REFIT_START_METHOD=spawn`` is the slow, most conservative alternative."""
    start_method = start_method or settings.current().start_method
    session = job.session or uuid.uuid4().hex[:12]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = dataclasses.replace(job, session=session, store_port=store.port)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, inherited by the forkserver and workers
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["refit.bench.worker"])
        _start_forkserver_outside_cwd()
    members = range(len(job.topology.members))
    names = [job.topology.describe_member(m) for m in members]
    procs, conns = [], []
    try:
        for m in members:
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(job, m, send_end), name=f"refit-{names[m]}", daemon=True)
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        return _watch(job, procs, conns, names, on_progress)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for path in glob.glob(f"/dev/shm/refit-{session}-*"):
            os.unlink(path)
        del store


def _start_forkserver_outside_cwd() -> None:
    """The forkserver runs ``python -c``, which puts the current directory first on its
    ``sys.path``: started from a folder that holds another ``refit/`` (a source checkout), every
    worker would import that one and die on its differences.  Start it from ``/`` instead; the
    workers need no relative paths (the job carries the model spec, shard files are absolute)."""
    from multiprocessing import forkserver

    cwd = os.getcwd()
    os.chdir("/")
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(cwd)


def _watch(job: Job, procs: list[Any], conns: list[Any], names: list[str],
           on_progress: Callable[[int, str], None] | None) -> list[WorkerResult]:
    results: dict[int, WorkerResult] = {}
    errors: dict[int, str] = {}
    last: dict[int, str] = {}
    open_conns = dict(enumerate(conns))
    failed_at: float | None = None
    progress_at = time.monotonic()

    def drain(m: int) -> None:
        nonlocal progress_at
        conn = open_conns[m]
        try:
            while conn.poll():
                kind, _, payload = conn.recv()
                progress_at = time.monotonic()
                if kind == "progress":
                    last[m] = payload
                    if on_progress:
                        on_progress(m, payload)
                elif kind == "result":
                    results[m] = payload
                else:
                    errors[m] = payload
        except (EOFError, OSError):
            del open_conns[m]

    while len(results) < len(procs):
        running = [p.sentinel for p in procs if p.exitcode is None]
        ready = wait(list(open_conns.values()) + running, timeout=0.2)
        for m in list(open_conns):
            if open_conns[m] in ready or procs[m].exitcode is not None:
                drain(m)
        dead = [m for m, p in enumerate(procs)  # gone without a word: the cause, not a symptom
                if p.exitcode is not None and m not in results and m not in errors and m not in open_conns]
        now = time.monotonic()
        if (dead or errors) and failed_at is None:
            failed_at = now
        if failed_at is not None and (now - failed_at > GRACE_S or all(p.exitcode is not None for p in procs)):
            raise _failure(procs, names, dead, errors, last)
        # Workers give up at their own deadline (``timeout_s`` after the step they last reported)
        # and say whom they waited on: GRACE_S more for that report before the watchdog speaks.
        if failed_at is None and now - progress_at > job.timeout_s + GRACE_S:
            waiting = [m for m in range(len(procs)) if m not in results]
            seen = "; ".join(f"{names[m]}: {last.get(m, 'nothing')}" for m in waiting)
            raise WorkerFailure(f"refit run made no progress for {job.timeout_s:.0f} s; still waiting on "
                                f"{', '.join(names[m] for m in waiting)} (last reports: {seen})", [])
    return [results[m] for m in range(len(procs))]


def _failure(procs: list[Any], names: list[str], dead: list[int], errors: dict[int, str],
             last: dict[int, str]) -> WorkerFailure:
    parts = []
    for m in dead:
        p = procs[m]
        parts.append(f"{names[m]} (pid {p.pid}) died ({_exit_text(p.exitcode)}) "
                     f"after reporting '{last.get(m, 'nothing')}'")
    head = "refit run failed: " + ("; ".join(parts) if parts else "a worker reported an error")
    if errors:
        dead_names = [names[m] for m in dead]
        # Reports that name a dead worker first: they say what it was doing when it went.
        order = sorted(errors, key=lambda m: (not any(f"with {n} " in errors[m] for n in dead_names), m))
        shown = [errors[m] for m in order][:MAX_REPORTS]
        more = len(errors) - len(shown)
        head += ". Reports from workers: " + " | ".join(shown) + (f" | ... and {more} more" if more else "")
    silent = [m for m, p in enumerate(procs) if m not in errors and m not in dead and p.exitcode is None]
    if silent and (dead or errors):
        head += ". Still running, no report: " + ", ".join(f"{names[m]} (last: '{last.get(m, 'nothing')}')" for m in silent)
    return WorkerFailure(head, [names[m] for m in dead])
