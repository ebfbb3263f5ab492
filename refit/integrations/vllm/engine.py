"""The worker side of the ``refit`` backend: a vLLM `WeightTransferEngine` with an engine agent.

Lifecycle (one instance per vLLM worker, created by vLLM after the model loaded):

* ``init_transfer_engine({"coordinator", "group", "token"?, "staging"?, "window_layers"?, "replica"?})``:
  this worker's rank, layout and spec come from vLLM's configs (`config.identify`; ``replica``: the
  index of the replica a server of its own serves in an elastic group); it decides how each
  parameter of its own shard lands (`landing.Landing`: in place, or staged and re-processed;
  ``staging`` is ``bounded`` or ``atomic``) and registers an engine agent with the coordinator.
  With ``adapter`` (an engine started with ``enable_lora``) the agent holds one LoRA adapter
  instead of the base weights, landed in its pinned slot (`lora_slot.AdapterLanding`, docs/lora.md).
  With ``bounded`` staging, ``window_layers`` (default 1; 0: off) and something staged, the agent
  registers with ``phase_layers=window_layers`` and the landing as its phase hook: plans into this
  group run in phases, and each phase is re-processed as soon as it landed (one window staged).
* ``update_weights({"plan_id", "version", "timeout"?})``: every worker's agent expects that
  (plan, version) (`Agent.expecting`); once all do, the worker of rank 0 of vLLM's world
  (`_leader`; one per replica of a dense DP engine) asks the coordinator to run the plan (the
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
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from refit.control.agent import EngineAgent
from refit.control.agent_state import Holding
from refit.control.embedded import coordinator_for
from refit.control.membership import within_replica
from refit.drafters import drafter_config
from refit.errors import InvalidInput, RefitFailed
from refit.layouts import resolve_layout
from refit.spec import build_spec
from refit.timeline import mark
from refit.validation import parse
from refit.integrations.vllm.config import WorkerIdentity, identify
from refit.integrations.vllm.infos import RefitInitInfo, RefitUpdateInfo
from refit.integrations.vllm import compat, draft as drafts, failures, sleep
from refit.integrations.vllm.landing import Landing
from refit.integrations.vllm.lora_slot import AdapterLanding, adapter_of

log = logging.getLogger(__name__)


class VllmEngineAgent(EngineAgent):
    """The engine agent of a vLLM worker: it runs only the refit that ``update_weights`` expects.

    Why no forward pass can read a half-written weight: the data plane writes into this agent's
    tensors (live parameters, with ``bounded`` staging) only while it runs a share, and a share
    starts only from a RunRefit command, which the coordinator sends only while some client's
    ``refit`` call runs.  The agent refuses every command but the (plan, version) each worker
    expects inside ``update_weights`` (`Agent.expecting`) before its world's rank 0 calls
    ``Client.refit``; vLLM runs ``update_weights`` on the engine's own thread between engine
    steps, and the worker stops expecting only after its share ended (`Agent.wait_idle`; a data
    plane returns by the refit's deadline and writes nothing once the refit is cancelled).  So a
    refit started by anyone else (another client of the same coordinator) is answered with an
    error, never written.  The replicas of a dense DP engine enter ``update_weights``
    independently (each its own world): another replica's leader may start the refit a moment
    before this worker expects it, which `Agent.EXPECT_GRACE` allows for."""

    expects_refits = True

    # With ``staging`` "atomic" the tensors the agent is given are the landing's staging already,
    # and the switch is the landing's `apply`, which ``update_weights`` runs after the commit.
    def _staging(self, live: Any, refresh: bool = False) -> Any:
        return live  # refreshing is the landing's: it stages what it re-processes (no delta refits: takes_delta)

    def _switch(self, staged: Any, live: Any) -> None:
        pass

    def expect_grace(self, run: Any) -> float:
        # only another replica's leader may start a refit before this worker announces it
        members = self._members.get(run.rendezvous.prefix, ())
        alone = members and within_replica(self.layout, self.rank, self.group, members)
        return 0.0 if alone else self.EXPECT_GRACE

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
        self.agent: VllmEngineAgent | None = None
        self.landing: Landing | None = None
        self.init_info: RefitInitInfo | None = None
        # What the weights are: outlives each agent (a later init_transfer_engine registers holding them)
        self.holding = Holding()
        self.draft: Any = None  # the drafter's engine (`draft.attach`), kept across inits for its holding
        # the leader's channel to the coordinator, kept between refits: opening one costs about as
        # much as the rest of the control plane's round trip (1.9 ms of an 8B refit on an H200)
        self._client: Any = None
        # vLLM's sleep mode (CUDA): refits wait for the weights to be awake; a sleep that drops
        # them makes this engine stale at once (`sleep.py`)
        self._pool = sleep.allocator()
        self._unwatch = sleep.watch_discards(self._pool, self._weights_discarded)

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        # staging and window_layers were checked when init_info was built (`infos.RefitInitInfo`)
        if init_info.adapter is not None:
            adapter_of(init_info.adapter)  # its fields too (what the engine can hold is checked once built)
        if self.agent is not None:
            self.shutdown()
        # Registered again over weights a failed refit may have torn: stale whatever outcomes say
        # until a refit lands whole.
        self.holding.pinned = self.holding.stale
        who = self._identify(init_info)
        spec, layout = who.spec, who.layout
        if init_info.adapter is not None:  # one LoRA adapter into its slot (lora_slot.py); always staged
            self.landing = AdapterLanding(self.model, who.spec, who.layout, who.rank, self.device, init_info.adapter)
            spec, layout = self.landing.spec, self.landing.layout
        else:
            self.landing = self._landing(who, init_info)
        phased = self.landing.phase_layers > 0
        # none configured: the job's own coordinator, served by the first piece of the job that needs it
        address = coordinator_for(init_info.coordinator or None, init_info.token)
        self.agent = VllmEngineAgent(address, group=init_info.group, rank=who.rank, spec=spec,
                                     layout=layout, tensors=self.landing.tensors, host=init_info.host,
                                     token=init_info.token, holding=self.holding,
                                     phase_layers=self.landing.phase_layers,
                                     phase_hook=self.landing if phased else None,
                                     stages=init_info.staging == "atomic" or init_info.adapter is not None)
        # staged (re-processed) parameters are not what the engine serves: a Check cannot read them
        self.agent.serves_its_tensors = self.landing.nbytes == 0
        self.agent.start()
        self.init_info = init_info
        log.info("refit: %s registered as %s rank %d of %s (%s; staging %s%s: %.1f MiB staged, %.1f MiB written in "
                 "place)", self.agent.worker_id, init_info.group, who.rank, layout.describe(), spec.name,
                 init_info.staging, f", phases of {self.landing.phase_layers} layers" if phased else "",
                 self.landing.nbytes / 2**20, self.landing.direct_nbytes / 2**20)
        self.draft = drafts.attach(self, init_info, self.draft)

    def draft_engine(self, model: torch.nn.Module, model_config: Any) -> "DraftEngine":
        """A new engine for this engine's drafter, ``model`` (`draft.attach` registers it)."""
        return DraftEngine(self, model, model_config)

    def _identify(self, init_info: RefitInitInfo) -> WorkerIdentity:
        """This worker's rank, layout and spec (a drafter's engine answers its own: draft.py)."""
        return identify(self.vllm_config, init_info.replica, self.model_config)

    def _landing(self, who: WorkerIdentity, init_info: RefitInitInfo) -> Landing:
        return Landing(self.model, who.spec, who.layout, who.rank, self.device, init_info.staging,
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
        agent, landing, info = self._require_init()
        if update_info.atomic and info.staging != "atomic" and info.adapter is None:
            raise InvalidInput(f"refit: update_info atomic needs an engine that stages whole versions; this one "
                               f"was initialised with staging {info.staging!r}: init_weight_transfer_engine with "
                               f"init_info staging 'atomic'")
        if sleep.weights_asleep(self._pool):  # writing into unmapped memory would fault
            raise InvalidInput("refit: this engine's weights are asleep (llm.sleep): wake them first "
                               "(llm.wake_up(tags=['weights'])), then update_weights, then wake the KV cache")
        t0 = time.perf_counter()
        mark("engine worker: update_weights entered")
        version = int(update_info.version)
        outcome: tuple[bool, str, str] = (False, "", "")
        before = agent.last_refit
        landing.begin()
        try:
            with agent.expecting(update_info.plan_id, version):
                self._barrier()  # every worker expects it before the coordinator sends the command
                if self._leader():
                    outcome = self._run_refit(self._coordinator(info), update_info)
                ok, refit_id, error = self._broadcast(outcome)
                mark("engine worker: outcome known")
                if not ok:
                    # the share is cancelled with the failure; no write may land after we return
                    if not agent.wait_idle(update_info.timeout + 5.0):
                        log.error("refit: %s still runs its share of the failed refit", agent.worker_id)
                    raise RefitFailed(f"refit {update_info.plan_id} version {version} failed: {error}")
                seen = agent.outcome(refit_id, 10.0)  # the commit reaches every agent right after the client
                if seen is None or not seen.committed:
                    raise RefitFailed(f"refit version {version}: {agent.worker_id} did not see the commit "
                                       f"({seen.error if seen else 'no outcome within 10 s'})")
            if refit_id == self.holding.landed_refit and agent.last_refit == before:
                # the coordinator answered with the refit this engine already landed (the same
                # version asked again): nothing moved, and the landing holds nothing new
                log.info("refit: %s already holds version %d (refit %s)", agent.worker_id, version, refit_id)
                return
            seconds = landing.apply(self.model_config)
            mark("engine worker: landed")
        except BaseException:
            # our share ran (unless the refit failed before any byte moved): the live weights may be partly new
            ran = agent.last_refit != before
            heard = agent.outcome(agent.last_refit, 2.0) if ran else None
            if ran and not (heard is not None and heard.moved_nothing):
                log.error("refit: %s holds a partly written version %d; reporting it stale", agent.worker_id,
                          version)
                try:
                    self._report_stale(agent)
                except Exception as e:  # noqa: BLE001 - the refit's own error is the one to raise
                    log.error("refit: %s could not register again as stale: %s", agent.worker_id, e)
            raise
        self.holding.landed(refit_id)
        log.info("refit: version %d landed in %s (%.3f s applying, %.3f s in all)", version, agent.worker_id,
                 seconds, time.perf_counter() - t0)

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
        """A level-2 sleep (or a discard) dropped the weights: whatever version this engine held is
        gone.  Stale from now on, and registered again as such, so that nobody lists it holding a
        version and the next refit moves every byte."""
        log.warning("refit: vLLM dropped this engine's weights (sleep level 2 / discard): stale until the "
                    "next refit")
        self.holding.pin_stale()
        self.holding.landed_refit = ""
        agent = self.agent
        if agent is not None and agent.connected:
            try:
                agent.stop()
                agent.start(timeout=10.0)
            except Exception as e:  # noqa: BLE001 - the sleep itself must not fail over it
                log.error("refit: %s could not register again as stale: %s", agent.worker_id, e)

    def shutdown(self) -> None:
        if self.agent is not None:
            # the weights stay (`self.holding`): a later init_transfer_engine registers holding them
            self.agent.stop()
        if self.draft is not None:  # the drafter's agent too; its engine stays, holding its version
            self.draft.shutdown()
        # the landing's staging (a whole shard with atomic staging) serves no later refit: a new
        # init_transfer_engine builds its own
        self.agent = self.landing = self.init_info = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ helpers
    def _report_stale(self, agent: VllmEngineAgent) -> None:
        """This engine's weights are not whole although its share ran (it failed after writing,
        maybe after the commit): stale from now on, whatever outcome still arrives.  Unless the
        coordinator said that refit failed (then it lists us stale already), register again so
        that it lists us stale too, and runs the next refit of the same version for real instead
        of answering that this engine holds it."""
        self.holding.pin_stale()
        heard = agent.outcome(agent.last_refit)
        if heard is not None and not heard.committed:
            return
        log.warning("%s: registering again as stale (holding version %d)", agent.worker_id, self.holding.version)
        agent.stop()
        agent.start(timeout=10.0)  # a failure path: not the 30 s of a first registration

    def _require_target(self) -> None:
        if self.model is not self._default_model:
            raise InvalidInput("refit: only the target model can be refitted (its landing was set up at "
                             "init_weight_transfer_engine), not a speculative draft model")

    def _require_init(self) -> tuple[VllmEngineAgent, Landing, RefitInitInfo]:
        if self.agent is None or self.landing is None or self.init_info is None:
            raise InvalidInput("refit: call init_weight_transfer_engine({'init_info': {'coordinator': ...}}) first")
        if not self.agent.connected:
            log.warning("refit: %s lost its coordinator stream (%s); reconnecting", self.agent.worker_id,
                        self.agent.error)
            self.agent.start()
        return self.agent, self.landing, self.init_info

    def _coordinator(self, info: RefitInitInfo) -> Any:
        """The client the leader asks for refits with (one channel for this init's coordinator)."""
        from refit.control.client import Client

        if self._client is None:
            self._client = Client(info.coordinator, token=info.token)
        return self._client

    @staticmethod
    def _run_refit(client: Any, update: RefitUpdateInfo) -> tuple[bool, str, str]:
        """(ok, refit id, error) of running the plan for the update's version."""
        import grpc

        from refit.control.client import RefitFailed

        try:
            result = client.refit(update.plan_id, int(update.version), timeout=update.timeout,
                                  atomic=update.atomic, verify=update.verify, delta=update.delta)
            if result.delta is not None:
                d = result.delta
                log.info("refit %s: delta %s: %.2f%% of words changed, %d of %d bytes sent%s", result.refit_id,
                         "in full" if result.delta_fallback else "applied", 100 * d["changed_fraction"],
                         d["wire_bytes"], d["full_bytes"], f" ({result.delta_fallback})" if result.delta_fallback else "")
            return True, result.refit_id, ""
        except RefitFailed as e:
            return False, e.result.refit_id, str(e)
        except grpc.RpcError as e:
            return False, "", f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported to every worker, raised there
            return False, "", f"{type(e).__name__}: {e}"

    @staticmethod
    def _leader() -> bool:
        """Whether this worker asks the coordinator to run the refit: rank 0 of its world.  That
        is one worker per engine, or one per replica of a dense DP engine (vLLM runs those as
        independent worlds): the coordinator runs one refit per (plan, version) and every
        leader asking for it joins it."""
        from vllm.distributed import parallel_state as ps

        return ps.get_world_group().rank_in_group == 0

    @staticmethod
    def _barrier() -> None:
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        if group.world_size > 1:
            dist.barrier(group=group.cpu_group)

    @staticmethod
    def _broadcast(outcome: tuple[bool, str, str]) -> tuple[bool, str, str]:
        """Rank 0's outcome on every worker of this engine (over vLLM's own CPU group)."""
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        if group.world_size == 1:
            return outcome
        box = [outcome]
        dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]


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
        return WorkerIdentity(target.rank, resolve_layout(target.layout.describe(), spec, "dst"), spec)

    def _landing(self, who: WorkerIdentity, init_info: RefitInitInfo) -> Any:
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
            raise InvalidInput(f"refit: the {drafts.drafter_name(self.vllm_config)} holds {', '.join(own)} of its own "
                               f"(its checkpoint's differ from the target's): refit lands EAGLE heads that use the "
                               f"target's embedding and LM head; drop them from the head's checkpoint")

    def receive_weights(self, update_info: Any) -> None:
        super().receive_weights(update_info)
        self.version = int(update_info.version)
