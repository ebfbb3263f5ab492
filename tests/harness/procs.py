"""Small helpers the tests share for running things side by side: threads that hand back their
exceptions, the stop-then-kill teardown of a spawned helper process driven over a pipe, waiting
for such a process's answer that fails at once when it dies (`await_answer`), its output kept in
a log file whose last lines a failure quotes (`spawn_logged`), and a fault that strikes a member
once the first phase of a refit landed (`AfterFirstPhase`)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from multiprocessing.connection import wait as _wait_any
from typing import Any, Callable


def together(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run every function on its own thread; each result, or the exception it raised."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # handed back to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


class ProcessDied(AssertionError):
    """A helper process ended (killed, crashed) before it answered.  An AssertionError, as a timeout
    is: the tests and `PipedProcess.close` treat both alike."""


LOG_LINES = 40  # of a dead or silent process's log, quoted in the failure


def log_tail(path: str | None, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of the log file ``path`` ("" when there is none)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last {len(tail)} lines of {path} ---\n" + "\n".join(tail)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _died(proc: Any, what: str, log: str | None) -> ProcessDied:
    """The failure for ``proc`` having ended before it answered ``what``, with its log's last lines."""
    proc.join(5)
    return ProcessDied(f"{what}: the process died ({_exit_text(proc.exitcode)}) before it answered" + log_tail(log))


def await_answer(conn: Any, proc: Any, timeout: float, what: str, log: str | None = None) -> None:
    """Wait until ``conn`` (a pipe to the spawned ``proc``) has something to read; fail at once,
    naming how it ended and quoting its log's last lines, when ``proc`` dies first (it watches
    the process's sentinel with the pipe: no waiting out ``timeout`` for a dead engine), and fail
    after ``timeout`` seconds of silence.  A message sent just before the process exited counts."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready = _wait_any([conn, proc.sentinel], max(0.0, left))
        if conn in ready or conn.poll(0):
            return
        if proc.sentinel in ready:
            raise _died(proc, what, log)
        if left <= 0:
            raise AssertionError(f"{what}: no answer within {timeout:.0f} s" + log_tail(log))


def recv_answer(conn: Any, proc: Any, timeout: float, what: str, log: str | None = None) -> Any:
    """`await_answer`, then the message; a pipe closed by the dying process (EOF) fails as its
    death does."""
    await_answer(conn, proc, timeout, what, log)
    try:
        return conn.recv()
    except EOFError:
        raise _died(proc, what, log) from None


class WarmContext:
    """A multiprocessing context whose processes start with torch and vLLM already imported: they
    fork from a server process (``forkserver``) that imported them once (`tests.harness.warm_preload`),
    where ``spawn`` imports them again in every process.  Each process gets the environment its
    parent has when it starts it (as with ``spawn``), not the server's."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["tests.harness.warm_preload"])

    def Pipe(self, duplex: bool = True) -> Any:  # noqa: N802 - multiprocessing's name
        return self._ctx.Pipe(duplex)

    def Event(self) -> Any:  # noqa: N802
        return self._ctx.Event()

    def Process(self, target: Callable[..., Any], args: tuple[Any, ...] = (), daemon: bool | None = None) -> Any:  # noqa: N802
        return self._ctx.Process(target=_in_environment, args=(dict(os.environ), target, *args), daemon=daemon)


def _in_environment(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


@functools.lru_cache(maxsize=None)
def warm_context() -> WarmContext:
    """The one `WarmContext` of a test run (its server starts with the first process)."""
    return WarmContext()


def _logged_main(log: str, main: Callable[..., Any], *args: Any) -> None:
    """A spawned process's target: its stdout and stderr (and its own children's: vLLM's workers)
    into the file ``log``, then ``main(*args)``."""
    import sys

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main(*args)


_LOG_DIR: str | None = None


def new_log(prefix: str) -> str:
    """A fresh log file's path, in one temporary directory per test run."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = tempfile.mkdtemp(prefix="refit-test-logs-")
    fd, path = tempfile.mkstemp(prefix=f"{prefix}-", suffix=".log", dir=_LOG_DIR)
    os.close(fd)
    return path


def spawn_logged(ctx: Any, main: Callable[..., Any], args: tuple[Any, ...], prefix: str,
                 daemon: bool | None = None) -> tuple[Any, str]:
    """Start ``ctx.Process(target=main, args=args)`` with its output in a log file of its own
    (`new_log`); returns (the started process, the log's path) for `await_answer`."""
    log = new_log(prefix)
    p = ctx.Process(target=_logged_main, args=(log, main, *args), daemon=daemon)
    p.start()
    return p, log


class PipedProcess:
    """A spawned process (``self.proc``) that answers ``ask(cmd)`` over a pipe and stops on "stop"."""

    proc: Any
    stop_timeout, join_timeout = 10.0, 5.0  # seconds for its answer to "stop", then for it to exit

    def ask(self, cmd: str, arg: Any = None, timeout: float = 30.0) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Ask it to stop; kill it if it does not."""
        if self.proc.is_alive():
            try:
                self.ask("stop", timeout=self.stop_timeout)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(self.join_timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


# processes whose exit nobody waits for, each with the thread that reaps it (`reap_later`)
_exiting: list[tuple[Any, threading.Thread]] = []


def reap_later(proc: Any, timeout: float = 60.0) -> None:
    """Let ``proc``, which sent its last answer, finish exiting while the run goes on (a vLLM engine
    takes 1-4 s to tear itself down after it left the coordinator): a thread of its own joins it,
    and kills it if it is still there after ``timeout`` seconds; `reap_all` waits at the end."""
    _exiting[:] = [(p, t) for p, t in _exiting if t.is_alive()]
    t = threading.Thread(target=_reap, args=(proc, timeout), daemon=True)
    t.start()
    _exiting.append((proc, t))


def _reap(proc: Any, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def reap_all(timeout: float = 30.0) -> None:
    """Wait for every process handed to `reap_later`; kill those still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while _exiting:
        proc, t = _exiting.pop()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():  # its thread is still joining it: the kill ends that join
            proc.kill()
            t.join(15)


def stop_then_reap(proc: Any, stop: Callable[[], Any]) -> None:
    """The teardown of a process that answers "stop" once it no longer holds anything the next test
    may meet (its agents left the coordinator): ``stop()`` asks and waits for that answer; a process
    that does not give it is killed; either way its exit goes on beside the run (`reap_later`)."""
    if not proc.is_alive():
        return
    try:
        stop()
    except (AssertionError, OSError, EOFError):
        proc.kill()
    reap_later(proc)


def strike_self(sig: int) -> None:
    """Send ``sig`` (SIGKILL, SIGSTOP) to this process *through the calling thread*: it takes effect
    before the call returns.  ``os.kill(os.getpid(), SIGSTOP)`` from a thread other than the main
    one does not: the main thread starts the group stop once it runs, and on a loaded machine the
    caller went on through two more phases of a refit before it stopped."""
    signal.pthread_kill(threading.get_ident(), sig)


class AfterFirstPhase:
    """A `refit.control.dataplane.PhaseHook` that strikes this process once the first phase of a
    refit has landed on every member: the data plane calls ``landed`` after the phase's end
    barrier (every member finished writing it, none started the next; for an unphased plan that
    is the whole plan, before this member answers).  It wraps the member's own hook (an engine's
    landing), which runs first; then it sets ``entered`` and acts, once:

    * ``"kill"`` / ``"stop"``: SIGKILL / SIGSTOP this process (`strike_self`: no sleep, no race;
      the fault is in the member's share, between the phase that landed and the next);
    * ``"hold"``: block here (``hold`` seconds) for the test to kill the process from outside.

    Install it for one refit by setting ``ctx.phase_hook`` before the data plane runs."""

    ACTIONS = ("kill", "stop", "hold")

    def __init__(self, inner: Any, entered: Any, action: str, hold: float = 120.0) -> None:
        if action not in self.ACTIONS:
            raise ValueError(f"action must be one of {self.ACTIONS}, not {action!r}")
        self.inner, self.entered, self.action, self.hold = inner, entered, action, hold
        self.fired = False

    def check(self, plan: Any) -> None:
        if self.inner is not None:
            self.inner.check(plan)

    def landed(self, plan: Any, phase: int) -> None:
        if self.inner is not None:
            self.inner.landed(plan, phase)
        if self.fired:
            return
        self.fired = True
        self.entered.set()
        if self.action in ("kill", "stop"):
            strike_self(signal.SIGKILL if self.action == "kill" else signal.SIGSTOP)
        elif self.action == "hold":
            time.sleep(self.hold)
