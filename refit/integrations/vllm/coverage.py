"""Whether refit's layout covers the live vLLM model: checked once, when the landing is built,
so that an engine never reports a version it does not fully hold.

* `left_behind`: live parameters no refit tensor writes (a module refit's spec does not know,
  such as a Qwen3-MoE config's ``shared_expert``) would keep the weights loaded at start.
* `compat.loaded_shape`: what vLLM built a parameter as, before its post-load processing changed
  it.  For a re-processed module (every GEMM on CPU, MoE experts, quantized layers) the live
  tensor says nothing about the shape its loader takes; vLLM records it for its own reload
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
