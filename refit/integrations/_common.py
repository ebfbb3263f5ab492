"""What the trainer integrations share: the spec of a transformers config, the process's rank,
the "nothing silently dropped" check, and a trainer agent serving live parameters.

Live parameters.  The agent serves *views* of the parameters' storage (``detach()``, ``narrow``,
``select``: never a copy), so a refit sends what the trainer holds when it runs.  Parameters are
looked up again by module path at every refit (`ParameterPaths`): a parameter *object* replaced
after attach (``load_state_dict(sd, assign=True)``, ``module.weight = nn.Parameter(...)``, FSDP2 or
a wrapper re-registering its own parameters) is followed, and so is one whose data was re-pointed
(``p.data = ...``, ``.to()``, Megatron's DDP buffers).  A tie broken since attach, a parameter gone
from its path, or one of another kind than at attach fails the refit naming it, before any byte
moves: never the old tensors sent as new.  (FSDP2's gathered parameters, registered between
``unshard()`` and ``reshard()``, are the exception: the sharded ones it keeps meanwhile are served.)
`LiveDataPlane` refuses a parameter left on another device than at attach.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from refit.control.agent import TrainerAgent
from refit.control.embedded import coordinator_for
from refit.control.dataplane import RunContext
from refit.control.dataplane_executor import ExecutorDataPlane
from refit.errors import InvalidInput, RefitError, RefitFailed
from refit.layouts import Layout
from refit.plan import Plan
from refit.spec import ModelConfig, ModelSpec, build_spec

log = logging.getLogger(__name__)

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def spec_of_hf_config(config: Any, params: Mapping[str, torch.Tensor]) -> ModelSpec:
    """refit's spec of a transformers ``PretrainedConfig`` (``model.config``), in the dtype the
    parameters hold when they share one: a trainer keeps its parameters in the dtype it trains in
    (verl's FSDP2: float32 under a bfloat16 config), and a plan into an engine of another dtype
    casts on the way (`refit.casts`).  Parameters of mixed dtypes take the config's."""
    cfg = config.to_dict()
    dtypes = {p.dtype for p in params.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else cfg.get("dtype") or cfg.get("torch_dtype")
    if dtype is None:
        raise InvalidInput(f"the model's parameters mix dtypes {sorted(map(str, dtypes))} "
                           f"and model.config names none")
    cfg["dtype"] = DTYPE_NAMES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else dtype
    cfg.pop("torch_dtype", None)
    name = str(getattr(config, "name_or_path", "") or cfg.get("model_type") or "model").rstrip("/").rsplit("/", 1)[-1]
    return build_spec(name, ModelConfig.from_hf(cfg))


def global_rank() -> int:
    """This process's rank in the default process group (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def refuse_unmapped(unmapped: list[str], where: str, why: str = "") -> None:
    """Item 5 of the contract: a parameter refit cannot place is an error, never skipped."""
    if not unmapped:
        return
    more = f" (and {len(unmapped) - 1} more: {', '.join(unmapped[1:4])}{'...' if len(unmapped) > 4 else ''})" \
        if len(unmapped) > 1 else ""
    raise InvalidInput(f"{where}: parameter {unmapped[0]!r}{more} has no place in refit's tensors of this model"
                     f"{'; ' + why if why else ''}; refusing to attach rather than leave it behind")


def check_dtypes(served: Mapping[str, "Served"], spec: ModelSpec, layout: Layout, rank: int) -> None:
    """Each served tensor in the dtype the layout holds it in: the config's, but float32 router
    biases (``e_score_correction_bias``, Megatron's ``expert_bias``)."""
    held = {lt.name: lt.dtype for lt in layout.local_tensors(spec, rank)}
    for name, s in served.items():
        want = held.get(name, spec.config.dtype)
        got = DTYPE_NAMES.get(s.view.dtype, str(s.view.dtype))
        if got != want:
            whose = "the model's config says" if want == spec.config.dtype else f"refit holds {name!r} in"
            raise InvalidInput(f"parameter {s.param_name!r} is {got}, {whose} {want}: a model's parameters "
                               f"are served in one dtype (plans cast between the trainer's and the engine's "
                               f"dtypes, not within a model); keep it in {want} (or fix config.dtype)")


def held_dtype(spec: ModelSpec, layout: Layout, served: Mapping[str, "Served"], rank: int) -> tuple[ModelSpec, Layout]:
    """The spec (and layout) in the dtype the trainer holds its parameters in, when every tensor the
    config's dtype covers is served in one other dtype (a Megatron model kept in float32 under a
    bfloat16 checkpoint): plans into engines of the config's dtype then cast (`refit.casts`)."""
    held = {lt.name: lt.dtype for lt in layout.local_tensors(spec, rank)}
    got = {DTYPE_NAMES.get(s.view.dtype, str(s.view.dtype)) for n, s in served.items()
           if held.get(n) == spec.config.dtype}
    if len(got) != 1 or (dtype := got.pop()) == spec.config.dtype or dtype not in DTYPE_NAMES.values():
        return spec, layout
    spec = build_spec(spec.name, dataclasses.replace(spec.config, dtype=dtype))
    return spec, layout.resolve(spec)


class ParameterPaths:
    """The parameters of ``module`` followed by module path: `follow` gives a callable answering the
    one registered at a parameter's path(s) at the time of the call, so that a refit reads the
    parameter the model holds then, not the object it held at attach (``load_state_dict(assign=True)``, a re-tie, FSDP2's
    unshard all swap parameter objects).  A parameter reached by several paths at attach (tied
    weights) must still be one object at all of them: otherwise the copy refit does not serve
    would be left behind, so the refit is refused naming it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.paths: dict[int, list[str]] = {}
        self.kinds: dict[int, type] = {}
        for path, p in module.named_parameters(remove_duplicate=False):
            self.paths.setdefault(id(p), []).append(path)
            self.kinds[id(p)] = type(p)

    def follow(self, p: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A callable giving, at each call, the parameter now at ``p``'s path(s) in the module;
        ``p`` (a parameter of the module at attach) itself when it is none of the module's."""
        paths = self.paths.get(id(p))
        if paths is None:
            return lambda: p
        kind = self.kinds[id(p)]
        last = [p]  # the last parameter of the attach kind seen at the path
        return lambda: self._now(paths, kind, last)

    def _now(self, paths: list[str], kind: type, last: list[torch.Tensor]) -> torch.Tensor:
        found = []
        for path in paths:
            try:
                found.append(self.module.get_parameter(path))
            except AttributeError:
                raise RefitFailed(f"parameter {path!r} is no longer in the model (attached at that path): "
                                  f"attach again for a model of other parameters") from None
        now = found[0]
        for path, other in zip(paths[1:], found[1:]):
            if other is not now and not _same_view(other, now):  # load_state_dict(assign=True) wraps each anew
                raise RefitFailed(f"parameter {path!r} is no longer {paths[0]!r} (tied at attach, served once): "
                                  f"tie it again (model.tie_weights()) or attach again")
        if isinstance(now, kind):
            last[0] = now
            return now
        if _is_dtensor_kind(kind):
            # FSDP2 registers the gathered parameter at the path between unshard() and reshard() (the
            # root module after a forward): the sharded one it keeps meanwhile is what the optimizer
            # updates, and what this rank serves.
            return last[0]
        raise RefitFailed(f"parameter {paths[0]!r} is a {type(now).__name__} now, a {kind.__name__} at attach: "
                          f"attach again")


def _is_dtensor_kind(kind: type) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return issubclass(kind, DTensor)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two parameters show the very same elements (one storage, offset, shape, strides)."""
    a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
    return (a.device, a.dtype, a.shape, a.stride(), a.data_ptr()) == \
        (b.device, b.dtype, b.shape, b.stride(), b.data_ptr())


@dataclass
class Served:
    """One local tensor of refit's layout as served: a view (``cut``) of what a live parameter
    holds now (``live``: its data, its local shard for a DTensor), derived again at every refit."""

    param_name: str  # the framework's parameter name (for messages)
    live: Callable[[], torch.Tensor]
    cut: Callable[[torch.Tensor], torch.Tensor] | None = None  # the part of the parameter served (fused experts)

    @property
    def view(self) -> torch.Tensor:
        data = self.live()
        return data if self.cut is None else self.cut(data)


class LiveDataPlane(ExecutorDataPlane):
    """`refit.executor`'s data plane for attached models.  The served tensors are read at every
    refit, so a parameter whose storage changed since the last one (offloaded and loaded back
    between steps, re-pointed by a wrapper, re-materialized) is followed: every member of the plan
    builds its transfers again within that refit.  One that now lies on another device than at
    attach (still offloaded to CPU) is refused, naming it: the plan's peers reach this rank's
    tensors on its device."""

    def __init__(self, served: Mapping[str, Served], device: torch.device, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.served = served
        self.device = device

    def run(self, plan: Plan, tensors: Mapping[str, torch.Tensor], ctx: RunContext) -> tuple[int, float]:
        away = [(self.served[n].param_name, t.device) for n, t in tensors.items()
                if n in self.served and t.device != self.device]
        if away:
            (name, where), count = away[0], len({a[0] for a in away})
            raise RefitFailed(f"parameter {name!r} ({count} in all) lies on {where}, on {self.device} at attach: "
                              f"load the model back onto {self.device} before the refit (an offloaded model is "
                              f"followed where it is loaded again, not fetched from the host)")
        return super().run(plan, tensors, ctx)


def view(name: str, served: Served) -> torch.Tensor:
    """``served``'s view now, or a refusal naming the parameter: one that no longer has the rows
    refit serves from it (a fused expert parameter emptied) fails the refit, not with an IndexError."""
    try:
        return served.view
    except RefitError:  # already names it (`ParameterPaths`)
        raise
    except (IndexError, RuntimeError) as e:
        raise RefitFailed(f"parameter {served.param_name!r} no longer holds refit's {name!r} "
                          f"({type(e).__name__}: {e}): attach again for a model of other shapes") from None


def start_trainer(address: str | None, *, group: str, rank: int, spec: ModelSpec, layout: Layout,
                  served: Mapping[str, Served], token: str | None = None, **agent_options: Any) -> TrainerAgent:
    """Check, then register: the layout's tensors of ``rank`` must all be served (names, shapes,
    dtypes, by `TrainerAgent`'s own check) before anything connects."""
    spec, layout = held_dtype(spec, layout, served, rank)
    check_dtypes(served, spec, layout, rank)
    devices = {s.view.device for s in served.values()}
    if len(devices) != 1:
        raise InvalidInput(f"the model's parameters lie on several devices ({sorted(map(str, devices))}); "
                           f"attach a rank's model on one device")
    device = devices.pop()
    if device.type == "cuda":
        agent_options.setdefault("gpu", device.index or 0)
    address = coordinator_for(address, token)  # none configured: the job's own, served here if nobody does
    agent = TrainerAgent(address, group=group, rank=rank, spec=spec, layout=layout,
                         tensors=lambda: {name: view(name, s) for name, s in served.items()},
                         data_plane=LiveDataPlane(served, device), token=token, **agent_options)
    log.info("%s: serving %d tensors of %s (%s) from live parameters", agent.worker_id, len(served),
             spec.name, agent.layout.describe())
    return agent.start()
