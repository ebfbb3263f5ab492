"""refit as a verl checkpoint engine named ``refit`` (verl 0.9.1).

    actor_rollout_ref.rollout.checkpoint_engine.backend=refit
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=refit.integrations.verl
    actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config='{backend: refit}'

Importing this module registers the engine (``CheckpointEngineRegistry``).  verl builds one per
actor rank (``is_master`` on rank 0) and one per rollout worker, and runs every sync as
``prepare`` / ``build_topology`` / ``init_process_group`` / ``send_weights`` + ``receive_weights``
/ ``finalize``.  What refit does in each (docs/verl.md):

* ``prepare``: actor rank 0 starts a coordinator in its process (or joins ``engine_kwargs.refit.
  address`` / ``$REFIT_ADDRESS``); rollout workers report their config's refusal, if any, and the
  replica's vLLM server (Ray handle) from the worker owning it.
* ``build_topology`` (verl's driver): raises `refit.InvalidInput` with that refusal; hands the
  address and the servers to every worker.
* ``init_process_group``: every actor rank attaches its live model once (FSDP2, Megatron or an
  unsharded transformers model; shard to shard, never full tensors); a PEFT LoRA actor its
  adapter alone, which the engines hold in vLLM's LoRA slot under verl's LoRA id.
* ``send_weights``: verl's full-tensor generator is closed unread; actor rank 0 initialises each
  replica's refit backend once (``init_weight_transfer_engine``, group ``<engine_group>-<replica>``,
  with the adapter's ``init_info["adapter"]`` for a LoRA actor; every DP engine of the replica's
  server registers),
  creates one plan per replica once (and one for the MTP drafter of an MTP rollout), and runs
  vLLM's start / update_weights / finish on every replica (then the drafter's, same version)
  for the next refit version (``global_steps`` when it increases, else the last + 1).
* ``receive_weights``: nothing left to receive; returns an empty `Handled` marker, which the
  rollout's server adapter is made to skip (`_skip_handled`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Any, Generator, Iterator, Mapping, Optional

from pydantic import Field
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refit.errors import InvalidInput, RefitFailed
from refit.integrations.verl import live
from refit.validation import check_fields, parse

__all__ = ["BACKEND", "Handled", "RefitCheckpointEngine"]

log = logging.getLogger(__name__)

BACKEND = "refit"


class Handled:
    """What ``receive_weights`` returns: no tensors (the actor's rank 0 already refitted the
    replica through refit); iterating it yields nothing."""

    def __iter__(self) -> Iterator[Any]:
        return iter(())


@dataclass
class VerlOptions:
    """``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refit``, declared once
    (`refit.validation`; docs/verl.md lists them)."""

    address: Annotated[Optional[str], Field(description=(
        "a coordinator already running (`refit serve`); default `$REFIT_ADDRESS`; with neither, actor rank 0 "
        "serves one in its own process on `serve_host`"))] = None
    token: Annotated[Optional[str], Field(description="its bearer token; default `$REFIT_TOKEN`")] = None
    serve_host: Annotated[str, Field(min_length=1, description=(
        "where actor rank 0 serves the coordinator when no address is given (`127.0.0.1`: one node; on several, "
        "a host the other nodes reach, or an address)"))] = "127.0.0.1"
    trainer_group: Annotated[str, Field(min_length=1, description="the actor ranks' group")] = "verl-actor"
    engine_group: Annotated[str, Field(min_length=1, description=(
        "the rollout replicas' groups: replica r registers as `<engine_group>-r`"))] = "verl-rollout"
    timeout: Annotated[float, Field(gt=0, description="seconds per refit")] = 120.0
    delta: Annotated[bool, Field(description=(
        "send, at each sync, only the values that changed since the last one where they cross a wire (NCCL, "
        "gloo), exact as a full sync ([delta-refits.md](delta-refits.md))"))] = False
    init_info: Annotated[Optional[dict[str, Any]], Field(description=(
        "more of the vLLM backend's `init_info` (`staging`, `window_layers`, `host`: the address an engine's "
        "node is reached at when trainers and engines are on different nodes)"))] = None

    def __post_init__(self) -> None:
        check_fields(self, "engine_kwargs.refit")


def plain(value: Any) -> Any:
    """OmegaConf's containers (verl's configs) as plain dicts and lists, for the strict checks."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [plain(v) for v in value]
    return value


@CheckpointEngineRegistry.register(BACKEND)
class RefitCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over refit: one per verl worker (see the module's docstring).
    ``engine_kwargs.refit``: ``address`` / ``token`` (default ``$REFIT_ADDRESS`` / ``$REFIT_TOKEN``;
    without an address, actor rank 0 serves a coordinator on ``serve_host``), ``trainer_group``,
    ``engine_group``, ``timeout`` (seconds per refit), ``delta`` (send only what changed since the
    last sync: `refit.Client.refit`) and ``init_info`` (more of the vLLM backend's init_info:
    ``staging``, ``window_layers``, ``host``)."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **options: Any) -> None:
        # the keys of engine_kwargs.refit, checked against their declaration (`VerlOptions`): an
        # unknown key is refused naming the nearest known one, a wrong value naming its field
        o = parse(VerlOptions, plain(options), "engine_kwargs.refit")
        reason = live.refusal_at_construction()
        if reason:
            raise InvalidInput(reason)
        self.is_master = is_master
        self.address, self.token, self.serve_host = o.address, o.token, o.serve_host
        self.trainer_group, self.engine_group, self.timeout = o.trainer_group, o.engine_group, float(o.timeout)
        self.delta = o.delta
        self.init_info = dict(o.init_info or {})
        self._server: Any = None  # ThreadedServer, on the master when no address is given
        self._agent: Any = None
        self._attached: int | None = None  # id() of the module the agent serves
        self._adapter: dict[str, Any] | None = None  # a LoRA actor's init_info["adapter"] for the engines
        self._draft_agent: Any = None  # the actor's MTP layers (last pipeline stage), when vLLM drafts with them
        self._mtp = False  # vLLM drafts with the actor's MTP layers: every refit moves the drafter too
        self._draft_plans: dict[int, str] = {}  # replica rank -> the drafter's plan
        self._servers: dict[int, Any] = {}  # replica rank -> vLLM server (Ray handle)
        self._plans: dict[int, str] = {}  # replica rank -> plan id, created once
        self._planned_for: dict[int, Any] = {}  # replica rank -> the server those plans were made with
        self._version = 0  # the last refit version run
        self._sync: asyncio.Future | None = None  # this sync's send (hybrid: send_weights runs twice)
        self._barrier_group: Any = None
        self.last_seconds = 0.0

    # ------------------------------------------------------------------ verl's interface
    def prepare(self) -> dict[str, Any]:
        # A sync that failed never reached `finalize`: its send must not answer this one.
        self._sync = None
        holder = live.holder_of(self)
        meta: dict[str, Any] = {"master": False, "address": None, "refusal": None, "replica": None, "server": None}
        if self.is_master and live.training_engine(holder) is not None:
            meta.update(master=True, address=self._coordinator())
        adapter = live.rollout_adapter(holder)
        if adapter is not None:
            model = getattr(adapter, "model_config", None)
            meta["refusal"] = live.rollout_refusal(adapter.config, getattr(model, "hf_config", None),
                                                   live.lora_mode(model))
            server = live.server_of(adapter)
            if server is not None:
                meta.update(replica=int(adapter.replica_rank), server=server)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        refusals = sorted({m["refusal"] for m in metadata if m.get("refusal")})
        if refusals:
            raise InvalidInput(refusals[0])
        addresses = {m["address"] for m in metadata if m.get("master")}
        if len(addresses) != 1:
            raise InvalidInput(f"refit: expected one actor rank 0 serving or naming the coordinator, found "
                               f"{sorted(addresses) or 'none'}")
        servers = {m["replica"]: m["server"] for m in metadata if m.get("server") is not None}
        if not servers:
            raise InvalidInput("refit: no rollout replica reported its vLLM server (rollout rank 0 of each replica)")
        topology = {"address": addresses.pop(), "servers": servers}
        return {"topology": [topology] * actor_wg_world_size}, {"topology": [topology] * rollout_world_size}

    def init_process_group(self, topology: dict[str, Any]) -> None:
        self.address, self._servers = topology["address"], dict(topology["servers"])
        holder = live.holder_of(self)
        engine = live.training_engine(holder)
        if engine is not None:
            self._attach(engine)
        elif (adapter := live.rollout_adapter(holder)) is not None:
            _skip_handled(adapter)

    async def send_weights(self, weights: Generator[tuple[str, Any], None, None] | Any,
                           global_steps: int | None = None) -> dict[str, float]:
        # Never consumed: refit serves the live shards.  Closing the lazy generator gathers nothing.
        close = getattr(weights, "close", None)
        if callable(close):
            close()
        if self._sync is None:  # hybrid: verl calls send_weights twice per worker and sync; one refit
            self._sync = asyncio.ensure_future(self._send(global_steps))
        return await asyncio.shield(self._sync)

    def receive_weights(self, global_steps: int | None = None) -> Handled:
        return Handled()

    def finalize(self) -> None:
        self._sync = None  # the agents, plans and coordinator stay for the next sync

    # ------------------------------------------------------------------ the work
    def _coordinator(self) -> str:
        from refit.control.common import coordinator_address, coordinator_token

        if self.address is None and self._server is None:
            from refit.settings import current

            if current().address:  # $REFIT_ADDRESS
                self.address = coordinator_address(None)
            else:
                from refit.control.server import ThreadedServer

                self._server = ThreadedServer(host=self.serve_host, token=coordinator_token(self.token),
                                              default_timeout=self.timeout)
                self.address = self._server.address
                log.info("refit: coordinator serving on %s (verl actor rank 0)", self.address)
        return coordinator_address(self.address)

    def _attach(self, engine: Any) -> None:
        if self._attached == id(engine.module) and self._agent is not None:
            return
        if self._agent is not None:  # verl rebuilt the model: serve the new one
            self._agent.stop()
            if self._draft_agent is not None:
                self._draft_agent.stop()
        attached = live.attach_actor(engine, self.address, self.trainer_group, self.token)
        self._agent, self._draft_agent, self._adapter = attached.agent, attached.draft, attached.adapter
        self._mtp = live.mtp_rollout(getattr(engine, "model_config", None))
        self._attached = id(engine.module)
        if live.params_offloaded(engine) and self._barrier_group is None:
            import torch.distributed as dist

            self._barrier_group = dist.new_group(backend="gloo")  # every actor rank, in the same init

    async def _send(self, global_steps: int | None) -> dict[str, float]:
        engine = live.training_engine(live.holder_of(self))
        offloaded = engine is not None and live.params_offloaded(engine)
        if offloaded:  # refit reads the parameters where they live: on the device during the refit
            await asyncio.to_thread(live.load_params, engine, "device")
            await asyncio.to_thread(self._barrier)
        metrics: dict[str, float] = {}
        try:
            if self.is_master:
                metrics = await self._refit(global_steps)
        finally:
            if offloaded:
                await asyncio.to_thread(self._barrier)  # every rank's parameters stay until the refit ended
                await asyncio.to_thread(live.load_params, engine, "cpu")
        return metrics

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._barrier_group)

    async def _refit(self, global_steps: int | None) -> dict[str, float]:
        t0 = time.perf_counter()
        # a replica is new, or replaced (verl relaunched its server after a failure): (re)initialise it
        new = [r for r in sorted(self._servers)
               if _actor_id(self._planned_for.get(r)) != _actor_id(self._servers[r])]
        if new:
            await asyncio.gather(*(self._init_replica(r) for r in new))
        if not self._version:  # joining engines that already hold versions: go on above them
            self._version = await asyncio.to_thread(self._held_version)
        version = global_steps if isinstance(global_steps, int) and global_steps > self._version \
            else self._version + 1
        await asyncio.gather(*(self._refit_replica(r, version, global_steps) for r in sorted(self._servers)))
        self._version = version
        self.last_seconds = time.perf_counter() - t0
        log.info("refit: version %d (global_steps %s) into %d replica(s) in %.3f s", version, global_steps,
                 len(self._servers), self.last_seconds)
        return {"refit/version": float(version), "refit/seconds": self.last_seconds}

    async def _init_replica(self, replica: int) -> None:
        server, group = self._servers[replica], f"{self.engine_group}-{replica}"
        info = {**self.init_info, "coordinator": self.address, "group": group}
        if self._adapter is not None:  # a LoRA actor: the adapter alone, into the engine's LoRA slot
            info["adapter"] = self._adapter
        if self._mtp:  # the engine registers its MTP drafter as a group of its own
            info["draft_group"] = f"{group}-draft"
        if self.token:
            info["token"] = self.token
        await server.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": info})
        self._plans[replica] = (await asyncio.to_thread(self._create_plan, self.trainer_group, group))["plan_id"]
        if self._mtp:  # the actor's MTP layers (its last stage) into the engine's drafter
            self._draft_plans[replica] = (await asyncio.to_thread(
                self._create_plan, f"{self.trainer_group}-draft", f"{group}-draft"))["plan_id"]
        self._planned_for[replica] = server
        log.info("refit: replica %d registered as %s; plan %s", replica, group, self._plans[replica])

    def _client(self) -> Any:
        from refit.control.client import Client

        return Client(self.address, token=self.token)

    def _create_plan(self, trainers: str, engines: str) -> dict[str, Any]:
        with self._client() as client:
            return client.create_plan(trainers, engines)

    def _held_version(self) -> int:
        with self._client() as client:
            return max([int(w.get("version") or 0) for r in self._servers
                        for w in client.list_workers(group=f"{self.engine_group}-{r}")] or [0])

    async def _refit_replica(self, replica: int, version: int, global_steps: int | None) -> None:
        server = self._servers[replica]
        info = {"plan_id": self._plans[replica], "version": version, "timeout": self.timeout, "delta": self.delta}
        try:
            await server.collective_rpc.remote("start_weight_update")
            await server.collective_rpc.remote("update_weights", kwargs={"update_info": info})
            await server.collective_rpc.remote("finish_weight_update")
            if replica in self._draft_plans:  # then the MTP drafter, at the same version (vLLM's draft update)
                await server.collective_rpc.remote("start_draft_weight_update")
                draft = {**info, "plan_id": self._draft_plans[replica]}
                await server.collective_rpc.remote("update_weights", kwargs={"update_info": draft})
                await server.collective_rpc.remote("finish_weight_update")
        except Exception as e:  # a RefitFailed naming the worker, or Ray's error for a server that died
            raise RefitFailed(f"refit: version {version} into rollout replica {replica} "
                              f"({self.engine_group}-{replica}) failed: {e}") from e
        if global_steps is not None:  # what verl's own adapters tell the server after an update
            await server.set_global_steps.remote(global_steps)


def _actor_id(server: Any) -> Any:
    """A Ray actor handle's identity (handles are re-made on every sync's topology)."""
    return None if server is None else getattr(server, "_actor_id", id(server))


def _skip_handled(adapter: Any) -> None:
    """Disaggregated rollout workers hand ``receive_weights``' result to their server adapter,
    whose vLLM ``update_weights`` would load the (empty) stream and re-run vLLM's post-load
    processing, which is not idempotent.  The actor's rank 0 already refitted the replica: for a
    `Handled` marker the adapter does nothing.  This instance-level wrap is the one place refit
    replaces a verl behaviour; any other stream goes to verl's own method."""
    if getattr(adapter, "_refit_skips_handled", False):
        return
    inner = adapter.update_weights

    async def update_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(weights, Handled):
            return None
        return await inner(weights, *args, **kwargs)

    adapter.update_weights = update_weights
    adapter._refit_skips_handled = True
