"""The worker side of the ``refit`` backend: a vLLM `WeightTransferEngine` with an engine agent.

Lifecycle (one instance per vLLM worker, created by vLLM after the model loaded):

* ``init_transfer_engine({"coordinator", "group", "token"?})``: this worker's rank, layout and spec
  come from vLLM's configs (`config.identify`); it allocates staging tensors for its own shard
  (`landing.Landing`) and registers an engine agent with the coordinator.
* ``update_weights({"plan_id", "version", "timeout"?})``: the worker of global rank 0 asks the
  coordinator to run the plan for that version (the trainer agents answer it on their own); its
  result is broadcast over the engine's own process group, so every worker learns the outcome,
  success or the coordinator's error naming the failed worker.  On success each worker checks its
  agent saw the commit, then lands the staged shard in the live model and returns.  On failure it
  raises; the live weights were never touched and the agent reports itself stale.
* ``start_weight_update`` / ``finish_weight_update``: nothing to do (the writes happen inside
  ``update_weights``, which vLLM runs between engine steps).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit.control.agent import EngineAgent
from refit.errors import RefitError
from refit.integrations.vllm.config import identify
from refit.integrations.vllm.landing import Landing

log = logging.getLogger(__name__)


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    coordinator: str
    group: str = "engine"
    token: str | None = None
    host: str = "127.0.0.1"


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    plan_id: str
    version: int
    timeout: float = 60.0


class WatchingEngineAgent(EngineAgent):
    """An engine agent that remembers the outcome of each refit, for `wait_outcome`."""

    KEEP = 64  # outcomes remembered

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._outcomes: dict[str, tuple[bool, str]] = {}
        self._cond = threading.Condition()

    def _on_outcome(self, out: Any) -> None:
        super()._on_outcome(out)
        with self._cond:
            self._outcomes[out.refit_id] = (out.committed, out.error)
            while len(self._outcomes) > self.KEEP:
                self._outcomes.pop(next(iter(self._outcomes)))
            self._cond.notify_all()

    def wait_outcome(self, refit_id: str, timeout: float) -> tuple[bool, str] | None:
        """(committed, error) of refit ``refit_id`` as this agent heard it, or None."""
        with self._cond:
            self._cond.wait_for(lambda: refit_id in self._outcomes, timeout)
            return self._outcomes.get(refit_id)


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.agent: WatchingEngineAgent | None = None
        self.landing: Landing | None = None
        self.init_info: RefitInitInfo | None = None

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        if self.agent is not None:
            self.shutdown()
        who = identify(self.vllm_config)
        self.rank = who.rank
        self.landing = Landing(self.model, who.spec, who.layout, who.rank, self.device)
        self.agent = WatchingEngineAgent(init_info.coordinator, group=init_info.group, rank=who.rank, spec=who.spec,
                                         layout=who.layout, tensors=self.landing.staging, host=init_info.host,
                                         token=init_info.token)
        self.agent.start()
        self.init_info = init_info
        log.info("refit: %s registered as %s rank %d of %s (%s, %.1f MiB staged)", self.agent.worker_id,
                 init_info.group, who.rank, who.layout.describe(), who.spec.name, self.landing.nbytes / 2**20)

    def start_weight_update(self) -> None:
        self._require_init()

    def finish_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        agent, landing, info = self._require_init()
        t0 = time.perf_counter()
        version = int(update_info.version)
        outcome: tuple[bool, str, str] = (False, "", "")
        if self.rank == 0:
            outcome = self._run_refit(info, update_info.plan_id, version, update_info.timeout)
        ok, refit_id, error = self._broadcast(outcome)
        if not ok:
            raise RuntimeError(f"refit {update_info.plan_id} version {version} failed: {error}")
        seen = agent.wait_outcome(refit_id, 10.0)  # the commit reaches every agent right after the client
        if seen is None or not seen[0]:
            raise RuntimeError(f"refit version {version}: {agent.worker_id} did not see the commit "
                               f"({seen[1] if seen else 'no outcome within 10 s'})")
        seconds = landing.apply(self.model_config)
        log.info("refit: version %d landed in %s (%.3f s applying, %.3f s in all)", version, agent.worker_id,
                 seconds, time.perf_counter() - t0)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":  # copies and re-processing are queued on the stream
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        self.agent = None

    # ------------------------------------------------------------------ helpers
    def _require_init(self) -> tuple[WatchingEngineAgent, Landing, RefitInitInfo]:
        if self.agent is None or self.landing is None or self.init_info is None:
            raise RefitError("refit: call init_weight_transfer_engine({'init_info': {'coordinator': ...}}) first")
        if not self.agent.connected:
            log.warning("refit: %s lost its coordinator stream (%s); reconnecting", self.agent.worker_id,
                        self.agent.error)
            self.agent.start()
        return self.agent, self.landing, self.init_info

    @staticmethod
    def _run_refit(info: RefitInitInfo, plan_id: str, version: int, timeout: float) -> tuple[bool, str, str]:
        """(ok, refit id, error) of running the plan for ``version``."""
        import grpc

        from refit.control.client import Client, RefitFailed

        try:
            with Client(info.coordinator, token=info.token) as client:
                return True, client.refit(plan_id, version, timeout=timeout).refit_id, ""
        except RefitFailed as e:
            return False, e.result.refit_id, str(e)
        except grpc.RpcError as e:
            return False, "", f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported to every worker, raised there
            return False, "", f"{type(e).__name__}: {e}"

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
