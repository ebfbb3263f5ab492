"""Small helpers the tests share for running things side by side: threads that hand back their
exceptions, the stop-then-kill teardown of a spawned helper process driven over a pipe, and a
fault that strikes a member once the first phase of a refit landed (`AfterFirstPhase`)."""

from __future__ import annotations

import os
import signal
import threading
import time
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
