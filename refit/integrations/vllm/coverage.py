"""Whether refit's layout covers the live vLLM model: checked once, when the landing is built,
so that an engine never reports a version it does not fully hold.

* `left_behind`: live parameters no refit tensor writes (a module refit's spec does not know,
  such as a Qwen3-MoE config's ``shared_expert``) would keep the weights loaded at start.
* `loaded_shape`: what vLLM built a parameter as, before its post-load processing changed it.
  For a re-processed module (every GEMM on CPU, MoE experts, quantized layers) the live tensor
  says nothing about the shape its loader takes; vLLM 0.32 records it for its own reload
  (``record_metadata_for_reloading``), and a layout that disagrees would be loaded wrongly.
"""

from __future__ import annotations

import torch


def left_behind(model: torch.nn.Module, written_modules: set[int], written: set[int]) -> list[str]:
    """Parameters of ``model`` (by name) that no refit tensor writes (ids in ``written``), outside
    the modules whose re-processing recomputes theirs (ids in ``written_modules``: what processing
    adds, such as online quantization's scales, is no refit tensor)."""
    return [f"{name}.{attr}" if name else attr for name, module in model.named_modules()
            if id(module) not in written_modules
            for attr, p in module.named_parameters(recurse=False) if id(p) not in written]


def loaded_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...] | None:
    """The shape vLLM built ``module.attr`` with, as its reload recorded it (None: not recorded)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # another vLLM: no check
        return None
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(attr) if info is not None else None
    return tuple(meta.shape) if meta is not None else None
