"""What a vLLM worker is, in refit's terms: its rank, layout and model spec, from vLLM's configs.

* spec: refit's canonical tensors from the HF config vLLM loaded (``hf_config``), in the dtype
  vLLM runs (``model_config.dtype``, which may differ from the checkpoint's);
* layout: ``vllm:tpT[epE][dpD]`` from the parallel config (expert parallel spans tp*dp ranks);
* rank: dp_rank * tp + tp_rank, the rank refit's vLLM layout numbers its tensors by.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from refit.errors import RefitError
from refit.layouts import Layout, resolve_layout
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


def identify(vllm_config: Any) -> WorkerIdentity:
    """This worker's rank, layout and spec (call inside a vLLM worker, after the model loaded)."""
    from vllm.distributed import parallel_state as ps

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise RefitError(f"vllm: pipeline parallel (pp{pc.pipeline_parallel_size}) is not supported by refit yet")
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise RefitError("vllm: decode context parallel is not supported by refit yet")
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_dp_group().rank_in_group if dp > 1 else 0
    dtype = str(mc.dtype).removeprefix("torch.")
    name = os.path.basename(os.path.normpath(str(mc.model)))
    spec = spec_from_hf_config(name, mc.hf_config.to_dict(), dtype)
    layout = resolve_layout(layout_text(tp, dp, bool(pc.enable_expert_parallel) and spec.config.is_moe), spec, "dst")
    return WorkerIdentity(dp_rank * tp + tp_rank, layout, spec)
