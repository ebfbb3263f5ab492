"""One bench worker process: a `refit.executor.member.Member` plus what a benchmark adds.

The member (`refit.executor.member`) does the set-up and the refits; this module adds the bench's
own work around it: allocating and filling the shards with canonical values, timing, verifying
destinations bit-exact, measuring the link, reporting progress to the parent, and the test hook
that kills a worker mid-refit (`Job.kill`, ``REFIT_TEST_KILL``).

Failure: every wait is bounded.  Transfers with a peer that died fail at once (gloo sees the
socket close) or at the deadline (NCCL), with an error naming that peer; the parent
(`refit.bench.launch`) watches exit codes, kills the rest as soon as one dies and names it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from refit import settings
from refit.errors import InvalidInput, RefitError
from refit.executor.member import Budget, Member, ipc_direction, shares
from refit.executor.seating import connect
from refit.executor.shards import Shards, Verdict, allocate, fill_sentinel, fill_source, verify
from refit.executor.topology import Endpoint, Topology, endpoint_key, endpoint_name
from refit.executor.transports import PeerError
from refit.bench.quantized import SourceQuantizer, fill_finite, verify_quantized
from refit.bench.steps import Masters
from refit.bench.throttle import Throttled
from refit.executor.delta import DeltaStats
from refit.layouts import Layout, LocalTensor, QuantizedLayout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec, base_spec

log = logging.getLogger("refit.bench")


@dataclass(frozen=True)
class Refit:
    """One refit of a plan run: source values of ``seed`` (re-filled when it changes; with
    `Job.step_lr` the sources take a synthetic step before every refit instead), whether it counts
    in the timings, whether destinations are verified after it."""

    seed: int
    timed: bool = True
    verify: bool = False


@dataclass(frozen=True)
class PlanRun:
    """One planner's plan and its refits (the bench compares planners: p2p, then broadcast)."""

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
    runs: tuple[PlanRun, ...]  # one per planner compared (not the phases of a phased plan)
    device: str = "cpu"  # "cpu" or "cuda"
    timeout_s: float = 60.0
    link_bytes: int = 0  # >0: measure the link between the first two drivers with this message
    kill: tuple[Side, int, int] | None = None  # test hook: (side, rank, refit number) dies mid-refit
    hang: bool = False  # test hook: the `kill` victim stops itself (SIGSTOP) instead of dying
    store_port: int = 0
    store_host: str = "127.0.0.1"  # where the parent's rendezvous store listens (Ray: the driver's node)
    log_level: int = logging.WARNING
    # "framework": shards laid out as frameworks leave parameters (reverse order, irregular gaps:
    # blocks of neighbouring tensors do not merge); "arena": packed in layout order (they do).
    alloc: str = "framework"
    transport: str = "comm"  # "comm": NCCL (GPU) / gloo (CPU) between devices; "ipc": direct reads
    delta: bool = False  # delta refits (`Member.refit(delta=True)`): wire buckets carry the changed words
    # >0: before every refit each endpoint's float32 masters take a synthetic Adam-like step of this
    # size (`refit.bench.steps`), cast into the sources; destinations are verified against them
    step_lr: float | None = None
    wire_gbps: float | None = None  # emulate a wire of this rate (`refit.bench.throttle`)


@dataclass
class PlanRunResult:
    seconds: list[float] = field(default_factory=list)  # every refit of the plan run, in order
    quantize_seconds: list[float] = field(default_factory=list)  # of those, quantizing on the trainers
    verdicts: dict[str, list[Verdict]] = field(default_factory=dict)  # endpoint -> one per verified refit
    staging_bytes: int = 0
    direct_bytes: int = 0  # wire bytes sent from / received into shards directly (no staging)
    gather_bytes: int = 0
    peak_extra_bytes: int | None = None  # CUDA: allocator peak during refits minus own shards
    copies: int = 0
    blocks: int = 0
    memcpys: int = 0  # of the copies, calls on the copy engines (CUDA)
    quantized_on_landing: int = 0  # blocks of float8 weights quantized straight into the engine (`fused_quantize`)
    steps: int = 0
    deltas: list[DeltaStats] = field(default_factory=list)  # every refit's `Member.last_delta`, in order


@dataclass
class WorkerResult:
    member: int
    runs: list[PlanRunResult]
    link_seconds: float | None = None
    shard_bytes: int = 0


# ---------------------------------------------------------------------------------------------


class Session:
    """A worker's state across plan runs and refits."""

    def __init__(self, job: Job, member: int, report: Callable[[str], None], host: str = "127.0.0.1") -> None:
        """``host``: the address this worker's gloo groups listen on (Ray: its node's)."""
        self.job, self.member, self.report, self.host = job, member, report, host
        self.topo: Topology = job.topology
        self.mine: tuple[Endpoint, ...] = self.topo.members[member]
        self.name = self.topo.describe_member(member)
        self.refits_done = 0

    # ------------------------------------------------------------------ setup
    def locals_of(self, ep: Endpoint) -> list[LocalTensor]:
        layout = self.job.src if ep[0] is Side.TRAINER else self.job.dst
        return list(layout.local_tensors(self.job.spec, ep[1]))

    def shm_path(self, ep: Endpoint) -> str:
        return f"/dev/shm/refit-{self.job.session}-{endpoint_key(ep)}"

    def setup(self) -> None:
        job, topo = self.job, self.topo
        devices = topo.member_devices(self.member)
        if job.device == "cuda" and len(devices) != 1:
            raise InvalidInput(f"a CUDA worker must sit on one GPU; {self.name} spans {devices}")
        if job.transport not in ("comm", "ipc"):
            raise InvalidInput(f"unknown transport {job.transport!r} (comm or ipc)")
        ipc = job.transport == "ipc"
        index = topo.torch_index(devices[0])  # Ray: the topology's id of a GPU need not be its index here
        device = f"cuda:{index}" if job.device == "cuda" else "cpu"
        if job.device == "cuda":
            torch.cuda.set_device(index)  # this process's context on its own GPU first
        self.shards: dict[Endpoint, Shards] = {}
        self.unquantized: dict[Endpoint, Shards] = {}  # quantizing trainers (`refit.bench.quantized`)
        self.quantizers: dict[Endpoint, SourceQuantizer] = {}
        for ep in self.mine:  # a CPU shard another process reads lives in /dev/shm
            shm = self.shm_path(ep) if job.device == "cpu" and shares(topo, self.member, ep, ipc,
                                                                        ipc_direction(settings.current().ipc, cuda=False) == "push") else None
            self.shards[ep] = allocate(self.locals_of(ep), torch.device(device), shm, job.alloc == "framework")
            if ep[0] is Side.TRAINER and isinstance(job.src, QuantizedLayout):  # what the trainer holds, unquantized
                self.unquantized[ep] = allocate(job.src.inner.local_tensors(base_spec(job.spec), ep[1]),
                                                torch.device(device), shm and shm + "-unquantized",
                                                job.alloc == "framework")
                self.quantizers[ep] = SourceQuantizer(self.unquantized[ep], self.shards[ep], job.src, job.spec, ep[1])
        # every endpoint's masters, stepped in lockstep: a destination's say what its engine must hold
        self.masters: dict[Endpoint, Masters] = ({ep: Masters(s, job.spec) for ep, s in self.shards.items()}
                                                 if job.step_lr else {})
        names = [topo.describe_member(m) for m in range(len(topo.members))]
        store = connect(job.store_host, job.store_port, job.session, job.timeout_s)
        self.m = Member(store, topo, self.member, device, self.shards, job.spec, job.src, job.dst, names,
                        Budget(job.timeout_s, "set-up"), ipc=ipc, host=self.host, scattered=job.alloc == "framework",
                        unquantized=self.unquantized)
        self.device = self.m.device
        if job.wire_gbps and self.m.comm is not None:
            self.m.comm = Throttled(self.m.comm, job.wire_gbps)
        self.report("setup")

    # ------------------------------------------------------------------ link bandwidth
    def measure_link(self, reps: int = 3) -> float | None:
        """Seconds per one-way message of ``link_bytes`` between drivers 0 and 1 (receiver's clock)."""
        result = None
        comm = self.m.comm
        if comm is not None and self.topo.comm_rank(self.member) < 2:
            rank = self.topo.comm_rank(self.member)
            buf = torch.zeros(self.job.link_bytes, dtype=torch.uint8, device=self.device.torch)
            ops = ([(1, 0, buf)], []) if rank == 0 else ([], [(0, 0, buf)])
            marks = []
            for _ in range(reps + 1):
                comm.wait(comm.post(*ops), self.job.timeout_s)
                self.device.finish(time.monotonic() + self.job.timeout_s, comm.check, comm.stuck)
                marks.append(time.perf_counter())
            result = (marks[-1] - marks[0]) / reps if rank == 1 else None
            del buf
        self.m.barrier("link measurement", Budget(self.job.timeout_s))
        return result

    # ------------------------------------------------------------------ plan runs
    def run_plan(self, run: PlanRun) -> PlanRunResult:
        job, dev = self.job, self.device
        self.m.prepare(run.plan)
        for ep, quantizer in self.quantizers.items():  # what the drivers quantize on landing is not for the wire
            quantizer.skip(self.m.fused_sources(ep, Budget(job.timeout_s, "prepare")))
        bounds = self.m.bounds  # one per phase of a phased plan, over one shared set of staging buffers
        batches = [x for b in bounds for x in b.batches()]
        res = PlanRunResult(staging_bytes=self.m.staging_bytes,
                            direct_bytes=sum(b.direct_bytes for b in bounds),
                            gather_bytes=sum(b.program.gather_bytes for b in bounds),
                            steps=sum(b.program.num_steps for b in bounds), copies=sum(b.copies for b in batches),
                            blocks=sum(b.blocks for b in batches), memcpys=sum(len(b.memcpys) for b in batches),
                            quantized_on_landing=sum(len(st.quantizes) for b in bounds for st in b.program.stages))
        del bounds, batches
        for ep, s in self.shards.items():
            if ep[0] is Side.ENGINE:
                fill_sentinel(s)
        seed = None
        cuda = job.device == "cuda"
        # own: the weights each side holds anyway (and the bench's masters); a quantizing trainer's
        # wire shards are extra
        own = sum(s.nbytes for ep, s in self.shards.items() if ep not in self.unquantized) + \
            sum(s.nbytes for s in self.unquantized.values()) + sum(m.nbytes for m in self.masters.values())
        for refit in run.refits:
            if refit.seed != seed:
                seed = refit.seed
                for ep, s in self.shards.items():
                    if ep in self.unquantized:
                        fill_finite(self.unquantized[ep], base_spec(job.spec), seed)
                        self.quantizers[ep].copy_plain()
                    elif ep[0] is Side.TRAINER and self.masters:  # padding zero; `_step` writes the pieces
                        for m in s.memory():
                            m.zero_()
                    elif ep[0] is Side.TRAINER:
                        fill_source(s, job.spec, seed)
            if self.masters:
                self._step()
            dev.synchronize()
            if cuda:
                for d in [dev.torch.index, *sorted(self.m.peer_devices)]:
                    torch.cuda.reset_peak_memory_stats(d)
            started = lambda: self.report(f"refit {self.refits_done} started")  # noqa: E731
            # A quantizing trainer's work comes before the refit's start barrier: every member
            # waits for it there, so a refit takes its quantizing plus the shares (`direct.report`).
            res.quantize_seconds.append(self._quantize() if self.unquantized else 0.0)
            res.seconds.append(self.m.refit(Budget(job.timeout_s), self._kill_hook(), started, delta=job.delta))
            res.deltas.append(replace(self.m.last_delta))  # a copy: the member's is its own
            if cuda:  # plus anything this process allocated on peers (cross-device copy temporaries)
                peak = torch.cuda.max_memory_allocated(dev.torch) - own
                peak += sum(torch.cuda.max_memory_allocated(d) for d in self.m.peer_devices)
                res.peak_extra_bytes = max(res.peak_extra_bytes or 0, peak)
            if refit.verify:
                check = verify_quantized if job.spec.config.quantization else verify
                for ep, s in self.shards.items():
                    if ep[0] is Side.ENGINE:
                        verdict = self.masters[ep].verify(s) if self.masters else check(s, job.spec, seed)
                        res.verdicts.setdefault(endpoint_name(ep), []).append(verdict)
            self.refits_done += 1
            self.report(f"refit {self.refits_done - 1} done")
        return res

    def _step(self) -> None:
        """One synthetic optimizer step on every endpoint's masters (`refit.bench.steps`), cast into
        the sources' shards: the trainers' new weights, before the refit (untimed)."""
        with torch.no_grad():
            for ep, masters in self.masters.items():
                masters.step(self.job.step_lr or 0.0)
                if ep[0] is Side.TRAINER:
                    masters.cast_into(self.shards[ep])

    def _quantize(self) -> float:
        """Seconds this worker's trainer ranks took to quantize their shards for the wire."""
        self.device.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for quantize in self.quantizers.values():
                quantize()
        self.device.synchronize()
        return time.perf_counter() - t0

    def _kill_hook(self) -> Callable[[], None] | None:
        kill = self.job.kill
        if kill is None or (kill[0], kill[1]) not in self.mine or kill[2] != self.refits_done:
            return None

        def die() -> None:
            if self.job.hang:
                log.warning("%s: test hook: stopping (SIGSTOP) during refit %d", self.name, self.refits_done)
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            log.warning("%s: test hook: dying during refit %d", self.name, self.refits_done)
            logging.shutdown()
            os._exit(17)

        return die

    def run(self) -> WorkerResult:
        self.setup()
        link = self.measure_link() if self.job.link_bytes else None
        runs = [self.run_plan(p) for p in self.job.runs]
        self.m.release()  # drop every view of peers' arenas, then the mappings, before anyone exits
        self.m.barrier("exit", Budget(self.job.timeout_s))
        self.m.close()
        return WorkerResult(self.member, runs, link, sum(s.nbytes for s in self.shards.values()))


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
