"""vLLM's LoRA slots: where one adapter (`refit.adapters`) lies on each rank of a vLLM engine.

vLLM 0.32 wraps each base linear layer of a LoRA engine (``enable_lora``) in a LoRA layer holding,
per packed sub-module (slice), ``lora_a_stacked[i]`` ``[max_loras, 1, max_lora_rank, in]`` and
``lora_b_stacked[i]`` ``[max_loras, 1, out, max_lora_rank]``; an adapter in slot ``s`` of rank
``r`` fills ``[s, 0, :r, :]`` of A and ``[s, 0, :, :r]`` of B, the rest zero.  What a TP rank
holds is what ``set_lora`` copies after ``slice_lora_a`` / ``slice_lora_b``
(``vllm/lora/layers/column_parallel_linear.py``, ``row_parallel_linear.py``; not fully sharded):

* ``qkv_proj`` (``MergedQKVParallelLinearWithLoRA``): slices q, k, v.  A whole (the input is not
  split); B's rows of this rank's q heads / kv heads (kv heads replicated when fewer than tp:
  rank t holds kv head ``t // (tp / kv)``), as the base weight.
* ``gate_up_proj`` (``MergedColumnParallelLinearWithLoRA``): slices gate, up; A whole, B rows
  ``t*I/tp ..``.
* ``o_proj`` / ``down_proj`` (``RowParallelLinearWithLoRA``): one slice; A's columns of this
  rank's input shard, B whole.

Local tensor names say where they land: ``model.layers.{l}.self_attn.qkv_proj.lora_b_stacked.1``
is slice 1 (k) of that module's B, ``[kv_rows / tp, r]`` (the slot and the rank padding are the
engine's business: `refit.integrations.vllm.lora_slot`).
"""

from __future__ import annotations

from typing import Any

from refit.adapters import TARGETS, check_adapter, target_shape, tensor_name
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec

# vLLM's packed modules (packed_modules_mapping of Llama / Qwen2 / Qwen3) and each target's slice
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "down_proj": ("down_proj", 0)}
ROW_PARALLEL = ("o_proj", "down_proj")


def vllm_module(target: str, layer: int) -> tuple[str, int]:
    """(vLLM's LoRA module name, slice index) of ``target`` in ``layer``."""
    packed, index = PACKED[target]
    return f"model.layers.{layer}.{TARGETS[target]}.{packed}", index


def lora_local_tensors(layout: Any, spec: ModelSpec, rank: int) -> list[LocalTensor]:
    """The adapter's tensors on ``rank`` of a resolved `VllmLayout` (dense models: dp replicas
    hold the same), in vLLM's module order."""
    c = spec.config
    lora = check_adapter(c)
    T, t, r, dt = layout.tp, rank % layout.tp, lora.rank, c.dtype
    out: list[LocalTensor] = []
    for layer in range(c.num_layers):
        for target in lora.targets:
            module, s = vllm_module(target, layer)
            rows, cols = target_shape(c, target)
            a, b = tensor_name(target, "lora_A"), tensor_name(target, "lora_B")
            pos = spec.layer_pos(a, layer)
            if target in ROW_PARALLEL:  # A split on its input columns, B whole
                n = cols // T
                a_piece, a_shape = Piece(a, (pos, 0, t * n), (1, r, n), (0, 0, 0)), (r, n)
                b_piece, b_shape = Piece(b, (pos, 0, 0), (1, rows, r), (0, 0, 0)), (rows, r)
            else:  # column parallel: A whole, B's rows of this rank
                lo, n = _rows(c, target, T, t)
                a_piece, a_shape = Piece(a, (pos, 0, 0), (1, r, cols), (0, 0, 0)), (r, cols)
                b_piece, b_shape = Piece(b, (pos, lo, 0), (1, n, r), (0, 0, 0)), (n, r)
            out.append(LocalTensor(f"{module}.lora_a_stacked.{s}", a_shape, dt, (a_piece,)))
            out.append(LocalTensor(f"{module}.lora_b_stacked.{s}", b_shape, dt, (b_piece,)))
    return out


def _rows(c: Any, target: str, T: int, t: int) -> tuple[int, int]:
    """(first row, rows) of a column-parallel target's output held by tp rank ``t``."""
    hd = c.head_dim
    if target == "q_proj":
        n = c.num_heads // T * hd
        return t * n, n
    if target in ("k_proj", "v_proj"):
        if c.num_kv_heads >= T:
            n = c.num_kv_heads // T * hd
            return t * n, n
        return (t // (T // c.num_kv_heads)) * hd, hd
    n = c.intermediate_size // T  # gate_proj / up_proj
    return t * n, n
