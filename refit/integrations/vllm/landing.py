"""Landing a refit in a live vLLM model: stage the rank's shard, then put it in place.

The data plane writes this rank's shard into *staging* tensors in the layout vLLM's weight
loaders produce (refit's ``vllm:`` layout: fused qkv / gate_up / w13, vocab padding, expert
slices), never into the live model: a refit that fails half-way leaves the engine serving its
old weights untouched.  Once the coordinator committed the refit, `Landing.apply` runs between
engine steps (inside ``update_weights``) and puts each parameter in place by one of two paths,
decided once per parameter when the engine is set up and logged:

* ``inplace``: the live parameter still has the loader's shape and dtype and its module does no
  post-load processing (norms, and on CUDA every unquantized bf16/fp16 weight of a module without
  a transforming quant method): copy into its storage; addresses are kept (CUDA graphs hold them).
* ``reprocess``: vLLM transformed the weight after loading (CPU GEMM prepacking, MoE kernel
  layouts, quantization): restore the module's parameters in the loader layout from the staged
  shard and re-run that module's own post-load processing, module by module, so that only one
  module's extra copy is alive at a time.  MoE methods that skip their expert repacking on a
  "weight update" (vLLM 0.32's unquantized method with the CPU experts does, which makes vLLM's
  own reload of a Qwen3-MoE wrong on CPU) are processed as on first load.

A parameter vLLM builds in a wider dtype than the checkpoint's (GLM-4.5's float32 router weight,
which its loader upcasts from bf16) is staged in the checkpoint dtype, as refit's layout declares
it, and widened exactly when it lands (`landing_dtype`); a narrowing cast is refused.  Attention
layers that derive tensors from a refitted module at load time (MLA's ``W_UK_T`` / ``W_UV`` from
``kv_b_proj``) are re-processed after it, as on first load.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from refit.errors import RefitError
from refit.layouts import Layout
from refit.spec import ModelSpec

log = logging.getLogger(__name__)

INPLACE, REPROCESS = "inplace", "reprocess"


def transforms_after_loading(module: torch.nn.Module) -> bool:
    """Whether vLLM post-processes this module's weights after loading them."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    qm = getattr(module, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase) and \
            type(qm).process_weights_after_loading is not QuantizeMethodBase.process_weights_after_loading:
        return True
    return bool(is_deferred_attention_layer(module))


def landing_dtype(name: str, module: torch.nn.Module, attr: str, live: torch.Tensor,
                  staged: torch.dtype) -> torch.dtype:
    """The dtype the staged tensor ``name`` lands in: the one vLLM's loader filled the live
    parameter in.  That is the live tensor's dtype, except for a linear layer's weight / bias whose
    post-load processing may have changed it (CPU GEMM widens small biases): there the module's
    ``params_dtype``.  Only exact (widening) casts are allowed."""
    want = live.dtype
    if attr in ("weight", "bias") and transforms_after_loading(module):
        want = getattr(module, "params_dtype", want)
    exact = want == staged or (want.is_floating_point and staged.is_floating_point
                               and torch.promote_types(staged, want) == want)
    if not exact:
        raise RefitError(f"vllm: {name} is {want} in the live model but {staged} in the loader layout; "
                         f"casting it would lose bits")
    return want


def _method_name(module: torch.nn.Module) -> str:
    return type(getattr(module, "quant_method", module)).__name__


@dataclass
class _Group:
    """The refit tensors of one module that must be re-processed together."""

    module_name: str
    module: torch.nn.Module
    params: list[tuple[str, str]]  # (refit local name, attribute on the module)


class Landing:
    def __init__(self, model: torch.nn.Module, spec: ModelSpec, layout: Layout, rank: int,
                 device: torch.device) -> None:
        self.model = model
        self.local = layout.local_tensors(spec, rank)
        self.staging: dict[str, torch.Tensor] = {
            lt.name: torch.zeros(lt.shape, dtype=getattr(torch, lt.dtype), device=device) for lt in self.local}
        self.paths: dict[str, str] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # the dtype each staged tensor lands in
        self.inplace: list[tuple[str, torch.nn.Module, str]] = []
        groups: dict[str, _Group] = {}
        for lt in self.local:
            module_name, _, attr = lt.name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise RefitError(f"vllm: the model has no module {module_name!r} for refit tensor {lt.name!r}") \
                    from None
            live = getattr(module, attr, None)
            if not isinstance(live, torch.Tensor):
                raise RefitError(f"vllm: {module_name} has no tensor {attr!r} for refit tensor {lt.name!r}")
            self.dtypes[lt.name] = landing_dtype(lt.name, module, attr, live, self.staging[lt.name].dtype)
            same = tuple(live.shape) == lt.shape and live.dtype == self.dtypes[lt.name]
            if transforms_after_loading(module):
                self.paths[lt.name] = REPROCESS
                groups.setdefault(module_name, _Group(module_name, module, [])).params.append((lt.name, attr))
            elif same:
                self.paths[lt.name] = INPLACE
                self.inplace.append((lt.name, module, attr))
            else:
                raise RefitError(f"vllm: {lt.name} is {list(live.shape)} {live.dtype} in the live model, the loader "
                                 f"layout is {list(lt.shape)} {lt.dtype}, and {type(module).__name__} declares no "
                                 f"post-load processing to re-run")
        self.groups = list(groups.values())
        # Modules that share a re-processed tensor (a tied LM head holds the embedding's weight)
        # keep their own processed copy, and attention layers derive tensors from a refitted
        # submodule (MLA's W_UK_T / W_UV from kv_b_proj): re-process them too, after the owners
        # and, as vLLM's loader does, attention layers last.
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        refitted = {id(g.module) for g in self.groups} | {id(m) for _, m, _ in self.inplace}
        shared = {id(getattr(g.module, attr)) for g in self.groups for _, attr in g.params}
        self.aliases: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if name in groups or not transforms_after_loading(module):
                continue
            if is_deferred_attention_layer(module):
                derives = any(id(m) in refitted for m in module.modules())
            else:
                derives = any(id(t) in shared for t in module.parameters(recurse=False))
            if derives:
                self.aliases.append((name, module))
        self.aliases.sort(key=lambda a: is_deferred_attention_layer(a[1]))
        counts = Counter(self.paths.values())
        log.info("refit landing, rank %d: %d parameters in place, %d re-processed in %d modules (+%d sharing or "
                 "deriving from them) (e.g. %s)", rank, counts[INPLACE], counts[REPROCESS], len(self.groups), len(self.aliases),
                 ", ".join(f"{g.module_name}: {_method_name(g.module)}" for g in self.groups[:3]))
        for name, path in self.paths.items():
            log.debug("refit landing: %s -> %s", name, path)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staging.values())

    @torch.no_grad()
    def apply(self, model_config: Any) -> float:
        """Put the staged shard into the live model; returns the seconds it took."""
        t0 = time.perf_counter()
        for name, module, attr in self.inplace:
            getattr(module, attr).data.copy_(self.staging[name])
        for g in self.groups:
            self._reprocess(g, model_config)
        for _, module in self.aliases:
            self._process(module, model_config)
        return time.perf_counter() - t0

    def _reprocess(self, g: _Group, model_config: Any) -> None:
        for name, attr in g.params:
            live, staged = getattr(g.module, attr), self.staging[name]
            if tuple(live.shape) == tuple(staged.shape) and live.dtype == self.dtypes[name]:
                live.data.copy_(staged)  # e.g. an embedding, which keeps its weight next to a packed copy
            else:
                # a fresh tensor: the processed module may keep it, and the staging buffer is
                # rewritten by the next refit
                setattr(g.module, attr, torch.nn.Parameter(staged.to(self.dtypes[name], copy=True),
                                                           requires_grad=False))
        self._process(g.module, model_config)

    @staticmethod
    def _process(module: torch.nn.Module, model_config: Any) -> None:
        """Run the module's own post-load processing, as vLLM's loader does on first load."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        qm = getattr(module, "quant_method", None)
        if qm is not None:
            if getattr(qm, "moe_kernel", None) is not None:
                qm.moe_kernel = None  # process as on first load (see the module docstring)
            qm.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        if is_deferred_attention_layer(module):
            module.process_weights_after_loading(model_config.dtype)
