"""A speculative-decoding engine's draft model, refitted through vLLM's own draft update.

vLLM 0.32's weight-transfer API updates a drafter in a session of its own: ``start_draft_weight_update``
makes the worker retarget the backend (``set_weight_update_target(draft_model, draft_model_config)``),
every ``update_weights`` of the session loads into the drafter, and ``finish_weight_update``
restores the target.  The refit backend answers that session with a second engine agent, of a
group of its own (init_info ``draft_group``, default ``<group>-draft``), registered at
``init_weight_transfer_engine`` with the draft model's spec and layout (`config.identify` of
``draft_model_config``): the trainer attaches its draft model as a second trainer group, and the
RL loop refits the target and then the drafter with the same version (docs/rl-loop-and-vllm.md).

`DraftEngine` is that agent's engine: the backend itself, bound to the draft model, so that the
draft's refits stage, fail, report stale and answer a repeated version exactly as the target's.
Only a separate draft model (speculative method ``draft_model``) is landed; an EAGLE head or MTP
layers share the target's embedding / LM head inside vLLM and need their own spec (issue 31), so
such a drafter is named in the log as kept, and a draft update of it is refused before any byte
moves.  ``draft_group=""`` says the trainer trains no drafter: it is kept, and named.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch

from refit.errors import InvalidInput

if TYPE_CHECKING:
    from refit.integrations.vllm.engine import RefitInitInfo, RefitWeightTransferEngine

log = logging.getLogger(__name__)

LANDED_METHODS = ("draft_model",)  # speculative methods whose drafter refit lands


def drafter_name(vllm_config: Any) -> str:
    """``<method> drafter <model>`` of an engine's speculative config (for logs and errors)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return "drafter"
    mc = getattr(sc, "draft_model_config", None)
    return f"{sc.method} drafter {getattr(mc, 'model', None) or sc.model}"


def attach(engine: "RefitWeightTransferEngine", init_info: "RefitInitInfo",
           previous: "DraftEngine | None") -> "DraftEngine | None":
    """The engine of ``engine``'s drafter, registered as ``init_info.draft_group`` (``previous``:
    the one an earlier ``init_weight_transfer_engine`` made, whose holding carries over), or None
    where nothing is to be refitted: no speculation with weights, or a drafter that stays as
    loaded (logged, naming it)."""
    sc = engine.vllm_config.speculative_config
    if isinstance(engine, DraftEngine) or sc is None or getattr(sc, "draft_model_config", None) is None:
        return None  # no drafter with weights (n-gram and suffix speculation have none)
    group = f"{init_info.group}-draft" if init_info.draft_group is None else init_info.draft_group
    if not group:
        log.warning("refit: the %s is kept as loaded (init_info draft_group ''): the trainer trains no drafter, "
                    "so its acceptance rate falls as the policy moves", drafter_name(engine.vllm_config))
        return None
    if sc.method not in LANDED_METHODS:
        log.warning("refit: the %s is kept as loaded: refit lands a separate draft model (speculative method "
                    "draft_model), not %s weights", drafter_name(engine.vllm_config), sc.method)
        return None
    model = previous.model if previous is not None else find_draft_model(engine)
    if model is None:
        log.warning("refit: the %s is kept as loaded: the backend could not reach vLLM's draft model at "
                    "init_weight_transfer_engine", drafter_name(engine.vllm_config))
        return None
    draft = previous if previous is not None else DraftEngine(engine, model, sc.draft_model_config)
    try:
        # one registration per group: the draft's agent holds no adapter and never a draft of its own
        draft.init_transfer_engine(dataclasses.replace(init_info, group=group, draft_group="", adapter=None))
    except BaseException:
        engine.shutdown()  # all or nothing: the target's agent, registered a moment ago, goes too
        raise
    return draft


def find_draft_model(engine: "RefitWeightTransferEngine") -> torch.nn.Module | None:
    """vLLM's draft model, from the worker that called ``init_weight_transfer_engine``.  vLLM hands
    a backend the target model only (the drafter comes with ``set_weight_update_target``, inside a
    draft session), but the draft's agent must register before the RL loop plans into its group:
    the worker is the caller up the stack whose ``weight_transfer_engine`` is this engine."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        worker = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine and callable(
                getattr(worker, "get_draft_model", None)):
            return worker.get_draft_model()
        frame = frame.f_back
    return None


def session_engine(engine: "RefitWeightTransferEngine") -> "RefitWeightTransferEngine":
    """The engine answering the current weight-update session: ``engine`` itself, or its drafter's
    when vLLM retargeted the session (``start_draft_weight_update``).  Refuses, before any byte
    moves, a draft session this backend has no drafter agent for."""
    if engine.model is engine._default_model:
        return engine
    draft = engine.draft
    if draft is None:
        raise InvalidInput(f"refit: start_draft_weight_update, but this engine registered no agent for its "
                           f"{drafter_name(engine.vllm_config)}: refit lands a separate draft model (speculative "
                           f"method draft_model) whose init_info draft_group is not '' (see the log of "
                           f"init_weight_transfer_engine)")
    if engine.model is not draft.model:
        raise InvalidInput("refit: vLLM retargeted this session at a model that is neither the target nor the draft "
                           "model refit registered at init_weight_transfer_engine: init it again")
    return draft


def after_target(engine: "RefitWeightTransferEngine", version: int) -> None:
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


def _engine_class() -> type:
    from refit.integrations.vllm.engine import RefitWeightTransferEngine

    return RefitWeightTransferEngine


class DraftEngine(_engine_class()):  # type: ignore[misc]
    """The backend bound to the draft model: its own landing, agent and holding; vLLM never calls
    it, its target engine hands it the draft sessions (`session_engine`)."""

    def __init__(self, target: "RefitWeightTransferEngine", model: torch.nn.Module, model_config: Any) -> None:
        super().__init__(target.config, target.vllm_config, target.device, model)
        self.model_config = self._default_model_config = model_config
        self.version: int | None = None  # the version last landed here (None: as loaded)
        self.target_version: int | None = None  # the target's last version (`after_target`)

    def receive_weights(self, update_info: Any) -> None:
        super().receive_weights(update_info)
        self.version = int(update_info.version)
