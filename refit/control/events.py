"""WatchRefits: the coordinator's progress events — refits, and workers joining and leaving —
fanned out to bounded per-watcher queues."""

from __future__ import annotations

import asyncio
import logging
import time

from refit.control.v1 import refit_pb2 as pb

log = logging.getLogger(__name__)


class EventHub:
    def __init__(self) -> None:
        self._watchers: list[tuple[str, asyncio.Queue]] = []

    def __bool__(self) -> bool:  # cheap test before building an event nobody reads
        return bool(self._watchers)

    def watch(self, plan_id: str, maxsize: int = 10_000) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self._watchers.append((plan_id, q))
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers = [(p, w) for p, w in self._watchers if w is not q]

    def publish(self, event: pb.RefitEvent) -> None:
        if not self._watchers:
            return
        event.unix_time = time.time()
        for plan_id, q in list(self._watchers):
            if plan_id and event.plan_id and plan_id != event.plan_id:  # membership (no plan) goes to all
                continue
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a watcher that does not read loses its stream, not our memory
                self.unwatch(q)
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(None)  # tells the stream to end (RESOURCE_EXHAUSTED)
                log.warning("dropping a WatchRefits stream that fell %d events behind", q.maxsize)
