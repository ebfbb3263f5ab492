"""A slower wire for the bench (``refit-bench --wire-gbps G``): what a refit does where the wire,
not memory, is the limit — trainers and engines on different hosts, 25–50 GB/s per GPU instead of
NVLink's hundreds — measured on one machine.

`Throttled` wraps a member's communicator: every step takes at least its larger direction's bytes
over G GB/s, counted from its post (the member sleeps out the rest after the real transfer).  Both
ends of a step hold the same bytes, so both wait alike; a full and a delta refit are held to the
same rate.  An emulation, said so in the report: the real wire still runs underneath, so a step is
never faster than the real one either.
"""

from __future__ import annotations

import time
from typing import Any

from refit.executor.transports import Comm, SendRecv


class Throttled:
    def __init__(self, inner: Comm, gbps: float) -> None:
        self.inner, self.rate = inner, gbps * 1e9

    def post(self, sends: SendRecv, recvs: SendRecv) -> Any:
        nbytes = max(sum(b.numel() * b.element_size() for _, _, b in sends),
                     sum(b.numel() * b.element_size() for _, _, b in recvs))
        return self.inner.post(sends, recvs), time.perf_counter() + nbytes / self.rate

    def wait(self, handle: Any, timeout_s: float) -> None:
        inner, until = handle
        self.inner.wait(inner, timeout_s)
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def check(self) -> None:
        self.inner.check()

    def stuck(self) -> str:
        return self.inner.stuck()

    def close(self) -> None:
        self.inner.close()
