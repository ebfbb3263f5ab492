"""What a vLLM worker is, in refit's terms: its rank, layout and model spec, from vLLM's configs.

* spec: refit's canonical tensors from the HF config vLLM loaded (``hf_config``), in the dtype
  vLLM runs (``model_config.dtype``, which may differ from the checkpoint's);
* layout: ``vllm:tpT[epE][dpD]`` from the parallel config (expert parallel spans tp*dp ranks);
* rank: dp_rank * tp + tp_rank, the rank refit's vLLM layout numbers its tensors by.

Data parallel.  vLLM 0.32 runs the DP replicas of a MoE model as one distributed world (its
workers see ``data_parallel_size`` and ``data_parallel_rank``), but those of a dense model as
independent DP=1 engines (`ParallelConfig.reconfigure_for_independent_dp_rank`): their workers
see ``data_parallel_size == 1``; the replica's index survives in ``data_parallel_index`` and the
replica count in ``elastic_ep_max_dp_size`` (set from the DP size before the reconfiguration, when
elastic EP is off).  `dp_rank_and_size` reads both cases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from refit.archs import DEEPSEEK_ARCHS
from refit.errors import InvalidInput
from refit.integrations.vllm import compat
from refit.layouts import Layout, resolve_layout
from refit.layouts.vllm import replicated_shared_experts
from refit.quantization import from_hf_config
from refit.sides import Side
from refit.spec import ModelConfig, ModelSpec, build_spec


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    layout: Layout
    spec: ModelSpec


def spec_from_hf_config(name: str, hf_config: dict[str, Any], dtype: str) -> ModelSpec:
    cfg = dict(hf_config)
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = dtype
    return build_spec(name, ModelConfig.from_hf(cfg))


def layout_text(tp: int, dp: int, expert_parallel: bool) -> str:
    text = f"vllm:tp{tp}"
    if expert_parallel:
        text += f"ep{tp * dp}"
    if dp > 1:
        text += f"dp{dp}"
    return text


def dp_rank_and_size(pc: Any) -> tuple[int, int]:
    """(this replica's DP rank, the number of DP replicas) from a vLLM ``ParallelConfig``."""
    if pc.data_parallel_size > 1:  # one world across the replicas (MoE)
        return pc.data_parallel_rank, pc.data_parallel_size
    index = getattr(pc, "data_parallel_index", 0) or 0
    size = getattr(pc, "elastic_ep_max_dp_size", None) or 1
    if not 0 <= index < size:
        raise InvalidInput(f"vllm: data-parallel replica {index} of {size}: vLLM's parallel config disagrees with itself")
    return index, size


def identify(vllm_config: Any, replica: int | None = None, model_config: Any = None) -> WorkerIdentity:
    """This worker's rank, layout and spec (call inside a vLLM worker, after the model loaded).
    ``replica``: a server started on its own to serve replica ``replica`` of an elastic engine group
    (`refit.control.membership`): its ranks are that replica's, in a layout of ``replica + 1``
    replicas (the group's engines agree on everything but the count).  ``model_config``: the model
    to identify when it is not the target (a speculative draft model's ``draft_model_config``,
    which vLLM runs at the target's tensor-parallel size)."""
    mc, pc = model_config or vllm_config.model_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise InvalidInput(f"vllm: pipeline parallel (pp{pc.pipeline_parallel_size}) is not supported by refit yet")
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise InvalidInput("vllm: decode context parallel is not supported by refit yet")
    if getattr(pc, "prefill_context_parallel_size", 1) > 1:  # its ranks would share refit ranks
        raise InvalidInput(f"vllm: prefill context parallel (pcp{pc.prefill_context_parallel_size}) is not supported "
                         f"by refit yet")
    if getattr(pc, "enable_elastic_ep", False):
        raise InvalidInput("vllm: elastic expert parallel is not supported by refit yet")
    if getattr(pc, "enable_eplb", False):
        # EPLB adds redundant experts and moves experts between ranks while serving; refit's
        # layout places them where vLLM's loader first put them
        raise InvalidInput("vllm: expert-parallel load balancing (enable_eplb) is not supported by refit yet: it "
                         "moves experts between ranks while serving")
    quantized = getattr(mc.hf_config, "quantization_config", None)
    if quantized:  # its layers hold quantized weights and scales: refit must write those, in its format
        try:
            from_hf_config(quantized)
        except InvalidInput as e:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
            raise InvalidInput(f"vllm: the checkpoint is quantized ({method}) in a format refit does not write: {e}. "
                               f"Serve an unquantized checkpoint (online quantization such as quantization='fp8' "
                               f"is refitted), or one written by refit reshard --dst-dtype fp8") from None
    tp = pc.tensor_parallel_size
    dp_rank, dp = dp_rank_and_size(pc)
    dtype = str(mc.dtype).removeprefix("torch.")
    name = os.path.basename(os.path.normpath(str(mc.model)))
    spec = spec_from_hf_config(name, mc.hf_config.to_dict(), dtype)
    c = spec.config
    ep_on = bool(pc.enable_expert_parallel) and c.is_moe
    if c.arch in DEEPSEEK_ARCHS and c.num_shared_experts and \
            bool(getattr(pc, "use_sequence_parallel_moe", False)) != replicated_shared_experts(c.arch, tp, dp, ep_on):
        # DeepseekV2MoE builds its shared experts with disable_tp=use_sequence_parallel_moe; refit's
        # layout follows vLLM's default all2all backends, which other backends can contradict
        raise InvalidInput(f"vllm: {c.arch}'s shared experts are "
                         f"{'replicated' if getattr(pc, 'use_sequence_parallel_moe', False) else 'split over tp'} "
                         f"under all2all backend {getattr(pc, 'all2all_backend', '?')} (tp{tp} dp{dp}, expert "
                         f"parallel {ep_on}), not as refit's vllm layout places them: use the default backend "
                         f"(allgather_reducescatter) or a DeepEP one")
    if replica is not None:
        if isinstance(replica, bool) or not isinstance(replica, int) or replica < 0:
            raise InvalidInput(f"init_info replica must be a replica index (an int >= 0), got {replica!r}")
        if dp > 1:
            raise InvalidInput(f"init_info replica={replica}: this server runs {dp} data-parallel replicas itself, "
                               f"which register as such; replica is for a server that serves one")
        if c.is_moe:
            raise InvalidInput(f"init_info replica={replica}: {spec.name} is a MoE model, whose data-parallel ranks "
                               f"each hold part of the experts; only a dense model's replicas come and go")
        dp_rank, dp = replica, replica + 1
    layout = resolve_layout(layout_text(tp, dp, ep_on), spec, Side.ENGINE)
    return WorkerIdentity(dp_rank * tp + compat.tensor_parallel_rank(), layout, spec)
