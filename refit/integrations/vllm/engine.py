"""The worker side of the ``refit`` backend: a vLLM `WeightTransferEngine` with an engine agent.

Lifecycle (one instance per vLLM worker, created by vLLM after the model loaded):

* ``init_transfer_engine({"coordinator", "group", "token"?, "staging"?, "window_layers"?, "replica"?})``:
  this worker's rank, layout and spec come from vLLM's configs (`config.identify`; ``replica``: the
  index of the replica a server of its own serves in an elastic group); it decides how each
  parameter of its own shard lands (`landing.VllmLanding`: in place, or staged and re-processed;
  ``staging`` is ``bounded`` or ``atomic``) and registers an engine agent with the coordinator.
  With ``adapter`` (an engine started with ``enable_lora``) the agent holds one LoRA adapter
  instead of the base weights, landed in its pinned slot (`lora_slot.AdapterLanding`, docs/lora.md).
  With ``bounded`` staging, ``window_layers`` (default 1; 0: off) and something staged, the agent
  registers with ``phase_layers=window_layers`` and the landing as its phase hook: plans into this
  group run in phases, and each phase is re-processed as soon as it landed (one window staged).
* ``update_weights({"plan_id", "version", "timeout"?})``: the host-driven refit every engine runs
  (`refit.engine.host.HostRefit`, over vLLM's world group, `compat.VllmWorld`): every worker's
  agent expects that (plan, version) (`Agent.expecting`); once all do, the worker of rank 0 of
  vLLM's world (one per replica of a dense DP engine) asks the coordinator to run the plan (the
  trainer agents answer it on their own); its result is broadcast over the engine's own process
  group, so every worker learns the outcome, success or the coordinator's error naming the failed
  worker.  On success each worker checks its agent heard the commit (`Agent.outcome`), then
  re-processes what is left (phased: the modules that read re-processed ones; else every staged
  module) and returns.  On failure it raises, and the agent reports itself stale (with
  ``atomic`` staging the live weights were never touched); a failure after the coordinator
  committed (the landing raised) registers the agent again as stale, so that nobody lists it
  holding a version it does not hold whole.  The version this engine already landed, asked again,
  is answered by the coordinator without moving anything, and nothing is re-applied.  What the
  worker's weights are (`Holding`) is one record, carried over from agent to agent when the
  worker registers again.
* ``start_weight_update`` / ``finish_weight_update``: nothing to do (the writes happen inside
  ``update_weights``, which vLLM runs between engine steps).
* A speculative engine's separate draft model has an agent of its own (``draft_group``, default
  ``<group>-draft``), registered by ``init_transfer_engine``; a ``start_draft_weight_update``
  session is answered by it (`DraftEngine`, `draft.py`): a separate draft model, MTP layers or an
  EAGLE head.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit.control.agent_state import Holding
from refit.control.embedded import coordinator_for
from refit.drafters import drafter_config
from refit.engine.host import HostDrivenAgent, HostRefit
from refit.errors import InvalidInput
from refit.layouts import resolve_layout
from refit.sides import Side
from refit.spec import build_spec
from refit.timeline import mark
from refit.validation import parse
from refit.integrations.vllm.config import WorkerIdentity, identify
from refit.integrations.vllm.infos import RefitInitInfo, RefitUpdateInfo
from refit.integrations.vllm import compat, draft as drafts, failures, sleep
from refit.integrations.vllm.landing import VllmLanding
from refit.integrations.vllm.lora_slot import AdapterLanding, adapter_of

log = logging.getLogger(__name__)


class VllmEngineAgent(HostDrivenAgent):
    """The engine agent of a vLLM worker: it runs only the refit that ``update_weights`` expects
    (`HostDrivenAgent`: vLLM runs ``update_weights`` on the engine's own thread between engine
    steps, so a refit started by anyone else, another client of the same coordinator, is answered
    with an error, never written)."""

    def refusal(self, plan_id: str, version: int) -> str:
        return (f"{self.worker_id} is not inside vLLM's update_weights for plan {plan_id} version {version}; "
                f"refits of a vLLM engine are driven by update_weights")


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    # A draft session (``start_draft_weight_update``) is answered by the drafter's own agent and
    # landing (`DraftEngine`), registered at init: the target's stay fixed.
    supports_draft_weight_update = True
    is_draft = False  # the drafter's own engine (`DraftEngine`) has no drafter of its own

    # The loop's dicts, checked by refit's declarations (`infos`): an unknown key is refused naming
    # the nearest known one, a wrong value naming its field (vLLM's own parse would pass a typo on
    # as a TypeError and a string where an int belongs on to fail deep inside).
    def parse_init_info(self, init_dict: dict[str, Any]) -> RefitInitInfo:
        return parse(RefitInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> RefitUpdateInfo:
        return parse(RefitUpdateInfo, update_dict, "update_info")

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        compat.check_version()
        super().__init__(config, vllm_config, device, model)
        # The refits this worker drives: its agent, landing and what the weights are (the holding
        # outlives each agent: a later init_transfer_engine registers holding them)
        self.refits = HostRefit(compat.VllmWorld())
        self.init_info: RefitInitInfo | None = None
        self.draft: Any = None  # the drafter's engine (`draft.attach`), kept across inits for its holding
        # vLLM's sleep mode (CUDA): refits wait for the weights to be awake; a sleep that drops
        # them makes this engine stale at once (`sleep.py`)
        self._pool = sleep.allocator()
        self._unwatch = sleep.watch_discards(self._pool, self._weights_discarded)

    # The driver's, named as vLLM's workers and the tests read them (``collective_rpc``)
    @property
    def agent(self) -> VllmEngineAgent | None:
        return self.refits.agent  # type: ignore[return-value]

    @agent.setter
    def agent(self, agent: VllmEngineAgent | None) -> None:
        self.refits.agent = agent

    @property
    def landing(self) -> VllmLanding | AdapterLanding | None:
        return self.refits.landing  # type: ignore[return-value]

    @landing.setter
    def landing(self, landing: VllmLanding | AdapterLanding | None) -> None:
        self.refits.landing = landing

    @property
    def holding(self) -> Holding:
        return self.refits.holding

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        # staging and window_layers were checked when init_info was built (`infos.RefitInitInfo`)
        if init_info.adapter is not None:
            adapter_of(init_info.adapter)  # its fields too (what the engine can hold is checked once built)
        if self.agent is not None:
            self.shutdown()
        who = self._identify(init_info)
        spec, layout = who.spec, who.layout
        landing: VllmLanding | AdapterLanding
        if init_info.adapter is not None:  # one LoRA adapter into its slot (lora_slot.py); always staged
            landing = AdapterLanding(self.model, who.spec, who.layout, who.rank, self.device, init_info.adapter)
            spec, layout = landing.spec, landing.layout
        else:
            landing = self._landing(who, init_info)
        # none configured: the job's own coordinator, served by the first piece of the job that needs it
        address = coordinator_for(init_info.coordinator or None, init_info.token)
        agent = self.refits.register(address, group=init_info.group, rank=who.rank, spec=spec, layout=layout,
                                     landing=landing, host=init_info.host, token=init_info.token,
                                     agent_cls=VllmEngineAgent)
        self.init_info = init_info
        phased = landing.phase_layers > 0
        log.info("refit: %s registered as %s rank %d of %s (%s; staging %s%s: %.1f MiB staged, %.1f MiB written in "
                 "place)", agent.worker_id, init_info.group, who.rank, layout.describe(), spec.name,
                 init_info.staging, f", phases of {landing.phase_layers} layers" if phased else "",
                 landing.nbytes / 2**20, landing.direct_nbytes / 2**20)
        self.draft = drafts.attach(self, init_info, self.draft)

    def draft_engine(self, model: torch.nn.Module, model_config: Any) -> "DraftEngine":
        """A new engine for this engine's drafter, ``model`` (`draft.attach` registers it)."""
        return DraftEngine(self, model, model_config)

    def _identify(self, init_info: RefitInitInfo) -> WorkerIdentity:
        """This worker's rank, layout and spec (a drafter's engine answers its own: draft.py)."""
        return identify(self.vllm_config, init_info.replica, self.model_config)

    def _landing(self, who: WorkerIdentity, init_info: RefitInitInfo) -> VllmLanding:
        return VllmLanding(self.model, who.spec, who.layout, who.rank, self.device, init_info.staging,
                           init_info.window_layers, self.model_config)

    def start_weight_update(self) -> None:
        engine = drafts.session_engine(self)  # a draft session: the drafter's agent, or refused here
        engine._require_target()
        engine._require_init()

    def finish_weight_update(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM's trainer-side send (abstract in vLLM 0.26): refit's trainers send through their
        agents, shard to shard, never a stream of whole tensors."""
        raise InvalidInput("refit: trainers send through an agent (refit.integrations.hf / fsdp / megatron attach, or "
                           "a TrainerAgent) when the RL loop refits, not through trainer_send_weights")

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        self._require_target()
        _, landing, info = self._require_init()
        if update_info.atomic and not landing.stages:
            raise InvalidInput(f"refit: update_info atomic needs an engine that stages whole versions; this one "
                               f"was initialised with staging {info.staging!r}: init_weight_transfer_engine with "
                               f"init_info staging 'atomic'")
        if sleep.weights_asleep(self._pool):  # writing into unmapped memory would fault
            raise InvalidInput("refit: this engine's weights are asleep (llm.sleep): wake them first "
                               "(llm.wake_up(tags=['weights'])), then update_weights, then wake the KV cache")
        self.refits.refit(update_info.plan_id, int(update_info.version), timeout=update_info.timeout,
                          atomic=update_info.atomic, verify=update_info.verify, delta=update_info.delta)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        engine = drafts.session_engine(self)  # vLLM retargets a draft session at the drafter
        with failures.carried():  # the loop tells refit's errors by type across vLLM's processes
            info = engine.parse_update_info(update_info)
            engine.receive_weights(info)
            if engine is self:
                drafts.after_target(self, int(info.version))
        if self.device.type == "cuda":  # copies and re-processing are queued on the stream
            torch.cuda.synchronize(self.device)
        mark("engine worker: update_weights returns")

    def staging_report(self) -> dict[str, Any]:
        """What this worker stages for a refit (tests and benchmarks read it through
        ``collective_rpc``): bytes staged now (one window when phased), what staging the whole
        shard would cost, and each phase's staged bytes on this rank."""
        _, landing, _ = self._require_init()
        window = landing.window
        return {"nbytes": landing.nbytes, "unphased_nbytes": landing.unphased_nbytes,
                "phase_layers": landing.phase_layers, "direct_nbytes": landing.direct_nbytes,
                "phase_nbytes": dict(window.phase_nbytes) if window else {},
                "phase_of": dict(window.phase_of) if window else {}}

    def _weights_discarded(self) -> None:
        """A level-2 sleep (or a discard) dropped the weights: stale until the next refit
        (`HostRefit.weights_lost`)."""
        log.warning("refit: vLLM dropped this engine's weights (sleep level 2 / discard): stale until the "
                    "next refit")
        self.refits.weights_lost()

    def shutdown(self) -> None:
        # the weights stay (`self.holding`): a later init_transfer_engine registers holding them;
        # the landing's staging (a whole shard with atomic staging) serves no later refit
        self.refits.shutdown()
        if self.draft is not None:  # the drafter's agent too; its engine stays, holding its version
            self.draft.shutdown()
        self.init_info = None

    # ------------------------------------------------------------------ helpers
    def _require_target(self) -> None:
        if self.model is not self._default_model:
            raise InvalidInput("refit: only the target model can be refitted (its landing was set up at "
                             "init_weight_transfer_engine), not a speculative draft model")

    def _require_init(self) -> tuple[VllmEngineAgent, VllmLanding | AdapterLanding, RefitInitInfo]:
        ready = self.refits.ready() if self.init_info is not None else None
        if ready is None or self.init_info is None:
            raise InvalidInput("refit: call init_weight_transfer_engine({'init_info': {'coordinator': ...}}) first")
        agent, landing = ready
        return agent, landing, self.init_info  # type: ignore[return-value]


class DraftEngine(RefitWeightTransferEngine):
    """The backend bound to the draft model: its own landing, agent and holding; vLLM never calls
    it, its target engine hands it the draft sessions (`draft.session_engine`).  Here, beside its
    base class, so that `draft`, which the target engine calls, imports no engine."""

    is_draft = True

    def __init__(self, target: RefitWeightTransferEngine, model: torch.nn.Module, model_config: Any) -> None:
        super().__init__(target.config, target.vllm_config, target.device, model)
        self.model_config = self._default_model_config = model_config
        self.method: str = target.vllm_config.speculative_config.method
        # the target's parameters: those the drafter shares (MTP / EAGLE embedding and LM head)
        self.target_params = frozenset(id(p) for p in target._default_model.parameters())
        self.version: int | None = None  # the version last landed here (None: as loaded)
        self.target_version: int | None = None  # the target's last version (`after_target`)

    def _identify(self, init_info: RefitInitInfo) -> WorkerIdentity:
        """A separate draft model is identified by its own config; MTP layers and an EAGLE head by
        `refit.drafters` (vLLM's draft config of them, ``deepseek_mtp`` / ``eagle``, is no model
        refit knows), at the target's rank and layout."""
        if self.method == "draft_model":
            return identify(self.vllm_config, init_info.replica, self.model_config)
        target = identify(self.vllm_config, init_info.replica)
        cfg = drafter_config(self.method, drafts.hf_dict(self.vllm_config.model_config),
                             drafts.hf_dict(self.model_config))
        spec = build_spec(f"{target.spec.name}-{cfg.drafter}", cfg)
        return WorkerIdentity(target.rank, resolve_layout(target.layout.describe(), spec, Side.ENGINE), spec)

    def _landing(self, who: WorkerIdentity, init_info: RefitInitInfo) -> Any:
        if self.method == "eagle":
            self._check_eagle_shares()
        return VllmLanding(self.model, who.spec, who.layout, who.rank, self.device, init_info.staging,
                           init_info.window_layers, self.model_config, written_elsewhere=self.target_params)

    def _check_eagle_shares(self) -> None:
        """An EAGLE head refit lands uses the target's embedding and LM head (vLLM shares them when
        the head's checkpoint has none, or identical ones); one of its own is refused, naming it."""
        own = [n for n, p in self.model.named_parameters() if id(p) not in self.target_params
               and n.rpartition(".")[0].split(".")[-1] in ("embed_tokens", "lm_head")]
        if own:
            raise InvalidInput(f"refit: the {drafts.drafter_name(self.vllm_config)} holds {', '.join(own)} of its own "
                               f"(its checkpoint's differ from the target's): refit lands EAGLE heads that use the "
                               f"target's embedding and LM head; drop them from the head's checkpoint")

    def receive_weights(self, update_info: Any) -> None:
        super().receive_weights(update_info)
        self.version = int(update_info.version)
