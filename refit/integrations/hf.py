"""Attach an unsharded transformers model (one process) to the refit control plane.

    from refit.integrations import hf as refit_hf
    agent = refit_hf.attach(model, "127.0.0.1:50051", group="trainer")

The spec comes from ``model.config``; the layout is ``hf`` (one rank holding every tensor).
Parameters are served as views of their live storage under refit's HF names:

* most parameters already carry their HF checkpoint name;
* transformers 5 stores a MoE layer's experts fused (``Qwen3MoeExperts``):
  ``mlp.experts.gate_up_proj`` [E, 2I, H] whose rows are [gate; up] of each expert (its forward
  takes ``linear(x, gate_up_proj[e]).chunk(2)`` as gate, up) and ``mlp.experts.down_proj``
  [E, H, I]; expert e's ``gate_proj.weight`` is then ``gate_up_proj[e, :I]``, ``up_proj.weight``
  ``gate_up_proj[e, I:]``, ``down_proj.weight`` ``down_proj[e]`` — all views;
* the per-expert form (``mlp.experts.{e}.gate_proj.weight``, transformers 4) is served as is;
* a tied ``lm_head.weight`` is the embedding itself: served once, as ``model.embed_tokens.weight``;
* DeepSeek-V3's and GLM-4.5's router bias ``mlp.gate.e_score_correction_bias`` is a (float32)
  buffer, not a parameter: served from the module's buffer, looked up again at every check.

A parameter that maps to none of refit's tensors (a Llama's ``mlp_bias`` or ``o_proj`` bias, an
untied ``lm_head`` when the config says tied) fails the attach, naming it.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch

from refit.control.agent import TrainerAgent
from refit.errors import InvalidInput
from refit.integrations._common import (ParameterPaths, Served, global_rank, refuse_unmapped, spec_of_hf_config,
                                        start_trainer)
from refit.layouts import HFLayout, Layout
from refit.spec import ModelSpec

__all__ = ["attach", "serve_hf_parameters"]

FUSED_EXPERTS = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def attach(model: torch.nn.Module, address: str | None = None, *, group: str = "trainer", token: str | None = None,
           lora: str | None = None, adapter: str | None = None, **agent_options: Any) -> TrainerAgent:
    """Register this process's unsharded transformers ``model`` as rank (global rank) of ``group``
    and serve its live parameters; returns the started agent.  Raises `refit.InvalidInput`, before
    registering, for a parameter refit cannot place or a dtype the config does not name; a refit
    follows parameters replaced since attach (by module path); one whose tie broke, that left its path
    or now lies on another device fails with `refit.RefitFailed` naming it.  ``address`` and
    ``token`` default to ``$REFIT_ADDRESS`` (else 127.0.0.1:50051) and ``$REFIT_TOKEN``.
    ``lora="merge"``: ``model`` is a PEFT LoRA model, served merged (`refit.integrations.lora`).
    ``adapter="name"``: only that LoRA adapter's A/B matrices are served, into engines holding it in
    their LoRA slots (`refit.adapters`, docs/lora.md)."""
    from refit.integrations import lora as refit_lora

    merged: dict[str, Callable[[], torch.Tensor]] = {}
    if adapter is not None:
        if lora is not None:
            raise InvalidInput(f"lora={lora!r} and adapter={adapter!r}: pick one (merged weights, or the adapter "
                               f"alone into the engines' LoRA slots)")
        return _attach_adapter(model, adapter, address, group=group, token=token, **agent_options)
    if lora == "merge":
        model, named, merged = refit_lora.merged_parameters(model)
    elif lora is not None:
        raise InvalidInput(f"lora={lora!r}: the one mode is 'merge' (the engine serves W + scaling * B @ A); "
                           f"adapter='name' moves one adapter alone")
    elif refit_lora.is_lora_model(model):
        raise InvalidInput("the model holds LoRA layers: attach with lora='merge' to serve the merged weights "
                           "(the engine then needs no LoRA), or with adapter='name' to move that adapter alone")
    else:
        named = list(model.named_parameters(remove_duplicate=False))
    spec = spec_of_hf_config(model.config, dict(named))
    layout = HFLayout().resolve(spec)
    rank = global_rank()
    if rank != 0:
        raise InvalidInput(f"refit_hf.attach serves an unsharded model as the one rank of layout hf, but this process "
                         f"is global rank {rank}: use refit_fsdp.attach for a sharded model, or attach on rank 0 only")
    served = serve_hf_parameters(named, spec, layout, 0, local=lambda p: p.detach(), buffer=model.get_buffer,
                                 paths=ParameterPaths(model))
    served.update({name: Served(f"{name} (LoRA merged)", compute) for name, compute in merged.items()})
    return start_trainer(address, group=group, rank=0, spec=spec, layout=layout, served=served, token=token,
                         **agent_options)


def _attach_adapter(model: torch.nn.Module, adapter: str, address: str | None, *, group: str, token: str | None,
                    **agent_options: Any) -> TrainerAgent:
    """Serve one LoRA adapter's A/B matrices (views of the live parameters) as the one rank of
    layout ``hf``, under its adapter spec (`refit.spec.adapter_spec`)."""
    from refit.spec import adapter_spec
    from refit.integrations.lora import adapter_parameters

    base, named, rank, targets, scaling = adapter_parameters(model, adapter)
    spec = adapter_spec(spec_of_hf_config(base.config, dict(named)), rank, targets, scaling)
    layout = HFLayout().resolve(spec)
    if global_rank() != 0:
        raise InvalidInput(f"refit_hf.attach serves an unsharded model as the one rank of layout hf, but this process "
                           f"is global rank {global_rank()}: attach on rank 0 only")
    paths = ParameterPaths(base)
    served = {name: Served(name, lambda now=paths.follow(p): now().detach()) for name, p in named}
    return start_trainer(address, group=group, rank=0, spec=spec, layout=layout, served=served, token=token,
                         **agent_options)


def serve_hf_parameters(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, layout: Layout, rank: int,
                        local: Callable[[torch.Tensor], torch.Tensor], experts_held: range | None = None,
                        buffer: Callable[[str], torch.Tensor] | None = None,
                        buffer_local: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        paths: ParameterPaths | None = None) -> dict[str, Served]:
    """Map parameters under HF names to ``layout``'s local tensors of ``rank`` (whose names are HF
    names: layouts ``hf`` and ``fsdp``).  ``local(p)`` is the part of ``p`` this process holds, as
    a view; ``experts_held``: the experts whose rows ``local`` gives of a fused expert parameter
    (default all; FSDP2 holds ``torch.chunk``'s rows of the expert dimension).  ``buffer``
    (``model.get_buffer``) serves the tensors no parameter holds from the model's buffers of the
    same name (``buffer_local(b)``, default ``local``, the part this process holds).  ``paths``: the
    model's parameters by module path, so that each refit reads the parameter at ``p``'s path then
    (one replaced since attach is followed); without it, the objects in ``named`` are served."""
    expected = {lt.name: lt for lt in layout.local_tensors(spec, rank)}
    served: dict[str, Served] = {}
    unmapped: list[str] = []
    first_name: dict[int, str] = {}
    for name, p in named:
        if id(p) in first_name and name not in expected:
            continue  # a tied alias (lm_head.weight of tied embeddings): served under its first name
        first_name.setdefault(id(p), name)
        now = paths.follow(p) if paths is not None else (lambda p=p: p)
        live = (lambda now=now: local(now()))
        m = FUSED_EXPERTS.match(name)
        if m and f"{m['experts']}.0.gate_proj.weight" in expected:
            held = range(spec.config.num_experts) if experts_held is None else experts_held
            served.update(_split_fused(spec, m["experts"], m["kind"], name, live, held))
        elif name in expected:
            served[name] = Served(name, live)
        else:
            unmapped.append(name)
    if buffer is not None:
        for name in expected.keys() - served.keys():
            try:
                buffer(name)
            except AttributeError:
                continue  # left missing: TrainerAgent's check names it
            live = (lambda name=name: (buffer_local or local)(buffer(name)))
            served[name] = Served(name, live)
    refuse_unmapped(unmapped, f"{spec.name} ({spec.config.arch}, layout {layout.describe()})", _hint(spec, unmapped))
    return served


def _split_fused(spec: ModelSpec, experts: str, kind: str, name: str, live: Callable[[], torch.Tensor],
                 held: range) -> dict[str, Served]:
    """Per-expert views of a fused expert parameter whose local rows are experts ``held``; the
    experts held elsewhere are served as empty views (their local tensors have no rows)."""
    c = spec.config
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    w = live()
    want = (len(held), 2 * I, H) if kind == "gate_up_proj" else (len(held), H, I)
    if tuple(w.shape) != want:
        of = f"{len(held)} of {E} experts here" if len(held) != E else f"experts {E}"
        raise InvalidInput(f"{name!r} has shape {list(w.shape)}, expected {list(want)} "
                         f"({of}, moe_intermediate_size {I}, hidden_size {H})")
    out = {}
    for e in range(E):
        if e not in held:  # no rows here: an empty view of this rank's storage
            def cut(w: torch.Tensor) -> torch.Tensor:
                return w.flatten(0, 1)[:0]
            halves = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            out.update({f"{experts}.{e}.{h}.weight": Served(name, live, cut) for h in halves})
        elif kind == "gate_up_proj":
            i = e - held.start
            out[f"{experts}.{e}.gate_proj.weight"] = Served(name, live, lambda w, i=i: w[i, :I])
            out[f"{experts}.{e}.up_proj.weight"] = Served(name, live, lambda w, i=i: w[i, I:])
        else:
            out[f"{experts}.{e}.down_proj.weight"] = Served(name, live, lambda w, i=e - held.start: w[i])
    return out


def _hint(spec: ModelSpec, unmapped: list[str]) -> str:
    c = spec.config
    if any(n.endswith(".bias") for n in unmapped):
        held = "q/k/v projection biases only" if c.qkv_bias else "no biases"
        return (f"refit's {c.arch} holds {held} (mlp_bias, o_proj biases and biases of other layers are not "
                f"supported)")
    if "lm_head.weight" in unmapped and c.tie_embeddings:
        return "model.config.tie_word_embeddings is true but lm_head.weight is a parameter of its own"
    return f"refit knows {c.arch} as in its HF checkpoint names"
