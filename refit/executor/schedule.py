"""One member's share of a plan as a schedule of steps: pure data, no torch.

`compile_program` takes the plan, the resolved layouts and the topology and says, for every
bucket this member drives, which blocks of which local tensors fill (or empty) which bytes of the
bucket buffer.  `refit.executor.bound` binds it to real tensors and staging buffers and replays it.

Schedule.  Buckets between devices are exchanged in **steps**.  A step is keyed
``(stage, round, i)``: ``round`` is the device distance ``(dst_dev - src_dev) mod G`` (the
topology's devices; in the bench, the plan's GPUs, which the plan is ordered by), ``i`` the
bucket's index within its (stage, sender, receiver) pair.  In one step every device sends to at most one
peer and receives from at most one (for the placements refit makes), all of a step's sends and
receives are posted together (one NCCL group), and every member walks the steps in key order —
so the smallest unfinished step always has both ends posted: no deadlock, and each round runs on
all links at once.  Steps alternate between two sets of staging buffers (double buffering: pack
step k+1 while k is on the wire, unpack k while k+1 arrives), so staging is at most 2 send + 2
receive buffers of the largest bucket per member.

Buckets whose two devices are driven by this member need no wire: they become direct copies
(`moves`) from source blocks to destination blocks.

With ``ipc`` (single host: every driver has mapped every source shard, `transports`), a bucket
between two devices needs no wire either: the *destination's* driver copies straight out of the
peer device's source blocks into its destination blocks (`pulls`; the source's driver does
nothing for it).  This covers every bucket whose source blocks live in a source shard: all of a
plan that does not gather, and stage 0 of one that does (`Plan.gathers`).  Stage 1 of a
gathering plan reads the roots' gathered tensors, which only a root's driver holds, so it stays
on the communicator.

Gathering plans (the broadcast baseline) gather full tensors on a source "root" in stage 0.  The
driver of the root's device receives those parts into *gather* tensors of its own; in stage 1
the root's sending blocks come from its own pieces plus the gathered ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from refit.boxes import intersect, shift, volume
from refit.errors import InvalidInput
from refit.executor.topology import Endpoint, Topology, endpoint_name
from refit.layouts import Layout, LocalTensor, Piece, sent_tensors
from refit.plan import Bucket, Plan, Transfer
from refit.regions import Block, PieceIndex
from refit.sides import Side
from refit.spec import ModelSpec

GATHER_PREFIX = "refit.gather."


@dataclass(frozen=True)
class WireTransfer:
    """One transfer inside a bucket buffer: its box, row-major, at byte ``offset``, made of
    ``blocks`` of the local tensors of the wire's endpoint."""

    offset: int
    box: tuple[int, ...]
    dtype: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Wire:
    """One bucket as one end (endpoint ``ep``) sees it.  ``peer`` is the other end's rank in the
    data communicator; ``bucket`` (its index in the plan) doubles as the message tag."""

    bucket: int
    peer: int
    nbytes: int
    ep: Endpoint
    transfers: tuple[WireTransfer, ...]


@dataclass(frozen=True)
class Move:
    """A direct copy from block ``src`` of endpoint ``src_ep`` to block ``dst`` of ``dst_ep``."""

    src_ep: Endpoint
    src: Block
    dst_ep: Endpoint
    dst: Block
    dtype: str


@dataclass(frozen=True)
class QuantizeMove:
    """A move of float8 values quantized on landing (`refit.executor.fused_quantize`): block
    ``src`` of the trainer's unquantized local tensor quantized straight into block ``values`` of
    ``dst_ep`` and its scales into block ``scales``, in format ``fmt``."""

    src_ep: Endpoint
    src: Block
    dst_ep: Endpoint
    values: Block
    scales: Block
    fmt: str


@dataclass(frozen=True)
class Step:
    key: tuple[int, int, int]
    sends: tuple[Wire, ...]
    recvs: tuple[Wire, ...]


@dataclass(frozen=True)
class Stage:
    stage: int
    moves: tuple[Move, ...]
    steps: tuple[Step, ...]
    pulls: tuple[Move, ...] = ()  # ipc: copies out of another device's source shard
    quantizes: tuple[QuantizeMove, ...] = ()  # moves of float8 values quantized on landing


@dataclass(frozen=True)
class Program:
    member: int
    stages: tuple[Stage, ...]
    gather: dict[Endpoint, tuple[LocalTensor, ...]] = field(repr=False)
    send_slots: tuple[int, ...]  # bytes of each send buffer in one buffer set
    recv_slots: tuple[int, ...]

    @property
    def staging_bytes(self) -> int:
        """Both buffer sets, sends and receives."""
        return 2 * (sum(self.send_slots) + sum(self.recv_slots))

    @property
    def gather_bytes(self) -> int:
        return sum(lt.nbytes for lts in self.gather.values() for lt in lts)

    @property
    def num_steps(self) -> int:
        return sum(len(s.steps) for s in self.stages)


def bucket_ends(b: Bucket) -> tuple[Endpoint, Endpoint]:
    # stage 0 gathers among trainers (to a root), stage 1 sends to an engine
    return (Side.TRAINER, b.sender), (Side.TRAINER if b.stage == 0 else Side.ENGINE, b.receiver)


def compile_program(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, topo: Topology, member: int,
                    ipc: bool = False, push: bool = False, buckets: range | None = None) -> Program:
    """This member's share of ``plan`` (layouts resolved, as the plan was made from).  With
    ``ipc`` the buckets that `pullable` accepts become pulls by the destination's driver, or with
    ``push`` (every destination shard mapped by every driver; not for a gathering plan, whose
    roots' gathered tensors no other driver sees) copies by the source's driver into the
    destination's memory.  Both land in `Stage.pulls`: copies between this device and a peer's.
    ``buckets``: only those of the plan (one phase of a phased plan, `Plan.phase_ranges`).  Wires
    keep their plan-wide bucket index (the message tag) and steps their plan-wide index within
    the pair, so every member keys a subset's steps alike and tags never repeat across phases."""
    check_plan(plan, spec, src, dst, topo)
    push = push and ipc and not plan.gathers
    G = max(d for _, d in topo.devices) + 1  # devices are the topology's (the plan's placement in the bench)
    mine = set(topo.driven_devices(member))
    locals_: dict[Endpoint, list[LocalTensor]] = {}
    for dev in mine:
        for ep in topo.endpoints_on(dev):
            layout = src if ep[0] is Side.TRAINER else dst
            locals_[ep] = sent_tensors(spec, layout, ep[1])
    if ipc:  # every source shard on the host is readable (push: every destination shard writable)
        for ep, _ in topo.devices:
            if ep not in locals_ and (ep[0] is Side.TRAINER or push):
                locals_[ep] = sent_tensors(spec, src if ep[0] is Side.TRAINER else dst, ep[1])
    gather = _gather_tensors(plan, spec, topo, mine)
    index = {ep: PieceIndex(lts + list(gather.get(ep, ()))) for ep, lts in locals_.items()}

    moves: dict[int, list[Move]] = defaultdict(list)
    pulls: dict[int, list[Move]] = defaultdict(list)
    steps: dict[tuple[int, int, int], tuple[list[Wire], list[Wire]]] = {}
    pair_count: dict[tuple[int, int, int], int] = defaultdict(int)
    for bi, b in enumerate(plan.buckets):
        i = pair_count[(b.stage, b.sender, b.receiver)]
        pair_count[(b.stage, b.sender, b.receiver)] += 1
        if buckets is not None and bi not in buckets:
            continue
        s_ep, d_ep = bucket_ends(b)
        sdev, ddev = topo.device_of[s_ep], topo.device_of[d_ep]
        if sdev not in mine and ddev not in mine:
            continue
        transfers = plan.transfers[b.first:b.first + b.count]
        if sdev in mine and ddev in mine:
            moves[b.stage].extend(_moves(plan, transfers, index[s_ep], index[d_ep], s_ep, d_ep))
            continue
        if ipc and pullable(plan, b):
            if (sdev if push else ddev) in mine:  # the other end's driver has nothing to do for it
                pulls[b.stage].extend(_moves(plan, transfers, index[s_ep], index[d_ep], s_ep, d_ep))
            continue
        key = (b.stage, (ddev - sdev) % G, i)
        sends, recvs = steps.setdefault(key, ([], []))
        if sdev in mine:
            peer = topo.comm_rank(topo.driver_of[ddev])
            sends.append(_wire(plan, bi, b, transfers, index[s_ep], s_ep, peer, sending=True))
        else:
            peer = topo.comm_rank(topo.driver_of[sdev])
            recvs.append(_wire(plan, bi, b, transfers, index[d_ep], d_ep, peer, sending=False))

    stages = []
    for stage in sorted({k[0] for k in steps} | set(moves) | set(pulls)):
        keyed = sorted(k for k in steps if k[0] == stage)
        stages.append(Stage(stage, tuple(moves.get(stage, ())),
                            tuple(Step(k, tuple(steps[k][0]), tuple(steps[k][1])) for k in keyed),
                            tuple(pulls.get(stage, ()))))
    all_steps = [s for st in stages for s in st.steps]
    send_slots = _slots([s.sends for s in all_steps])
    recv_slots = _slots([s.recvs for s in all_steps])
    return Program(member, tuple(stages), {ep: tuple(v) for ep, v in gather.items()}, send_slots, recv_slots)


def check_plan(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, topo: Topology) -> None:
    """Refuse a plan made for another model, other layouts or other ranks than this run's, before
    anything is bound: such a plan may still name boxes every rank holds, and then leave parts
    of the destination unwritten with no error."""
    if plan.model_digest != spec.digest():
        raise InvalidInput(f"plan is for model {plan.model} (digest {plan.model_digest}), this run holds "
                         f"{spec.name} (digest {spec.digest()})")
    for side, layout, text in (("source", src, plan.src_layout), ("destination", dst, plan.dst_layout)):
        if layout.describe() != text:
            raise InvalidInput(f"plan is for {side} layout {text}, this run's is {layout.describe()}")
    ranks = {Side.TRAINER: len(plan.placement.src_gpus), Side.ENGINE: len(plan.placement.dst_gpus)}
    if (ranks[Side.TRAINER], ranks[Side.ENGINE]) != (src.world_size, dst.world_size):
        raise InvalidInput(f"plan places {ranks[Side.TRAINER]} source and {ranks[Side.ENGINE]} destination ranks, "
                         f"the layouts have {src.world_size} and {dst.world_size}")
    missing = [endpoint_name((side, r)) for side, n in ranks.items() for r in range(n)
               if (side, r) not in topo.device_of]
    if missing:
        raise InvalidInput(f"the topology places no device for {', '.join(missing[:4])} of the plan")


def pullable(plan: Plan, b: Bucket) -> bool:
    """Whether the source blocks of ``b`` lie in a source shard (not in a root's gathered data)."""
    return b.stage == 0 or not plan.gathers


def _slots(per_step: list[tuple[Wire, ...]]) -> tuple[int, ...]:
    """Buffer sizes for one set: slot j holds the j-th wire of a step, sized for the largest."""
    width = max((len(w) for w in per_step), default=0)
    return tuple(max((w[j].nbytes for w in per_step if len(w) > j), default=0) for j in range(width))


def _gather_tensors(plan: Plan, spec: ModelSpec, topo: Topology, mine: set[int]) -> dict[Endpoint, list[LocalTensor]]:
    """One gather tensor per stage-0 transfer landing on a root this member drives."""
    out: dict[Endpoint, list[LocalTensor]] = defaultdict(list)
    for b in plan.buckets:
        root: Endpoint = (Side.TRAINER, b.receiver)  # a stage-0 receiver is a trainer rank
        if b.stage != 0 or topo.device_of[root] not in mine:
            continue
        for t in plan.transfers[b.first:b.first + b.count]:
            name = f"{GATHER_PREFIX}{len(out[root])}"
            out[root].append(LocalTensor(name, t.size, spec[t.tensor].dtype,
                                         (Piece(t.tensor, t.start, t.size, (0,) * len(t.size)),)))
    return out


def box_blocks(index: PieceIndex, t: Transfer, ep: Endpoint, whole: bool, sending: bool) -> list[Block]:
    """The blocks of endpoint ``ep``'s local tensors that hold transfer ``t``'s box (``whole``: all
    of it); refused when the layouts do not match the plan (`refit.executor.checksum` uses it too)."""
    blocks = index.regions(t.tensor, (t.start, t.size))
    got = sum(volume(r.size) for r in blocks)
    if (whole and got != t.numel) or got > t.numel:
        raise InvalidInput(f"plan does not match the layouts: {endpoint_name(ep)} holds {got} of the "
                         f"{t.numel} elements of {t.tensor} {list(t.start)}+{list(t.size)} it must "
                         f"{'send' if sending else 'receive'}")
    return blocks


def _wire(plan: Plan, bi: int, b: Bucket, transfers: tuple[Transfer, ...], index: PieceIndex, ep: Endpoint,
          peer: int, sending: bool) -> Wire:
    out, offset = [], 0
    for t in transfers:
        # A sender must hold the whole box; a receiver of a gathering plan keeps what its pieces
        # cover (whole tensors are sent), otherwise the whole box too.
        blocks = box_blocks(index, t, ep, whole=sending or not plan.gathers, sending=sending)
        out.append(WireTransfer(offset, t.size, plan.tensors[t.tensor][0], tuple(blocks)))
        offset += plan.transfer_bytes(t)
    if offset != b.nbytes:
        raise InvalidInput(f"bucket {bi} says {b.nbytes} bytes, its transfers add up to {offset}")
    return Wire(bi, peer, b.nbytes, ep, tuple(out))


def _moves(plan: Plan, transfers: tuple[Transfer, ...], s_index: PieceIndex, d_index: PieceIndex,
           s_ep: Endpoint, d_ep: Endpoint) -> list[Move]:
    out = []
    for t in transfers:
        dtype = plan.tensors[t.tensor][0]
        src_blocks = box_blocks(s_index, t, s_ep, whole=True, sending=True)
        dst_blocks = box_blocks(d_index, t, d_ep, whole=not plan.gathers, sending=False)
        for sr in src_blocks:
            for dr in dst_blocks:
                inter = intersect((sr.box_start, sr.size), (dr.box_start, dr.size))
                if inter is None:
                    continue
                start, size = inter
                sb = Block(sr.local, shift(sr.local_start, shift(start, sr.box_start, -1)), start, size)
                db = Block(dr.local, shift(dr.local_start, shift(start, dr.box_start, -1)), start, size)
                out.append(Move(s_ep, sb, d_ep, db, dtype))
    return out
