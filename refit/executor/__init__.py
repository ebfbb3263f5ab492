"""The executor: moves the bytes of a `refit.plan.Plan`, one worker's share at a time.

Files, in reading order:

* `values`     — deterministic canonical values, to fill sources and verify destinations bit-exact;
* `shards`     — an endpoint's local tensors in one arena (shareable with one handle);
* `topology`   — endpoints, processes, devices, and the one *driver* per device;
* `program`    — a member's share of a plan, compiled once, bound to tensors and buffers;
* `copies`     — batched block copies (merged strided views, ``_foreach_copy_``);
* `device`     — CPU / CUDA streams and bounded waits;
* `transports` — CUDA IPC / shared memory export, NCCL (cupy) and gloo communicators;
* `worker`     — a worker process: setup, `run_refit`, verification;
* `launch`     — the parent: processes, rendezvous store, watchdog.
"""

from refit.executor.launch import WorkerFailure, run_job
from refit.executor.topology import Topology
from refit.executor.worker import Job, Phase, Refit, run_refit

__all__ = ["Job", "Phase", "Refit", "Topology", "WorkerFailure", "run_job", "run_refit"]
