"""A coordinator on loopback and a client of it, and the teardown of what tests start around it.

`loopback` is the pair the integration tests build (a `ThreadedServer` on a free port, a `Client`
of it; the client closed, then the server stopped).  tests/conftest.py turns it into the shared
fixtures ``server`` (one per test module, default timeout from ``coordinator_timeout``) and
``make_coordinator`` (a factory, everything it made closed after the test).  `close_all` is the
teardown of a cluster: its worker processes, then the client and the server."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from refit.control.client import Client
from refit.control.server import ThreadedServer


@contextlib.contextmanager
def loopback(**server_kw: Any) -> Iterator[tuple[ThreadedServer, Client]]:
    """A coordinator on loopback and a client of it: ``(server, client)``.  ``server_kw`` goes to
    `ThreadedServer` (``default_timeout``, ``token``, ``keepalive_ms``, ...)."""
    server = ThreadedServer(**server_kw)
    try:
        client = Client(server.address)
    except BaseException:
        server.stop()
        raise
    try:
        yield server, client
    finally:
        close_all([], client, server)


def close_all(things: Iterable[Any], client: Client | None = None, server: ThreadedServer | None = None) -> None:
    """Close each of ``things`` (worker processes: their ``close()``), then ``client``, then stop
    ``server``: every one of them even if an earlier one raised; the first error is raised at the
    end."""
    steps = [t.close for t in things] + ([client.close] if client is not None else []) \
        + ([server.stop] if server is not None else [])
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - the rest still close; raised below
            first = first or e
    if first is not None:
        raise first
