"""Attach a drafter trained beside the policy — MTP layers or an EAGLE head — as a trainer group.

    from refit.integrations import hf as refit_hf, hf_draft

    refit_hf.attach(policy, address, group="trainer")
    # DeepSeek-V3's / GLM-4.5's MTP layers, under their HF checkpoint names (model.layers.{N}.*, N >= num_hidden_layers)
    hf_draft.attach_draft(mtp_layers, address, group="draft-trainer", method="mtp", config=policy.config)
    # or an EAGLE head whose state dict uses EAGLE checkpoint names (fc.weight, layers.{i}.*)
    hf_draft.attach_draft(eagle_head, address, group="draft-trainer", method="eagle", config=eagle_head.config)

The drafter's spec is `refit.drafters`' (``mtp_config`` of the policy's config, ``eagle_config`` of
the head's), its layout ``hf`` (one rank, every tensor whole); its parameters are served as views
of their live storage, as `refit.integrations.hf.attach` serves a model's.  What vLLM's drafter
takes from the target (each MTP layer's ``embed_tokens`` / ``shared_head.head``, an EAGLE head's
frozen ``embed_tokens`` / ``lm_head`` copies) is not served: the policy's refit moves it (logged).
A tensor that maps to none of the drafter's (a decoder layer of the policy passed by mistake) fails
the attach, naming it.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch

from refit.control.agent import TrainerAgent
from refit.drafters import EAGLE, METHOD_DRAFTER, drafter_config, eagle_canonical, moved_by_target
from refit.errors import InvalidInput
from refit.integrations._common import DTYPE_NAMES, global_rank, start_trainer
from refit.integrations.hf import serve_hf_parameters
from refit.layouts import HFLayout
from refit.spec import build_spec

__all__ = ["attach_draft"]
log = logging.getLogger(__name__)

Drafter = torch.nn.Module | Mapping[str, torch.Tensor]


def attach_draft(drafter: Drafter, address: str | None = None, *, group: str, method: str, config: Any,
                 token: str | None = None, **agent_options: Any) -> TrainerAgent:
    """Register ``drafter`` (a module: its parameters and buffers; or a mapping name -> tensor) as
    the one rank of trainer group ``group``, holding the drafter of vLLM speculative ``method``
    (``mtp`` / ``deepseek_mtp``: ``config`` is the policy's config; ``eagle``: the head's).  Raises
    `refit.InvalidInput` before registering for a tensor refit cannot place."""
    kind = METHOD_DRAFTER.get(method)
    if kind is None:
        raise InvalidInput(f"attach_draft: method {method!r}: refit lands {', '.join(sorted(METHOD_DRAFTER))} "
                           f"drafters (a separate draft model: refit_hf.attach it as a model of its own)")
    if global_rank() != 0:
        raise InvalidInput(f"attach_draft serves an unsharded drafter as the one rank of layout hf, but this process "
                           f"is global rank {global_rank()}: attach on rank 0 only")
    named = _named(drafter)
    hf = _config_dict(config, named)
    cfg = drafter_config(method, hf, hf)
    spec = build_spec(f"{_model_name(config, hf)}-{kind}", cfg)
    layout = HFLayout().resolve(spec)
    served = serve_hf_parameters(_canonical(named, cfg), spec, layout, 0, local=lambda p: p.detach())
    return start_trainer(address, group=group, rank=0, spec=spec, layout=layout, served=served, token=token,
                         **agent_options)


def _named(drafter: Drafter) -> list[tuple[str, torch.Tensor]]:
    if isinstance(drafter, torch.nn.Module):
        # buffers too: DeepSeek's float32 router bias (e_score_correction_bias) is one in transformers
        return list(drafter.named_parameters(remove_duplicate=False)) + list(drafter.named_buffers())
    return list(drafter.items())


def _config_dict(config: Any, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``config`` as an HF config dict in the dtype the drafter holds its (non-float32-bias)
    tensors in, as `refit.integrations._common.spec_of_hf_config` takes a model's."""
    cfg = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    dtypes = {t.dtype for n, t in named if not n.endswith("e_score_correction_bias")}
    dtype = dtypes.pop() if len(dtypes) == 1 else cfg.get("dtype") or cfg.get("torch_dtype")
    if dtype is None:
        raise InvalidInput("attach_draft: the drafter's tensors mix dtypes and its config names none")
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = DTYPE_NAMES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else str(dtype)
    return cfg


def _model_name(config: Any, cfg: dict[str, Any]) -> str:
    path = str(getattr(config, "name_or_path", "") or cfg.get("model_type") or "model")
    return path.rstrip("/").rsplit("/", 1)[-1]


def _canonical(named: Iterable[tuple[str, torch.Tensor]], cfg: Any) -> list[tuple[str, torch.Tensor]]:
    """The drafter's tensors under refit's names, without those the policy's refit moves."""
    out, kept = [], []
    for name, t in named:
        if moved_by_target(cfg, name):
            kept.append(name)
        else:
            out.append((eagle_canonical(name) if cfg.drafter == EAGLE else name, t))
    if kept:
        log.info("attach_draft: %s not served: vLLM's %s drafter holds the target's, which the policy's refit moves",
                 ", ".join(kept), cfg.drafter)
    return out
