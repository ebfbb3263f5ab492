"""One worker process: set up once, then run its share of every refit.

Setup: connect to the rendezvous store, allocate the shards of its endpoints, export them to the
device's driver (or, as a driver, map the colocated peers' shards), build the control group
(barriers) and, for drivers, the data communicator.  With ``transport="ipc"`` (one host) every
source shard is exported and every driver maps all of them, so buckets between devices become
direct reads of the peer's memory (`program` "pulls"); they happen between the refit-start and
refit-end barriers, while no source changes (sources are refilled only outside that window).
Per plan ("phase"): compile and bind the program once, then for every refit: barrier,
`run_refit`, barrier, verify when asked.

Failure: every wait is bounded.  Transfers with a peer that died fail at once (gloo sees the
socket close) or at the deadline (NCCL), with an error naming that peer; the parent
(`refit.executor.launch`) watches exit codes, kills the rest as soon as one dies and names it.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from refit.errors import RefitError
from refit.executor.device import Device, enable_peer_access, make_device
from refit.executor.program import Bound, BoundStep, bind, compile_program
from refit.executor.shards import Shards, Verdict, allocate, fill_sentinel, fill_source, remove_file, verify, views
from refit.executor.topology import Endpoint, Topology, endpoint_name
from refit.executor.transports import Comm, PeerError, gloo_group, export_arena, first_line, import_arena, make_comm
from refit.layouts import Layout, LocalTensor
from refit.plan import Plan
from refit.spec import ModelSpec

log = logging.getLogger("refit.executor")


@dataclass(frozen=True)
class Refit:
    """One refit of a phase: source values of ``seed`` (re-filled when it changes), whether it
    counts in the timings, whether destinations are verified after it."""

    seed: int
    timed: bool = True
    verify: bool = False


@dataclass(frozen=True)
class Phase:
    plan: Plan
    refits: tuple[Refit, ...]


@dataclass(frozen=True)
class Job:
    """Everything a worker needs; identical for all workers of a run."""

    session: str
    spec: ModelSpec
    src: Layout
    dst: Layout
    topology: Topology
    phases: tuple[Phase, ...]
    device: str = "cpu"  # "cpu" or "cuda"
    timeout_s: float = 60.0
    link_bytes: int = 0  # >0: measure the link between the first two drivers with this message
    kill: tuple[str, int, int] | None = None  # test hook: (side, rank, refit number) dies mid-refit
    store_port: int = 0
    log_level: int = logging.WARNING
    transport: str = "comm"  # "comm": NCCL (GPU) / gloo (CPU) between devices; "ipc": direct reads


@dataclass
class PhaseResult:
    seconds: list[float] = field(default_factory=list)  # every refit of the phase, in order
    verdicts: dict[str, list[Verdict]] = field(default_factory=dict)  # endpoint -> one per verified refit
    staging_bytes: int = 0
    gather_bytes: int = 0
    peak_extra_bytes: int | None = None  # CUDA: allocator peak during refits minus own shards
    copies: int = 0
    blocks: int = 0
    memcpys: int = 0  # of the copies, calls on the copy engines (CUDA)
    steps: int = 0


@dataclass
class WorkerResult:
    member: int
    phases: list[PhaseResult]
    link_seconds: float | None = None
    shard_bytes: int = 0


# ---------------------------------------------------------------------------------------------


def run_refit(bound: Bound, comm: Comm | None, device: Device, timeout_s: float,
              hook: Callable[[], None] | None = None) -> None:
    """One refit of this member's share, in program order.  Two steps in flight at most (the two
    buffer sets); a stage is drained before the next starts (stage 1 sends what stage 0 gathered).
    A stage's pulls (ipc) are issued first, on streams of their own, and joined at its end."""
    deadline = time.monotonic() + timeout_s
    device.begin()
    if hook and not any(st.steps for st in bound.stages):
        hook()
    for stage in bound.stages:
        if not stage.steps:  # local copies first: issuing them never waits on a peer
            device.copy(stage.moves)
        for batch in stage.pulls:
            device.pull(batch)
        inflight: deque[tuple[BoundStep, Any]] = deque()
        for j, step in enumerate(stage.steps):
            if len(inflight) == 2:
                _finish(*inflight.popleft(), comm, device)
            device.copy(step.pack)
            assert comm is not None, "a program with steps needs a communicator"
            inflight.append((step, comm.post(step.sends, step.recvs)))
            if j == 0:
                if hook:
                    hook()
                device.copy(stage.moves)  # direct copies overlap the first transfer
        while inflight:
            _finish(*inflight.popleft(), comm, device)
        if stage.pulls:
            device.join()
    device.finish(deadline, comm.check if comm else _nothing, comm.stuck if comm else (lambda: "local copies"))


def _finish(step: BoundStep, handle: Any, comm: Comm | None, device: Device) -> None:
    assert comm is not None
    comm.wait(handle)
    device.copy(step.unpack)


def _nothing() -> None:
    pass


# ---------------------------------------------------------------------------------------------


class Session:
    """A worker's state across phases and refits."""

    def __init__(self, job: Job, member: int, report: Callable[[str], None]) -> None:
        self.job, self.member, self.report = job, member, report
        self.topo: Topology = job.topology
        self.mine: tuple[Endpoint, ...] = self.topo.members[member]
        self.name = self.topo.describe_member(member)
        self.refits_done = 0

    # ------------------------------------------------------------------ setup
    def locals_of(self, ep: Endpoint) -> list[LocalTensor]:
        layout = self.job.src if ep[0] == "src" else self.job.dst
        return list(layout.local_tensors(self.job.spec, ep[1]))

    def shm_path(self, ep: Endpoint) -> str:
        return f"/dev/shm/refit-{self.job.session}-{ep[0]}{ep[1]}"

    def setup(self) -> None:
        job, topo = self.job, self.topo
        timeout = datetime.timedelta(seconds=job.timeout_s)
        store = dist.TCPStore("127.0.0.1", job.store_port, is_master=False, timeout=timeout)
        self.store = dist.PrefixStore(job.session, store)
        devices = topo.member_devices(self.member)
        if job.device == "cuda" and len(devices) != 1:
            raise RefitError(f"a CUDA worker must sit on one GPU; {self.name} spans {devices}")
        self.device = make_device(job.device, devices[0])
        self.ctl = gloo_group(dist.PrefixStore("ctl", self.store), self.member, len(topo.members), job.timeout_s)
        driven = set(topo.driven_devices(self.member))
        if job.transport not in ("comm", "ipc"):
            raise RefitError(f"unknown transport {job.transport!r} (comm or ipc)")
        ipc = job.transport == "ipc"

        self.shards: dict[Endpoint, Shards] = {}
        for ep in self.mine:
            exported = topo.device_of[ep] not in driven or (ipc and ep[0] == "src")
            shared = job.device == "cpu" and exported
            self.shards[ep] = allocate(self.locals_of(ep), self.device.torch, self.shm_path(ep) if shared else None)
            if exported:
                self.store.set(f"arena/{ep[0]}{ep[1]}", export_arena(self.shards[ep]))
        self.tensors: dict[Endpoint, dict[str, torch.Tensor]] = {ep: s.tensors for ep, s in self.shards.items()}
        self.imported: list[torch.Tensor] = []
        for dev in sorted(driven):
            for ep in topo.endpoints_on(dev):
                if ep not in self.shards:
                    arena = import_arena(self.store.get(f"arena/{ep[0]}{ep[1]}"))
                    self.imported.append(arena)
                    self.tensors[ep] = views(arena, self.locals_of(ep))
        self.peer_devices: set[int] = set()  # CUDA devices whose memory this process reads (ipc)
        if ipc and driven:  # a driver maps every source shard of the host, once
            if job.device == "cuda":  # both ways, before the handles are opened (else copies go through the host)
                for dev in sorted({d for ep, d in topo.devices if ep[0] == "src"} - set(driven)):
                    enable_peer_access(self.device.torch.index, dev)
                    enable_peer_access(dev, self.device.torch.index)
            for ep, dev in topo.devices:
                if ep[0] == "src" and ep not in self.tensors:
                    arena = import_arena(self.store.get(f"arena/{ep[0]}{ep[1]}"))
                    self.imported.append(arena)
                    self.tensors[ep] = views(arena, self.locals_of(ep))
                    if arena.is_cuda and arena.device != self.device.torch:
                        self.peer_devices.add(arena.device.index)
        self.barrier("setup")
        for s in self.shards.values():
            remove_file(s.path)  # every peer has mapped it; the mapping outlives the name

        self.comm: Comm | None = None
        if self.member in topo.drivers and len(topo.drivers) > 1:
            names = [topo.describe_member(m) for m in topo.drivers]
            self.comm = make_comm(job.device, dist.PrefixStore("data", self.store), topo.comm_rank(self.member),
                                  len(topo.drivers), self.device, job.timeout_s, names)
        self.report("setup")

    def barrier(self, what: str) -> None:
        try:
            self.ctl.allreduce([torch.zeros(1)]).wait()
        except RuntimeError as e:
            raise PeerError(f"lost contact with another worker at the {what} barrier (a worker died?): "
                            f"{first_line(e)}") from None

    # ------------------------------------------------------------------ link bandwidth
    def measure_link(self, reps: int = 3) -> float | None:
        """Seconds per one-way message of ``link_bytes`` between drivers 0 and 1 (receiver's clock)."""
        result = None
        if self.comm is not None and self.topo.comm_rank(self.member) < 2:
            rank = self.topo.comm_rank(self.member)
            buf = torch.zeros(self.job.link_bytes, dtype=torch.uint8, device=self.device.torch)
            ops = ([(1, 0, buf)], []) if rank == 0 else ([], [(0, 0, buf)])
            marks = []
            for _ in range(reps + 1):
                self.comm.wait(self.comm.post(*ops))
                self.device.finish(time.monotonic() + self.job.timeout_s, self.comm.check, self.comm.stuck)
                marks.append(time.perf_counter())
            result = (marks[-1] - marks[0]) / reps if rank == 1 else None
            del buf
        self.barrier("link measurement")
        return result

    # ------------------------------------------------------------------ phases
    def run_phase(self, phase: Phase) -> PhaseResult:
        job, dev = self.job, self.device
        program = compile_program(phase.plan, job.spec, job.src, job.dst, self.topo, self.member,
                                  ipc=job.transport == "ipc")
        tensors = {ep: dict(t) for ep, t in self.tensors.items()}
        gathers = []
        for ep, lts in program.gather.items():
            g = allocate(lts, dev.torch)
            gathers.append(g)
            tensors[ep].update(g.tensors)
        bound = bind(program, tensors, dev.torch)
        res = PhaseResult(staging_bytes=bound.staging_bytes, gather_bytes=program.gather_bytes,
                          steps=program.num_steps, copies=sum(b.copies for b in bound.batches()),
                          blocks=sum(b.blocks for b in bound.batches()),
                          memcpys=sum(len(b.memcpys) for b in bound.batches()))
        for ep, s in self.shards.items():
            if ep[0] == "dst":
                fill_sentinel(s)
        seed = None
        cuda = job.device == "cuda"
        own = sum(s.nbytes for s in self.shards.values())
        for refit in phase.refits:
            if refit.seed != seed:
                seed = refit.seed
                for ep, s in self.shards.items():
                    if ep[0] == "src":
                        fill_source(s, job.spec, seed)
            dev.synchronize()
            if cuda:
                for d in [dev.torch.index, *sorted(self.peer_devices)]:
                    torch.cuda.reset_peak_memory_stats(d)
            self.barrier("refit start")
            self.report(f"refit {self.refits_done} started")
            t0 = time.perf_counter()
            if self.member in self.topo.drivers:
                run_refit(bound, self.comm, dev, job.timeout_s, self._kill_hook())
            else:
                hook = self._kill_hook()
                if hook:
                    hook()
            res.seconds.append(time.perf_counter() - t0)
            self.barrier("refit end")
            if cuda:  # plus anything this process allocated on peers (cross-device copy temporaries)
                peak = torch.cuda.max_memory_allocated(dev.torch) - own
                peak += sum(torch.cuda.max_memory_allocated(d) for d in self.peer_devices)
                res.peak_extra_bytes = max(res.peak_extra_bytes or 0, peak)
            if refit.verify:
                for ep, s in self.shards.items():
                    if ep[0] == "dst":
                        res.verdicts.setdefault(endpoint_name(ep), []).append(verify(s, job.spec, seed))
            self.refits_done += 1
            self.report(f"refit {self.refits_done - 1} done")
        del bound, gathers
        return res

    def _kill_hook(self) -> Callable[[], None] | None:
        kill = self.job.kill
        if kill is None or (kill[0], kill[1]) not in self.mine or kill[2] != self.refits_done:
            return None

        def die() -> None:
            log.warning("%s: test hook: dying during refit %d", self.name, self.refits_done)
            logging.shutdown()
            os._exit(17)

        return die

    def run(self) -> WorkerResult:
        self.setup()
        link = self.measure_link() if self.job.link_bytes else None
        phases = [self.run_phase(p) for p in self.job.phases]
        self.tensors.clear()  # drop every view of peers' arenas, then the mappings, before anyone exits
        self.imported.clear()
        if self.job.device == "cuda":
            torch.cuda.ipc_collect()
        self.barrier("exit")
        if self.comm is not None:
            self.comm.close()
        return WorkerResult(self.member, phases, link, sum(s.nbytes for s in self.shards.values()))



def worker_main(job: Job, member: int, conn: Any) -> None:
    """Process entry point: run the session, send the result (or the error) to the parent, and
    leave without running interpreter teardown (peers' sockets may already be gone)."""
    torch.set_num_threads(1)  # many workers share the cores
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (also set by the launcher)
    name = job.topology.describe_member(member)
    logging.basicConfig(level=job.log_level, format=f"[{name}] %(levelname)s %(message)s")
    code = 0
    try:
        session = Session(job, member, lambda what: conn.send(("progress", member, what)))
        conn.send(("result", member, session.run()))
    except (PeerError, TimeoutError, RefitError) as e:
        conn.send(("error", member, f"{name}: {e}"))
        code = 1
    except BaseException as e:  # a bug: keep the traceback
        log.exception("worker failed")
        conn.send(("error", member, f"{name}: {type(e).__name__}: {e}"))
        code = 1
    finally:
        logging.shutdown()
        conn.close()
        os._exit(code)
