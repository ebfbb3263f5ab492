"""How bytes reach another process.  Three transports (and an ipc variant of the third), chosen
per bucket by where its ends are:

* **Local** (both ends' devices driven by this process): no transport at all — `schedule` turns
  the bucket into direct block copies, no staging.
* **Same device, other process** (a colocated trainer and engine): the passive process exports
  its shard arena once — a CUDA IPC handle on GPU, the path of its ``/dev/shm`` arena file on
  CPU, as plain validated data (`refit.executor.handles`, never pickle) — through the
  rendezvous store (an agent exports its tensors one handle each instead of an arena); the
  device's driver maps it once at setup and from then on copies straight out of (or into) the
  peer's tensors.  Handles are opened once and kept for the life of the worker.
* **Remote** (another device): point-to-point sends and receives of staging buffers on a
  communicator of refit's own, over the drivers only — never the default ``torch.distributed``
  group, which belongs to the trainer or to vLLM.

  - GPU: NCCL through ``cupy.cuda.nccl`` (``get_unique_id`` → store, as a `handles` value →
    ``NcclCommunicator``;
    a step's sends and receives in one ``groupStart``/``groupEnd`` on our comm stream).  We pick
    cupy because it gives an explicit stream per call and no dependence on c10d's world state or
    private coalescing API.  ``REFIT_NCCL=torch`` selects a fallback on a ``ProcessGroupNCCL``
    built directly on our own store (for machines whose cupy lacks NCCL).
  - CPU: gloo, a ``ProcessGroupGloo`` constructed on our own prefixed store, async
    ``send``/``recv`` with the bucket index as tag.
* **Remote, one host, ``ipc``** (the bench's ``--transport ipc``; agents on one host): every source shard is exported as above
  (not only passive ones) and every driver maps all of them once at setup; a bucket from another
  device becomes a direct copy by the destination's driver out of the peer's source regions
  (CUDA: a cross-device ``copy_`` on the peer's memory — ``cudaMemcpyAsync`` over NVLink for
  contiguous blocks; CPU: the peer's ``/dev/shm`` mapping).  No staging, no communicator, except
  for a broadcast plan's stage 1 (see `schedule`).  Opening a handle of GPU j in the process of
  GPU i creates that process's CUDA context on GPU j (torch opens it under a guard of device j).

A failed or timed-out operation raises `PeerError` naming the peer (the endpoints it drives).
Waits take the refit's remaining seconds: the group's own timeout (fixed when it was built) is
only an upper bound.
"""

from __future__ import annotations

import datetime
import logging
import re
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from refit.errors import InvalidInput, RefitFailed
from refit.executor import handles
from refit.executor.device import CudaDevice
from refit.executor.shards import Shards

SendRecv = list[tuple[int, int, torch.Tensor]]  # (peer comm rank, tag, contiguous uint8 buffer)

log = logging.getLogger("refit.executor")


class PeerError(RefitFailed):
    """A transfer with a named peer failed (it died, hung, or reported an error)."""


# ---------------------------------------------------------------------------------------------
# Same device, other process


def export_arena(shards: Shards) -> bytes:
    """A handle another process on the same device can map ``shards``' arena with."""
    if shards.arena.is_cuda:
        return handles.encode("cuda", handles.cuda_fields(shards.arena))
    if shards.path is None:
        raise RuntimeError("CPU shards must be allocated in /dev/shm (shm_path) to be shared")
    return handles.shm_handle(shards.path, shards.arena.numel())


def import_share(handle: bytes) -> torch.Tensor | dict[str, torch.Tensor]:
    """Map what a peer exported: its whole arena (uint8; `export_arena`) or its tensors by name
    (`export_tensors`).  The mapping outlives the /dev/shm name (unlinked after setup); CUDA IPC
    mappings are cached by torch per handle."""
    fields = handles.decode(handle, "cuda", "shm", "tensors")
    if fields["kind"] == "tensors":
        return {n: handles.open_cuda(f) for n, f in fields["tensors"].items()}
    if fields["kind"] == "cuda":
        return handles.open_cuda(fields)
    return torch.from_file(fields["path"], shared=True, size=fields["nbytes"], dtype=torch.uint8)


def export_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """CUDA tensors that are separate allocations (an agent's parameters), one IPC handle each.
    Memory that CUDA IPC cannot export (virtual-memory allocations: vLLM's sleep-mode pool) is
    refused naming the tensor and the way around it: the member holding it copies by itself."""
    fields = {}
    for n, t in tensors.items():
        try:
            fields[n] = handles.cuda_fields(t)
        except RuntimeError as e:
            raise InvalidInput(f"{n}: CUDA IPC cannot export its memory ({first_line(e)}); memory of "
                               f"vLLM's sleep mode (enable_sleep_mode) is such: with GPUs of their own, set "
                               f"REFIT_IPC=pull so that the engines' drivers copy into it themselves") from None
    return handles.encode("tensors", {"tensors": fields})


# ---------------------------------------------------------------------------------------------
# Remote


class Comm(Protocol):
    def post(self, sends: SendRecv, recvs: SendRecv) -> Any:
        """Start a step's sends and receives together; returns a handle."""

    def wait(self, handle: Any, timeout_s: float) -> None:
        """Order later copies after the step (GPU: stream wait; CPU: block until done, at most
        ``timeout_s``: the refit's remaining time)."""

    def check(self) -> None:
        """Raise if the communicator reported an asynchronous error."""

    def stuck(self) -> str:
        """Describe the oldest step not finished (for timeout messages)."""

    def close(self) -> None: ...


def first_line(e: BaseException) -> str:
    """The useful part of a backend error: first line, without gloo's source location and advice."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0]


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float,
               host: str = "127.0.0.1") -> dist.ProcessGroupGloo:
    """A gloo group of our own on ``store`` (never the default group), reached at ``host``."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def retire(pg: dist.ProcessGroupGloo, pending: Sequence[dist.Work], what: str) -> threading.Thread | None:
    """Let go of gloo group ``pg`` (the caller drops its own reference) without waiting for
    ``pending``: collectives it posted that may never finish, such as a barrier that some member
    never reached, left when its refit was abandoned.

    Why: the group's destructor joins its worker threads, so it waits until such a collective
    times out — at the abandoned refit's deadline, a minute later perhaps — and ``abort`` or
    ``shutdown`` (torch 2.13) do not cut that short.  So a daemon thread holds the group until
    every pending collective has ended, then drops it (its destructor returns at once then), and
    ends.  It polls in Python, never inside the destructor and with no callback on the work's
    future: a process that exits meanwhile exits cleanly (one exiting while a thread sits in that
    destructor, or while gloo runs a Python callback, dies of "terminate called").  Returns that
    thread (tests join it), or None when nothing is pending: the group goes with the caller's
    reference, at once.  (Point-to-point work — `GlooComm`'s sends and receives — never holds the
    destructor: only collectives run on the worker threads.)"""
    waiting = [w for w in pending if not w.is_completed()]
    if not waiting:
        return None
    held = [pg]

    def drop_once_ended() -> None:
        while not all(w.is_completed() for w in waiting):  # with an error, at its own timeout
            time.sleep(0.1)
        waiting.clear()
        held.clear()
        log.info("%s: released (its abandoned collectives have ended)", what)

    thread = threading.Thread(target=drop_once_ended, name=f"refit-retire {what}", daemon=True)
    thread.start()
    return thread


def ended(work: dist.Work, wait_s: float) -> bool:
    """Whether ``work`` has ended (done or failed), waiting at most ``wait_s`` for it: returns as
    soon as it ends.  (A wait that runs out raises and leaves the work as it was.)"""
    try:
        work.wait(datetime.timedelta(seconds=wait_s))
    except RuntimeError:  # ran out, or the work failed: the caller's ``work.wait()`` says which
        pass
    return work.is_completed()


class GlooComm:
    """CPU transport: async gloo send/recv on a process group of our own."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, names: list[str],
                 host: str = "127.0.0.1") -> None:
        self.pg = gloo_group(store, rank, size, timeout_s, host)
        self.names = names

    def _op(self, fn: Callable[[], Any], verb: str, peer: int, tag: int) -> Any:
        try:
            return fn()
        except RuntimeError as e:
            raise PeerError(f"{verb} bucket {tag} with {self.names[peer]} failed: {first_line(e)}") from None

    def post(self, sends: SendRecv, recvs: SendRecv) -> list[tuple[Any, str, int, int]]:
        works = []
        for peer, tag, buf in recvs:
            works.append((self._op(lambda: self.pg.recv([buf], peer, tag), "receiving", peer, tag), "receiving", peer, tag))
        for peer, tag, buf in sends:
            works.append((self._op(lambda: self.pg.send([buf], peer, tag), "sending", peer, tag), "sending", peer, tag))
        return works

    def wait(self, handle: list[tuple[Any, str, int, int]], timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=max(timeout_s, 0.001))
        for work, verb, peer, tag in handle:
            self._op(lambda: work.wait(timeout), verb, peer, tag)

    def check(self) -> None:
        pass

    def stuck(self) -> str:
        return "gloo operations are waited on synchronously"

    def close(self) -> None:
        pass


class WireStep:
    """A step's sends and receives as the trace logs them (`CudaDevice` with ``REFIT_TRACE=1``)."""

    def __init__(self, sends: SendRecv, recvs: SendRecv) -> None:
        self.sent = sum(b.numel() for _, _, b in sends)
        self.received = sum(b.numel() for _, _, b in recvs)

    def __repr__(self) -> str:
        return f"WireStep(sends {self.sent} bytes, receives {self.received} bytes)"


class _NcclBase:
    """Shared by both NCCL flavours: per-step end events, to wait, poll and name stuck peers."""

    def __init__(self, device: CudaDevice, names: list[str]) -> None:
        self.device = device
        self.names = names
        self.steps: list[tuple[Any, SendRecv, SendRecv]] = []

    def wait(self, handle: Any, timeout_s: float) -> None:
        self.device.copies_after(handle)  # never blocks: the deadline is kept by device.finish

    def stuck(self) -> str:
        for ev, sends, recvs in self.steps:
            if not ev.query():
                peers = sorted({self.names[p] for p, _, _ in sends + recvs})
                tags = sorted({t for _, t, _ in sends + recvs})
                return f"buckets {tags} with {', '.join(peers)} never completed (peer dead or stuck?)"
        return "copies never completed"

    def _trace_start(self) -> Any:
        return self.device.trace_start(self.device.comm_stream)

    def _finished(self, ev: Any, sends: SendRecv, recvs: SendRecv, start: Any = None) -> Any:
        if start is not None:
            self.device.trace_end(WireStep(sends, recvs), start, self.device.comm_stream)
        self.steps = [s for s in self.steps if not s[0].query()] + [(ev, sends, recvs)]
        return ev


class CupyNcclComm(_NcclBase):
    """GPU transport: a cupy NCCL communicator over the drivers, one group per step."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: CudaDevice, names: list[str]) -> None:
        super().__init__(device, names)
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as e:
            raise RuntimeError("the GPU transport needs cupy with NCCL (pip install cupy-cuda13x), "
                               "or set REFIT_NCCL=torch") from e
        self.nccl = nccl
        mine = nccl.get_unique_id()  # also tells which form this cupy takes
        if rank == 0:
            store.set("nccl_unique_id", handles.nccl_handle(mine))
        uid = handles.nccl_id(store.get("nccl_unique_id"), like=mine)  # blocks until rank 0 has published it
        with cupy.cuda.Device(device.index):
            self.comm = nccl.NcclCommunicator(size, uid, rank)
        self.uint8 = getattr(nccl, "NCCL_UINT8", 1)

    def post(self, sends: SendRecv, recvs: SendRecv) -> Any:
        self.device.comm_after_copies()
        start = self._trace_start()
        stream = self.device.comm_stream.cuda_stream
        self.nccl.groupStart()
        try:
            for peer, _, buf in sends:
                self.comm.send(buf.data_ptr(), buf.numel(), self.uint8, peer, stream)
            for peer, _, buf in recvs:
                self.comm.recv(buf.data_ptr(), buf.numel(), self.uint8, peer, stream)
        finally:
            self.nccl.groupEnd()
        return self._finished(self.device.record_comm(), sends, recvs, start)

    def check(self) -> None:
        try:
            self.comm.check_async_error()
        except Exception as e:
            raise PeerError(f"NCCL reported an error: {e}; {self.stuck()}") from None

    def close(self) -> None:
        self.comm.abort()  # also what makes pending kernels of a failed run return


class TorchNcclComm(_NcclBase):
    """Fallback GPU transport: ``ProcessGroupNCCL`` built directly on our store (no
    init_process_group); a step is one coalesced group (``_start/_end_coalescing``)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: CudaDevice, names: list[str],
                 timeout_s: float) -> None:
        super().__init__(device, names)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        # Create the communicator now, on every driver together: left lazy, the first p2p op
        # (the link measurement, between two drivers only) would wait for all of them.
        self.pg.eager_connect_single_device(device.torch)

    def post(self, sends: SendRecv, recvs: SendRecv) -> Any:
        self.device.comm_after_copies()
        start = self._trace_start()
        with torch.cuda.stream(self.device.comm_stream):  # NCCL's stream waits on the current one
            self.pg._start_coalescing(self.device.torch)
            for peer, tag, buf in sends:
                self.pg.send([buf], peer, tag)
            for peer, tag, buf in recvs:
                self.pg.recv([buf], peer, tag)
            work = self.pg._end_coalescing(self.device.torch)
            if work is not None:
                work.wait()  # the comm stream (current) waits for the group
        return self._finished(self.device.record_comm(), sends, recvs, start)

    def check(self) -> None:
        pass

    def close(self) -> None:
        for name in ("abort", "shutdown"):
            if hasattr(self.pg, name):
                getattr(self.pg, name)()
                return


def make_comm(kind: str, store: dist.Store, rank: int, size: int, device: Any, timeout_s: float,
              names: list[str], host: str = "127.0.0.1") -> Comm:
    """The data communicator among the device drivers: ``kind`` ``cpu`` (gloo), ``cuda-cupy`` or
    ``cuda-torch`` (NCCL bootstrapped by cupy or by torch: ``REFIT_NCCL``); ``host``: the address
    this member's gloo sockets bind to (its own host's, so that CPU data can cross machines)."""
    if kind == "cpu":
        return GlooComm(store, rank, size, timeout_s, names, host)
    if kind == "cuda-torch":
        return TorchNcclComm(store, rank, size, device, names, timeout_s)
    if kind == "cuda-cupy":
        return CupyNcclComm(store, rank, size, device, names)
    raise InvalidInput(f"unknown communicator kind {kind!r} (cpu, cuda-cupy or cuda-torch)")
