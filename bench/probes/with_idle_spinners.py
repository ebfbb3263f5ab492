"""Run a command while every CPU it may use runs a SCHED_IDLE spin loop, so no core ever halts.

Why: refit's control time per refit is a chain of thread wake-ups across processes (the caller's
gRPC call, the coordinator, each agent's loop and worker thread).  After an RL loop's pause each
wake-up costs a few hundred microseconds on the lent GPU host, and holding ``/dev/cpu_dma_latency``
at 0 µs did not change that (bench/RESULTS.md, case "Control-plane overhead"), so the cost is not deep
C-states.  On a virtual
machine a halted vCPU wakes through the hypervisor, which a guest's PM QoS cannot prevent.  A
SCHED_IDLE task never halts its core, and the scheduler treats a core running only SCHED_IDLE
tasks as idle when it places a woken thread (``sched_idle_cpu``), which then preempts the spinner
at once.  This probe measures whether that is where the idle round trip's extra time goes.

    python3 bench/probes/with_idle_spinners.py -- python3 bench/probes/grpc_idle_latency.py --json

Spinners burn the cores they sit on (any real work preempts them): a probe, not a setting.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys

from with_cpu_latency import parse_wrapper  # this folder is on sys.path when run as a script


def spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", type=int, default=0, help="spin on the first N usable CPUs (default 0: all)")
    args, command = parse_wrapper(ap)
    cpus = sorted(os.sched_getaffinity(0))
    cpus = cpus[:args.cpus] if args.cpus > 0 else cpus
    spinners = [mp.Process(target=spin, args=(c,), daemon=True) for c in cpus]
    for s in spinners:
        s.start()
    print(f"with_idle_spinners: {len(spinners)} SCHED_IDLE spinners on CPUs {cpus}", file=sys.stderr)
    try:
        sys.exit(subprocess.call(command))
    finally:
        for s in spinners:
            s.kill()


if __name__ == "__main__":
    main()
