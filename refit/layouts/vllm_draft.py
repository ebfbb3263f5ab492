"""vLLM's drafters: where the tensors of an MTP or EAGLE drafter spec (`refit.drafters`) lie on each
rank of a speculative engine, as vLLM 0.32's loaders fill them.

* MTP (``DeepSeekMTP``): layer ``N``'s decoder lives under ``model.layers.{N}.mtp_block.`` (its
  ``_rewrite_spec_layer_name``), split and fused over tp exactly as the target's layers
  (`VllmLayout._layer_parts`: ``fused_qkv_a_proj``, ``gate_up_proj``, experts' ``w13_weight`` ...);
  ``enorm`` / ``hnorm`` / ``shared_head.norm`` are RMSNorms and ``eh_proj`` a plain ``nn.Linear``
  ([H, 2H]): whole on every rank.  The layer's ``embed_tokens`` and ``shared_head.head`` are the
  target's modules (not the drafter's tensors).
* EAGLE (``EagleLlamaForCausalLM``): ``model.layers.{i}.`` of its own ``nn.ModuleList`` (0-based,
  whatever the attention prefix), fused ``qkv_proj`` / ``gate_up_proj`` split over tp as Llama's;
  layer 0 has no ``input_layernorm``; ``model.fc`` is a ``ReplicatedLinear``: whole on every rank.
"""

from __future__ import annotations

from typing import Protocol

from refit.drafters import EAGLE, MTP, MTP_OWN, mtp_layers
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec

MTP_BLOCK = "mtp_block."


class VllmParts(Protocol):
    """What a drafter's tensors are built from: the target's decoder-layer pieces of a vLLM layout
    (`refit.layouts.vllm.VllmLayout`, which imports this module to lay out a drafter spec)."""

    tp: int

    def _layer_parts(self, spec: ModelSpec, layer: int,
                     t: int) -> tuple[tuple[LocalTensor, ...], tuple[LocalTensor, ...]]: ...

    def _qkv(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]: ...

    def _dense_mlp(self, spec: ModelSpec, p: str, layer: int, t: int, shared: bool = False,
                   ways: int | None = None) -> list[LocalTensor]: ...

    def _routed_experts(self, spec: ModelSpec, p: str, layer: int, rank: int) -> list[LocalTensor]: ...


def drafter_local_tensors(layout: VllmParts, spec: ModelSpec, rank: int) -> list[LocalTensor]:
    c = spec.config
    if c.drafter == MTP:
        return _mtp(layout, spec, rank)
    if c.drafter == EAGLE:
        return _eagle(layout, spec, rank)
    raise ValueError(f"not a drafter spec: {spec.name}")


def drafter_varying_tensors(layout: VllmParts, spec: ModelSpec, rank: int) -> list[LocalTensor]:
    """The routed experts of the MTP layers (what differs between the dp ranks of one tp rank)."""
    if spec.config.drafter != MTP:
        return []
    return [lt for layer in spec.config.moe_layers
            for lt in layout._routed_experts(spec, f"model.layers.{layer}.{MTP_BLOCK}", layer, rank)]


def _whole(spec: ModelSpec, local: str, tensor: str, layer: int | None) -> LocalTensor:
    """A tensor every rank holds whole (norms, ``eh_proj``, EAGLE's ``fc``)."""
    ts = spec[tensor]
    if layer is None:
        return LocalTensor(local, ts.shape, ts.dtype, (Piece(tensor, (0,) * len(ts.shape), ts.shape,
                                                             (0,) * len(ts.shape)),))
    inner = ts.shape[1:]
    pos = spec.layer_pos(tensor, layer)
    return LocalTensor(local, inner, ts.dtype, (Piece(tensor, (pos,) + (0,) * len(inner), (1,) + inner,
                                                      (0,) * (len(inner) + 1)),))


def _mtp(layout: VllmParts, spec: ModelSpec, rank: int) -> list[LocalTensor]:
    t = rank % layout.tp
    out: list[LocalTensor] = []
    for layer in mtp_layers(spec.config):
        p = f"model.layers.{layer}."
        for own in MTP_OWN:
            out.append(_whole(spec, p + own, f"model.layers.*.{own}", layer))
        head, tail = layout._layer_parts(spec, layer, t)
        block = [_renamed(lt, p, p + MTP_BLOCK) for lt in head]
        if layer in spec.config.moe_layers:
            block.extend(layout._routed_experts(spec, p + MTP_BLOCK, layer, rank))
        block.extend(_renamed(lt, p, p + MTP_BLOCK) for lt in tail)
        out.extend(block)
    return out


def _renamed(lt: LocalTensor, old: str, new: str) -> LocalTensor:
    return LocalTensor(new + lt.name.removeprefix(old), lt.shape, lt.dtype, lt.pieces)


def _eagle(layout: VllmParts, spec: ModelSpec, rank: int) -> list[LocalTensor]:
    c = spec.config
    T, H, dt = layout.tp, c.hidden_size, c.dtype
    t = rank % T
    out: list[LocalTensor] = []
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        out.extend(layout._qkv(spec, p, layer, t))
        o = "model.layers.*.self_attn.o_proj.weight"
        cols = spec[o].shape[2] // T
        out.append(LocalTensor(p + "self_attn.o_proj.weight", (H, cols), dt,
                               (Piece(o, (spec.layer_pos(o, layer), 0, t * cols), (1, H, cols), (0, 0, 0)),)))
        out.extend(layout._dense_mlp(spec, p, layer, t))
        if layer:  # layer 0's input_layernorm is nn.Identity in vLLM's EAGLE
            out.append(_whole(spec, p + "input_layernorm.weight", "model.layers.*.input_layernorm.weight", layer))
        out.append(_whole(spec, p + "post_attention_layernorm.weight",
                          "model.layers.*.post_attention_layernorm.weight", layer))
    out.append(_whole(spec, "model.fc.weight", "model.fc.weight", None))
    return out
