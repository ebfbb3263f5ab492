"""What the ``refit`` checkpoint engine reaches inside verl: the worker that holds it, the actor's
live model, the rollout's server adapter, and the rollout configs refit refuses.

verl hands a checkpoint engine a full-tensor generator and nothing else (only its own
``delta_sharded`` backend is given the training engine), so refit finds the actor's model itself.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch

from refit.control.agent import TrainerAgent
from refit.errors import InvalidInput

log = logging.getLogger(__name__)


def holder_of(engine: object) -> Any | None:
    """The verl worker holding ``engine`` as its ``checkpoint_engine``, or None.

    Why this way: every verl caller of a checkpoint engine's methods is a method of the worker
    holding it (``execute_checkpoint_engine``, ``update_weights``), so that worker is a ``self``
    on the call stack (an awaiting coroutine's frame is the ``f_back`` of the awaited one).  It is
    picked by identity (``worker.checkpoint_engine is engine``), never by class or method name,
    so renamed workers (ActorRolloutRefWorker, TrainingWorker, CheckpointEngineWorker, a user's
    subclass) are found alike.  The generator's frame was the other candidate; its locals are the
    body of each engine's ``get_per_tensor_param`` (the FSDP engine wraps it in
    ``unfuse_moe_params``, whose frame holds no engine), so any verl refactor would break it.
    Off the stack (a call from elsewhere), the worker is found as the owner of the ``__dict__``
    that refers to ``engine``."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and obj is not engine and getattr(obj, "checkpoint_engine", None) is engine:
            return obj
        frame = frame.f_back
    for ref in gc.get_referrers(engine):
        if isinstance(ref, dict) and ref.get("checkpoint_engine") is engine:
            for owner in gc.get_referrers(ref):
                if getattr(owner, "__dict__", None) is ref:
                    return owner
    return None


def training_engine(holder: Any) -> Any | None:
    """verl's training engine (FSDP / Megatron) of an actor worker: ``ActorRolloutRefWorker.actor.engine``
    or ``TrainingWorker.engine``; None for a rollout-only worker."""
    actor = getattr(holder, "actor", None)
    for engine in (getattr(actor, "engine", None), getattr(holder, "engine", None)):
        if engine is not None and hasattr(engine, "module"):
            return engine
    return None


def rollout_adapter(holder: Any) -> Any | None:
    """The rollout's server adapter: ``CheckpointEngineWorker.server_adapter`` (disaggregated) or
    ``ActorRolloutRefWorker.rollout`` (hybrid); None for a trainer-only worker."""
    for name in ("server_adapter", "rollout"):
        adapter = getattr(holder, name, None)
        if adapter is not None and hasattr(adapter, "config") and hasattr(adapter, "replica_rank"):
            return adapter
    return None


def server_of(adapter: Any) -> Any | None:
    """The Ray handle of the adapter's vLLM server when this worker is the replica's one that owns
    it (rollout rank 0), else None."""
    ensure = getattr(adapter, "_ensure_server_handle", None)
    if ensure is None or not ensure():
        return None
    return adapter.server_handle


def _field(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a verl config given as its dataclass or as a plain mapping."""
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def rollout_refusal(config: Any, hf_config: Any = None) -> str | None:
    """Why refit cannot serve this rollout (verl's ``RolloutConfig``), in one line, or None."""
    def get(key: str, default: Any = None) -> Any:
        return _field(config, key, default)

    name = get("name")
    if name not in (None, "vllm"):
        return f"refit serves vLLM rollouts only (actor_rollout_ref.rollout.name={name})"
    vllm = dict((get("engine_kwargs") or {}).get("vllm") or {})
    pp = int(get("pipeline_model_parallel_size", 1) or 1)
    if pp > 1 or int(vllm.get("pipeline_parallel_size") or 1) > 1:
        return "vllm: pipeline parallel is not supported by refit yet (rollout.pipeline_model_parallel_size=1)"
    if int(get("data_parallel_size", 1) or 1) > 1 or int(vllm.get("data_parallel_size") or 1) > 1:
        return ("refit through verl serves rollout data_parallel_size=1 (use more replicas instead: each replica "
                "is refitted by its own plan)")
    if vllm.get("enable_eplb"):
        return "vllm: expert-parallel load balancing (enable_eplb) is not supported by refit yet"
    quant = get("quantization") or vllm.get("quantization")
    quantized = quant or (getattr(hf_config, "quantization_config", None) if hf_config is not None else None)
    if quantized:
        return (f"vllm: the rollout is quantized ({quant or 'quantization_config in the checkpoint'}); refit moves "
                f"the trainer's unquantized weights: serve an unquantized rollout")
    mtp = get("mtp")
    if mtp is not None and _field(mtp, "enable") and _field(mtp, "enable_rollout"):
        # verl's own sync feeds vLLM's MTP drafter the actor's mtp.* weights; this backend refits the
        # target only, so the drafter would keep the checkpoint's MTP layers while the policy moves
        return ("refit through verl does not refit vLLM's MTP drafter yet (actor_rollout_ref.model.mtp."
                "enable_rollout=True): turn it off, or drive the engine with refit's RL-loop calls "
                "(megatron attach_mtp + start_draft_weight_update, docs/rl-loop-and-vllm.md)")
    backend = (vllm.get("weight_transfer_config") or {}).get("backend")
    if backend != "refit":
        return ("the vLLM rollout must load refit's weight-transfer backend: set "
                "actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config='{backend: refit}'"
                + (f" (it is {backend!r})" if backend else ""))
    return None


def refusal_at_construction() -> str | None:
    """The refusal of the rollout config found on the stack of verl's code building the engine
    (``CheckpointEngineWorker.rollout_config``, or ``rollout_config`` / ``model_config`` locals of
    ``ActorRolloutRefWorker.init_model``), so a bad config fails when verl builds the backend."""
    from verl.workers.config import RolloutConfig

    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        owner = local.get("self")
        config = local.get("rollout_config") or getattr(owner, "rollout_config", None)
        if isinstance(config, RolloutConfig):  # verl's own class: never a look-alike further up
            model = local.get("model_config") or getattr(owner, "model_config", None)
            return rollout_refusal(config, getattr(model, "hf_config", None))
        frame = frame.f_back
    return None


def attach_actor(engine: Any, address: str, group: str, token: str | None) -> TrainerAgent:
    """Attach the live model of verl's training engine on this rank, shard to shard: FSDP2 (every
    parameter a DTensor), Megatron (a list of model chunks), or one unsharded transformers model."""
    from torch.distributed.tensor import DTensor

    module = engine.module
    if isinstance(module, (list, tuple)):  # Megatron: model chunks (virtual pipeline stages)
        from refit.integrations import megatron
        from refit.integrations._common import spec_of_hf_config

        spec = spec_of_hf_config(engine.model_config.hf_config, {})
        return megatron.attach(list(module), address, group=group, spec=spec, token=token)
    if hasattr(module, "_fsdp_wrapped_module"):
        raise InvalidInput("verl's FSDP1 engine wraps the model in FlatParameters refit cannot serve: use FSDP2 "
                           "(actor_rollout_ref.actor.strategy=fsdp2)")
    if any(isinstance(p, DTensor) for p in module.parameters()):
        from refit.integrations import fsdp

        return fsdp.attach(module, address, group=group, token=token)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidInput(f"verl's actor model on rank {dist.get_rank()} of {dist.get_world_size()} is not "
                           f"sharded with FSDP2 or Megatron: refit cannot tell which rank holds what")
    from refit.integrations import hf

    return hf.attach(module, address, group=group, token=token)


def params_offloaded(engine: Any) -> bool:
    """Whether verl keeps this engine's parameters on the host between steps (param offload)."""
    try:
        return bool(engine.is_param_offload_enabled)
    except (AttributeError, NotImplementedError):
        return False


def load_params(engine: Any, where: str) -> None:
    """verl's own move of the model's parameters (``engine.to``) to ``where`` ("cpu" or the device)."""
    device = where if where == "cpu" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine.to(device, model=True, optimizer=False, grad=False)
