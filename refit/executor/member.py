"""One member of a plan: the endpoints one process holds, set up once, refit many times.

Both users of the executor — the bench's worker processes (`refit.bench.worker`) and the
agents' data plane (`refit.control.dataplane_executor`) — go through `Member`, which owns the
whole sequence:

1. the rendezvous store (`connect`), under a prefix of the run or of the plan's generation;
2. the device this process drives or shares (`locate` publishes where each agent sits);
3. peer access both ways between this GPU and every GPU whose memory it will read (ipc);
4. sharing: what a device's driver must read is exported once, as plain data through the store
   (`refit.executor.handles`) — a passive member's shards, and with ipc every source shard — and
   each driver maps the peers' shards of its devices (and with ipc every source shard);
5. the control group (gloo) over all members and the data communicator over the drivers; members
   on one host with GPUs meet at the refit barriers in shared memory (`refit.executor.shm_barrier`);
6. per plan (`prepare`): compile the schedule, allocate gather tensors, bind (drivers only) —
   one program per phase of a phased plan (`refit.phases`), all over one set of staging buffers;
7. per refit (`refit`): barrier, replay, barrier — per phase, then the phase's ``on_phase``;
   where trainer ranks cut FP8 blocks, first their shared-scale quantization
   (`refit.executor.shared_blocks`: an all-reduce of block amaxes, then a barrier).  For FP8
   engines, drivers holding a trainer's unquantized tensors quantize on landing
   (`refit.executor.member_quantized`).

Every wait is bounded by the caller's ``remaining`` (seconds left in this refit; it raises once
the refit is past its deadline or abandoned), so no wait outlives the refit that started it.  A
barrier that times out names the members that never reached it; a transfer that fails names its
peer (`refit.executor.transports.PeerError`).  Nor does teardown wait: `Member.close` lets go of a
control group without waiting for the barriers an abandoned refit left posted in it
(`refit.executor.transports.retire`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from refit import settings
from refit.errors import InvalidInput, RefitFailed
from refit.executor.bound import Bound, Remaining, bind_all, run_refit
from refit.executor.delta import DeltaCache, DeltaRun, DeltaStats, full_stats
from refit.executor.device import Device, enable_peer_access, make_device
from refit.executor.member_barriers import MemberBarriers
from refit.executor.member_quantized import MemberQuantized
from refit.executor.schedule import compile_program
from refit.executor.shards import Own, Shards, allocate, check_own, remove_file, views
from refit.executor.shm_barrier import ShmBarrier
from refit.executor.topology import Endpoint, Topology, endpoint_key, endpoint_name
from refit.executor.transports import (Comm, PeerError, export_arena, export_tensors, first_line, gloo_group,
                                       import_share, make_comm)
from refit.layouts import Layout
from refit.plan import WHOLE, Plan
from refit.sides import Side
from refit.spec import ModelSpec
from refit.timeline import mark

log = logging.getLogger("refit.executor")


class Rebuild(Exception):
    """Some member asked, at the refit's start barrier, for every member to be built again (its
    tensors moved); raised on every member, before any byte moves."""


class Budget:
    """Seconds left until a deadline fixed now: `Member`'s ``remaining`` for callers without a
    control plane (the bench)."""

    def __init__(self, seconds: float, what: str = "refit") -> None:
        self.deadline, self.seconds, self.what = time.monotonic() + seconds, seconds, what

    def __call__(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.what} did not complete within {self.seconds:g} s")
        return left


def ipc_direction(mode: str, cuda: bool, packed: bool = False) -> str:
    """Who copies a bucket between two devices with the ipc transport (``REFIT_IPC``, `mode`).
    ``pull``: the destination's driver reads the source's memory; ``push``: the source's driver
    writes into the destination's with SM stores (posted over NVLink, where loads wait a round
    trip each); ``auto``: push on GPUs, except between arenas ``packed`` by the bench (`--alloc
    arena`), whose blocks merge into a few big copies that the copy engines pull faster; pull on
    CPU.  Measured: bench/RESULTS.md, case "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC"
    (its history: push instead of pull)."""
    if mode == "auto":
        return "push" if cuda and not packed else "pull"
    return mode


def shares(topo: Topology, member: int, ep: Endpoint, ipc: bool, push: bool = False) -> bool:
    """Whether endpoint ``ep`` of ``member`` is read or written by another process: it sits on a
    device this member does not drive, or (ipc) it is a source every driver reads — and with
    ``push`` a destination the drivers of other devices write (sources stay shared: a gathering
    plan pulls).  A destination its own driver alone writes is not exported: on one GPU nobody
    else maps it, and memory CUDA IPC cannot export (vLLM's sleep-mode pool) stays usable there."""
    if topo.device_of[ep] not in topo.driven_devices(member):
        return True
    return ipc and (ep[0] is Side.TRAINER or (push and len(topo.drivers) > 1))


class Member(MemberBarriers, MemberQuantized):
    """Member ``member`` of ``topology``: holds ``own`` (its endpoints' tensors), on ``device``
    (``cpu`` or ``cuda:<index>``); ``names`` name every member in messages.  Builds everything
    but the plan's schedule (`prepare`); ``remaining`` bounds the set-up waits.  Its barriers are
    `MemberBarriers`' (`refit.executor.member_barriers`)."""

    def __init__(self, store: dist.Store, topology: Topology, member: int, device: str, own: Mapping[Endpoint, Own],
                 spec: ModelSpec, src: Layout, dst: Layout, names: Sequence[str], remaining: Remaining,
                 ipc: bool = False, host: str = "127.0.0.1", scattered: bool = False,
                 unquantized: Mapping[Endpoint, Own] | None = None) -> None:
        """``scattered``: peers' arenas are laid out framework-style (`refit.executor.shards.arena_offsets`).
        ``unquantized``: a quantizing trainer's local tensors as it holds them, by endpoint, for
        drivers to quantize on landing (`refit.executor.member_quantized`)."""
        self.store, self.topo, self.member, self.names = store, topology, member, list(names)
        self.spec, self.src, self.dst, self.ipc, self.scattered = spec, src, dst, ipc, scattered
        self.name = self.names[member]
        self.cuda = device.startswith("cuda")
        self.device: Device = make_device("cuda" if self.cuda else "cpu", torch.device(device).index or 0)
        for ep, tensors in own.items():
            check_own(ep, tensors, src if ep[0] is Side.TRAINER else dst, spec, self.device.torch, self.name)
        own, derived = self._derive(own)
        driven = set(topology.driven_devices(member))
        self.driver = bool(driven)
        self.rounds = 0  # barriers passed, in lockstep on every member
        self.delta_cache = DeltaCache()  # what this member last sent over a wire (delta refits)
        self.delta_ready = False  # the last refit was a delta refit that completed: the cache is what landed
        self.last_delta = DeltaStats()

        # Member 0's run knobs hold for all (`refit.settings`), and with ipc its choice of direction.
        if member == 0:
            packed = any(isinstance(t, Shards) for t in own.values()) and not scattered
            mine = settings.from_environment()
            self.store.set("settings", json.dumps({**mine.run_values(),
                                                   "direction": ipc_direction(mine.ipc, self.cuda, packed)}))
        agreed = json.loads(self.store.get("settings"))
        direction = agreed.pop("direction")
        self.push = ipc and direction == "push"
        self.settings = settings.adopt(agreed, self.name)
        # Share what others read or write, then map what we read or write.
        shared = {ep for ep in own if shares(topology, member, ep, ipc, self.push)}
        for ep in shared:
            self.store.set(f"share/{endpoint_key(ep)}", self._export(ep, own[ep]))
        self.tensors: dict[Endpoint, dict[str, torch.Tensor]] = {
            ep: dict(t.tensors if isinstance(t, Shards) else t) for ep, t in own.items()}
        self._share_unquantized(unquantized or {}, own, shared)
        self._fused, self._plan_hash = {}, None
        self.imported: list[torch.Tensor] = []  # peers' arenas, kept mapped for the member's life
        self.peer_devices: set[int] = set()  # CUDA devices whose memory this process reads (ipc)
        wanted = [ep for dev in sorted(driven) for ep in topology.endpoints_on(dev) if ep not in own]
        if ipc and driven:  # a driver maps every source shard of the host, once (push: every shard)
            sides = (Side.TRAINER, Side.ENGINE) if self.push else (Side.TRAINER,)
            wanted += [ep for ep, _ in topology.devices if ep[0] in sides and ep not in own and ep not in wanted]
            if self.cuda:  # both ways, before the handles are opened (else copies go through the host)
                here = self.device.torch.index
                for dev in sorted({d for ep, d in topology.devices if ep[0] in sides} - driven):
                    there = topology.torch_index(dev)
                    if there is None:
                        raise InvalidInput(f"{self.name}: ipc needs every GPU visible in every member, and GPU "
                                         f"{dev} is not visible here (CUDA_VISIBLE_DEVICES isolation?): use the "
                                         "communicator")
                    enable_peer_access(here, there)
                    enable_peer_access(there, here)
        for ep in wanted:
            self.tensors[ep] = self._import(ep)
            if ep[0] is Side.TRAINER:
                self._import_unquantized(ep)

        self.abandoned: list[dist.Work] = []  # barriers left unfinished: the control group still runs them
        # GPU members on one host (every ipc run; NCCL ones where all map the file) meet at the
        # refit barriers in shared memory (`refit.executor.shm_barrier`); CPU runs keep gloo,
        # whose errors name a peer that died at once
        self.shm_barrier: ShmBarrier | None = self._offer_shm_barrier() if self.cuda else None
        try:
            self.ctl: dist.ProcessGroupGloo | None = gloo_group(
                dist.PrefixStore("ctl", self.store), member, len(topology.members), remaining(), host)
        except RuntimeError as e:
            self._drop_shm_barrier()
            raise PeerError(f"building the control group of {len(topology.members)} members: {first_line(e)}") from None
        try:
            self.barrier("setup", remaining)
            if self.cuda:
                self._agree_shm_barrier()
            self.shared = self._agree_shared(derived, remaining)
        except BaseException:  # nobody will close a member never built: let its group go now
            self._retire_ctl()
            raise
        for t in [*own.values(), *(unquantized or {}).values()]:
            if isinstance(t, Shards):
                remove_file(t.path)  # every peer has mapped it; the mapping outlives the name
        self.comm: Comm | None = None
        if member in topology.drivers and len(topology.drivers) > 1:
            try:
                kind = ("cuda-" + self.settings.nccl) if self.cuda else "cpu"
                self.comm = make_comm(kind, dist.PrefixStore("data", self.store),
                                      topology.comm_rank(member), len(topology.drivers), self.device, remaining(),
                                      [self.names[m] for m in topology.drivers], host)
            except BaseException:  # as above: nobody will close this member
                self._retire_ctl()
                raise
        self.phases: list[tuple[int, Bound | None]] = []  # (phase key, this member's share) in run order
        self.gathers: list[Shards] = []
        log.info("%s: member %d, device %s, %s, drives %s", self.name, member, device,
                 ("ipc push" if self.push else "ipc") if ipc else "communicator", sorted(driven) or "nothing")

    # ------------------------------------------------------------------ sharing
    def _export(self, ep: Endpoint, tensors: Own) -> bytes:
        if isinstance(tensors, Shards):
            return export_arena(tensors)
        if not self.cuda:
            raise InvalidInput(f"{self.name}: CPU tensors are shared only as a /dev/shm arena (refit.executor.shards)")
        return export_tensors(dict(tensors))

    def _import(self, ep: Endpoint) -> dict[str, torch.Tensor]:
        shared = import_share(self.store.get(f"share/{endpoint_key(ep)}"))
        layout = self.src if ep[0] is Side.TRAINER else self.dst
        if isinstance(shared, dict):  # separate tensors (an agent's): as its layout says, or refused
            out = shared
            arena = next(iter(out.values()), None)
            check_own(ep, out, layout, self.spec, None, f"{self.name}: shared by {self.names[self.topo.member_of[ep]]}")
        else:  # an arena: the views follow from the peer's layout
            arena = shared
            self.imported.append(arena)
            try:
                out = views(arena, list(layout.local_tensors(self.spec, ep[1])), self.scattered)
            except ValueError as e:
                raise InvalidInput(f"{self.name}: {endpoint_name(ep)} of {layout.describe()} shared by "
                                 f"{self.names[self.topo.member_of[ep]]}: {e}") from None
        if arena is not None and arena.is_cuda and arena.device != self.device.torch:
            self.peer_devices.add(arena.device.index)
        return out

    # ------------------------------------------------------------------ per plan
    def prepare(self, plan: Plan) -> "Member":
        """Compile and bind this member's share of ``plan`` (drivers; others have nothing to do
        but the barriers): one program per phase (`Plan.phase_ranges`; an unphased plan is one),
        bound over one shared set of staging buffers."""
        self.gathers, self.phases = [], []  # until this plan is bound: a failed prepare leaves none to run
        self.delta_cache.clear()  # another plan's buckets: the next delta refit starts full
        self.delta_ready = False
        self._fused, self._plan_hash = {}, plan.plan_hash
        ranges = plan.phase_ranges()
        if not self.driver:
            self.phases = [(key, None) for key, _, _ in ranges]
            return self
        whole = len(ranges) == 1 and ranges[0][1:] == (0, len(plan.buckets))
        programs = [compile_program(plan, self.spec, self.src, self.dst, self.topo, self.member, ipc=self.ipc,
                                    push=self.push, buckets=None if whole else range(first, end))
                    for _, first, end in ranges]
        programs = self._fuse(programs, plan)
        tensors = {ep: dict(t) for ep, t in self.tensors.items()}
        gathers = []
        for program in programs:
            for ep, lts in program.gather.items():  # a gathering plan's root receives whole tensors
                g = allocate(lts, self.device.torch)
                gathers.append(g)
                tensors[ep].update(g.tensors)
        bounds = bind_all(programs, tensors, self.device.torch)
        self.gathers, self.phases = gathers, [(key, b) for (key, _, _), b in zip(ranges, bounds)]
        return self

    @property
    def bounds(self) -> list[Bound]:
        """This member's share of the prepared plan, one per phase (empty unless it drives)."""
        return [b for _, b in self.phases if b is not None]

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers this member holds (shared by all phases: counted once)."""
        seen = {b.data_ptr(): b.numel() for _, bound in self.phases if bound for b in bound.buffers}
        return sum(seen.values())

    # ------------------------------------------------------------------ per refit
    def refit(self, remaining: Remaining, hook: Callable[[], None] | None = None,
              started: Callable[[], None] | None = None, on_phase: Callable[[int], None] | None = None,
              rebuild: bool = False, delta: bool = False, base: bool = True) -> float:
        """One refit: per phase, start barrier, this member's share, end barrier, then
        ``on_phase(key)`` (an engine applies what landed; every member has finished writing the
        phase and none has started the next).  Returns the summed seconds of the shares alone.
        ``hook`` (tests) runs once the first transfer is posted; ``started`` after the first barrier.
        ``rebuild``: this member's tensors moved; then every member raises `Rebuild` after the first
        barrier (which carries the flag), having moved nothing.
        ``delta``: send each wire bucket as the words that changed since the last refit
        (`refit.executor.delta`); against the cache only where the last refit of this member was a
        delta refit that completed and the caller says the engines hold what landed then (``base``;
        the control plane: `refit.control.refits.delta_fallback`) — else FULL, refreshing the cache.
        ``last_delta`` says what was sent either way."""
        if not self.phases:  # else the barriers would pass and report a refit that moved nothing
            raise RefitFailed(f"{self.name}: no plan prepared (prepare failed or was never called)")
        phases = self.phases
        phased = any(key != WHOLE for key, _ in phases)
        seconds = 0.0
        against, self.delta_ready = self.delta_ready and delta and base, False  # a failure below leaves it False
        if not delta:
            self.delta_cache.clear()
        self.last_delta = DeltaStats()
        for i, (key, bound) in enumerate(phases):
            if self.cuda:  # a trainer's step, or an engine's last use (its previous on_phase), is finished
                self.device.synchronize()
            where = f"phase {key} " if phased else "refit "
            mark(f"{self.name}: at the start barrier")
            asked = self.barrier(where + "start", remaining, flag=float(rebuild and i == 0))
            mark(f"{self.name}: past the start barrier")
            if asked:
                raise Rebuild(f"{self.name}: a member's tensors moved since the plan's members were built")
            if started and i == 0:
                started()
            first_hook = hook if i == 0 else None
            t0 = time.perf_counter()
            if i == 0:  # the trainers' weights are final now: blocks cut across them get their scales
                self.share_scales(remaining)
            if bound is not None:
                run = DeltaRun(self.delta_cache, i, against) if delta else None
                run_refit(bound, self.comm, self.device, remaining, first_hook, run)
                self.last_delta += run.stats if run else full_stats(bound)
            elif first_hook:
                first_hook()
            seconds += time.perf_counter() - t0
            mark(f"{self.name}: at the end barrier")
            self.barrier(where + "end", remaining)
            mark(f"{self.name}: past the end barrier")
            if on_phase:
                remaining()  # an abandoned refit applies nothing more
                on_phase(key)
        if delta and not against and self.delta_cache.nbytes:  # filled again: say what it costs
            log.info("%s: delta refits: keeping what it sends over wires, %d bytes on %s", self.name,
                     self.delta_cache.nbytes, self.device.torch)
        self.delta_ready = delta
        return seconds

    # ------------------------------------------------------------------ teardown
    def release(self) -> None:
        """Drop every view of peers' memory (then the mappings go), before anyone exits."""
        self.phases = []
        self.gathers = []
        self.shared = None
        self.tensors.clear()
        self.imported.clear()
        if self.cuda:
            torch.cuda.ipc_collect()

    def close(self) -> None:
        """Close the communicator, release the buffers and peers' memory, and let the control
        group go — without waiting for the barriers of an abandoned refit, which gloo runs until
        that refit's deadline (`refit.executor.transports.retire`).  The communicator goes first:
        after a refit that timed out, its receives may still be posted into the staging buffers,
        and aborting it is what ends them; freed before, those buffers could be handed out again."""
        if self.comm is not None:
            try:
                self.comm.close()
            except Exception as e:  # closing after a failure may fail too; nothing to save
                log.info("closing the communicator: %s", e)
        self.comm = None
        self.release()
        self._retire_ctl()
