"""``refit-bench --ray ADDRESS``: the direct bench with every rank a Ray actor across a cluster.

The driver (this process) plans as the direct bench does, places one actor per rank with
`refit.integrations.ray.rl_placement` (colocated: source rank i and destination rank i in bundle
i, on one GPU; disaggregated: a placement group per side), asks each actor where it landed, and
hands every actor the same `refit.bench.worker.Job` — each runs the same `Session` (member,
timing, element-by-element verification) as a direct-bench worker process.  The driver hosts the
rendezvous store; a worker's gloo groups listen on its node's address (`refit_ray.host_for`).

Where bytes go.  A Ray node is a host: no shared memory or CUDA IPC between nodes.
* CPU: gloo between ranks; a colocated pair (one node) shares the source's /dev/shm arena.
* GPU, every rank on one node: with ``--transport auto``/``ipc`` the actors see all the node's
  GPUs (Ray's RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) and pull peers' shards over CUDA IPC,
  as the direct bench does; ``--transport nccl`` keeps Ray's isolation (each actor sees its GPU
  as cuda:0; GPUs are told apart by UUID) and sends over NCCL.
* GPU over several nodes: NCCL between GPUs, CUDA IPC only within a colocated pair's GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import socket
import time
import uuid
from typing import Any

import ray
import torch.distributed as dist

from refit.bench.launch import WorkerFailure
from refit.bench.worker import Job, PlanRun, Refit, Session, WorkerResult
from refit.errors import InvalidInput
from refit.executor.topology import GpuSeat, Topology, all_visible, local_indices
from refit.integrations.ray import coordinator as ray_coord
from refit.integrations.ray.placement import STRATEGIES, RLPlacement, rl_placement, traffic
from refit.sides import Side
from refit.spec import ModelSpec
from refit.units import MiB, fmt_bytes

log = logging.getLogger("refit.bench")

GRACE_S = 2.0  # how long survivors may take to report after the first failure


class BenchRank:
    """One rank of the bench as a Ray actor: says where it runs, then runs a worker `Session`."""

    def __init__(self, verbose: bool) -> None:
        import torch

        torch.set_num_threads(1)  # ranks share the node's cores
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="[%(name)s] %(levelname)s %(message)s")

    def where(self, cuda: bool) -> dict[str, Any]:
        """Node, refit host string, and (GPU) this actor's GPU UUID and the UUIDs it sees."""
        ep = ray_coord.endpoint()
        out: dict[str, Any] = {"node_id": ep.node_id, "node_ip": ep.node_ip, "host": ep.host}
        if cuda:
            from refit.executor.seating import visible_gpus

            if ep.cuda_index < 0:
                raise InvalidInput(f"a GPU rank actor on node {ep.node_ip} was given no GPU")
            visible = visible_gpus()
            out |= {"uuid": visible[ep.cuda_index], "visible": list(visible), "gpu": ep.gpu}
        return out

    def peer_access(self, uuids: list[str]) -> bool:
        """Whether every pair of these GPUs (all visible here) can access each other."""
        import torch

        from refit.executor.seating import visible_gpus

        visible = visible_gpus()
        idx = [visible.index(u) for u in uuids]
        return all(torch.cuda.can_device_access_peer(i, j) for i in idx for j in idx if i != j)

    def run(self, job: Job, member: int, host: str) -> WorkerResult:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        return Session(job, member, lambda what: None, host).run()


_BenchRankActor = ray.remote(max_restarts=0)(BenchRank)


# ---------------------------------------------------------------------------------------------
# The driver


def connect(address: str, ranks: int, timeout: float = 30.0, verbose: bool = False) -> bool:
    """Join the cluster ``address`` names; True when this call connected (so it disconnects).
    ``auto``: the cluster this process already joined, else $RAY_ADDRESS, else a new local one
    (with a CPU per rank at least; never a cluster found by guessing).  A host:port that does not
    answer within ``timeout`` seconds is refused (`ray.init` would retry it for minutes)."""
    if ray.is_initialized():
        return False
    # -v: the rank actors' INFO logs come back to this terminal (Ray forwards workers' output)
    kw: dict[str, Any] = dict(include_dashboard=False, logging_level="warning", log_to_driver=verbose)
    if address != "auto":
        _probe(address, "--ray", timeout, required=True)
        ray.init(address=address, **kw)
    elif os.environ.get("RAY_ADDRESS"):
        _probe(os.environ["RAY_ADDRESS"], "$RAY_ADDRESS", timeout, required=False)
        ray.init(address=os.environ["RAY_ADDRESS"], **kw)
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, ranks), **kw)
    return True


def _probe(address: str, what: str, timeout: float, required: bool) -> None:
    """Refuse (`RefitError`) a Ray address that is not host:port (``required``: else leave it to
    Ray) or whose host:port takes no TCP connection within ``timeout`` seconds."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in address:
        if required:
            raise InvalidInput(f"{what} {address}: expected host:port of a running Ray cluster's head, or auto")
        return
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout, 30.0)).close()
    except OSError as e:
        raise InvalidInput(f"{what} {address}: no Ray cluster answers there ({e.strerror or e})") from None


def _refuse_early(need_gpus: int, ranks: int, cuda: bool, transport: str) -> None:
    """What cannot work on this cluster, said before anything starts."""
    res = ray.cluster_resources()
    if cuda and need_gpus > res.get("GPU", 0):
        raise InvalidInput(f"this plan needs {need_gpus} GPUs and the Ray cluster has {res.get('GPU', 0):g} "
                         f"(use --cpu for a reduced-width CPU run)")
    if not cuda and ranks > res.get("CPU", 0):
        raise InvalidInput(f"a CPU run puts {ranks} rank actors of one CPU each on the Ray cluster, which has "
                         f"{res.get('CPU', 0):g} CPUs")
    if not cuda and transport == "ipc":
        raise InvalidInput("--ray on CPU runs over gloo: Ray nodes share no memory, so --transport ipc is refused")


def _node_gpus() -> int:
    return max((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]), default=0)


def run_on_ray(args: argparse.Namespace, spec: ModelSpec, plans: list[Any], cuda: bool,
               reduced: dict[str, list[int]] | None, kill: tuple[tuple[Side, int, int] | None, bool] = (None, False),
               ) -> dict[str, Any]:
    """Place, run and report (the caller has joined the cluster: `connect`).  ``kill``: the
    test hook of `refit.bench.cli._kill_hook` (a rank actor dies or stops mid-refit)."""
    first = plans[0]
    placement = first.plan.placement
    ns, nd = len(placement.src_gpus), len(placement.dst_gpus)
    pl: RLPlacement | None = None
    actors: list[Any] = []
    session = uuid.uuid4().hex[:12]
    try:
        _refuse_early(placement.num_gpus, ns + nd, cuda, args.transport)
        one_node = cuda and _node_gpus() >= placement.num_gpus
        if cuda and args.transport == "ipc" and not one_node:
            raise InvalidInput(f"--transport ipc needs every rank on one Ray node, and no node has "
                             f"{placement.num_gpus} GPUs; use nccl")
        strategy = args.ray_strategy or ("STRICT_PACK" if one_node else "PACK" if cuda else "SPREAD")
        visible = one_node and args.transport in ("auto", "ipc")  # ipc needs every GPU visible
        pl = rl_placement(ns, nd, colocated=placement.kind == "colocated", gpus_per_rank=1 if cuda else 0,
                          cpus_per_rank=1, strategy=strategy, all_gpus_visible=visible, timeout=args.timeout)
        topo = Topology.one_per_rank(placement)
        for ep in (e for eps in topo.members for e in eps):
            # (NCCL_NVLS_ENABLE=0 is set by the actor itself: no runtime_env beyond what placement needs)
            opts = pl.trainer_options(ep[1]) if ep[0] is Side.TRAINER else pl.engine_options(ep[1])
            actors.append(_BenchRankActor.options(**opts).remote(args.verbose))
        where = _where(actors, topo, cuda, args.timeout)
        topos, transport = _seat(topo, where, cuda, args.transport, actors, args.timeout)
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        job = dataclasses.replace(_job(args, spec, plans, topo, cuda, session, store.port), kill=kill[0], hang=kill[1])
        results = _run(actors, [dataclasses.replace(job, topology=t, transport="ipc" if transport == "ipc" else "comm")
                                for t in topos], where, topo, args.timeout)
        del store
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        if pl is not None:
            pl.remove()
        for path in glob.glob(f"/dev/shm/refit-{session}-*"):  # CPU shards of a colocated pair (this machine)
            os.unlink(path)
    from refit.bench.direct import report

    link_mb = args.link_mb if args.link_mb is not None else (1024 if cuda else 16)
    timed = [[rf.timed for rf in p.refits] for p in job.runs]
    out = report(spec, plans, timed, results, "cuda" if cuda else "cpu", reduced, len(topo.members),
                 int(link_mb * MiB), transport, {}, args.alloc)
    out["ray"] = _ray_report(args.ray, strategy, plans, topo, where, transport, cuda)
    return out


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _where(actors: list[Any], topo: Topology, cuda: bool, timeout: float) -> list[dict[str, Any]]:
    """Each actor's answer to `BenchRank.where`; an actor that died starting (its node lacks a
    package, its runtime env failed, ...) or did not answer within ``timeout`` seconds is a
    `WorkerFailure` naming its rank, not a traceback; a `RefitError` it raised stays one."""
    refs = [a.where.remote(cuda) for a in actors]
    deadline = time.monotonic() + timeout
    out = []
    for m, ref in enumerate(refs):
        name = topo.describe_member(m)
        try:
            out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [topo.describe_member(k) for k, r in enumerate(refs) if r not in ready]
            raise WorkerFailure(f"refit run on Ray failed: rank actors did not start within {timeout:g} s: "
                                f"{', '.join(late)}", []) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            if isinstance(cause, InvalidInput):
                raise InvalidInput(f"{name}: {cause}") from None
            raise WorkerFailure(f"refit run on Ray failed: {name} failed starting: {_first_line(cause)}",
                                []) from None
        except ray.exceptions.RayError as e:  # the actor died (or never came up)
            raise WorkerFailure(f"refit run on Ray failed: {name} died starting ({_first_line(e)})",
                                [name]) from None
    return out


def _seat(topo: Topology, where: list[dict[str, Any]], cuda: bool, requested: str, actors: list[Any],
          timeout: float) -> tuple[list[Topology], str]:
    """Each member's topology (on GPU with its own torch index of every GPU) and the transport."""
    if not cuda:
        return [topo] * len(where), "gloo"
    seats = [GpuSeat(w["host"], w["uuid"], tuple(w["visible"])) for w in where]
    ids = [topo.device_of[eps[0]] for eps in topo.members]
    by_device: dict[int, set[tuple[str, str]]] = {}
    for d, s in zip(ids, seats):
        by_device.setdefault(d, set()).add((s.host, s.uuid))
    gpus = [next(iter(v)) for v in by_device.values()]
    if any(len(v) > 1 for v in by_device.values()) or len(set(gpus)) != len(gpus):
        raise InvalidInput(f"Ray placed the ranks on GPUs that do not match the plan's placement: "
                         f"{ {topo.describe_member(m): (s.host, s.uuid) for m, s in enumerate(seats)} }")
    ipc_ok = all_visible(seats) and ray.get(actors[0].peer_access.remote(sorted({s.uuid for s in seats})),
                                            timeout=timeout)
    if requested == "ipc" and not ipc_ok:
        raise InvalidInput("--transport ipc needs every rank on one Ray node with every GPU visible and peer "
                         "access between them; use nccl")
    transport = "ipc" if ipc_ok and requested in ("auto", "ipc") else "nccl"
    return [dataclasses.replace(topo, local=local_indices(seats, ids, me)) for me in seats], transport


def _job(args: argparse.Namespace, spec: ModelSpec, plans: list[Any], topo: Topology, cuda: bool,
         session: str, port: int) -> Job:
    runs = []
    for i, r in enumerate(plans):
        refits = [Refit(seed=i + 1, timed=False) for _ in range(args.warmup)]
        refits += [Refit(seed=i + 1, timed=True, verify=(k == args.iters - 1)) for k in range(args.iters)]
        runs.append(PlanRun(r.plan, tuple(refits)))
    link_mb = args.link_mb if args.link_mb is not None else (1024 if cuda else 16)
    return Job(session, spec, plans[0].src, plans[0].dst, topo, tuple(runs), device="cuda" if cuda else "cpu",
               timeout_s=args.timeout, link_bytes=int(link_mb * MiB), store_port=port,
               store_host=ray.util.get_node_ip_address(),
               log_level=logging.INFO if args.verbose else logging.WARNING, alloc=args.alloc)


def _run(actors: list[Any], jobs: list[Job], where: list[dict[str, Any]], topo: Topology,
         timeout: float) -> list[WorkerResult]:
    """Every actor's session at once; the first failure names its rank and node, the rest are killed."""
    names = [f"{topo.describe_member(m)} (node {w['node_id'][:8]} {w['node_ip']})" for m, w in enumerate(where)]
    refs = {a.run.remote(j, m, w["host"]): m for m, (a, j, w) in enumerate(zip(actors, jobs, where))}
    refits = sum(len(p.refits) for p in jobs[0].runs)
    allowed = timeout * (3 + refits)  # every wait inside is bounded by ``timeout``
    deadline = time.monotonic() + allowed
    results: dict[int, WorkerResult] = {}
    dead: list[str] = []
    errors: list[str] = []
    failed_at: float | None = None
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        for ref in done:
            m = refs[ref]
            try:
                results[m] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead.append(f"{names[m]} died ({str(e).strip().splitlines()[0]})")
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if e.cause is not None else e
                errors.append(f"{names[m]}: {(str(cause).strip().splitlines() or [type(cause).__name__])[0]}")
        now = time.monotonic()
        if (dead or errors) and failed_at is None:
            failed_at = now
        if failed_at is not None and (now - failed_at > GRACE_S or not pending):
            raise WorkerFailure("refit run on Ray failed: " + "; ".join(dead + errors), dead)
        if now > deadline:
            raise WorkerFailure(f"refit run on Ray did not finish within {allowed:.0f} s; "
                                f"still running: {', '.join(names[refs[r]] for r in pending)}", [])
    return [results[m] for m in range(len(actors))]


def _ray_report(address: str, strategy: str, plans: list[Any], topo: Topology, where: list[dict[str, Any]],
                transport: str, cuda: bool) -> dict[str, Any]:
    """Nodes used (ranks and GPUs on each) and each run's bytes within each node and across nodes."""
    node = {m: w["node_id"][:8] for m, w in enumerate(where)}
    nodes: dict[str, dict[str, Any]] = {}
    for m, w in enumerate(where):
        n = nodes.setdefault(node[m], {"ip": w["node_ip"], "host": w["host"], "ranks": [], "gpus": []})
        n["ranks"].append(topo.describe_member(m))
        if cuda and w["gpu"] not in n["gpus"]:
            n["gpus"].append(w["gpu"])
    member_of = topo.member_of
    src = {ep[1]: node[m] for ep, m in member_of.items() if ep[0] is Side.TRAINER}
    dst = {ep[1]: node[m] for ep, m in member_of.items() if ep[0] is Side.ENGINE}
    runs = []
    for r in plans:
        t = traffic(r.plan, src, dst)
        runs.append({"planner": r.summary["planner"], "within_node": t.within, "across_nodes": t.across,
                     "total": t.total})
    within_how = {"ipc": "CUDA IPC / peer pulls", "nccl": "NCCL (CUDA IPC within a colocated pair's GPU)",
                  "gloo": "gloo (/dev/shm within a colocated pair)"}[transport]
    return {"address": address, "strategy": strategy, "nodes": nodes, "runs": runs,
            "within_node_transport": within_how, "across_nodes_transport": "NCCL" if cuda else "gloo"}


def table_ray(r: dict[str, Any]) -> str:
    """The lines `refit-bench --ray` adds below the direct bench's table."""
    ray_r = r["ray"]
    lines = ["", f"Ray ({ray_r['address']}, placement strategy {ray_r['strategy']}): every rank an actor on "
             f"{len(ray_r['nodes'])} node(s)"]
    for nid, n in ray_r["nodes"].items():
        gpus = f", GPUs {n['gpus']}" if n["gpus"] else ""
        lines.append(f"  node {nid} ({n['ip']}{gpus}): {'; '.join(n['ranks'])}")
    for run in ray_r["runs"]:
        within = ", ".join(f"node {k} {fmt_bytes(v)}" for k, v in sorted(run["within_node"].items())) or "none"
        lines.append(f"  {run['planner']}: per refit within nodes {within}; across nodes "
                     f"{fmt_bytes(run['across_nodes'])}")
    lines.append(f"  within a node: {ray_r['within_node_transport']}; across nodes: {ray_r['across_nodes_transport']}")
    return "\n".join(lines)


__all__ = ["STRATEGIES", "connect", "run_on_ray", "table_ray"]
