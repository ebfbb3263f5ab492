"""Attach a transformers model sharded with torch FSDP2 (``fully_shard``) to the refit control plane.

    from refit.integrations import fsdp as refit_fsdp
    agent = refit_fsdp.attach(model, "127.0.0.1:50051", group="trainer")   # on every rank

FSDP2 turns every parameter into a DTensor placed ``Shard(0)`` over the data-parallel mesh, its
rows split as ``torch.chunk`` does (ceil-sized chunks, the last ones short or empty): refit's
``fsdp:dp<N>`` layout.  What moves is each rank's local shard (``to_local()``, a view of FSDP's
sharded storage); no rank ever gathers a full tensor.

Supported: a 1-D mesh spanning the whole world in rank order (mesh coordinate = global rank),
every parameter sharded on dim 0 (``fsdp:dp<N>``); HSDP, a 2-D ``(replicate, shard)`` mesh in rank
order with placements ``(Replicate(), Shard(0))`` (``fsdp:dp<S>rep<R>``: every replica group
serves, and plans spread their reads over the groups).  transformers 5 fused experts
(``mlp.experts.gate_up_proj`` [E, 2I, H]): FSDP2 splits their expert dimension, so a rank holds
whole experts (layout ``fsdp:dp<N>fused1``), served per expert as views.  FSDP x TP: a 2-D
``(dp, tp)`` mesh in rank order, torch's ``parallelize_module`` with torchtitan's plan for a
Llama-style model before ``fully_shard`` on the dp sub-mesh (``fsdp:dp<S>tp<T>``; the plan is
`refit.layouts.fsdp.TP_DIMS`).  Refused, naming the parameter: a TP plan other than that one,
other placements (``shard_placement_fn``), parameters left unsharded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from refit.control.agent import TrainerAgent
from refit.errors import InvalidInput
from refit.integrations._common import ParameterPaths, global_rank, spec_of_hf_config, start_trainer
from refit.integrations.hf import FUSED_EXPERTS, serve_hf_parameters
from refit.layouts import FsdpLayout
from refit.layouts.fsdp import chunk_rows, tp_dim

__all__ = ["attach"]


def attach(model: torch.nn.Module, address: str | None = None, *, group: str = "trainer", token: str | None = None,
           adapter: str | None = None, **agent_options: Any) -> TrainerAgent:
    """Register this rank's shard of an FSDP2-sharded transformers ``model`` as rank (global rank)
    of ``group``; call it on every rank.  Returns the started agent.  Raises `refit.InvalidInput`,
    before registering, for a mesh, placement or parameter refit cannot serve.  ``address`` and
    ``token`` default to ``$REFIT_ADDRESS`` (else 127.0.0.1:50051) and ``$REFIT_TOKEN``.
    ``adapter="name"``: ``model`` is a sharded PEFT LoRA model; only that adapter's A/B shards are
    served (`refit.adapters`, docs/lora.md)."""
    from torch.distributed.tensor import DTensor

    if adapter is not None:
        return _attach_adapter(model, adapter, address, group=group, token=token, **agent_options)
    named = list(model.named_parameters(remove_duplicate=False))
    if not named:
        raise InvalidInput("the model has no parameters")
    dp, rep, tp = _mesh_degrees(named, DTensor)
    rank = global_rank()
    spec = spec_of_hf_config(model.config, {n: p.to_local() for n, p in named})
    fused = any(FUSED_EXPERTS.match(n) for n, _ in named)
    layout = FsdpLayout(dp=dp, rep=rep, tp=tp, fused=int(fused)).resolve(spec)
    shard, _ = layout.coords(rank)
    # FSDP2 leaves buffers (the float32 router bias) whole on every rank: serve this rank's rows
    served = serve_hf_parameters(named, spec, layout, rank, local=lambda p: p.to_local().detach(),
                                 experts_held=layout.experts_held(spec, rank), buffer=model.get_buffer,
                                 buffer_local=lambda b: b.detach().narrow(0, *chunk_rows(b.shape[0], dp, shard)),
                                 paths=ParameterPaths(model))
    return start_trainer(address, group=group, rank=rank, spec=spec, layout=layout, served=served, token=token,
                         **agent_options)


def _attach_adapter(model: torch.nn.Module, adapter: str, address: str | None, *, group: str, token: str | None,
                    **agent_options: Any) -> TrainerAgent:
    """This rank's shards (``to_local()``) of one LoRA adapter's A/B matrices, layout ``fsdp:dp<N>``
    (or HSDP) over the adapter's spec: FSDP2 splits A's rank rows and B's output rows like any
    parameter's dim 0."""
    from torch.distributed.tensor import DTensor

    from refit.spec import adapter_spec
    from refit.integrations._common import Served
    from refit.integrations.lora import adapter_parameters

    base, named, rank_r, targets, scaling = adapter_parameters(model, adapter)
    dp, rep, tp = _mesh_degrees(named, DTensor)
    if tp > 1:
        raise InvalidInput(f"adapter={adapter!r}: the adapter is split by tensor parallelism (tp{tp}); refit's "
                           f"adapter refits take FSDP2 / HSDP shards (Shard(0)) only")
    spec = adapter_spec(spec_of_hf_config(base.config, {n: p.to_local() for n, p in named}), rank_r, targets, scaling)
    layout = FsdpLayout(dp=dp, rep=rep).resolve(spec)
    paths = ParameterPaths(base)
    served = {n: Served(n, lambda now=paths.follow(p): now().to_local().detach()) for n, p in named}
    return start_trainer(address, group=group, rank=global_rank(), spec=spec, layout=layout, served=served,
                         token=token, **agent_options)


def _mesh_degrees(named: list[tuple[str, torch.Tensor]], dtensor: type) -> tuple[int, int, int]:
    """(shard ranks, replica groups, tp ranks), after checking that every parameter is a DTensor
    placed as one of refit's fsdp layouts: FSDP (a 1-D mesh, ``Shard(0)``), HSDP (a 2-D mesh,
    ``(Replicate(), Shard(0))``) or FSDP x TP (`_tp_degrees`), over the whole world in rank order."""
    from torch.distributed.tensor import Replicate, Shard

    for name, p in named:
        if not isinstance(p, dtensor):
            raise InvalidInput(f"parameter {name!r} is not a DTensor: fully_shard every module holding parameters "
                               f"(the root module too) before attaching, or use refit_hf.attach for an unsharded model")
        if p.device_mesh.ndim > 2:
            raise InvalidInput(f"parameter {name!r} lies on a {p.device_mesh.ndim}-D mesh {p.device_mesh.mesh_dim_names}: "
                               f"refit's fsdp layouts are FSDP (1-D), HSDP (2-D: replicate, shard) and FSDP x TP "
                               f"(2-D: dp, tp)")
    tp_split = [p for _, p in named if p.device_mesh.ndim == 2 and not isinstance(p.placements[0], Replicate)]
    if tp_split:
        return _tp_degrees(named, tp_split[0].device_mesh)
    mesh = None
    for name, p in named:
        ndim = p.device_mesh.ndim
        want = (Shard(0),) if ndim == 1 else (Replicate(), Shard(0))
        if tuple(p.placements) != want:
            raise InvalidInput(f"parameter {name!r} is placed {tuple(p.placements)}, refit's fsdp layout needs {want}"
                               " (no shard_placement_fn)")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise InvalidInput(f"parameter {name!r} lies on mesh {p.device_mesh}, others on {mesh}: one mesh only")
    assert mesh is not None
    _check_rank_order(mesh)
    return (mesh.size(0), 1, 1) if mesh.ndim == 1 else (mesh.size(1), mesh.size(0), 1)


def _tp_degrees(named: list[tuple[str, torch.Tensor]], mesh: Any) -> tuple[int, int, int]:
    """FSDP x TP on the 2-D mesh ``(dp, tp)``: every parameter placed as layout ``fsdp:dp<S>tp<T>``
    says (`refit.layouts.fsdp.TP_DIMS`): split on dim 0 by TP, then FSDP
    (``(_StridedShard(0, split_factor=T), Shard(0))``), split on dim 1 by TP
    (``(Shard(0), Shard(1))``), or not split by TP (``Shard(0)`` on this rank's dp sub-mesh)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    _check_rank_order(mesh)
    dp, tp = mesh.size(0), mesh.size(1)
    rank = global_rank()
    dp_ranks = mesh.mesh[:, rank % tp].tolist()
    for name, p in named:
        dim = tp_dim(name)
        placed = tuple(p.placements)
        if dim is None:
            ok = p.device_mesh.ndim == 1 and p.device_mesh.mesh.tolist() == dp_ranks and placed == (Shard(0),)
            want = f"(Shard(dim=0),) on the dp mesh {dp_ranks}"
        elif dim == 0:
            ok = p.device_mesh == mesh and len(placed) == 2 and isinstance(placed[0], _StridedShard) \
                and placed[0].dim == 0 and placed[0].split_factor == tp and placed[1] == Shard(0)
            want = f"(_StridedShard(dim=0, sf={tp}), Shard(dim=0)): TP's rows first (ColwiseParallel), then FSDP's"
        else:
            ok = p.device_mesh == mesh and placed == (Shard(0), Shard(1))
            want = "(Shard(dim=0), Shard(dim=1)) (RowwiseParallel, then FSDP)"
        if not ok:
            raise InvalidInput(f"parameter {name!r} is placed {placed} on mesh {p.device_mesh.mesh.tolist()}: refit's "
                               f"fsdp:dp{dp}tp{tp} layout needs {want} (refit.layouts.fsdp.TP_DIMS: torchtitan's plan "
                               f"for a Llama-style model)")
    return dp, 1, tp


def _check_rank_order(mesh: Any) -> None:
    world = dist.get_world_size()
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(world)):
        raise InvalidInput(f"the FSDP mesh holds ranks {ranks} of a world of {world}: refit needs one mesh over the "
                           f"whole world in rank order (mesh coordinate = global rank)")
