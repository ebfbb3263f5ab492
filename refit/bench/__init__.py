"""``refit-bench`` and its harness: a user of `refit.executor`, never imported by it.

* `cli`      — the command line: arguments, device and transport choice, reduced-width models;
* `direct`   — the direct bench: one worker process per rank, timings, the report and table;
* `worker`   — a bench worker: `Job` / `PlanRun` / `Refit`, a `refit.executor.member.Member` plus
  fill, verify, link measurement, progress reports and the kill / hang test hooks;
* `launch`   — the parent: processes, rendezvous store, watchdog (`run_job`, `WorkerFailure`);
* `via_grpc` — the same refit driven through the control plane (``--via grpc``).
"""

from refit.bench.cli import main

__all__ = ["main"]
