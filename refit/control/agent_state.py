"""What an agent shares with the threads of its host process, apart from the stream.

An agent reads its stream on the agents' event loop (`refit.control.common.agent_loop`), while its
host (a vLLM worker's engine thread) announces the refit it is about to drive and waits for that
refit's outcome.  These three pieces cross between the two, each woken rather than polled:

* `Holding` — the one record of what the worker's weights are (version, staleness), which a host
  carries over to the next agent of the same weights when it registers again;
* `Outcomes` — the last outcomes the agent heard, by refit id, for host threads to wait on;
* `Expectation` — the refit (plan, version) the host expects, set from its thread and awaited on
  the loop by the stream reader before it runs a command.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass


@dataclass
class Holding:
    """The version of the weights a worker holds, and whether they are stale (partly written by a
    refit that did not commit, or being written now).  ``pinned``: stale whatever outcomes say, until
    the host says a refit landed whole (`landed`): its weights are torn although the coordinator may
    have committed.  ``landed_refit``: the last refit the host finished landing (a commit of that
    refit again moved nothing new)."""

    version: int = 0
    stale: bool = False
    pinned: bool = False
    landed_refit: str = ""

    def pin_stale(self) -> None:
        self.pinned = self.stale = True

    def landed(self, refit_id: str) -> None:
        """Refit ``refit_id`` committed and landed whole here."""
        self.pinned = self.stale = False
        self.landed_refit = refit_id


@dataclass(frozen=True)
class Outcome:
    """How a refit ended, as the coordinator told this agent."""

    committed: bool
    error: str = ""
    untouched: bool = False  # failed before any byte moved

    @property
    def moved_nothing(self) -> bool:
        return not self.committed and self.untouched


class Outcomes:
    """The outcomes an agent heard, by refit id (the last `KEEP`).  Written on the agents' loop,
    waited on by host threads (a `threading.Condition`: woken as each one arrives)."""

    KEEP = 64

    def __init__(self) -> None:
        self._heard: dict[str, Outcome] = {}
        self._cond = threading.Condition()

    def add(self, refit_id: str, outcome: Outcome) -> None:
        with self._cond:
            self._heard[refit_id] = outcome
            while len(self._heard) > self.KEEP:
                self._heard.pop(next(iter(self._heard)))
            self._cond.notify_all()

    def wait(self, refit_id: str, timeout: float) -> Outcome | None:
        """The outcome of ``refit_id``, waiting up to ``timeout`` seconds for it; None if none came."""
        with self._cond:
            self._cond.wait_for(lambda: refit_id in self._heard, timeout)
            return self._heard.get(refit_id)


class Expectation:
    """The refit ``(plan id, version)`` a host expects, or None.  Set from any thread; awaited on an
    event loop by one reader at a time (an agent's stream reader), which `set` wakes through that
    loop's ``call_soon_threadsafe``: asyncio's own objects are touched on their loop only."""

    def __init__(self) -> None:
        self.value: tuple[str, int] | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def set(self, value: tuple[str, int] | None) -> None:
        self.value = value  # before reading the waiter: `until` stores its waiter before it reads this
        waiter = self._waiter
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
                waiter[0].call_soon_threadsafe(waiter[1].set)

    async def until(self, value: tuple[str, int], timeout: float) -> bool:
        """Whether ``value`` is (or becomes, within ``timeout`` seconds) the one expected."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        self._waiter = (loop, changed)
        end = loop.time() + timeout
        try:
            while True:
                changed.clear()  # before reading: a `set` from now on wakes the wait below
                if self.value == value:
                    return True
                left = end - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
        finally:
            self._waiter = None
