"""An oracle for block-FP8 weight placement: what vLLM's own loading of an FP8 block-quantized
checkpoint leaves in one tensor-parallel rank's parameters, computed on CPU without an FP8 kernel.

Why: refit places FP8 weights (float8_e4m3fn values and their float32 ``weight_scale_inv`` block
scales) directly into a vLLM rank's parameters.  Whether it puts every element and every scale
where vLLM would can only be judged against vLLM itself, and an engine cannot serve FP8 block
quantization on the CPUs the suite runs on (vLLM's CPU block-FP8 GEMMs need AMX).  The
*placement* does not need a kernel, though: it is decided by the quant methods' ``create_weights``
(shapes, dtypes, the refusals of ``validate_fp8_block_shape``) and by the parameters' own
``weight_loader``s.  This module runs exactly those and stops before
``process_weights_after_loading`` (which repacks for a kernel), so the tensors it returns are the
loader layout that a weight update of a live engine has to reproduce.

How (``load_fp8_rank``):

* vLLM's configuration comes from vLLM: the HF config dict is written as ``config.json`` into a
  temporary directory and read by ``ModelConfig``; ``VllmConfig`` builds the real ``Fp8Config``
  from its ``quantization_config`` (``is_checkpoint_fp8_serialized``, ``weight_block_size``, any
  ``ignored_layers`` / ``modules_to_not_convert``), with ``tensor_parallel_size = tp_size``.
* The model is vLLM's own model class for the architecture (``Qwen3ForCausalLM``,
  ``Qwen3MoeForCausalLM``), built by ``initialize_model`` as vLLM's model loader builds it (default
  dtype and device set the same way).  So the parallel layers (``QKVParallelLinear``,
  ``MergedColumnParallelLinear``, ``RowParallelLinear``, the ``FusedMoEFactory`` runner and its
  ``RoutedExperts``) are constructed by vLLM's code with vLLM's arguments, and
  ``Fp8LinearMethod.create_weights`` / ``Fp8MoEMethod.create_weights`` create the parameters.
  Building the whole model rather than hand-building the layers costs ~0.1 s and makes the
  parameter names those of vLLM's ``named_parameters()`` by construction.
* The checkpoint's FP8 tensors (every float8_e4m3fn tensor and every ``*.weight_scale_inv``) are
  fed to the model's own ``load_weights``: its ``WeightsMapper`` turns ``q_proj``/``k_proj``/
  ``v_proj`` into ``qkv_proj`` shards ``"q"``/``"k"``/``"v"`` and ``gate_proj``/``up_proj`` into
  ``gate_up_proj`` shards 0/1, and the MoE runner's ``RoutedExperts.load_weights`` maps
  ``experts.{e}.gate_proj``/``up_proj``/``down_proj`` to ``w13`` shards ``"w1"``/``"w3"`` and
  ``w2`` with expert id ``e``.  Nothing here re-implements that routing.

How the rank is faked: vLLM's layers and parameters read the TP rank and size through
``get_tensor_model_parallel_rank()`` / ``_world_size()``, which read the module global
``vllm.distributed.parallel_state._TP`` (likewise ``_DP``, ``_PCP``, ``_EP``, ``_PP``).  For the
duration of one call those globals are replaced (``unittest.mock.patch.object``) with stand-ins
that report the requested rank and size: TP ``(tp_rank, tp_size)``, DP, PCP and PP ``(0, 1)``,
EP ``(tp_rank, tp_size)`` (vLLM's EP group spans dp x pcp x tp even with expert parallelism off,
which it is here: every rank holds every expert, the experts' intermediate dim split over TP).
Patching the globals rather than each module's imported function catches every call site at
once; no torch.distributed process group is created, and a stand-in raises on anything but rank
and size, so a loader that tried to communicate would fail here instead of being faked.  This is
the approach of ``tests/harness/vllm_capture/direct.py``, whose captures were checked against
live engines.

What else is replaced for the call, and why it cannot change the result:

* ``init_fp8_linear_kernel`` and ``select_fp8_moe_backend`` (as imported by vLLM's ``fp8``
  module) return a placeholder: they choose the GEMM kernel, which needs FP8 hardware and is used
  only after loading.  ``create_weights`` registers the parameters before choosing it, and the MoE
  layer's sizes do not depend on it (``Fp8MoEMethod`` keeps the base ``maybe_roundup_sizes``).  A
  kernel vLLM could not find would refuse the deployment on real hardware; that is not a layout
  refusal and is not reproduced.
* ``os.environ`` is restored afterwards: building a ``VllmConfig`` on the CPU platform sets
  process-wide variables (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ``VLLM_WORKER_MULTIPROC_METHOD``)
  that would leak into the subprocesses of later tests.

Determinism: vLLM allocates FP8 weights with ``torch.empty``; elements no loader writes would be
whatever memory held.  Before loading, every float8 parameter is filled with NaN (0x7F), so a gap
is visible (and compares unequal to anything) instead of random.  Scales keep vLLM's own initial
values (linear ``weight_scale_inv``: ``torch.finfo(float32).min``; MoE scales: 1.0).

Returned: for every parameter of a layer that vLLM quantizes with ``Fp8LinearMethod`` /
``Fp8MoEMethod`` and that the checkpoint's FP8 tensors loaded into, a clone of the value the loader
left, keyed by vLLM's full parameter name, fp8 staying fp8.  Unquantized checkpoint tensors (norms,
embeddings, lm_head, a bf16 router) are not loaded, so not returned.  Note that vLLM quantizes
Qwen3-MoE's router (``mlp.gate``, a ``ReplicatedLinear``) too unless the quantization config
exempts it by full module name (``ignored_layers`` / ``modules_to_not_convert``, e.g.
``model.layers.0.mlp.gate``); it would then cast a bf16 router into its FP8 parameter and keep the
scales at their initial value.  An FP8 router in the checkpoint is loaded and returned like any
other FP8 layer.

Refusals propagate unchanged, wherever vLLM makes them: at construction (``create_weights``:
``validate_fp8_block_shape``'s ``ValueError`` when a TP shard of a row-parallel layer cuts a
128-block, ``validate_fp8_block_shape_moe``'s for expert shards; the attention's
``AssertionError`` when heads do not divide) or inside the loaders (vLLM 0.32 skips the block check
for a merged ``qkv_proj`` / ``gate_up_proj`` whose parts are not block multiples, and its scale
placement then runs past the scale parameter: a ``RuntimeError`` from ``narrow`` or ``copy_``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterator
from unittest import mock

import torch

from tests.harness.vllm_capture.direct import _DeviceGroup  # rank and size of a group, as vLLM reads them

# HF model_type -> vLLM model class (its registry name), for configs that do not name it.
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The quant methods whose parameters the oracle reports (vLLM's block-FP8 linear and MoE methods).
FP8_METHODS = ("Fp8LinearMethod", "Fp8MoEMethod")
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = ".weight_scale_inv"


class _GroupStandIn:
    """A vLLM ``GroupCoordinator`` reduced to one process's rank and size in it.

    Construction and weight loading must not communicate; if vLLM ever did, the attribute lookup
    raises here rather than returning something that would fake the result."""

    def __init__(self, kind: str, rank: int, size: int) -> None:
        self.kind, self.rank_in_group, self.world_size = kind, rank, size
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1  # read of the PP group
        self.device_group = _DeviceGroup(rank, size)

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(f"stand-in {self.kind} group (rank {self.rank_in_group} of {self.world_size}) has "
                             f"no {attr!r}: vLLM used more than its rank and size while building or loading")


class _NoKernel:
    """Placeholder for the FP8 GEMM kernel / MoE backend vLLM would choose: the oracle stops before
    anything uses one, and any use would be a bug of the oracle, so every attribute raises."""

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(f"the FP8 oracle builds no kernel (asked for {attr!r})")


def _no_linear_kernel(*args: Any, **kwargs: Any) -> _NoKernel:
    return _NoKernel()


def _no_moe_backend(*args: Any, **kwargs: Any) -> tuple[_NoKernel, None]:
    return _NoKernel(), None


@contextlib.contextmanager
def _as_rank(tp_size: int, tp_rank: int) -> Iterator[None]:
    """For the block: vLLM's parallel-state globals report TP rank ``tp_rank`` of ``tp_size`` (DP,
    PCP and PP of one, EP as TP) and no FP8 kernel is chosen; on exit all of that is undone and
    ``os.environ`` is restored to what it was on entry."""
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ))
        for attr, group in (("_TP", _GroupStandIn("tp", tp_rank, tp_size)),
                            ("_DP", _GroupStandIn("dp", 0, 1)),
                            ("_PCP", _GroupStandIn("pcp", 0, 1)),
                            ("_PP", _GroupStandIn("pp", 0, 1)),
                            ("_EP", _GroupStandIn("ep", tp_rank, tp_size))):
            stack.enter_context(mock.patch.object(ps, attr, group))
        stack.enter_context(mock.patch.object(vllm_fp8, "init_fp8_linear_kernel", _no_linear_kernel))
        stack.enter_context(mock.patch.object(vllm_fp8, "select_fp8_moe_backend", _no_moe_backend))
        yield


def _check_config(config: dict, tp_size: int, tp_rank: int) -> None:
    """Refuse what the oracle does not model before vLLM sees it (a misread config would still
    produce tensors, just not the ones a deployment gets)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not one the oracle knows ({sorted(ARCHITECTURES)})")
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or not qc.get("weight_block_size"):
        raise ValueError(f"not a block-FP8 checkpoint config: quantization_config = {qc!r}")


def _vllm_config(config: dict, tp_size: int, directory: str) -> Any:
    """The ``VllmConfig`` of a TP=``tp_size`` engine of this checkpoint config, built by vLLM from
    a ``config.json`` (so the quant config is vLLM's parse of ``quantization_config``)."""
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    hf = dict(config)
    hf.setdefault("architectures", [ARCHITECTURES[hf["model_type"]]])
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)
    # The activation dtype only sets the FP8 layers' orig_dtype (and the unquantized tensors,
    # which are not reported); the checkpoint's own dtype where it names one, else bfloat16.
    dtype = "auto" if ("torch_dtype" in hf or "dtype" in hf) else "bfloat16"
    model_config = ModelConfig(model=directory, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True)
    return VllmConfig(model_config=model_config, parallel_config=ParallelConfig(tensor_parallel_size=tp_size))


def _fp8_feed(checkpoint: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors the oracle loads: the FP8 weights and the block scales.  Each is a
    new tensor object on the caller's storage (``detach``), because vLLM's ``WeightsMapper`` tags
    the tensors it routes with a ``shard_id`` attribute, and the caller's tensors stay untouched
    (the loaders only read them)."""
    return [(name, t.detach()) for name, t in checkpoint.items() if t.dtype == FP8 or name.endswith(SCALE_SUFFIX)]


def _fp8_parameter_names(model: torch.nn.Module) -> set[str]:
    """Full names of the parameters that vLLM's block-FP8 quant methods created (the router of a
    config that does not exempt it is one of them; norms and embeddings are not)."""
    names = set()
    for mod_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ in FP8_METHODS:
            names.update(f"{mod_name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return names


def load_fp8_rank(checkpoint: dict[str, torch.Tensor], config: dict, tp_size: int,
                  tp_rank: int) -> dict[str, torch.Tensor]:
    """What vLLM 0.32's loading of block-FP8 ``checkpoint`` puts into TP rank ``tp_rank`` of
    ``tp_size`` (expert parallelism off), before ``process_weights_after_loading``.

    ``checkpoint``: HF names to tensors, the FP8 weights in float8_e4m3fn with their float32
    ``*.weight_scale_inv`` (``[ceil(N/128), ceil(K/128)]``); other tensors are ignored.
    ``config``: the HF config dict (``model_type`` ``qwen3`` or ``qwen3_moe``) with a block-FP8
    ``quantization_config``.

    Returns vLLM's full parameter name -> a clone of what the loaders left there, for every
    parameter of an FP8-quantized layer that the checkpoint loaded: per decoder layer ``i``,
    ``model.layers.{i}.self_attn.qkv_proj.weight`` / ``.weight_scale_inv``, ``...o_proj...``, and
    ``model.layers.{i}.mlp.gate_up_proj...`` / ``mlp.down_proj...`` (dense) or
    ``model.layers.{i}.mlp.experts.routed_experts.w13_weight`` / ``w13_weight_scale_inv`` /
    ``w2_weight`` / ``w2_weight_scale_inv`` (MoE).  Raises what vLLM raises for a layout it refuses.
    """
    _check_config(config, tp_size, tp_rank)
    from tests.harness.marks import require_vllm_mark

    require_vllm_mark("runs vLLM's model loaders")
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    feed = _fp8_feed(checkpoint)
    with tempfile.TemporaryDirectory(prefix="refit-fp8-oracle-") as directory, _as_rank(tp_size, tp_rank):
        vllm_config = _vllm_config(config, tp_size, directory)
        # As BaseModelLoader.load_model: build under the model dtype, on the load device.
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        fp8_names = _fp8_parameter_names(model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in fp8_names:
                if params[name].dtype == FP8:
                    params[name].data.fill_(float("nan"))
        with set_current_vllm_config(vllm_config), torch.no_grad():
            loaded = set(model.load_weights(iter(feed)))
    return {name: p.detach().clone() for name, p in params.items() if name in fp8_names and name in loaded}
