"""A coordinator in this process when none is configured: one RL job on one host needs no `refit
serve` of its own.

Trainer attaches (`refit.integrations.hf` / `fsdp` / `megatron`) and the vLLM backend call
`coordinator_for` with the address they were given.  Given one (or ``REFIT_ADDRESS``), that is the
coordinator.  Given none, the coordinator is the loopback default, ``127.0.0.1:50051`` — and the
first of them to find nobody serving there serves it, from a background thread of its own process,
for as long as that process lives (logged at INFO).  Every other piece of the job (an engine's
workers, other trainer ranks, the RL loop's `refit.Client`) reaches the same default without being
told.  Whoever binds the port first wins; a loser of that race uses the winner's.

A shared coordinator (several jobs, several hosts, engines that outlive the trainer process) is
still `refit serve` and an address: the embedded one goes when its process does.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading

from refit import settings
from refit.control.common import DEFAULT_PORT

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_lock = threading.Lock()
_server = None  # the ThreadedServer this process serves, once it serves one


def coordinator_for(address: str | None, token: str | None = None) -> str | None:
    """The coordinator to register with: ``address`` or ``REFIT_ADDRESS`` when set (returned as
    given); else the loopback default, served by this process if nobody serves it yet."""
    global _server
    if address or settings.current().address:
        return address
    default = f"{HOST}:{DEFAULT_PORT}"
    with _lock:
        if _server is not None or _listening(HOST, DEFAULT_PORT):
            return default
        from refit.control.server import ThreadedServer

        try:
            server = ThreadedServer(host=HOST, port=DEFAULT_PORT, token=token or settings.current().token or None)
        except Exception as e:  # noqa: BLE001 - the port was taken meanwhile (another process won): use theirs
            log.debug("embedded coordinator not started (%s: %s): using %s", type(e).__name__, e, default)
            return default
        _server = server
        atexit.register(server.stop)
    log.info("no coordinator configured (address or REFIT_ADDRESS): this process serves one at %s for the job "
             "on this host; run `refit serve` and give its address for shared, multi-job or multi-host setups",
             default)
    return default


def serving() -> bool:
    """Whether this process serves the embedded coordinator."""
    return _server is not None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
