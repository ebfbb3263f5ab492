"""A speculative-decoding engine's drafter, refitted through vLLM's own draft update.

vLLM 0.32's weight-transfer API updates a drafter in a session of its own: ``start_draft_weight_update``
makes the worker retarget the backend (``set_weight_update_target(draft_model, draft_model_config)``),
every ``update_weights`` of the session loads into the drafter, and ``finish_weight_update``
restores the target.  The refit backend answers that session with a second engine agent, of a
group of its own (init_info ``draft_group``, default ``<group>-draft``), registered at
``init_weight_transfer_engine`` with the drafter's spec and layout: the trainer attaches its
drafter as a second trainer group, and the RL loop refits the target and then the drafter with
the same version (docs/rl-loop-and-vllm.md).

Landed drafters (`LANDED_METHODS`), by vLLM's speculative method:

* ``draft_model``: a separate draft model, of the spec of its own config
  (`config.identify` of ``draft_model_config``);
* ``mtp`` (``deepseek_mtp``): the MTP layers of DeepSeek-V3 or GLM-4.5, the spec
  `refit.drafters.mtp_config` of the target's config (the trainer:
  `refit.integrations.hf_draft.attach_draft` of the MTP layers' tensors under their HF names,
  ``model.layers.{N}.*``);
* ``eagle``: an EAGLE-1 head of a Llama target, `refit.drafters.eagle_config` of the head's
  config (the trainer: ``attach_draft`` of the head's module, EAGLE checkpoint names).

MTP layers and EAGLE heads hold the target's embedding and LM head in vLLM (its proposer shares
them at load): the target's refit moves them, once; the drafter's landing counts them as written
(`Landing` ``written_elsewhere``).  An EAGLE head that keeps an embedding or LM head of its own (a
checkpoint whose copy differs from the target's) is refused at init.

`refit.integrations.vllm.engine.DraftEngine` is that agent's engine: the backend itself, bound to
the drafter, so that the draft's refits stage, fail, report stale and answer a repeated version
exactly as the target's.  It lives beside its base class; this module, which the target engine
calls, names the engines by what it reads of them (`Engine`) and imports neither.
A drafter refit cannot land (another speculative method, MTP layers of another architecture) is
named in the log as kept, and a draft update of it is refused before any byte moves;
``draft_group=""`` says the trainer trains no drafter: it is kept, and named.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from refit.drafters import drafter_config
from refit.errors import InvalidInput
from refit.integrations.vllm import compat

if TYPE_CHECKING:
    from refit.integrations.vllm.infos import RefitInitInfo

log = logging.getLogger(__name__)

LANDED_METHODS = ("draft_model", "mtp", "eagle")  # speculative methods whose drafter refit lands


class Engine(Protocol):
    """What this module reads of an engine of the backend: `refit.integrations.vllm.engine`'s
    `RefitWeightTransferEngine` (which calls this module, so it is named here by its shape) or
    its drafter's `DraftEngine` (``is_draft``)."""

    vllm_config: Any
    model: torch.nn.Module
    _default_model: torch.nn.Module
    draft: Any  # its drafter's engine, or None
    is_draft: bool

    def draft_engine(self, model: torch.nn.Module, model_config: Any) -> Engine: ...

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None: ...

    def shutdown(self) -> None: ...


def drafter_name(vllm_config: Any) -> str:
    """``<method> drafter <model>`` of an engine's speculative config (for logs and errors)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return "drafter"
    mc = getattr(sc, "draft_model_config", None)
    return f"{sc.method} drafter {getattr(mc, 'model', None) or sc.model}"


def attach(engine: Engine, init_info: RefitInitInfo, previous: Engine | None) -> Engine | None:
    """The engine of ``engine``'s drafter, registered as ``init_info.draft_group`` (``previous``:
    the one an earlier ``init_weight_transfer_engine`` made, whose holding carries over), or None
    where nothing is to be refitted: no speculation with weights, or a drafter that stays as
    loaded (logged, naming it)."""
    sc = engine.vllm_config.speculative_config
    if getattr(engine, "is_draft", False) or sc is None or getattr(sc, "draft_model_config", None) is None:
        return None  # no drafter with weights (n-gram and suffix speculation have none)
    group = f"{init_info.group}-draft" if init_info.draft_group is None else init_info.draft_group
    if not group:
        log.warning("refit: the %s is kept as loaded (init_info draft_group ''): the trainer trains no drafter, "
                    "so its acceptance rate falls as the policy moves", drafter_name(engine.vllm_config))
        return None
    why = unlanded(engine)
    if why:
        log.warning("refit: the %s is kept as loaded: %s", drafter_name(engine.vllm_config), why)
        return None
    model = previous.model if previous is not None else find_draft_model(engine)
    if model is None:
        log.warning("refit: the %s is kept as loaded: the backend could not reach vLLM's draft model at "
                    "init_weight_transfer_engine", drafter_name(engine.vllm_config))
        return None
    draft = previous if previous is not None else engine.draft_engine(model, sc.draft_model_config)
    try:
        # one registration per group: the draft's agent holds no adapter and never a draft of its own
        draft.init_transfer_engine(dataclasses.replace(init_info, group=group, draft_group="", adapter=None))
    except BaseException:
        engine.shutdown()  # all or nothing: the target's agent, registered a moment ago, goes too
        raise
    return draft


def unlanded(engine: Engine) -> str:
    """Why refit cannot land this engine's drafter ("" where it can): another speculative method,
    or MTP layers / an EAGLE head of an architecture `refit.drafters` does not describe."""
    sc = engine.vllm_config.speculative_config
    if sc.method not in LANDED_METHODS:
        return (f"refit lands a separate draft model, MTP layers or an EAGLE head (speculative methods "
                f"{', '.join(LANDED_METHODS)}), not {sc.method} weights")
    if sc.method == "draft_model":
        return ""
    try:
        drafter_config(sc.method, hf_dict(engine.vllm_config.model_config), hf_dict(sc.draft_model_config))
    except InvalidInput as e:
        return str(e)
    return ""


def hf_dict(model_config: Any) -> dict[str, Any]:
    """The HF config dict of a vLLM ``ModelConfig``, in the dtype vLLM runs it (EAGLE: the head's own
    config, which vLLM wraps in an ``EAGLEConfig``)."""
    hf = model_config.hf_config
    cfg = dict(getattr(hf, "model", None).to_dict() if getattr(hf, "model", None) is not None else hf.to_dict())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = str(model_config.dtype).removeprefix("torch.")
    return cfg


def find_draft_model(engine: Engine) -> torch.nn.Module | None:
    """vLLM's draft model, from the worker that called ``init_weight_transfer_engine``.  vLLM hands
    a backend the target model only (the drafter comes with ``set_weight_update_target``, inside a
    draft session), but the draft's agent must register before the RL loop plans into its group."""
    worker = compat.calling_worker(engine)
    return compat.draft_model(worker) if worker is not None else None


def session_engine(engine: Engine) -> Engine:
    """The engine answering the current weight-update session: ``engine`` itself, or its drafter's
    when vLLM retargeted the session (``start_draft_weight_update``).  Refuses, before any byte
    moves, a draft session this backend has no drafter agent for."""
    if engine.model is engine._default_model:
        return engine
    draft = engine.draft
    if draft is None:
        raise InvalidInput(f"refit: start_draft_weight_update, but this engine registered no agent for its "
                           f"{drafter_name(engine.vllm_config)}: refit lands a drafter of speculative method "
                           f"{', '.join(LANDED_METHODS)} whose init_info draft_group is not '' (see the log of "
                           f"init_weight_transfer_engine)")
    if engine.model is not draft.model:
        raise InvalidInput("refit: vLLM retargeted this session at a model that is neither the target nor the draft "
                           "model refit registered at init_weight_transfer_engine: init it again")
    return draft


def after_target(engine: Engine, version: int) -> None:
    """A target refit to ``version`` landed: name the drafter if it did not follow the last one
    (the RL loop refits the target, then the drafter, with the same version)."""
    draft = engine.draft
    if draft is None:
        return
    previous, draft.target_version = draft.target_version, version
    if previous is not None and draft.version != previous and previous != version:
        log.warning("refit: the %s still holds version %s while the target moves from version %d to %d: refit it "
                    "each step (start_draft_weight_update) or its acceptance rate falls",
                    drafter_name(engine.vllm_config), draft.version, previous, version)
