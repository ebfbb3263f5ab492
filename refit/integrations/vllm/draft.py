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

`DraftEngine` is that agent's engine: the backend itself, bound to the drafter, so that the
draft's refits stage, fail, report stale and answer a repeated version exactly as the target's.
A drafter refit cannot land (another speculative method, MTP layers of another architecture) is
named in the log as kept, and a draft update of it is refused before any byte moves;
``draft_group=""`` says the trainer trains no drafter: it is kept, and named.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from refit.drafters import drafter_config
from refit.errors import InvalidInput
from refit.integrations.vllm import compat

if TYPE_CHECKING:
    from refit.integrations.vllm.config import WorkerIdentity
    from refit.integrations.vllm.engine import RefitInitInfo, RefitWeightTransferEngine

log = logging.getLogger(__name__)

LANDED_METHODS = ("draft_model", "mtp", "eagle")  # speculative methods whose drafter refit lands


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
    why = unlanded(engine)
    if why:
        log.warning("refit: the %s is kept as loaded: %s", drafter_name(engine.vllm_config), why)
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


def unlanded(engine: "RefitWeightTransferEngine") -> str:
    """Why refit cannot land this engine's drafter ("" where it can): another speculative method,
    or MTP layers / an EAGLE head of an architecture `refit.drafters` does not describe."""
    sc = engine.vllm_config.speculative_config
    if sc.method not in LANDED_METHODS:
        return (f"refit lands a separate draft model, MTP layers or an EAGLE head (speculative methods "
                f"{', '.join(LANDED_METHODS)}), not {sc.method} weights")
    if sc.method == "draft_model":
        return ""
    try:
        drafter_config(sc.method, _hf_dict(engine.vllm_config.model_config), _hf_dict(sc.draft_model_config))
    except InvalidInput as e:
        return str(e)
    return ""


def _hf_dict(model_config: Any) -> dict[str, Any]:
    """The HF config dict of a vLLM ``ModelConfig``, in the dtype vLLM runs it (EAGLE: the head's own
    config, which vLLM wraps in an ``EAGLEConfig``)."""
    hf = model_config.hf_config
    cfg = dict(getattr(hf, "model", None).to_dict() if getattr(hf, "model", None) is not None else hf.to_dict())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = str(model_config.dtype).removeprefix("torch.")
    return cfg


def find_draft_model(engine: "RefitWeightTransferEngine") -> torch.nn.Module | None:
    """vLLM's draft model, from the worker that called ``init_weight_transfer_engine``.  vLLM hands
    a backend the target model only (the drafter comes with ``set_weight_update_target``, inside a
    draft session), but the draft's agent must register before the RL loop plans into its group."""
    worker = compat.calling_worker(engine)
    return compat.draft_model(worker) if worker is not None else None


def session_engine(engine: "RefitWeightTransferEngine") -> "RefitWeightTransferEngine":
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
        self.method: str = target.vllm_config.speculative_config.method
        # the target's parameters: those the drafter shares (MTP / EAGLE embedding and LM head)
        self.target_params = frozenset(id(p) for p in target._default_model.parameters())
        self.version: int | None = None  # the version last landed here (None: as loaded)
        self.target_version: int | None = None  # the target's last version (`after_target`)

    def _identify(self, init_info: "RefitInitInfo") -> "WorkerIdentity":
        """A separate draft model is identified by its own config; MTP layers and an EAGLE head by
        `refit.drafters` (vLLM's draft config of them, ``deepseek_mtp`` / ``eagle``, is no model
        refit knows), at the target's rank and layout."""
        from refit.integrations.vllm.config import WorkerIdentity, identify
        from refit.layouts import resolve_layout
        from refit.spec import build_spec

        if self.method == "draft_model":
            return identify(self.vllm_config, init_info.replica, self.model_config)
        target = identify(self.vllm_config, init_info.replica)
        cfg = drafter_config(self.method, _hf_dict(self.vllm_config.model_config), _hf_dict(self.model_config))
        spec = build_spec(f"{target.spec.name}-{cfg.drafter}", cfg)
        return WorkerIdentity(target.rank, resolve_layout(target.layout.describe(), spec, "dst"), spec)

    def _landing(self, who: "WorkerIdentity", init_info: "RefitInitInfo") -> Any:
        from refit.integrations.vllm.landing import Landing

        if self.method == "eagle":
            self._check_eagle_shares()
        return Landing(self.model, who.spec, who.layout, who.rank, self.device, init_info.staging,
                       init_info.window_layers, self.model_config, written_elsewhere=self.target_params)

    def _check_eagle_shares(self) -> None:
        """An EAGLE head refit lands uses the target's embedding and LM head (vLLM shares them when
        the head's checkpoint has none, or identical ones); one of its own is refused, naming it."""
        own = [n for n, p in self.model.named_parameters() if id(p) not in self.target_params
               and n.rpartition(".")[0].split(".")[-1] in ("embed_tokens", "lm_head")]
        if own:
            raise InvalidInput(f"refit: the {drafter_name(self.vllm_config)} holds {', '.join(own)} of its own (its "
                               f"checkpoint's differ from the target's): refit lands EAGLE heads that use the target's "
                               f"embedding and LM head; drop them from the head's checkpoint")

    def receive_weights(self, update_info: Any) -> None:
        super().receive_weights(update_info)
        self.version = int(update_info.version)
