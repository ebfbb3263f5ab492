"""``refit-bench --via grpc``: the same refit driven the way an RL loop drives it.

A coordinator (`refit.control.server`, loopback) runs in the bench process; one process per rank
holds its shard (source values or the destination sentinel, as in the direct bench) and embeds a
`TrainerAgent` or `EngineAgent` whose data plane is `refit.executor`
(`refit.control.dataplane_executor`).  The bench is the RL loop: it creates the plan through
`refit.Client`, asks the trainers to write new weights (outside the timing), then calls
``Refit(plan_id, version)`` and times the round trip.  Reported per refit: the client's round trip,
the data time (slowest worker's executor time, from its own clock) and the difference — what the
control plane and the start/end barriers add.  The last version is verified on every engine.
``--atomic`` and ``--verify`` pass the same options to every ``Refit`` (all or none: engines
stage and switch; checksums of every transfer compared), so their cost reads against the same
command without them.

With ``--alloc framework`` (the default) each engine rank allocates every parameter on its own,
one ``torch.empty`` each in model order, as vLLM does, and its agent registers those very tensors:
the data plane writes into them in place, which is the vLLM backend's ``bounded`` landing on GPUs
(`refit.integrations.vllm.landing`) without vLLM around it.  Verification also checks that no
engine parameter moved (CUDA graphs hold their addresses).  Trainers lay their shards out as
frameworks do (`refit.executor.shards.arena_offsets`).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import time
from typing import Any, Callable

from refit.errors import RefitError
from refit.spec import ModelSpec
from refit.timeline import CLIENT_CALL, mark
from refit.units import fmt_bytes

log = logging.getLogger(__name__)


def _agent_main(conn: Any, address: str, spec: ModelSpec, role: str, rank: int, layout: str, gpu: int,
                transport: str, log_level: int, alloc: str) -> None:
    """One rank: allocate, fill, embed an agent, then obey the bench (fill / verify / stop)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    logging.basicConfig(level=log_level, format=f"[{role} {rank}] %(levelname)s %(message)s")
    import torch

    from refit.control import EngineAgent, TrainerAgent
    from refit.sides import Side
    from refit.control.dataplane_executor import ExecutorDataPlane
    from refit.executor.shards import allocate, allocate_each, fill_sentinel, fill_source, verify
    from refit.layouts import resolve_layout

    torch.set_num_threads(1)
    try:
        side = Side.named(role)
        lay = resolve_layout(layout, spec, side)
        device = torch.device("cuda", gpu) if gpu >= 0 else torch.device("cpu")
        if gpu >= 0:
            torch.cuda.set_device(gpu)
        locals_ = list(lay.local_tensors(spec, rank))
        if side is Side.ENGINE and alloc == "framework":
            shards = allocate_each(locals_, device)  # one allocation per parameter, as vLLM
        else:
            shards = allocate(locals_, device, scattered=alloc == "framework")
        fill_sentinel(shards)
        addresses = {n: t.data_ptr() for n, t in shards.tensors.items()}
        cls = TrainerAgent if side is Side.TRAINER else EngineAgent
        agent = cls(address, group=role, rank=rank, spec=spec, layout=lay, tensors=shards.tensors, gpu=gpu,
                    data_plane=ExecutorDataPlane(transport)).start()
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "fill":
                fill_source(shards, spec, arg)
                if gpu >= 0:
                    torch.cuda.synchronize(device)
                conn.send(("ok", None))
            elif cmd == "verify":
                moved = [n for n, t in shards.tensors.items() if t.data_ptr() != addresses[n]]
                conn.send(("ok", (verify(shards, spec, arg), moved, agent.staging_bytes)))
            else:
                agent.stop()
                conn.send(("ok", None))
                break
    except BaseException as e:  # the bench reports it, naming the rank
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
        os._exit(0)


class _Ranks:
    """The rank processes and their command pipes."""

    def __init__(self, address: str, spec: ModelSpec, plan: Any, src: str, dst: str, cuda: bool,
                 transport: str, log_level: int, alloc: str, timeout: float = 600.0,
                 on_error: Callable[[], None] | None = None) -> None:
        """``on_error``: called when starting a rank fails (after those started are stopped)."""
        self.timeout = timeout  # every wait for a rank's answer (--timeout)
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.names, self.roles = [], [], [], []
        try:
            for role, layout, gpus in (("trainer", src, plan.placement.src_gpus),
                                       ("engine", dst, plan.placement.dst_gpus)):
                for rank, g in enumerate(gpus):
                    parent, child = ctx.Pipe()
                    p = ctx.Process(target=_agent_main, daemon=True, name=f"{role}-{rank}",
                                    args=(child, address, spec, role, rank, layout, g if cuda else -1, transport,
                                          log_level, alloc))
                    p.start()
                    child.close()  # the rank's end: ours closed, so that its death reads as EOF here
                    self.procs.append(p)
                    self.conns.append(parent)
                    self.names.append(f"{role} {rank}")
                    self.roles.append(role)
        except BaseException:
            for p in self.procs:  # none has been told anything yet
                p.kill()
                p.join(5)
            if on_error:
                on_error()
            raise

    def ask(self, which: list[int], cmd: str, arg: Any = None, timeout: float | None = None) -> list[Any]:
        """Send ``cmd`` to the ranks ``which`` and return their answers; a rank that is gone, says
        "error" or stays silent for ``timeout`` seconds is a `WorkerFailure` naming it (exit 3)."""
        from refit.bench.launch import WorkerFailure

        for i in which:
            if cmd != "ready":
                try:
                    self.conns[i].send((cmd, arg))
                except OSError:  # its end of the pipe is closed: the process is gone
                    raise self._gone(i, cmd) from None
        out = []
        timeout = self.timeout if timeout is None else timeout
        for i in which:
            if not self.conns[i].poll(timeout):
                raise WorkerFailure(f"refit run failed: {self.names[i]} did not answer {cmd!r} within "
                                    f"{timeout:g} s", [])
            try:
                kind, value = self.conns[i].recv()
            except (EOFError, OSError):  # died without a word (killed, crashed)
                raise self._gone(i, cmd) from None
            if kind == "error":
                raise WorkerFailure(f"refit run failed: {self.names[i]}: {value}", [])
            out.append(value)
        return out

    def _gone(self, i: int, cmd: str) -> Exception:
        from refit.bench.launch import WorkerFailure, _exit_text

        p = self.procs[i]
        p.join(1)
        return WorkerFailure(f"refit run failed: {self.names[i]} (pid {p.pid}) died ({_exit_text(p.exitcode)}) "
                             f"before answering {cmd!r}", [self.names[i]])

    def of(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r == role]

    def close(self) -> None:
        from refit.bench.launch import WorkerFailure

        for i, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.ask([i], "stop", timeout=10)
                except (RefitError, OSError, EOFError, WorkerFailure):
                    pass
            p.join(5)
            if p.is_alive():
                p.kill()


def run_grpc(args: argparse.Namespace, spec: ModelSpec, plan: Any, cuda: bool, transport: str,
             reduced: dict[str, list[int]] | None, bucket: int) -> dict[str, Any]:
    from refit.bench.launch import WorkerFailure
    from refit.control import Client
    from refit.control.client import ControlError, RefitFailed
    from refit.control.server import ThreadedServer

    level = logging.INFO if args.verbose else logging.WARNING
    server = ThreadedServer(default_timeout=args.timeout)
    client = Client(server.address)
    ranks = _Ranks(server.address, spec, plan.plan, plan.src.describe(), plan.dst.describe(), cuda,
                   transport if cuda else "comm", level, args.alloc, args.timeout, on_error=server.stop)
    try:
        ranks.ask(list(range(len(ranks.procs))), "ready")
        created = client.create_plan("trainer", "engine", placement=args.placement, planner=args.planner,
                                     bucket_bytes=bucket)
        trips, data, worst = [], [], []
        for k in range(args.warmup + args.iters):
            version = k + 1
            ranks.ask(ranks.of("trainer"), "fill", version)
            t0 = time.perf_counter()
            mark(CLIENT_CALL)
            result = client.refit(created["plan_id"], version=version, timeout=args.timeout, atomic=args.atomic,
                                  verify=args.verify)
            trip = time.perf_counter() - t0
            if k >= args.warmup:
                trips.append(trip)
                slowest = max(w.seconds for w in result.workers.values())
                data.append(slowest)
                worst.append(trip - slowest)
            log.info("refit %d: %.1f ms round trip", version, trip * 1e3)
        checks = ranks.ask(ranks.of("engine"), "verify", args.warmup + args.iters)
    except (RefitFailed, ControlError) as e:  # a worker failed or left: not bad input (exit 3)
        why = e.result.error if isinstance(e, RefitFailed) else (e.details() or type(e).__name__)
        raise WorkerFailure(f"refit run failed: {why}", []) from None
    finally:
        coord_log = logging.getLogger("refit.control.coordinator")
        level_before = coord_log.level
        coord_log.setLevel(logging.ERROR)  # agents leaving is expected now
        try:
            ranks.close()
            client.close()
            server.stop()
        finally:
            coord_log.setLevel(level_before)  # a library caller's logging stays as it was
    verdicts = [v for v, _, _ in checks]
    moved = sum(len(m) for _, m, _ in checks)
    verified = all(v.ok for v in verdicts) and not moved
    return {
        "via": "grpc", "model": spec.name, "src": plan.src.describe(), "dst": plan.dst.describe(),
        "placement": args.placement, "planner": args.planner, "device": "cuda" if cuda else "cpu",
        "transport": transport if cuda else "gloo", "reduced": reduced, "processes": len(ranks.procs), "plan_id": created["plan_id"],
        "plan_hash": created["plan_hash"],
        "round_trip": _stats(trips), "data": _stats(data), "overhead": _stats(worst),
        "engine_bytes": result.total_bytes, "verified": verified, "alloc": args.alloc,
        "engine_allocation": ("one allocation per parameter (as vLLM), written in place" if args.alloc == "framework"
                              else "one arena per rank"), "moved_parameters": moved,
        "checked_elements": sum(v.checked for v in verdicts), "mismatches": sum(v.mismatches for v in verdicts),
        "first_mismatch": next((v.first for v in verdicts if v.first), None),
        "atomic": args.atomic, "staging_bytes": max(s for _, _, s in checks),
        "verify": args.verify, "verified_transfers": result.verified_transfers,
    }


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def table_grpc(r: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1e3:9.2f}"  # noqa: E731
    lines = [f"refit-bench --via grpc  {r['model']}  {r['src']} -> {r['dst']}  {r['placement']}  "
             f"({r['processes']} agent processes)  planner {r['planner']}  transport {r['transport']}",
             "device: " + ("CUDA, full size" if r["device"] == "cuda" else
                           "CPU (gloo), reduced width — shows the control path works, not speed"),
             "", f"{'per refit':24s} {'median ms':>9s} {'min ms':>9s} {'max ms':>9s}"]
    for key, what in (("round_trip", "client round trip"), ("data", "data (slowest worker)"),
                      ("overhead", "control + barriers")):
        s = r[key]
        lines.append(f"{what:24s} {ms(s['median'])} {ms(s['min'])} {ms(s['max'])}")
    lines += ["", f"engines received {fmt_bytes(r['engine_bytes'])} per refit into {r['engine_allocation']}; "
              f"verified: {'yes' if r['verified'] else 'NO'} ({r['checked_elements']} elements, {r['mismatches']} wrong, "
              f"{r['moved_parameters']} parameters moved)"]
    if r.get("first_mismatch"):
        lines.append(f"first wrong: {r['first_mismatch']}")
    if r.get("atomic"):
        lines.append(f"atomic: every engine staged its shard and switched at the commit; staging "
                     f"{fmt_bytes(r['staging_bytes'])} per engine (the largest)")
    if r.get("verify"):
        lines.append(f"verify: {r['verified_transfers']} transfers checksummed at both ends, all equal")
    return "\n".join(lines)
