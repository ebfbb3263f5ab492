"""The refit coordinator as a named Ray actor, and where an actor sits (its host and GPU) as refit
sees it.

The coordinator actor runs `refit.control.server.CoordinatorServer` (gRPC, the rendezvous store the
data planes meet on) on a thread of its own, listening on the head node's IP so that every node
reaches it.  It is named (`COORDINATOR_NAME`), so any actor or task of the same Ray job (same
namespace) finds it with `coordinator_address()`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

from refit.errors import InvalidInput

log = logging.getLogger(__name__)

COORDINATOR_NAME = "refit-coordinator"
HEAD_RESOURCE = "node:__internal_head__"  # every Ray head node has it: pins an actor to the head
_HANDLES: dict[str, Any] = {}


class _Coordinator:
    """The actor body: a `ThreadedServer` on this node's IP (an OS-chosen port)."""

    def __init__(self, token: str | None, default_timeout: float) -> None:
        from refit.control.server import ThreadedServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._token = token
        self._server = ThreadedServer(host=ray.util.get_node_ip_address(), token=token,
                                      default_timeout=default_timeout)
        log.info("refit coordinator actor listening on %s", self._server.address)

    def address(self) -> str:
        return self._server.address

    def token(self) -> str | None:
        return self._token

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self._server.stop()


_CoordinatorActor = ray.remote(num_cpus=0, max_concurrency=8)(_Coordinator)


def _require_ray() -> None:
    if not ray.is_initialized():
        raise InvalidInput("Ray is not initialized: call ray.init() (or run inside a Ray actor or task) first")


def start_coordinator(token: str | None = None, *, name: str = COORDINATOR_NAME, detached: bool = False,
                      default_timeout: float = 60.0, timeout: float = 120.0) -> str:
    """Start `refit serve` as the named actor ``name`` on the head node, or find the running one;
    its "host:port".  ``detached``: outlive the caller (default: the actor ends with the process
    that started it, normally the job's driver; call this there).
    ``token``: require it on every call; agents get it from `agent_kwargs` (Ray itself is the
    trust boundary: whoever can call actors of this job can read it).  ``timeout``: seconds to
    wait for the actor to come up."""
    _require_ray()
    opts: dict[str, Any] = dict(name=name, get_if_exists=True, resources={HEAD_RESOURCE: 0.001})
    if detached:
        opts["lifetime"] = "detached"
    actor = _CoordinatorActor.options(**opts).remote(token, default_timeout)
    # A non-detached actor dies with its creator's handle (one that finds a running actor does not
    # keep it alive): keep the first handle to each actor, not the later ones.
    held = _HANDLES.get(name)
    if held is None or held._actor_id != actor._actor_id:
        _HANDLES[name] = actor
    try:
        address, running_token = ray.get([actor.address.remote(), actor.token.remote()], timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise InvalidInput(f"the refit coordinator actor {name!r} did not start within {timeout:g} s") from None
    if running_token != token:
        raise InvalidInput(f"a refit coordinator {name!r} already runs at {address} with "
                         f"{'another token' if running_token else 'no token'}; stop it first")
    return address


def _actor(name: str) -> Any:
    _require_ray()
    try:
        return ray.get_actor(name)
    except ValueError:
        namespace = ray.get_runtime_context().namespace
        raise InvalidInput(f"no refit coordinator actor {name!r} in Ray namespace {namespace!r}: "
                         f"call refit.integrations.ray.start_coordinator() in the driver first") from None


def coordinator_address(*, name: str = COORDINATOR_NAME, timeout: float = 60.0) -> str:
    """The "host:port" of the coordinator `start_coordinator` started (from any actor or task of
    the same Ray job, or the driver)."""
    return ray.get(_actor(name).address.remote(), timeout=timeout)


def stop_coordinator(*, name: str = COORDINATOR_NAME, timeout: float = 30.0) -> None:
    """Stop and remove the coordinator actor (no-op when none runs).  One that does not stop within
    ``timeout`` seconds, or died, is killed all the same: this never raises for it."""
    try:
        actor = ray.get_actor(name)
    except ValueError:
        return
    try:
        ray.get(actor.stop.remote(), timeout=timeout)
    except ray.exceptions.RayError as e:  # hung (GetTimeoutError) or dead: the kill below ends it
        log.warning("coordinator actor %s did not stop cleanly (%s): killing it", name, type(e).__name__)
    finally:
        ray.kill(actor, no_restart=True)
        _HANDLES.pop(name, None)


def host_for(node_id: str, node_ip: str, one_machine: bool) -> str:
    """The host string refit's agents register with for a Ray node.

    refit uses it twice: as the host's identity (members on one host may share memory and CUDA
    IPC) and as the address this member's gloo groups bind to.  So it is the node's IP; except
    where every Ray node of the cluster runs on one machine (``one_machine``: they all report one
    IP, as with `ray.cluster_utils` or several `ray start` on one host): there each node gets a
    loopback address of its own, 127.a.b.c hashed from its node id, so that each Ray node is a
    host of its own while every member still reaches every other (all of 127/8 is loopback).
    Several Ray nodes on one machine of a multi-machine cluster share their machine's IP and so
    look like one host."""
    if not one_machine:
        return node_ip
    h = int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:3], "big")
    return f"127.{h >> 16}.{(h >> 8) & 255}.{1 + (h & 255) % 254}"


def _one_machine() -> bool:
    """Whether every alive node of the cluster reports the same IP."""
    return len({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}) == 1


@dataclass(frozen=True)
class RayEndpoint:
    """Where the calling actor or task runs."""

    node_id: str  # Ray's node id (hex)
    node_ip: str  # the node's IP, as Ray reports it
    host: str     # what refit's agents take as ``host=`` (`host_for`)
    gpu: int      # the GPU id Ray assigned (an index among the node's GPUs), -1 without one
    gpus: tuple[int, ...]  # every GPU id Ray assigned
    cuda_index: int  # the torch device index of ``gpu`` in this process (-1 without one)


def cuda_index(gpu: int) -> int:
    """The torch device index of Ray's GPU id ``gpu`` in this process: its position in
    CUDA_VISIBLE_DEVICES where Ray set that (its default: an actor sees only its own GPUs, from
    cuda:0), else the id itself (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: every GPU visible)."""
    if gpu < 0:
        return -1
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return gpu
    if str(gpu) not in visible:
        raise InvalidInput(f"GPU {gpu} is not in CUDA_VISIBLE_DEVICES={','.join(visible)}")
    return visible.index(str(gpu))


def endpoint(gpu: int | None = None) -> RayEndpoint:
    """Where the caller runs.  ``gpu``: which of several assigned GPUs this rank uses (by Ray's
    id); an actor with exactly one GPU needs no choice."""
    _require_ray()
    ctx = ray.get_runtime_context()
    node_id, node_ip = ctx.get_node_id(), ray.util.get_node_ip_address()
    ids = ctx.get_accelerator_ids().get("GPU", [])
    if not all(str(g).isdigit() for g in ids):
        raise InvalidInput(f"Ray assigned GPUs {ids}: refit needs numeric GPU ids (not UUIDs in CUDA_VISIBLE_DEVICES)")
    gpus = tuple(int(g) for g in ids)
    if gpu is None:
        if len(gpus) > 1:
            raise InvalidInput(f"this actor holds {len(gpus)} GPUs {list(gpus)}: say which one the rank uses (gpu=)")
        gpu = gpus[0] if gpus else -1
    elif gpu not in gpus:
        raise InvalidInput(f"gpu={gpu} is not one of the GPUs Ray assigned this actor: {list(gpus)}")
    return RayEndpoint(node_id, node_ip, host_for(node_id, node_ip, _one_machine()), gpu, gpus, cuda_index(gpu))


def agent_kwargs(*, name: str = COORDINATOR_NAME, gpu: int | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """The keyword arguments a `TrainerAgent` / `EngineAgent` (or an integration's attach call)
    needs inside a Ray actor: ``address`` and ``token`` of the job's coordinator, ``host`` and
    ``gpu`` of this actor::

        TrainerAgent(**agent_kwargs(), group="trainer", rank=r, spec=spec, layout=..., tensors=...)
    """
    actor = _actor(name)
    address, token = ray.get([actor.address.remote(), actor.token.remote()], timeout=timeout)
    where = endpoint(gpu)
    return {"address": address, "token": token, "host": where.host, "gpu": where.gpu}
