"""Second mappings of CUDA IPC memory in the reading device's own context.

torch opens a peer process's CUDA IPC handle in the context of the device the memory lives on.
Copy engines reach such a mapping from any device (unified addressing), but a *kernel* on another
device faults on it (measured on 4x H200: ``cudaErrorIllegalAddress``).  CUDA lets a process open a
handle once per device context, so for kernels that read peers (`refit.executor.table_copy`) the
puller opens the same handle again in its own device's context and reads through that alias.

`remember` records every mapping the executor imports; `alias` translates an address inside one of
them into the puller's own mapping, opening it on first use (cached for the process's lifetime, as
torch caches its own).
"""

from __future__ import annotations

import bisect
import logging
import threading

log = logging.getLogger(__name__)

_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t; torch may prefix one byte naming the handle's kind
_lock = threading.Lock()
_starts: list[int] = []  # sorted storage start addresses (as torch mapped them)
_maps: dict[int, tuple[int, bytes, int]] = {}  # start -> (bytes, raw handle, offset of the storage in its allocation)
_aliases: dict[tuple[bytes, int], int] = {}  # (raw handle, device) -> base address in that device's context


def _raw_handle(handle: bytes) -> bytes | None:
    """The cudaIpcMemHandle_t inside torch's handle: torch 2.11 sends a version byte (2) and a
    kind byte (``c``: a plain cudaMalloc block) before it (seen on the GPU machine)."""
    if len(handle) == _IPC_HANDLE_BYTES:
        return handle
    kind_at = len(handle) - _IPC_HANDLE_BYTES - 1
    if kind_at in (0, 1) and handle[kind_at:kind_at + 1] == b"c":
        return handle[kind_at + 1:]
    return None  # expandable segments and other kinds: no second mapping, callers fall back


def remember(start: int, nbytes: int, handle: bytes, offset: int) -> None:
    """A storage of ``nbytes`` at ``start`` (torch's mapping) is ``offset`` bytes into the
    allocation that IPC ``handle`` exports."""
    raw = _raw_handle(handle)
    if raw is None or nbytes <= 0:
        log.info("IPC handle of %d bytes (kind %r): no second mapping", len(handle), handle[:1])
        return
    with _lock:
        if start not in _maps:
            bisect.insort(_starts, start)
        _maps[start] = (nbytes, raw, offset)


def alias(ptr: int, device: int) -> int | None:
    """``ptr`` as an address in ``device``'s own mapping, or None when it is not in remembered IPC
    memory or the second open fails."""
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        start = _starts[i]
        nbytes, raw, offset = _maps[start]
        if ptr >= start + nbytes:
            return None
        base = _aliases.get((raw, device))
        if base is None:
            try:
                import cupy
                from cupy.cuda import runtime

                with cupy.cuda.Device(device):
                    base = runtime.ipcOpenMemHandle(raw, runtime.cudaIpcMemLazyEnablePeerAccess)
            except Exception as e:  # noqa: BLE001 - any failure means: no alias, push instead
                log.info("no second IPC mapping on cuda:%d: %s", device, e)
                return None
            _aliases[(raw, device)] = base
        return base + offset + (ptr - start)
