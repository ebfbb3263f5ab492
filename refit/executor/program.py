"""One member's share of a plan, compiled once and replayed every refit.

`compile_program` is pure (layouts and plan in, schedule out): for every bucket this member
drives, which blocks of which local tensors fill (or empty) which bytes of the bucket buffer.
`bind` turns it into `CopyBatch` es over real tensors and fixed staging buffers.

Schedule.  Buckets between devices are exchanged in **steps**.  A step is keyed
``(stage, round, i)``: ``round`` is the device distance ``(dst_dev - src_dev) mod G`` (the
topology's devices; in the bench, the plan's GPUs, which the plan is ordered by), ``i`` the bucket's index within its (stage, src, dst) pair.  In one step every
device sends to at most one peer and receives from at most one (for the placements refit makes),
all of a step's sends and receives are posted together (one NCCL group), and every member walks
the steps in key order — so the smallest unfinished step always has both ends posted: no
deadlock, and each round runs on all links at once.  Steps alternate between two sets of
staging buffers (double buffering: pack step k+1 while k is on the wire, unpack k while k+1
arrives), so staging is at most 2 send + 2 receive buffers of the largest bucket per member.

Buckets whose two devices are driven by this member need no wire: they become direct copies
(`moves`) from source blocks to destination blocks.

With ``ipc`` (single host: every driver has mapped every source shard, `transports`), a bucket
between two devices needs no wire either: the *destination's* driver copies straight out of the
peer device's source regions into its destination regions (`pulls`; the source's driver does
nothing for it).  This covers every bucket whose source regions live in a source shard: all of a
p2p plan, and stage 0 of a broadcast plan.  Stage 1 of a broadcast plan reads the root's
gathered tensors, which only the root's driver holds, so it stays on the communicator.

Broadcast plans (stage 0) gather full tensors on a source "root" first.  The driver of the
root's device receives those parts into *gather* tensors of its own; in stage 1 the root's
sending regions come from its own pieces plus the gathered ones.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from refit.boxes import Index, intersect, shift, volume
from refit.errors import RefitError
from refit.executor.copies import CopyBatch, Pair, dma_enabled
from refit.executor.topology import Endpoint, Topology
from refit.executor.values import TORCH_DTYPES, int_view
from refit.layouts import Layout, LocalTensor, Piece
from refit.plan import Bucket, Plan, Transfer
from refit.regions import PieceIndex, Region, slices
from refit.spec import DTYPE_BYTES, ModelSpec

GATHER_PREFIX = "refit.gather."


@dataclass(frozen=True)
class Block:
    """``size`` elements at ``local_start`` of local tensor ``local`` of endpoint ``ep`` (viewed
    with the canonical ndim) are the ones at ``box_start`` of a transfer's box."""

    ep: Endpoint
    local: str
    local_start: Index
    box_start: Index
    size: Index


@dataclass(frozen=True)
class WireTransfer:
    """One transfer inside a bucket buffer: its box, row-major, at byte ``offset``."""

    offset: int
    box: Index
    dtype: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Wire:
    """One bucket as one end sees it.  ``peer`` is the other end's rank in the data communicator;
    ``bucket`` (its index in the plan) doubles as the message tag."""

    bucket: int
    peer: int
    nbytes: int
    transfers: tuple[WireTransfer, ...]


@dataclass(frozen=True)
class Move:
    """A direct copy between two blocks, both on devices this member drives."""

    src: Block
    dst: Block
    dtype: str


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
    return ("src", b.src), ("src" if b.stage == 0 else "dst", b.dst)


def compile_program(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, topo: Topology, member: int,
                    ipc: bool = False) -> Program:
    """This member's share of ``plan`` (layouts resolved, as the plan was made from).  With
    ``ipc`` the buckets that `pullable` accepts become pulls by the destination's driver."""
    G = max(d for _, d in topo.devices) + 1  # devices are the topology's (the plan's placement in the bench)
    mine = set(topo.driven_devices(member))
    locals_: dict[Endpoint, list[LocalTensor]] = {}
    for dev in mine:
        for ep in topo.endpoints_on(dev):
            layout = src if ep[0] == "src" else dst
            locals_[ep] = list(layout.local_tensors(spec, ep[1]))
    if ipc:  # every source shard on the host is readable
        for ep, _ in topo.devices:
            if ep[0] == "src" and ep not in locals_:
                locals_[ep] = list(src.local_tensors(spec, ep[1]))
    gather = _gather_tensors(plan, spec, topo, mine)
    index = {ep: PieceIndex(lts + list(gather.get(ep, ()))) for ep, lts in locals_.items()}

    moves: dict[int, list[Move]] = defaultdict(list)
    pulls: dict[int, list[Move]] = defaultdict(list)
    steps: dict[tuple[int, int, int], tuple[list[Wire], list[Wire]]] = {}
    pair_count: dict[tuple[int, int, int], int] = defaultdict(int)
    for bi, b in enumerate(plan.buckets):
        i = pair_count[(b.stage, b.src, b.dst)]
        pair_count[(b.stage, b.src, b.dst)] += 1
        s_ep, d_ep = bucket_ends(b)
        sdev, ddev = topo.device_of[s_ep], topo.device_of[d_ep]
        if sdev not in mine and ddev not in mine:
            continue
        transfers = plan.transfers[b.first:b.first + b.count]
        if sdev in mine and ddev in mine:
            moves[b.stage].extend(_moves(plan, transfers, index[s_ep], index[d_ep], s_ep, d_ep))
            continue
        if ipc and pullable(plan, b):
            if ddev in mine:  # the source's driver has nothing to do for this bucket
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


def pullable(plan: Plan, b: Bucket) -> bool:
    """Whether the source regions of ``b`` lie in a source shard (not in a root's gathered data)."""
    return b.stage == 0 or plan.planner != "broadcast"


def _slots(per_step: list[tuple[Wire, ...]]) -> tuple[int, ...]:
    """Buffer sizes for one set: slot j holds the j-th wire of a step, sized for the largest."""
    width = max((len(w) for w in per_step), default=0)
    return tuple(max((w[j].nbytes for w in per_step if len(w) > j), default=0) for j in range(width))


def _gather_tensors(plan: Plan, spec: ModelSpec, topo: Topology, mine: set[int]) -> dict[Endpoint, list[LocalTensor]]:
    """One gather tensor per stage-0 transfer landing on a root this member drives."""
    out: dict[Endpoint, list[LocalTensor]] = defaultdict(list)
    for b in plan.buckets:
        if b.stage != 0 or topo.device_of[("src", b.dst)] not in mine:
            continue
        root = ("src", b.dst)
        for t in plan.transfers[b.first:b.first + b.count]:
            name = f"{GATHER_PREFIX}{len(out[root])}"
            out[root].append(LocalTensor(name, t.size, spec[t.tensor].dtype,
                                         (Piece(t.tensor, t.start, t.size, (0,) * len(t.size)),)))
    return out


def _regions(index: PieceIndex, t: Transfer, ep: Endpoint, whole: bool) -> list[Region]:
    regions = index.regions(t.tensor, (t.start, t.size))
    got = sum(volume(r.size) for r in regions)
    if (whole and got != t.numel) or got > t.numel:
        raise RefitError(f"plan does not match the layouts: {ep[0]} rank {ep[1]} holds {got} of the "
                         f"{t.numel} elements of {t.tensor} {list(t.start)}+{list(t.size)} it must "
                         f"{'send' if whole else 'receive'}")
    return regions


def _wire(plan: Plan, bi: int, b: Bucket, transfers: tuple[Transfer, ...], index: PieceIndex, ep: Endpoint,
          peer: int, sending: bool) -> Wire:
    out, offset = [], 0
    for t in transfers:
        # A sender must hold the whole box; a receiver keeps what its pieces cover (broadcast
        # plans send full tensors), which for shard-to-shard plans is the whole box too.
        regions = _regions(index, t, ep, whole=sending or plan.planner != "broadcast")
        blocks = tuple(Block(ep, r.local, r.local_start, r.box_start, r.size) for r in regions)
        out.append(WireTransfer(offset, t.size, plan.tensors[t.tensor][0], blocks))
        offset += plan.transfer_bytes(t)
    if offset != b.nbytes:
        raise RefitError(f"bucket {bi} says {b.nbytes} bytes, its transfers add up to {offset}")
    return Wire(bi, peer, b.nbytes, tuple(out))


def _moves(plan: Plan, transfers: tuple[Transfer, ...], s_index: PieceIndex, d_index: PieceIndex,
           s_ep: Endpoint, d_ep: Endpoint) -> list[Move]:
    out = []
    for t in transfers:
        dtype = plan.tensors[t.tensor][0]
        src_regions = _regions(s_index, t, s_ep, whole=True)
        dst_regions = _regions(d_index, t, d_ep, whole=plan.planner != "broadcast")
        for sr in src_regions:
            for dr in dst_regions:
                inter = intersect((sr.box_start, sr.size), (dr.box_start, dr.size))
                if inter is None:
                    continue
                start, size = inter
                sb = Block(s_ep, sr.local, shift(sr.local_start, shift(start, sr.box_start, -1)), start, size)
                db = Block(d_ep, dr.local, shift(dr.local_start, shift(start, dr.box_start, -1)), start, size)
                out.append(Move(sb, db, dtype))
    return out


# ---------------------------------------------------------------------------------------------
# Binding to tensors


@dataclass
class BoundStep:
    """A step over fixed buffers: ``pack`` fills the send buffers, ``unpack`` empties the
    receive buffers; ``sends``/``recvs`` are (peer, tag, buffer view) for the communicator."""

    key: tuple[int, int, int]
    pack: CopyBatch
    unpack: CopyBatch
    sends: list[tuple[int, int, torch.Tensor]]
    recvs: list[tuple[int, int, torch.Tensor]]


@dataclass
class BoundStage:
    stage: int
    moves: CopyBatch
    steps: list[BoundStep]
    pulls: list[CopyBatch] = field(default_factory=list)  # one per source device


@dataclass
class Bound:
    program: Program
    stages: list[BoundStage]
    buffers: list[torch.Tensor] = field(repr=False)

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def batches(self) -> list[CopyBatch]:
        return [b for st in self.stages
                for b in [st.moves] + st.pulls + [x for s in st.steps for x in (s.pack, s.unpack)]]


class _Views:
    """Views of local tensors as integer arrays with the canonical ndim (bit-exact copies)."""

    def __init__(self, tensors: dict[Endpoint, dict[str, torch.Tensor]]) -> None:
        self.tensors = tensors
        self.cache: dict[tuple[Endpoint, str, int], torch.Tensor] = {}

    def block(self, b: Block) -> torch.Tensor:
        ndim = len(b.size)
        key = (b.ep, b.local, ndim)
        if key not in self.cache:
            t = self.tensors[b.ep][b.local]
            shape = (1,) * (ndim - t.dim()) + tuple(t.shape)
            self.cache[key] = int_view(t).view(shape)
        return self.cache[key][slices(b.local_start, b.size)]


def _buffer_pairs(wire: Wire, buf: torch.Tensor, views: _Views, into_buffer: bool) -> list[Pair]:
    pairs: list[Pair] = []
    for wt in wire.transfers:
        itemsize = DTYPE_BYTES[wt.dtype]
        if wt.offset % itemsize:
            raise RefitError(f"bucket {wire.bucket}: transfer at byte {wt.offset} is not aligned for {wt.dtype}")
        region = int_view(buf[wt.offset:wt.offset + volume(wt.box) * itemsize].view(TORCH_DTYPES[wt.dtype])).view(wt.box)
        for blk in wt.blocks:
            on_wire = region[slices(blk.box_start, blk.size)]
            local = views.block(blk)
            pairs.append((on_wire, local) if into_buffer else (local, on_wire))
    return pairs


def _ring_distance(me: torch.device, peer: torch.device) -> tuple[int, str]:
    """Round of a pull from ``peer``: round k reads the GPU k places ahead on the ring, so that
    when every device issues its pulls in this order each GPU is read by one peer at a time."""
    if me.type != "cuda" or peer.type != "cuda":
        return (0, str(peer))
    n = max(torch.cuda.device_count(), me.index + 1, peer.index + 1)
    return ((peer.index - me.index) % n, str(peer))


def bind(program: Program, tensors: dict[Endpoint, dict[str, torch.Tensor]], device: torch.device) -> Bound:
    """Make the views and staging buffers once; ``tensors`` holds, for every endpoint on the
    devices this member drives, its local tensors (own or mapped from a peer) and its gather
    tensors."""
    views = _Views(tensors)
    dma = device.type == "cuda" and dma_enabled()
    sets = [[torch.empty(n, dtype=torch.uint8, device=device) for n in program.send_slots] for _ in range(2)]
    rsets = [[torch.empty(n, dtype=torch.uint8, device=device) for n in program.recv_slots] for _ in range(2)]
    stages, j = [], 0
    for st in program.stages:
        move_pairs = [(views.block(m.dst), views.block(m.src)) for m in st.moves]
        steps = []
        for step in st.steps:
            sbufs, rbufs = sets[j % 2], rsets[j % 2]
            pack: list[Pair] = []
            unpack: list[Pair] = []
            sends, recvs = [], []
            for w, buf in zip(step.sends, sbufs):
                pack += _buffer_pairs(w, buf, views, into_buffer=True)
                sends.append((w.peer, w.bucket, buf[:w.nbytes]))
            for w, buf in zip(step.recvs, rbufs):
                unpack += _buffer_pairs(w, buf, views, into_buffer=False)
                recvs.append((w.peer, w.bucket, buf[:w.nbytes]))
            steps.append(BoundStep(step.key, CopyBatch(pack, dma=dma), CopyBatch(unpack, dma=dma), sends, recvs))
            j += 1
        by_device: dict[torch.device, list[Pair]] = defaultdict(list)
        for m in st.pulls:
            s_view = views.block(m.src)
            by_device[s_view.device].append((views.block(m.dst), s_view))
        pulls = [CopyBatch(pairs, peer=dev if dev.type == "cuda" and dev != device else None, dma=dma)
                 for dev, pairs in sorted(by_device.items(), key=lambda x: _ring_distance(device, x[0]))]
        stages.append(BoundStage(st.stage, CopyBatch(move_pairs, dma=dma), steps, pulls))
    return Bound(program, stages, [b for s in sets + rsets for b in s])
