"""Where a refit's control time goes: timestamps of its steps in every process, when asked.

A refit driven through the control plane crosses four processes' worth of steps — the caller's
``Refit`` call, the coordinator's dispatch and collection, each agent's hand-off to its data plane,
the members' start and end barriers — and the time between them is what ``refit-bench --via grpc``
reports as "control + barriers".  With ``REFIT_CONTROL_TRACE=PREFIX`` each process appends one line
per step, ``<CLOCK_MONOTONIC ns> <step>``, to ``PREFIX.<pid>``; every process of one host reads the
same clock, so the files merge into one timeline (`read_steps`, then `timeline`: each step's median
offset from the call; `bench/probes/control_breakdown.py` and ``bench/vllm_gpu.py --trace`` print
it).  Unset, `mark` costs one attribute read.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import statistics
import threading
import time
from typing import TextIO

from refit import settings

log = logging.getLogger(__name__)

_lock = threading.Lock()
# by (pid, prefix): a forked child opens its own; None: that file could not be written, tracing is off
_files: dict[tuple[int, str], TextIO | None] = {}


def mark(step: str) -> None:
    """Record that this process reached ``step`` now (only under ``REFIT_CONTROL_TRACE``)."""
    prefix = settings.current().control_trace
    if not prefix:
        return
    ns, pid = time.monotonic_ns(), os.getpid()
    key = (pid, prefix)
    with _lock:
        if key in _files and _files[key] is None:
            return
        try:
            f = _files.get(key)
            if f is None:
                f = _files[key] = open(f"{prefix}.{pid}", "a", buffering=1)  # a line at a time: nothing lost at exit
            f.write(f"{ns} {step}\n")
        except OSError as e:  # a diagnostic never fails what it traces: stop tracing in this process
            _files[key] = None
            log.warning("REFIT_CONTROL_TRACE: cannot write %s.%d (%s); control tracing is off in this process",
                        prefix, pid, e.strerror or e)


CLIENT_CALL = "client: Refit sent"  # where a refit of `refit-bench --via grpc` starts


def read_steps(prefix: str) -> list[tuple[int, str]]:
    """Every process's (ns, step), in clock order."""
    steps = []
    for path in glob.glob(prefix + ".*"):
        with open(path) as f:
            for line in f:
                ns, step = line.rstrip("\n").split(" ", 1)
                steps.append((int(ns), step))
    return sorted(steps)


def timeline(steps: list[tuple[int, str]], last: int, start: str = CLIENT_CALL) -> list[tuple[str, float]]:
    """(step, median microseconds after the call) over the last ``last`` refits, each cut at
    ``start`` (the caller's first step); a step reached several times in one refit (phases) is
    numbered."""
    refits: list[list[tuple[int, str]]] = []
    for ns, step in steps:
        if step == start:
            refits.append([])
        if refits:
            refits[-1].append((ns, step))
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for refit in refits[-last:]:
        t0, seen = refit[0][0], collections.Counter()
        for ns, step in refit:
            seen[step] += 1
            name = step if seen[step] == 1 else f"{step} #{seen[step]}"
            offsets[name].append((ns - t0) / 1e3)
    return sorted(((s, statistics.median(v)) for s, v in offsets.items()), key=lambda sv: sv[1])
