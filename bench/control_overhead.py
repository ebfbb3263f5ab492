"""Coordination overhead of one Refit: the control plane alone, no bytes moved.

A coordinator (`refit serve`, its own process), N registered workers (N/2 trainer ranks of
megatron:tp1dp{N/2} and N/2 engine ranks of vllm:tp1dp{N/2} of a tiny model, spread over a few
agent processes, every agent with its own stream and the no-op data plane), and a client that
runs Refit(plan_id) back to back.  Each refit is the full protocol: RunRefit to every member,
every member's result, the engines' commit.  With the no-op data plane the plan's contents do not
matter (the plan is sent to each worker once, at the first refit, which is a warm-up and not
timed).  Reported: the client's round trip and the coordinator's own time per refit.

    PYTHONPATH=. python bench/control_overhead.py --workers 64 --refits 500
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-llama"


def agents_main(address: str, role: str, group: str, ranks: list[int], layout: str, ready: "mp.Queue",
                stop: "mp.Event") -> None:
    """One process hosting several agents (each its own thread, event loop and stream)."""
    sys.path.insert(0, ROOT)
    from refit.control.agent import EngineAgent, TrainerAgent
    from refit.control.dataplane import NoopDataPlane
    from tests.harness.tiny import tiny_spec

    spec = tiny_spec(MODEL)
    cls = TrainerAgent if role == "trainer" else EngineAgent
    agents = [cls(address, group=group, rank=r, spec=spec, layout=layout, data_plane=NoopDataPlane()).start()
              for r in ranks]
    ready.put(len(agents))
    stop.wait()
    for a in agents:
        a.stop()


def _cpu(*pids: int) -> float:
    """User + system CPU seconds of processes (and their threads) so far."""
    import psutil

    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=64, help="registered workers, half trainers, half engines")
    p.add_argument("--refits", type=int, default=500)
    p.add_argument("--procs", type=int, default=4, help="agent processes (the workers are spread over them)")
    args = p.parse_args()
    half = args.workers // 2
    sys.path.insert(0, ROOT)
    from refit.control.client import Client

    server = subprocess.Popen([sys.executable, "-c", "import sys; from refit.control.server import serve_main; "
                               "sys.exit(serve_main(['--port', '0']))"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)})
    ctx = mp.get_context("spawn")
    procs = []
    try:
        address = server.stderr.readline().strip().rsplit(" ", 1)[1]
        ready, stop = ctx.Queue(), ctx.Event()
        per = max(1, args.procs // 2)
        for role, group, layout in (("trainer", "trainer", f"megatron:tp1dp{half}"), ("engine", "engine", f"vllm:tp1dp{half}")):
            for i in range(per):
                ranks = list(range(i, half, per))
                procs.append(ctx.Process(target=agents_main, args=(address, role, group, ranks, layout, ready, stop)))
        for pr in procs:
            pr.start()
        registered = sum(ready.get(timeout=120) for _ in procs)
        client = Client(address)
        plan = client.create_plan("trainer", "engine")
        for v in range(1, 6):  # warm-up: plans sent, channels hot
            client.refit(plan["plan_id"], version=v)
        cpu0 = _cpu(server.pid), _cpu(*(pr.pid for pr in procs)), time.process_time()
        rtt, coord = [], []
        for v in range(6, 6 + args.refits):
            t0 = time.perf_counter()
            r = client.refit(plan["plan_id"], version=v)
            rtt.append(time.perf_counter() - t0)
            coord.append(r.seconds)
        cpu1 = _cpu(server.pid), _cpu(*(pr.pid for pr in procs)), time.process_time()
        per = [1e3 * (b - a) / args.refits for a, b in zip(cpu0, cpu1)]
        ms = lambda xs, q: 1e3 * percentile(xs, q)  # noqa: E731
        print(f"workers {registered} ({half} trainers + {half} engines over {len(procs)} agent processes), "
              f"{args.refits} refits, {os.cpu_count()} cores")
        print(f"client round trip   median {ms(rtt, 0.5):6.2f} ms   p99 {ms(rtt, 0.99):6.2f} ms")
        print(f"coordinator time    median {ms(coord, 0.5):6.2f} ms   p99 {ms(coord, 0.99):6.2f} ms")
        print(f"CPU per refit: coordinator {per[0]:.2f} ms, all agents {per[1]:.2f} ms, client {per[2]:.2f} ms "
              f"(mean round trip {1e3 * statistics.mean(rtt):.2f} ms)")
        stop.set()
        client.close()
    finally:
        for pr in procs:
            pr.join(10)
            if pr.is_alive():
                pr.kill()
        server.terminate()
        server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
