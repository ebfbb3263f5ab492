"""Where copies run and how the executor waits for them: one small class per device kind.

On CUDA, copies (pack, unpack, direct moves) run on a dedicated *copy stream* and NCCL on a
*comm stream*; they are ordered by events only, so the host enqueues a whole refit without
blocking and packing/unpacking overlaps the wire.  The host waits once, at the end, by polling
(never an unbounded ``synchronize``): a dead peer turns into a timeout naming the stuck step
instead of a hang.  On CPU everything is synchronous and the same calls are no-ops.

Pulls (the ipc transport: copies out of another GPU's memory) run on a stream of their own per
peer device: copy-engine memcpys issued on this device (`refit.executor.copies`), and for what
those cannot express a torch cross-device ``copy_``, which torch issues on the source device's
current stream (a second stream, on the peer, in this process's context there), fenced by events
against the destination device's current stream.  Were that the copy stream, every pull would fence the
copy stream and serialise with the local moves; on streams of their own, pulls (copy engines,
NVLink) overlap the local moves (SMs, HBM) and the pulls from other peers.  `join` orders every
stream after all of them (a broadcast's stage 1 sends and moves what stage 0 gathered); `finish`
waits for them too.

Same-GPU moves beside wire steps (`beside`; the nccl transport) run on a *local stream*: on the copy
stream they sat between the first step's pack and the second's, so every later step waited for
all of them (16 GB per GPU for qwen3-30b-moe at TP2: the wire idled for most of the refit).  With
ipc, the local stream takes the part of the moves issued after the peer copies
(`refit.executor.bound.run_refit` says in which order and why).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from refit import settings
from refit.executor.copies import CopyBatch


class Batch(Protocol):
    """What `Device.copy` and `Device.beside` issue: a `CopyBatch`, or the quantizing on landing
    of a stage (`refit.executor.fused_quantize.QuantizeBatch`)."""

    def run_memcpys(self, stream: int, device_index: int | None = None) -> None: ...

    def run(self) -> None: ...


class Device(Protocol):
    torch: torch.device

    def copy(self, batch: Batch, part: str = "all") -> None:
        """Issue ``batch`` on the copy stream: ``all`` of it, or only its one-launch part
        (``launch``: the table kernel or copy-engine memcpys) or only the ``rest`` (the copies torch
        issues one by one), so that other work can be issued between the two."""

    def pull(self, batch: CopyBatch) -> None:
        """Issue a batch that reads another device's memory (ipc transport)."""

    def beside(self, batch: Batch, part: str = "all") -> None:
        """Issue same-device copies (or a ``part`` of them, as in `copy`) that nothing else in
        the stage waits for, on a stream of their own beside the copy stream (the pack / wire /
        unpack pipeline, or the table kernel of the same batch), joined by `join` and `finish`."""

    def join(self) -> None:
        """Order everything issued later, on any stream, after everything issued so far (a stage
        is drained before the next: a broadcast's stage 1 reads what stage 0 gathered)."""

    def begin(self) -> None:
        """Order this refit's work after everything already issued (source fills)."""

    def finish(self, deadline: float, check: Callable[[], None], stuck: Callable[[], str]) -> None:
        """Wait for all issued work; call ``check`` while waiting; past ``deadline`` raise
        TimeoutError with ``stuck()``'s description."""

    def synchronize(self) -> None: ...


class CpuDevice:
    def __init__(self) -> None:
        self.torch = torch.device("cpu")

    def copy(self, batch: Batch, part: str = "all") -> None:
        if part != "launch":  # on CPU everything is torch's part
            batch.run()

    def pull(self, batch: CopyBatch) -> None:
        batch.run()

    def beside(self, batch: Batch, part: str = "all") -> None:
        self.copy(batch, part)

    def join(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def finish(self, deadline: float, check: Callable[[], None], stuck: Callable[[], str]) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaDevice:
    def __init__(self, index: int) -> None:
        torch.cuda.set_device(index)
        self.index = index
        self.torch = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.torch)
        self.comm_stream = torch.cuda.Stream(self.torch)
        self.local_stream = torch.cuda.Stream(self.torch)  # `beside`
        self.pull_streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}  # peer -> (here, there)
        self._bulk_streams: dict[int, torch.cuda.Stream] = {}  # id(pull stream) -> its batched-memcpy twin
        # Pulls from several peers share one stream, issued in round order (`refit.executor.bound.bind`
        # sorts them by ring distance), so at any time each GPU reads one peer and is read by one:
        # pulling from all peers at once halves the inbound bandwidth (bench/RESULTS.md, case
        # "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, CUDA IPC", its history: pulls in rounds).
        self._round_stream: torch.cuda.Stream | None = None
        # REFIT_TRACE=1: time every batch with CUDA events and log the timeline after each refit.
        self.trace: list[tuple[str, object, torch.cuda.Event, torch.cuda.Event]] | None = \
            [] if settings.current().trace else None
        self._t0: torch.cuda.Event | None = None

    def copy(self, batch: Batch, part: str = "all") -> None:
        self._run_on(self.copy_stream, batch, "copy", part)

    def beside(self, batch: Batch, part: str = "all") -> None:
        self._run_on(self.local_stream, batch, "local", part)

    def _run_on(self, stream: torch.cuda.Stream, batch: Batch, kind: str, part: str = "all") -> None:
        if part not in ("all", "launch", "rest"):
            raise ValueError(f"part must be all, launch or rest, not {part!r}")
        start = self._mark(stream)
        if part != "rest":
            batch.run_memcpys(stream.cuda_stream)
        if part != "launch":
            with torch.cuda.stream(stream):
                batch.run()
        self._traced(kind, batch, start, stream)

    def _mark(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """A timing event on ``stream`` (before each batch, at `begin`), whether or not we trace.
        Without them the agents' path ran 15% slower than the bench, as if the same-GPU table
        kernel were launched after the peer kernel; our reading is that timing events keep the
        launch order on the GPU (the mechanism is not established).  They cost microseconds.
        Measured: bench/RESULTS.md, case "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, --via grpc" (its
        history from 1ba1ade)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _traced(self, kind: str, batch: object, start: torch.cuda.Event | None, stream: torch.cuda.Stream) -> None:
        if self.trace is not None and start is not None:
            self.trace.append((kind, batch, start, self._mark(stream)))

    def _report_trace(self) -> None:
        import logging

        if not self.trace or self._t0 is None:
            return
        log = logging.getLogger("refit.executor")
        log.warning("trace cuda:%d refit of %d batches", self.index, len(self.trace))  # starts a refit's lines
        for kind, batch, a, b in self.trace:
            log.warning("trace cuda:%d %s %r: starts %.2f ms, takes %.2f ms", self.index, kind, batch,
                        self._t0.elapsed_time(a), a.elapsed_time(b))
        self.trace.clear()

    def pull(self, batch: CopyBatch) -> None:
        if batch.peer is None or batch.peer.index == self.index:
            return self.copy(batch)
        streams = self.pull_streams.get(batch.peer.index)
        if streams is None:
            enable_peer_access(self.index, batch.peer.index)
            if self._round_stream is None:  # one stream: the peers take turns, in issue order
                self._round_stream = torch.cuda.Stream(self.torch)
            here = self._round_stream
            here.wait_stream(self.copy_stream)  # begin() has ordered the copy stream after the fills
            streams = self.pull_streams[batch.peer.index] = (here, torch.cuda.Stream(batch.peer))
        here, there = streams
        start = self._mark(here)
        # A table kernel reads the peer through our own second mapping of its memory when it can
        # (`ipc_alias`); else it runs on the peer, which reads its own memory and writes ours: SM
        # loads through torch's mapping fault here (measured on 4x H200: cudaErrorIllegalAddress;
        # that mapping lives in the peer device's context).
        bulk = None
        if batch.bulk is not None:  # the batched 1-D copies run on the copy engines beside the table kernel
            bulk = self._bulk_streams.setdefault(id(here), torch.cuda.Stream(self.torch))
            bulk.wait_event(_record(here))
        if batch.table and not batch.table_pulls_here():  # the peer pushes
            there.wait_event(_record(here))
            batch.run_memcpys(there.cuda_stream, batch.peer.index)
            here.wait_event(_record(there))
        else:
            batch.run_memcpys(here.cuda_stream)  # pulled by our device's copy engines, in our context
        if bulk is not None:
            batch.run_bulk(bulk.cuda_stream)
            here.wait_event(_record(bulk))  # after the table launch above: both run, `here` ends after both
        if batch.torch_pairs:
            try:
                with torch.cuda.stream(here), torch.cuda.stream(there):
                    batch.run()
            finally:
                torch.cuda.set_device(self.index)  # the stream contexts restore it; be sure
        self._traced("pull", batch, start, here)

    def _side_streams(self) -> list[torch.cuda.Stream]:
        """Streams whose work `join` and `finish` wait for: the local stream and the pull streams."""
        return [self.local_stream, *(here for here, _ in self.pull_streams.values())]

    def join(self) -> None:
        # Both ways: a broadcast's stage-1 same-GPU moves run on the local stream and read the
        # gather tensors that stage 0 filled on the copy stream (unpacks) and the pull streams.
        # Ordering only the copy stream after the side streams left those moves racing stage 0
        # (seen on 4x H200: zeros and the previous refit's values in the destination).
        side = self._side_streams()
        for s in side:
            self.copy_stream.wait_stream(s)
        for s in side:
            s.wait_stream(self.copy_stream)

    def begin(self) -> None:
        current = torch.cuda.current_stream(self.torch)
        self._t0 = self._mark(current)
        self.copy_stream.wait_stream(current)
        self.comm_stream.wait_stream(current)
        for s in self._side_streams():  # no pull or local move may overwrite what is still read
            s.wait_stream(current)

    def trace_start(self, stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        """Mark the start of work that is not a `CopyBatch` (a wire step) when tracing."""
        return self._mark(stream)

    def trace_end(self, what: object, start: torch.cuda.Event | None, stream: torch.cuda.Stream) -> None:
        self._traced("wire", what, start, stream)  # logged by its repr

    def comm_after_copies(self) -> None:
        """The comm stream waits for everything issued on the copy stream so far (packs)."""
        self.comm_stream.wait_stream(self.copy_stream)

    def record_comm(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.comm_stream)
        return ev

    def copies_after(self, ev: torch.cuda.Event) -> None:
        self.copy_stream.wait_event(ev)

    def finish(self, deadline: float, check: Callable[[], None], stuck: Callable[[], str]) -> None:
        events = []
        for s in (self.copy_stream, self.comm_stream, *self._side_streams()):
            ev = torch.cuda.Event()
            ev.record(s)
            events.append(ev)
        pause = 1e-5
        while not all(ev.query() for ev in events):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"refit did not complete in time: {stuck()}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-4)  # coarse enough not to steal the CPU, fine for timing
        current = torch.cuda.current_stream(self.torch)
        current.wait_stream(self.copy_stream)
        for s in self._side_streams():
            current.wait_stream(s)
        self._report_trace()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def enable_peer_access(index: int, peer: int) -> None:
    """Let ``index`` access ``peer``'s memory directly (NVLink / PCIe P2P) for copy-engine pulls;
    torch enables it lazily for its own copies, which pulls through cupy bypass.  With access
    enabled one way only, a pull out of a peer's IPC-mapped memory was staged through the host
    (a tenth of NVLink's speed, blocking the host); so the executor enables both ways, before it
    opens the peer's handles."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return  # no copy-engine pulls without cupy either (torch copies enable access themselves)
    with torch.cuda.device(index):
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as e:  # already enabled is fine; anything else is not
            if "AlreadyEnabled" not in str(e):
                raise


def make_device(kind: str, index: int) -> Device:
    return CudaDevice(index) if kind == "cuda" else CpuDevice()
