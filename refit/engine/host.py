"""The host-driven refit: the sequence an engine's worker runs to land one version, for any engine.

An inference engine refits between its own steps, on its own thread (vLLM's ``update_weights``),
never when a coordinator command happens to arrive: its worker *drives* the refit.  `HostRefit`
is that driver, one per engine worker, over the engine's `Landing` and `WorkerGroup`
(`refit.engine.landing`):

1. ``register``: an engine agent (`HostDrivenAgent`) is registered with the landing's tensors;
   it runs only the refit its host announces, so no refit started by anyone else writes into
   weights the engine is serving from.
2. ``refit(plan_id, version)``, inside the engine's step loop: the landing begins; every worker of
   the group expects that (plan, version) (`Agent.expecting`) and meets at a barrier; the leader
   asks the coordinator to run the plan (the trainers' agents answer it on their own) and
   broadcasts the outcome, so every worker learns success, or the coordinator's error naming the
   failed worker.  On success each worker checks its agent heard the commit, then the landing
   applies what is not live yet.  On failure it raises (after its share ended: no write lands
   after it returns); a failure after its share wrote (even after the commit: the landing
   raised) pins the worker stale and registers it again as such, so that nobody lists it holding
   a version it does not hold whole.  The version already landed, asked again, is answered by the
   coordinator without moving anything, and the landing applies nothing.
3. ``weights_lost``: the engine dropped its weights (vLLM's level-2 sleep): stale at once.

What the worker's weights are (`Holding`) is one record on the driver, carried over from agent to
agent when the worker registers again.  Nothing here knows an engine: vLLM's glue
(`refit.integrations.vllm.engine`) and the plain PyTorch engine of the tests
(tests/harness/torch_engine.py) both run this.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from refit.control.agent import EngineAgent
from refit.control.agent_state import Holding
from refit.control.membership import within_replica
from refit.control.v1 import refit_pb2 as pb
from refit.engine.landing import Alone, Landing, WorkerGroup
from refit.errors import InvalidInput, RefitFailed
from refit.layouts import Layout
from refit.spec import ModelSpec
from refit.timeline import mark

log = logging.getLogger(__name__)

Outcome = tuple[bool, str, str]  # (ok, refit id, error): what the leader broadcasts


class HostDrivenAgent(EngineAgent):
    """The engine agent of a worker whose host drives its refits: it runs only the refit the host
    expects (`Agent.expecting`), announced before the leader asks the coordinator for it.

    Why no engine step can read a half-written weight: the data plane writes into this agent's
    tensors only while it runs a share, a share starts only from a RunRefit command, and the agent
    refuses every command but the (plan, version) its host expects while it stands between two
    engine steps; the host stops expecting only after the share ended (`Agent.wait_idle`).  The
    replicas of a data-parallel engine enter their refits independently: another replica's leader
    may start the refit a moment before this worker expects it, which `Agent.EXPECT_GRACE` allows."""

    expects_refits = True
    driven_by = "its host's refit call"  # named in refusals: what drives this engine's refits

    # An atomic refit writes into the landing's own staging (`Landing.stages`), and the switch is
    # the landing's `apply`, which the host runs after the commit: nothing for the agent to do.
    def _staging(self, live: Any, refresh: bool = False) -> Any:
        return live  # refreshing is the landing's: it stages what it re-processes (no delta refits: takes_delta)

    def _switch(self, staged: Any, live: Any) -> None:
        pass

    def expect_grace(self, run: pb.RunRefit) -> float:
        # only another replica's leader may start a refit before this worker announces it
        members = self._members.get(run.rendezvous.prefix, ())
        alone = members and within_replica(self.layout, self.rank, self.group, members)
        return 0.0 if alone else self.EXPECT_GRACE

    def refusal(self, plan_id: str, version: int) -> str:
        return (f"{self.worker_id} is not inside {self.driven_by} for plan {plan_id} version {version}; refits of this "
                f"engine are driven by {self.driven_by}")


class HostRefit:
    """One engine worker's driver of its refits (see the module docstring)."""

    def __init__(self, group: WorkerGroup | None = None) -> None:
        self.group: WorkerGroup = group if group is not None else Alone()
        self.holding = Holding()  # outlives each agent: a later `register` registers holding it
        self.agent: HostDrivenAgent | None = None
        self.landing: Landing | None = None
        # the leader's channel to the coordinator, kept between refits: opening one costs about as
        # much as the rest of the control plane's round trip (1.9 ms of an 8B refit on an H200)
        self._client: Any = None

    # ------------------------------------------------------------------ lifecycle
    def register(self, address: str | None, *, group: str, rank: int, spec: ModelSpec, layout: Layout,
                 landing: Landing, host: str = "127.0.0.1", token: str | None = None,
                 agent_cls: type[HostDrivenAgent] = HostDrivenAgent) -> HostDrivenAgent:
        """Register this worker's agent over ``landing`` (after `shutdown` of an earlier one)."""
        if self.agent is not None:
            self.shutdown()
        # Registered again over weights a failed refit may have torn: stale whatever outcomes say
        # until a refit lands whole.
        self.holding.pinned = self.holding.stale
        phased = landing.phase_layers > 0
        agent = agent_cls(address, group=group, rank=rank, spec=spec, layout=layout, tensors=landing.tensors,
                          host=host, token=token, holding=self.holding, phase_layers=landing.phase_layers,
                          phase_hook=landing if phased else None, stages=landing.stages)
        # staged (re-processed) tensors are not what the engine serves: a Check cannot read them
        agent.serves_its_tensors = landing.nbytes == 0
        self.agent, self.landing = agent, landing  # before it starts: a `shutdown` stops one that failed to
        agent.start()
        return agent

    def ready(self) -> tuple[HostDrivenAgent, Landing] | None:
        """The registered agent (connected again if its stream dropped) and landing; None if none."""
        if self.agent is None or self.landing is None:
            return None
        if not self.agent.connected:
            log.warning("refit: %s lost its coordinator stream (%s); reconnecting", self.agent.worker_id,
                        self.agent.error)
            self.agent.start()
        return self.agent, self.landing

    def shutdown(self) -> None:
        """Stop the agent and let the landing go (its staging serves no later registration); the
        holding stays: a later `register` registers holding the same weights."""
        if self.agent is not None:
            self.agent.stop()
        self.agent = self.landing = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ a refit
    def refit(self, plan_id: str, version: int, *, timeout: float, atomic: bool = False, verify: bool = False,
              delta: bool = False) -> None:
        """Land version ``version`` of plan ``plan_id`` in this worker, with every worker of its
        group (call on the engine's own thread, between its steps).  Raises `RefitFailed` when the
        refit failed (this worker reported stale where its share wrote)."""
        got = self.ready()
        if got is None:
            raise InvalidInput("refit: this engine worker registered no agent: register it first")
        agent, landing = got
        t0 = time.perf_counter()
        mark("engine worker: refit entered")
        outcome: Outcome = (False, "", "")
        before = agent.last_refit
        landing.begin()
        try:
            with agent.expecting(plan_id, version):
                self.group.barrier()  # every worker expects it before the coordinator sends the command
                if self.group.leader():
                    outcome = self._run(plan_id, version, timeout, atomic, verify, delta)
                ok, refit_id, error = self.group.broadcast(outcome)
                mark("engine worker: outcome known")
                if not ok:
                    # the share is cancelled with the failure; no write may land after we return
                    if not agent.wait_idle(timeout + 5.0):
                        log.error("refit: %s still runs its share of the failed refit", agent.worker_id)
                    raise RefitFailed(f"refit {plan_id} version {version} failed: {error}")
                seen = agent.outcome(refit_id, 10.0)  # the commit reaches every agent right after the client
                if seen is None or not seen.committed:
                    raise RefitFailed(f"refit version {version}: {agent.worker_id} did not see the commit "
                                      f"({seen.error if seen else 'no outcome within 10 s'})")
            if refit_id == self.holding.landed_refit and agent.last_refit == before:
                # the coordinator answered with the refit this engine already landed (the same
                # version asked again): nothing moved, and the landing holds nothing new
                log.info("refit: %s already holds version %d (refit %s)", agent.worker_id, version, refit_id)
                return
            seconds = landing.apply()
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

    def weights_lost(self) -> None:
        """The engine dropped its weights (vLLM: a level-2 sleep, a discard): whatever version it
        held is gone.  Stale from now on, and registered again as such, so that nobody lists it
        holding a version and the next refit moves every byte."""
        self.holding.pin_stale()
        self.holding.landed_refit = ""
        agent = self.agent
        if agent is not None and agent.connected:
            try:
                agent.stop()
                agent.start(timeout=10.0)
            except Exception as e:  # noqa: BLE001 - the engine's own call must not fail over it
                log.error("refit: %s could not register again as stale: %s", agent.worker_id, e)

    # ------------------------------------------------------------------ helpers
    def _report_stale(self, agent: HostDrivenAgent) -> None:
        """This worker's weights are not whole although its share ran (it failed after writing,
        maybe after the commit): stale from now on, whatever outcome still arrives.  Unless the
        coordinator said that refit failed (then it lists us stale already), register again so
        that it lists us stale too, and runs the next refit of the same version for real instead
        of answering that this worker holds it."""
        self.holding.pin_stale()
        heard = agent.outcome(agent.last_refit)
        if heard is not None and not heard.committed:
            return
        log.warning("%s: registering again as stale (holding version %d)", agent.worker_id, self.holding.version)
        agent.stop()
        agent.start(timeout=10.0)  # a failure path: not the 30 s of a first registration

    def _client_of(self, agent: HostDrivenAgent) -> Any:
        """The client the leader asks for refits with (one channel to the agent's coordinator)."""
        from refit.control.client import Client

        if self._client is None:
            self._client = Client(agent.address, token=agent.token)
        return self._client

    def _run(self, plan_id: str, version: int, timeout: float, atomic: bool, verify: bool, delta: bool) -> Outcome:
        """(ok, refit id, error) of running the plan for ``version`` (the leader's call)."""
        import grpc

        from refit.control.client import RefitFailed as Failed

        assert self.agent is not None
        try:
            result = self._client_of(self.agent).refit(plan_id, version, timeout=timeout, atomic=atomic,
                                                       verify=verify, delta=delta)
            if result.delta is not None:
                d = result.delta
                log.info("refit %s: delta %s: %.2f%% of words changed, %d of %d bytes sent%s", result.refit_id,
                         "in full" if result.delta_fallback else "applied", 100 * d["changed_fraction"],
                         d["wire_bytes"], d["full_bytes"],
                         f" ({result.delta_fallback})" if result.delta_fallback else "")
            return True, result.refit_id, ""
        except Failed as e:
            return False, e.result.refit_id, str(e)
        except grpc.RpcError as e:
            return False, "", f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported to every worker, raised there
            return False, "", f"{type(e).__name__}: {e}"
