"""A second inference engine, as small as one can be: a plain ``torch.nn.Module`` refitted through
refit's engine side (`refit.engine`), with no vLLM anywhere.

It is what adding an engine takes: a `refit.engine.Landing` (`TorchLanding`: where the bytes land,
and how they become the module's parameters) and a call of the host-driven refit
(`refit.engine.HostRefit`) from the engine's own loop (`TorchEngine.refit`, between its "steps").
Nothing in refit.control or refit.executor knows it exists.  The module holds the model's tensors
under their HF names (refit's ``hf`` layout as the destination: one worker, so its
`WorkerGroup` is `refit.engine.Alone`).

Two landings, as an engine would choose between them:

* in place (``staged=False``): the data plane writes the parameters' own storage; ``apply`` has
  nothing left to do; atomic refits are refused (the live weights are written while they move);
* staged (``staged=True``): the data plane writes a copy; ``apply`` copies it into the parameters
  after the commit, so a refit that fails leaves the parameters as they were, and atomic refits
  are taken.

``fail_apply`` makes the next ``apply`` raise, as a landing that breaks after the commit would:
the driver must then report the engine stale.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from refit.engine import HostRefit
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec


def module_of(spec: ModelSpec, layout: Layout, rank: int = 0) -> torch.nn.Module:
    """A plain module holding, zeroed, the tensors ``layout`` gives ``rank``, at their dotted names."""
    root = torch.nn.Module()
    for lt in layout.local_tensors(spec, rank):
        *path, attr = lt.name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(attr, torch.nn.Parameter(torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype)),
                                                           requires_grad=False))
    return root


class TorchLanding:
    """The `Landing` of a plain module (see the module docstring)."""

    phase_layers = 0  # never phased: `check` and `landed` are not called
    tensors: dict[str, torch.Tensor]  # what the data plane writes: the parameters, or their staging

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, layout: Layout, rank: int = 0,
                 staged: bool = False) -> None:
        params = dict(model.named_parameters())
        self.live = {lt.name: params[lt.name] for lt in layout.local_tensors(spec, rank)}
        self.staged = staged
        self.tensors = {n: p.detach().clone() if staged else p.detach() for n, p in self.live.items()}
        self.fail_apply = False
        self.applied = 0  # how many refits were applied (a version asked again applies nothing)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) if self.staged else 0

    @property
    def stages(self) -> bool:
        return self.staged

    def begin(self) -> None:
        pass

    def check(self, plan: Plan) -> None:
        pass

    def landed(self, plan: Plan, phase: int) -> None:
        pass

    @torch.no_grad()
    def apply(self) -> float:
        t0 = time.perf_counter()
        if self.fail_apply:
            self.fail_apply = False
            raise RuntimeError("the landing broke after the commit (a test's fault)")
        if self.staged:
            for name, staged in self.tensors.items():
                self.live[name].copy_(staged)
        self.applied += 1
        return time.perf_counter() - t0


class TorchEngine:
    """One worker serving ``model``: it registers with a coordinator, and refits when its own loop
    says so (`refit`), never when a command happens to arrive."""

    def __init__(self, spec: ModelSpec, staged: bool = False, layout: str = "hf") -> None:
        self.spec, self.layout = spec, resolve_layout(layout, spec, Side.ENGINE)
        self.model = module_of(spec, self.layout)
        self.landing = TorchLanding(self.model, spec, self.layout, staged=staged)
        self.refits = HostRefit()

    def register(self, address: str, group: str) -> TorchEngine:
        self.refits.register(address, group=group, rank=0, spec=self.spec, layout=self.layout, landing=self.landing)
        return self

    def refit(self, plan_id: str, version: int, **options: Any) -> None:
        """Land ``version`` (``options``: ``atomic``, ``verify``, ``delta``, ``timeout``)."""
        self.refits.refit(plan_id, version, timeout=options.pop("timeout", 60.0), **options)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def close(self) -> None:
        agent = self.refits.agent
        self.refits.shutdown()
        if agent is not None:
            agent.data_plane.close()

