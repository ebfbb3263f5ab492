"""The floor under refit's control time: one gRPC unary round trip on loopback, back to back and
after the caller has been idle (an RL loop calls Refit between rollouts, never back to back).

Three servers, each answering the same way: grpc's own health service on a thread-pool server and
on a ``grpc.aio`` server (the coordinator's kind), and refit's coordinator itself answering
``Refit`` of an unknown plan (its whole request path, no worker).  For each, the median round trip
of ``--calls`` calls with a pause of 0, 2 and 20 ms before each.

    python3 bench/probes/grpc_idle_latency.py [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

GAPS_MS = (0, 2, 20)


def medians(call: Callable[[], object], calls: int) -> dict[str, float]:
    """Median round trip in microseconds per pause before each call (the first tenth is warm-up)."""
    out = {}
    for gap in GAPS_MS:
        times = []
        for _ in range(calls):
            if gap:
                time.sleep(gap / 1e3)
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[f"{gap} ms"] = round(statistics.median(times[calls // 10:]) * 1e6, 1)
    return out


def health_call(port: int) -> Callable[[], object]:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return lambda: stub.Check(health_pb2.HealthCheckRequest())


def thread_pool_server(calls: int) -> dict[str, float]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return medians(health_call(port), calls)
    finally:
        server.stop(0)


def aio_server(calls: int) -> dict[str, float]:
    """The server on an event loop of its own thread, as refit's coordinator runs in tests and
    benches; left to the daemon thread's end (stopping it across threads hung on one host)."""
    loop, ready, box = asyncio.new_event_loop(), threading.Event(), {}

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        box["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True).start()
    if not ready.wait(30):
        raise RuntimeError("the grpc.aio server did not start")
    return medians(health_call(box["port"]), calls)


def coordinator(calls: int) -> dict[str, float]:
    from refit.control.client import Client, ControlError
    from refit.control.server import ThreadedServer

    server = ThreadedServer()
    client = Client(server.address)

    def refit_unknown() -> None:
        try:
            client.refit("0" * 16, 1)
        except ControlError:  # PlanNotFound: the answer we time
            pass
    try:
        return medians(refit_unknown, calls)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="calls per server and pause (default 200)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    results = {"grpc health, thread-pool server": thread_pool_server(args.calls),
               "grpc health, grpc.aio server": aio_server(args.calls),
               "refit coordinator, Refit of an unknown plan": coordinator(args.calls)}
    if args.json:
        print(json.dumps({"grpc": grpc.__version__, "round_trip_us_by_pause": results}, indent=1))
        return
    print(f"grpc {grpc.__version__}; median round trip (us) after a pause of " + ", ".join(f"{g} ms" for g in GAPS_MS))
    for name, by_gap in results.items():
        print(f"  {name:45s} " + "  ".join(f"{v:8.0f}" for v in by_gap.values()))


if __name__ == "__main__":
    main()
