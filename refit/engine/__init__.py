"""The engine side of a refit, for any inference engine: what its workers do with a refit's bytes.

* `refit.engine.landing` — the `Landing` contract (where the bytes land, and how they become what
  the engine serves) and the `WorkerGroup` the workers of one engine agree through;
* `refit.engine.host` — `HostRefit`, the host-driven refit every engine worker runs (expect the
  refit, meet, the leader asks the coordinator, the outcome, apply, or report stale), and its
  agent, `HostDrivenAgent`;
* `refit.engine.window` — the one staging buffer a phased landing re-uses window after window.

An engine is glue that implements a `Landing` (and a `WorkerGroup` where it has several workers)
and calls `HostRefit`: vLLM's is `refit.integrations.vllm`, a plain PyTorch module's is
tests/harness/torch_engine.py.  Adding one touches nothing in `refit.control` or `refit.executor`.
This package sits above the control plane (its driver registers agents and asks the coordinator)
and below the integrations.
"""

from refit.engine.host import HostDrivenAgent, HostRefit
from refit.engine.landing import Alone, Landing, WorkerGroup

__all__ = ["Alone", "HostDrivenAgent", "HostRefit", "Landing", "WorkerGroup"]
