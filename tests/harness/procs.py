"""Small helpers the tests share for running things side by side: threads that hand back their
exceptions, and the stop-then-kill teardown of a spawned helper process driven over a pipe."""

from __future__ import annotations

import threading
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
