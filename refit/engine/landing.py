"""What an inference engine's worker does with a refit's bytes: the `Landing` contract, and the
`WorkerGroup` the workers of one engine agree through.

An engine joins refit by implementing these two, not by copying the refit sequence: the
host-driven refit (`refit.engine.host.HostRefit`) is the same for every engine, and calls a
landing at fixed points of it::

    landing.tensors                 # registered once: the data plane writes a refit's bytes here
    landing.begin()                 # before each refit this worker expects
    landing.check(plan)             # phased landings only: refuse a plan before any byte moves
    landing.landed(plan, phase)     # phased landings only: every member wrote ``phase``
    seconds = landing.apply()       # after the coordinator committed: make the engine serve it
    # a refit that fails after writing: no call; the driver reports this worker stale

Why these and no more: a data plane (`refit.control.dataplane`) writes into tensors in the
layout the engine registered and knows nothing of the engine; what turns those bytes into what
the engine serves (in place, re-processed, staged and switched, a LoRA slot) is the landing's,
and when it may do so (never before the commit unless it writes in place, between the engine's
steps) is the driver's.  vLLM's landings are `refit.integrations.vllm.landing` and
`refit.integrations.vllm.lora_slot`; a plain PyTorch module's is tests/harness/torch_engine.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from refit.plan import Plan


@runtime_checkable
class Landing(Protocol):
    """Where a refit's bytes land in one engine worker, and how they become what it serves.

    Contract:

    * ``tensors``: this worker's local tensors by local name, exactly the ones its layout gives
      its rank (shape and dtype; the agent checks them when it registers).  The data plane writes
      into them only while a refit this worker expects runs; they are either the live weights
      themselves (written in place) or a staging the landing puts into the live weights later.
    * ``nbytes``: bytes of staging the landing holds (one window when phased); 0 means ``tensors``
      are exactly what the engine serves, so a Check may read them and delta refits may start
      from them.
    * ``stages``: ``tensors`` are a staging nothing serves before `apply`: an atomic refit may
      write into them (a failed one leaves the live weights untouched, whole).  False: the data
      plane writes live weights, and atomic refits are refused before any byte moves.
    * ``phase_layers``: > 0 cuts this engine's plans into phases of that many layers
      (`refit.phases`), the landing then being the agent's phase hook (`check`, `landed`); 0: not
      phased, neither is called.
    * `begin`: before each refit the host drives; state of an earlier (failed) refit is dropped.
    * `check` / `landed`: see `refit.control.dataplane.PhaseHook`; `landed` runs on the agent's
      share thread, between two phases (it may re-use a staging window the next phase rewrites).
    * `apply`: once the coordinator committed and this agent heard it, on the host's thread
      between engine steps: put whatever is not live yet into the live weights; returns seconds.
      An exception leaves the worker reported stale (its weights may be partly new).
    """

    tensors: Mapping[str, "torch.Tensor"]
    phase_layers: int

    @property
    def nbytes(self) -> int: ...

    @property
    def stages(self) -> bool: ...

    def begin(self) -> None: ...

    def check(self, plan: "Plan") -> None: ...

    def landed(self, plan: "Plan", phase: int) -> None: ...

    def apply(self) -> float: ...


@runtime_checkable
class WorkerGroup(Protocol):
    """The workers of one engine (one replica of a data-parallel one) that land each refit
    together: one of them (the leader) asks the coordinator to run it, the others learn the
    outcome from it.  An engine implements it over its own process group (vLLM: its world's CPU
    group, `refit.integrations.vllm.compat.VllmWorld`); a single-process engine uses `Alone`."""

    def leader(self) -> bool:
        """Whether this worker asks the coordinator to run the refit."""
        ...

    def barrier(self) -> None:
        """Return once every worker of the group reached it (each expects the refit by then)."""
        ...

    def broadcast(self, value: Any) -> Any:
        """The leader's ``value`` on every worker (the others pass theirs, which is ignored)."""
        ...


class Alone:
    """The `WorkerGroup` of an engine of one worker: it leads, and waits for nobody."""

    def leader(self) -> bool:
        return True

    def barrier(self) -> None:
        pass

    def broadcast(self, value: Any) -> Any:
        return value
