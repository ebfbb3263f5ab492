"""Run a command while the host's CPUs are held out of deep idle states (PM QoS).

Why: refit's control time per refit is a chain of thread wake-ups across processes (the caller's
gRPC call, the coordinator, each agent's loop and worker thread).  An RL loop calls ``Refit``
after a pause, and a core idle for milliseconds sleeps in a deep C-state whose exit costs tens to
hundreds of microseconds per wake.  Linux's ``/dev/cpu_dma_latency`` takes a latency bound (an
int32 of microseconds) for as long as the file stays open; ``0`` keeps every core in its
shallowest idle state (what tuned's ``latency-performance`` profile sets).  This probe measures
whether that is where the idle round trip's extra time goes.

    python3 bench/probes/with_cpu_latency.py --us 0 -- python3 bench/probes/grpc_idle_latency.py --json

Needs write access to /dev/cpu_dma_latency (root); says so and runs the command anyway otherwise.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys

PATH = "/dev/cpu_dma_latency"


def parse_wrapper(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The wrapper's own options, and the command given after ``--`` (a probe that runs one)."""
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give a command after --")
    return args, command


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--us", type=int, default=0, help="the latency bound in microseconds (0: shallowest idle)")
    args, command = parse_wrapper(ap)
    fd = None
    try:
        fd = os.open(PATH, os.O_WRONLY)
        os.write(fd, struct.pack("i", args.us))
        print(f"with_cpu_latency: {PATH} held at {args.us} us", file=sys.stderr)
    except OSError as e:
        print(f"with_cpu_latency: cannot hold {PATH} ({e.strerror}); running without it", file=sys.stderr)
    try:
        sys.exit(subprocess.call(command))
    finally:
        if fd is not None:
            os.close(fd)


if __name__ == "__main__":
    main()
