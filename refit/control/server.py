"""`refit serve`: the coordinator as a gRPC server (grpc.aio, one event loop).

This module serves the gRPC service (`refit.control.servicer`: what each call does with its
request, status codes, the rendezvous store the workers' data planes meet on) with the
bearer-token interceptor and the health service, and is `refit serve`'s command line.  What a
refit does is in `refit.control.coordinator`.  Requests larger than `MAX_REQUEST_BYTES` are
refused by gRPC before they are read in full (RESOURCE_EXHAUSTED).

What protects what.  With a token, every gRPC call needs it, the rendezvous store's included:
the store is part of this service, not a port of its own, so a process without the token can
neither list, read nor write a key of any refit.  Its keys live under a random 128-bit prefix
per plan generation, told to members over their streams; values read from it are plain data,
never unpickled.  Traffic is not encrypted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from typing import Any, Callable

import grpc

from refit import settings
from refit.control.auth import TokenInterceptor
from refit.control.common import (DEFAULT_PORT, KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, SERVICE_NAME, new_event_loop,
                                  server_options)
from refit.control.coordinator import Coordinator
from refit.control.coordinator_state import DROP_AFTER
from refit.control.servicer import MAX_TIMEOUT, Servicer, method_handlers
from refit.entrypoint import run_main, setup_logging
from refit.errors import InvalidInput

log = logging.getLogger(__name__)


class CoordinatorServer:
    """The coordinator, its gRPC server (the rendezvous store's calls included) and health service."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
                 default_timeout: float = 60.0, grace: float = 0.25, advertise_host: str | None = None,
                 keepalive_ms: int = KEEPALIVE_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS,
                 drop_after: float | None = DROP_AFTER) -> None:
        """``advertise_host``: unused (it placed a separate rendezvous store, now part of the
        gRPC service); accepted for compatibility.  ``drop_after``: `Coordinator`'s."""
        if drop_after is not None and not 0 <= drop_after <= MAX_TIMEOUT:
            raise InvalidInput(f"--drop-engines-after must be a number of seconds in [0, {MAX_TIMEOUT:g}], "
                               f"got {drop_after}")
        self.drop_after = drop_after
        self.host, self.port, self.token = host, port, token
        self.advertise_host = advertise_host or host
        if not 0 < default_timeout <= MAX_TIMEOUT:  # 0 would fail every refit that gives none, at once
            raise InvalidInput(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {default_timeout}")
        self.options = server_options(keepalive_ms, keepalive_timeout_ms)
        self.default_timeout, self.grace = default_timeout, grace
        self.server: grpc.aio.Server | None = None
        self.coord: Coordinator | None = None

    async def start(self) -> int:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self.coord = Coordinator(self.default_timeout, self.grace, self.drop_after)
        interceptors = [TokenInterceptor(self.token)] if self.token else []
        self.server = grpc.aio.server(options=self.options, interceptors=interceptors)
        handlers = method_handlers(Servicer(self.coord))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise InvalidInput(f"cannot listen on {self.host}:{self.port}: address in use (another coordinator?) "
                             f"or not an address of this host")
        self.port = bound
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("refit coordinator on %s:%d%s", self.host, self.port, " (token required)" if self.token else "")
        return self.port

    async def stop(self, grace: float | None = 1.0) -> None:
        """End the refits (their callers answered FAILED, naming the stop), sends and rendezvous
        waits still under way, then stop serving (calls under way get ``grace`` seconds: time for
        those answers to go out)."""
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
        if self.coord is not None:
            await self.coord.close()
        if self.server is not None:
            await self.server.stop(grace)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class ThreadedServer:
    """A coordinator on a background thread with its own event loop — for tests and benches."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("port", 0)
        self.server = CoordinatorServer(**kwargs)
        self.loop = new_event_loop()
        started = threading.Event()
        self._error: BaseException | None = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as e:  # surfaced by the constructor
                self._error = e
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, name="refit-coordinator", daemon=True)
        self.thread.start()
        started.wait()
        if self._error:
            raise self._error

    @property
    def address(self) -> str:
        return self.server.address

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the coordinator's loop and return its result (to inspect state safely)."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def read_token(args: argparse.Namespace) -> str | None:
    """The token: --token-file, else $REFIT_TOKEN, else --token (visible to every local user in
    /proc/PID/cmdline: prefer the other two).  Refused unless every client can send it (printable
    ASCII, no space: it travels in a gRPC header)."""
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise InvalidInput(f"--token-file {args.token_file}: {e.strerror}") from None
        if not token:
            raise InvalidInput(f"--token-file {args.token_file} is empty")
        return _sendable(token, f"--token-file {args.token_file}")
    if settings.current().token:
        return _sendable(settings.current().token, "$REFIT_TOKEN")
    return _sendable(args.token, "--token") if args.token else None


def _sendable(token: str, source: str) -> str:
    if not all("!" <= c <= "~" for c in token):
        raise InvalidInput(f"{source}: the token holds a character no client can send in its gRPC header (space, "
                           f"newline, non-ASCII): use printable ASCII without spaces")
    return token


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535; argparse names the option on refusal (exit 2)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: 0 (any free one) to 65535")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `refit serve` (also for a subparser of refit/cli.py)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks one)")
    p.add_argument("--token-file", help="require `authorization: Bearer TOKEN` on every call, TOKEN read from this "
                   "file; or set $REFIT_TOKEN")
    p.add_argument("--token", help="the token on the command line (visible to other users in the process list: "
                   "prefer $REFIT_TOKEN or --token-file)")
    p.add_argument("--advertise-host", help=argparse.SUPPRESS)  # placed the old separate rendezvous store: unused
    p.add_argument("--timeout", type=float, default=60.0, help="refit timeout when a request gives none (seconds)")
    p.add_argument("--drop-engines-after", type=float, default=DROP_AFTER, metavar="SECONDS",
                   help=f"an engine replica of an elastic group (dense vLLM dp replicas) gone this long is left out "
                        f"of its plans' refits, which run for the replicas still there (default {DROP_AFTER:g}; "
                        f"docs/control-plane.md 'Engines that join and leave')")
    p.add_argument("-v", "--verbose", action="store_true", help="log registrations, plans and refits")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refit serve", description="Run the refit coordinator (gRPC control plane).")
    add_arguments(p)
    return p


async def serve(host: str, port: int, token: str | None, timeout: float, advertise_host: str | None = None,
                drop_after: float | None = DROP_AFTER) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully.  The signals are handled on the event
    loop: a KeyboardInterrupt raised wherever the main thread happens to be can land inside one of
    grpc's callbacks, which swallows it, and the server would serve on."""
    server = CoordinatorServer(host, port, token, timeout, advertise_host=advertise_host, drop_after=drop_after)
    bound = await server.start()
    print(f"refit coordinator listening on {host}:{bound}", file=sys.stderr, flush=True)
    loop, stopping = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    # shielded: cancelling grpc's wait_for_termination() (timeout None) cancels the server's own
    # shutdown future, and its stop() then raised CancelledError (exit 1 on every SIGTERM)
    waits = [asyncio.ensure_future(stopping.wait()),
             asyncio.shield(server.server.wait_for_termination())]  # type: ignore[union-attr]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop()
    if stopping.is_set():
        log.info("refit coordinator stopped by a signal")


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Let the tasks the server left (a stream handler whose client hung up during the stop's
    grace) end before the loop closes, as `asyncio.run` does: closed under a pending handler,
    grpc logged its ``GeneratorExit`` traceback to stderr on an otherwise clean stop."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)

    def run() -> int:
        token = read_token(args)
        if token is None and (args.token == "" or settings.token_set_empty()):
            log.warning("an empty token was given (%s): this coordinator requires NO token; anyone who reaches its "
                        "port can register workers and drive refits",
                        "--token ''" if args.token == "" else "REFIT_TOKEN=")
        loop = new_event_loop()
        try:
            loop.run_until_complete(serve(args.host, args.port, token, args.timeout, args.advertise_host,
                                          args.drop_engines_after))
        finally:
            _drain(loop)
            loop.close()
        return 0

    return run_main(run, "refit serve")


if __name__ == "__main__":
    sys.exit(serve_main())
