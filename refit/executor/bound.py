"""A member's schedule bound to tensors and buffers, and its replay (one refit).

`bind` turns a `refit.executor.schedule.Program` into `CopyBatch` es over real tensors and fixed
staging buffers, once per plan; `run_refit` replays it every refit.  Every wait in a refit is
bounded by the refit's own budget (``remaining``: seconds left, raising once the refit is past its
deadline or abandoned), never by a timeout fixed when the communicator was built.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from refit.boxes import volume
from refit.errors import InvalidInput
from refit.executor.copies import CopyBatch, Pair
from refit.executor.delta import DeltaRun, run_delta_step, word_size
from refit.executor.device import Device
from refit.executor.fused_quantize import QuantizeBatch
from refit.executor.schedule import Program, Wire
from refit.executor.topology import Endpoint
from refit.executor.transports import Comm
from refit.executor.values import TORCH_DTYPES, int_view
from refit.dtypes import DTYPE_BYTES
from refit.regions import Block, slices

Remaining = Callable[[], float]  # seconds left in this refit; raises past the deadline or when abandoned


@dataclass
class BoundStep:
    """A step over fixed buffers: ``pack`` fills the send buffers, ``unpack`` empties the
    receive buffers; ``sends``/``recvs`` are (peer, tag, buffer view) for the communicator."""

    key: tuple[int, int, int]
    pack: CopyBatch
    unpack: CopyBatch
    sends: list[tuple[int, int, torch.Tensor]]
    recvs: list[tuple[int, int, torch.Tensor]]
    words: list[int] = field(default_factory=list)  # per send: the word a delta compares (`refit.executor.delta`)
    refill: list[Pair] = field(default_factory=list)  # (receive buffer, local block): what a delta starts from
    _refill: CopyBatch | None = None

    def refill_batch(self, dma: bool) -> CopyBatch:
        """The copies that fill the staged receive buffers with what their blocks hold now (built
        at the first delta refit: a full refit never needs them)."""
        if self._refill is None:
            self._refill = CopyBatch(self.refill, dma=dma)
        return self._refill


@dataclass
class BoundStage:
    stage: int
    moves: CopyBatch
    steps: list[BoundStep]
    pulls: list[CopyBatch] = field(default_factory=list)  # one per source device
    quantize: QuantizeBatch | None = None  # float8 values quantized on landing (`refit.executor.fused_quantize`)


@dataclass
class Bound:
    program: Program
    stages: list[BoundStage]
    buffers: list[torch.Tensor] = field(repr=False)
    direct_bytes: int = 0  # wire bytes sent from / received into tensors directly (no staging)

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

    def block(self, ep: Endpoint, b: Block) -> torch.Tensor:
        ndim = len(b.size)
        key = (ep, b.local, ndim)
        if key not in self.cache:
            t = self.tensors[ep][b.local]
            shape = (1,) * (ndim - t.dim()) + tuple(t.shape)
            self.cache[key] = int_view(t).view(shape)
        return self.cache[key][slices(b.local_start, b.size)]


def _buffer_pairs(wire: Wire, buf: torch.Tensor, views: _Views, into_buffer: bool) -> list[Pair]:
    pairs: list[Pair] = []
    for wt in wire.transfers:
        itemsize = DTYPE_BYTES[wt.dtype]
        if wt.offset % itemsize:
            raise InvalidInput(f"bucket {wire.bucket}: transfer at byte {wt.offset} is not aligned for {wt.dtype}")
        region = int_view(buf[wt.offset:wt.offset + volume(wt.box) * itemsize].view(TORCH_DTYPES[wt.dtype])).view(wt.box)
        for blk in wt.blocks:
            on_wire = region[slices(blk.box_start, blk.size)]
            local = views.block(wire.ep, blk)
            pairs.append((on_wire, local) if into_buffer else (local, on_wire))
    return pairs


def _ring_distance(me: torch.device, peer: torch.device) -> tuple[int, str]:
    """Round of a pull from (or push into) ``peer``: round k reads (writes) the GPU k places ahead
    on the ring, so that when every device issues its copies in this order each GPU is read
    (written) by one peer at a time."""
    if me.type != "cuda" or peer.type != "cuda":
        return (0, str(peer))
    n = max(torch.cuda.device_count(), me.index + 1, peer.index + 1)
    return ((peer.index - me.index) % n, str(peer))


def _direct_region(pairs: list[Pair], buf: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The bytes of one local tensor that *are* this wire, or None.  ``pairs``: (region of
    ``buf``, local block) for every block of the wire.  A wire is direct when its blocks, in wire
    order, are contiguous pieces of one tensor that follow each other in memory exactly as they
    follow each other on the wire: then the bucket is sent from (or received into) the tensor
    itself, with no pack or unpack copy."""
    if not pairs:
        return None
    storage = pairs[0][1].untyped_storage()
    delta = pairs[0][1].data_ptr() - pairs[0][0].data_ptr()
    covered = 0
    for on_wire, local in pairs:
        if not (on_wire.is_contiguous() and local.is_contiguous()) \
                or local.untyped_storage().data_ptr() != storage.data_ptr() \
                or local.data_ptr() - on_wire.data_ptr() != delta:
            return None
        covered += on_wire.numel() * on_wire.element_size()
    start = buf.data_ptr() + delta - storage.data_ptr()
    if covered != nbytes or start < 0 or start + nbytes > storage.nbytes():  # e.g. a receiver keeping part of a box
        return None
    return torch.empty(0, dtype=torch.uint8, device=buf.device).set_(storage, start, (nbytes,))


def bind(program: Program, tensors: dict[Endpoint, dict[str, torch.Tensor]], device: torch.device) -> Bound:
    """Make the views and staging buffers once; ``tensors`` holds, for every endpoint on the
    devices this member drives, its local tensors (own or mapped from a peer) and its gather
    tensors.  Wires that are one contiguous region of a tensor (`_direct_region`) use that
    region as their buffer: no staging, no pack/unpack copy; only the rest is staged."""
    return bind_all([program], tensors, device)[0]


def bind_all(programs: list[Program], tensors: dict[Endpoint, dict[str, torch.Tensor]],
             device: torch.device) -> list[Bound]:
    """`bind` of several programs that run one after another (the phases of a phased plan,
    `refit.phases`), over ONE set of staging buffers sized for the largest: staging does not grow
    with the number of phases.  Each `Bound` lists the shared buffers."""
    views = _Views(tensors)
    dma = device.type == "cuda"  # the copy engines take what they can express
    width_s = max((len(p.send_slots) for p in programs), default=0)
    width_r = max((len(p.recv_slots) for p in programs), default=0)
    staged_s, staged_r = [0] * width_s, [0] * width_r
    direct: dict[tuple[int, bool], torch.Tensor] = {}  # (bucket, sending) -> the tensor region
    # Which wires are direct, found against one scratch buffer; then only the rest get staging.
    scratch = torch.empty(max((n for p in programs for n in p.send_slots + p.recv_slots), default=0),
                          dtype=torch.uint8, device=device)
    for program in programs:
        _find_direct(program, views, scratch, direct, staged_s, staged_r)
    del scratch
    sets = [[torch.empty(n, dtype=torch.uint8, device=device) for n in staged_s] for _ in range(2)]
    rsets = [[torch.empty(n, dtype=torch.uint8, device=device) for n in staged_r] for _ in range(2)]
    buffers = [b for s in sets + rsets for b in s]
    out = []
    for program in programs:
        stages = _bind_stages(program, views, direct, sets, rsets, device, dma)
        wires = {(w.bucket, sending) for st in program.stages for step in st.steps
                 for sending, ws in ((True, step.sends), (False, step.recvs)) for w in ws}
        out.append(Bound(program, stages, buffers, direct_bytes=sum(direct[k].numel() for k in wires if k in direct)))
    return out


def _find_direct(program: Program, views: _Views, scratch: torch.Tensor, direct: dict[tuple[int, bool], torch.Tensor],
                 staged_s: list[int], staged_r: list[int]) -> None:
    """Record the direct wires of ``program`` in ``direct`` and grow the staged slot sizes for the rest."""
    for st in program.stages:
        for step in st.steps:
            for wires, sizes, sending in ((step.sends, staged_s, True), (step.recvs, staged_r, False)):
                for j, w in enumerate(wires):
                    pairs = _buffer_pairs(w, scratch, views, into_buffer=True)  # (on wire, local)
                    region = _direct_region(pairs, scratch, w.nbytes)
                    if region is not None:
                        direct[(w.bucket, sending)] = region
                    else:
                        sizes[j] = max(sizes[j], w.nbytes)


def _moves(pairs: list[Pair], pulls: list[CopyBatch], pipelined: bool, dma: bool) -> CopyBatch:
    """A stage's same-GPU moves, told what they run beside (`table_copy.enabled`): the NCCL steps
    (``pipelined``: `run_refit` issues them beside the pipeline), the peer copies' table kernels,
    or nothing (a refit within one GPU)."""
    return CopyBatch(pairs, dma=dma, beside=pipelined, beside_kernel=any(p.table for p in pulls),
                     alone=not pipelined and not pulls)


def _bind_stages(program: Program, views: _Views, direct: dict[tuple[int, bool], torch.Tensor],
                 sets: list[list[torch.Tensor]], rsets: list[list[torch.Tensor]], device: torch.device,
                 dma: bool) -> list[BoundStage]:
    stages, j = [], 0
    for st in program.stages:
        move_pairs = [(views.block(m.dst_ep, m.dst), views.block(m.src_ep, m.src)) for m in st.moves]
        steps = []
        for step in st.steps:
            sbufs, rbufs = sets[j % 2], rsets[j % 2]
            pack: list[Pair] = []
            unpack: list[Pair] = []
            refill: list[Pair] = []
            sends, recvs = [], []
            for w, buf in zip(step.sends, sbufs):
                region = direct.get((w.bucket, True))
                if region is None:
                    pack += _buffer_pairs(w, buf, views, into_buffer=True)
                sends.append((w.peer, w.bucket, region if region is not None else buf[:w.nbytes]))
            for w, buf in zip(step.recvs, rbufs):
                region = direct.get((w.bucket, False))
                if region is None:
                    unpack += _buffer_pairs(w, buf, views, into_buffer=False)
                    refill += [(b, a) for a, b in unpack[len(refill):]]
                recvs.append((w.peer, w.bucket, region if region is not None else buf[:w.nbytes]))
            words = [word_size([DTYPE_BYTES[t.dtype] for t in w.transfers], [t.offset for t in w.transfers], w.nbytes)
                     for w in step.sends]
            steps.append(BoundStep(step.key, CopyBatch(pack, dma=dma), CopyBatch(unpack, dma=dma), sends, recvs,
                                   words, refill))
            j += 1
        by_device: dict[torch.device, list[Pair]] = defaultdict(list)  # by the peer device (pull or push)
        for m in st.pulls:
            s_view, d_view = views.block(m.src_ep, m.src), views.block(m.dst_ep, m.dst)
            by_device[d_view.device if d_view.device != device else s_view.device].append((d_view, s_view))
        pulls = [CopyBatch(pairs, peer=dev if dev.type == "cuda" and dev != device else None, dma=dma)
                 for dev, pairs in sorted(by_device.items(), key=lambda x: _ring_distance(device, x[0]))]
        moves = _moves(move_pairs, pulls, bool(st.steps), dma)
        quantize = QuantizeBatch(st.quantizes, views.tensors) if st.quantizes else None
        stages.append(BoundStage(st.stage, moves, steps, pulls, quantize))
    return stages


# ---------------------------------------------------------------------------------------------


def run_refit(bound: Bound, comm: Comm | None, device: Device, remaining: Remaining,
              hook: Callable[[], None] | None = None, delta: DeltaRun | None = None) -> None:
    """One refit of this member's share, in program order.  Two steps in flight at most (the two
    buffer sets); a stage is drained before the next starts (stage 1 sends what stage 0 gathered).
    A stage's same-device moves and its peer copies (ipc) run on streams of their own, beside its
    steps and each other (`Device.beside`, `Device.pull`), and are joined at its end.
    ``remaining`` is asked before every step and bounds every wait on the communicator.
    ``delta``: a delta refit — its wire steps run one at a time through `run_delta_step`; the
    same-device moves and peer copies stay full (a compare would read the source as often as the
    copy does, and write nearly as much)."""
    deadline = time.monotonic() + remaining()
    device.begin()
    if hook and not any(st.steps for st in bound.stages):
        hook()
    for stage in bound.stages:
        # Order of issue: the same-GPU moves' table kernel goes first (launched after a peer
        # kernel, whose blocks fill every SM, it runs in the gaps and ends late); then the peer
        # copies; then the rest of the moves (copy-engine memcpys, faster after the peer pulls,
        # and small copies torch issues one by one, which hold the peer copies back when first),
        # beside the table kernel on a stream of their own.  Measured: bench/RESULTS.md, case
        # "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC" (its history: order of issue).
        if stage.quantize is not None:  # first: the biggest kernel; the moves run beside it
            device.copy(stage.quantize)
        launched = not stage.steps and stage.moves.table
        if launched:
            device.copy(stage.moves, part="launch")
        for batch in stage.pulls:
            device.pull(batch)
        if not stage.steps:
            device.beside(stage.moves, part="rest" if launched else "all")
        if delta is not None and stage.steps:
            assert comm is not None, "a program with steps needs a communicator"
            for j, step in enumerate(stage.steps):
                run_delta_step(step, comm, device, deadline, remaining, delta)
                if j == 0:
                    if hook:
                        hook()
                        hook = None
                    device.beside(stage.moves)
            device.join()
            continue
        inflight: deque[tuple[BoundStep, Any]] = deque()
        for j, step in enumerate(stage.steps):
            if len(inflight) == 2:
                _finish(*inflight.popleft(), comm, device, remaining)
            device.copy(step.pack)
            assert comm is not None, "a program with steps needs a communicator"
            remaining()  # an abandoned refit stops before the next step
            inflight.append((step, comm.post(step.sends, step.recvs)))
            if j == 0:
                if hook:  # once per refit: at the first step of the first stage with steps
                    hook()
                    hook = None
                # Same-device copies run beside the whole pipeline, on a stream of their own:
                # on the copy stream every later pack would wait for them.
                device.beside(stage.moves)
        while inflight:
            _finish(*inflight.popleft(), comm, device, remaining)
        device.join()
    device.finish(deadline, comm.check if comm else _nothing, comm.stuck if comm else (lambda: "local copies"))


def _finish(step: BoundStep, handle: Any, comm: Comm | None, device: Device, remaining: Remaining) -> None:
    assert comm is not None
    comm.wait(handle, remaining())
    device.copy(step.unpack)


def _nothing() -> None:
    pass
