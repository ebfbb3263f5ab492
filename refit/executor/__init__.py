"""The executor: moves the bytes of a `refit.plan.Plan`, one member's share at a time.

Files, in reading order:

* `topology`   — endpoints, processes ("members"), devices, and the one *driver* per device (pure);
* `schedule`   — a member's share of a plan compiled into steps, moves and pulls (pure, no torch);
* `values`     — deterministic canonical values, to fill sources and verify destinations bit-exact;
* `shards`     — an endpoint's local tensors in one arena (shareable with one handle);
* `copies`     — batched block copies (merged strided views, ``_foreach_copy_``, copy engines);
* `memcpys`    — the copy-engine descriptors of a copy between two views (pure, no torch);
* `device`     — CPU / CUDA streams and bounded waits;
* `handles`    — what crosses processes through the store: plain validated JSON, never pickle;
* `transports` — CUDA IPC / shared memory export, NCCL (cupy) and gloo communicators;
* `bound`      — the schedule bound to tensors and buffers, and `run_refit` (one replay);
* `member_barriers` — how members wait for each other (gloo, or shared memory on one host);
* `seating`    — the rendezvous store a run's members meet in (`connect`), and `locate`: each
  publishes its device and learns everyone's (the run's `Topology`);
* `member`     — `Member`: one process's set-up (store, devices, sharing, groups), `prepare` per
  plan, `refit` per refit — what the agents' data plane and the bench both drive.

The library surface is below; `refit.bench` (the benchmark harness) and
`refit.control.dataplane_executor` (the agents) are its users.  Importing this package does not
import torch: the names are loaded on first use, so `schedule` and `topology` stay pure.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Topology": "refit.executor.topology",
    "Program": "refit.executor.schedule",
    "compile_program": "refit.executor.schedule",
    "Member": "refit.executor.member",
    "Budget": "refit.executor.member",
    "connect": "refit.executor.seating",
    "locate": "refit.executor.seating",
    "PeerError": "refit.executor.transports",
    "HandleError": "refit.executor.handles",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'refit.executor' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
