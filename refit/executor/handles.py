"""What crosses a process boundary through the rendezvous store: plain, validated data only.

Every member of a plan reads the store, and so could anyone else who reaches it; so nothing read
from it is ever unpickled or called.  Each value is JSON of one known shape, checked field by
field (bytes in base64), and turned back into an object by a fixed function of refit's — never
by a callable named in the data.  A malformed value raises `HandleError` naming the field.

Kinds:

* ``shm``    — a CPU arena shared as a ``/dev/shm/refit-*`` file: its path and size;
* ``cuda``   — a CUDA IPC handle of one tensor: the fields torch's ``reduce_tensor`` produces,
  rebuilt by ``torch.multiprocessing.reductions.rebuild_cuda_tensor``;
* ``tensors``— a member's local tensors, one ``cuda`` handle each (trainer parameters are
  separate allocations);
* ``nccl``   — an NCCL unique id (128 bytes).

Encoding and validation are pure; only `cuda_fields` and `open_cuda` touch torch (lazily).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Callable

from refit.errors import InvalidInput
from refit.executor import ipc_alias

NCCL_ID_BYTES = 128
MAX_HANDLE_BYTES = 16 << 20  # far above any real value (an expandable-segments CUDA handle lists one
# 64-byte handle per segment): a store value is refused past this
_SHM_PATH = re.compile(r"/dev/shm/refit-[A-Za-z0-9_.-]{1,200}")
_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,512}")
_TENSOR_CLASSES = ("Tensor", "Parameter")
_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
           "int16", "int32", "int64", "bool")


class HandleError(InvalidInput):
    """A value read from the rendezvous store is not what refit writes there."""


def encode(kind: str, fields: dict[str, Any]) -> bytes:
    """``fields`` (already plain: str, int, bool, lists, base64 text) as one JSON value."""
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode(data: bytes, *kinds: str) -> dict[str, Any]:
    """The validated fields (and ``kind``) of a value of one of ``kinds``; `HandleError` for
    anything else."""
    kind = "/".join(kinds)
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_HANDLE_BYTES:
        raise HandleError(f"{kind} handle: expected at most {MAX_HANDLE_BYTES} bytes of JSON, "
                          f"got {type(data).__name__} of {len(data) if isinstance(data, (bytes, bytearray)) else '?'}")
    try:
        value = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HandleError(f"{kind} handle is not JSON ({type(e).__name__}); refusing it") from None
    if not isinstance(value, dict) or value.get("kind") not in kinds:
        got = value.get("kind") if isinstance(value, dict) else type(value).__name__
        raise HandleError(f"expected a {kind} handle, got {str(got)[:40]!r}")
    fields = {k: v for k, v in value.items() if k != "kind"}
    return {"kind": value["kind"], **_CHECKS[value["kind"]](fields)}


# ------------------------------------------------------------------------------ field checks


def _int(fields: dict[str, Any], key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = fields.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise HandleError(f"handle field {key!r} must be an integer in [{lo}, {hi}], got {str(v)[:40]!r}")
    return v


def _bool(fields: dict[str, Any], key: str) -> bool:
    v = fields.get(key)
    if type(v) is not bool:
        raise HandleError(f"handle field {key!r} must be true or false, got {str(v)[:40]!r}")
    return v


def _ints(fields: dict[str, Any], key: str, max_len: int = 16) -> tuple[int, ...]:
    v = fields.get(key)
    if not isinstance(v, list) or len(v) > max_len or any(type(x) is not int or not 0 <= x < 1 << 62 for x in v):
        raise HandleError(f"handle field {key!r} must be a list of at most {max_len} integers, got {str(v)[:40]!r}")
    return tuple(v)


def _choice(fields: dict[str, Any], key: str, options: tuple[str, ...]) -> str:
    v = fields.get(key)
    if v not in options:
        raise HandleError(f"handle field {key!r} must be one of {', '.join(options)}, got {str(v)[:40]!r}")
    return v


def _bytes(fields: dict[str, Any], key: str, optional: bool = False, size: int | None = None) -> bytes | None:
    v = fields.get(key)
    if v is None and optional:
        return None
    try:
        out = base64.b64decode(v, validate=True) if isinstance(v, str) else None
    except (binascii.Error, ValueError):
        out = None
    if out is None or (size is not None and len(out) != size):
        want = f"{size} bytes" if size is not None else "bytes"
        raise HandleError(f"handle field {key!r} must be base64 of {want}, got {str(v)[:40]!r}")
    return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _check_shm(f: dict[str, Any]) -> dict[str, Any]:
    path = f.get("path")
    if not isinstance(path, str) or not _SHM_PATH.fullmatch(path):
        raise HandleError(f"shm handle: path must be /dev/shm/refit-<name>, got {str(path)[:80]!r}")
    return {"path": path, "nbytes": _int(f, "nbytes", 1)}


def _check_cuda(f: dict[str, Any]) -> dict[str, Any]:
    return {
        "tensor_cls": _choice(f, "tensor_cls", _TENSOR_CLASSES), "size": _ints(f, "size"),
        "stride": _ints(f, "stride"), "offset": _int(f, "offset"), "dtype": _choice(f, "dtype", _DTYPES),
        "device": _int(f, "device", 0, 1023), "handle": _bytes(f, "handle"),
        "storage_size_bytes": _int(f, "storage_size_bytes"), "storage_offset_bytes": _int(f, "storage_offset_bytes"),
        "requires_grad": _bool(f, "requires_grad"), "ref_counter_handle": _bytes(f, "ref_counter_handle"),
        "ref_counter_offset": _int(f, "ref_counter_offset"), "event_handle": _bytes(f, "event_handle", optional=True),
        "event_sync_required": _bool(f, "event_sync_required"),
    }


def _check_tensors(f: dict[str, Any]) -> dict[str, Any]:
    tensors = f.get("tensors")
    if not isinstance(tensors, dict) or len(tensors) > 100_000:
        raise HandleError("tensors handle: 'tensors' must map local names to cuda handles")
    out = {}
    for name, fields in tensors.items():
        if not _NAME.fullmatch(name) or not isinstance(fields, dict):
            raise HandleError(f"tensors handle: bad entry {str(name)[:80]!r}")
        out[name] = _check_cuda(fields)
    return {"tensors": out}


def _check_nccl(f: dict[str, Any]) -> dict[str, Any]:
    return {"id": _bytes(f, "id", size=NCCL_ID_BYTES)}


_CHECKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "shm": _check_shm, "cuda": _check_cuda, "tensors": _check_tensors, "nccl": _check_nccl}


# ------------------------------------------------------------------------------ the kinds


def shm_handle(path: str, nbytes: int) -> bytes:
    return encode("shm", {"path": path, "nbytes": nbytes})


def nccl_handle(unique_id: tuple[int, ...] | bytes) -> bytes:
    """cupy's ``nccl.get_unique_id()`` (a tuple of 128 C chars as ints) as a handle."""
    raw = bytes(x & 0xFF for x in unique_id) if not isinstance(unique_id, bytes) else unique_id
    if len(raw) != NCCL_ID_BYTES:
        raise HandleError(f"an NCCL unique id has {NCCL_ID_BYTES} bytes, not {len(raw)}")
    return encode("nccl", {"id": b64(raw)})


def nccl_id(data: bytes, like: tuple[int, ...] | bytes = b"") -> tuple[int, ...] | bytes:
    """The unique id as cupy's ``NcclCommunicator`` takes it, in the form of ``like`` (what this
    cupy's ``get_unique_id`` returns): bytes (cupy 14, seen on the GPU machine) or a tuple of
    signed C chars (older cupy)."""
    raw = decode(data, "nccl")["id"]
    return raw if isinstance(like, bytes) else tuple(b - 256 if b > 127 else b for b in raw)


def cuda_fields(tensor: Any) -> dict[str, Any]:
    """The plain fields of a CUDA tensor's IPC handle (torch's ``reduce_tensor``, no callable)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (tensor_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset,
     requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return {
        "tensor_cls": "Parameter" if issubclass(tensor_cls, torch.nn.Parameter) else "Tensor",
        "size": list(size), "stride": list(stride), "offset": offset, "dtype": str(dtype).removeprefix("torch."),
        "device": device, "handle": b64(handle), "storage_size_bytes": storage_size,
        "storage_offset_bytes": storage_offset, "requires_grad": bool(requires_grad),
        "ref_counter_handle": b64(ref_handle), "ref_counter_offset": ref_offset,
        "event_handle": b64(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync),
    }


def open_cuda(f: dict[str, Any]) -> Any:
    """Map a peer's CUDA tensor from validated `cuda` fields (torch's fixed rebuild function)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    cls = torch.nn.Parameter if f["tensor_cls"] == "Parameter" else torch.Tensor
    tensor = rebuild_cuda_tensor(
        cls, torch.Size(f["size"]), f["stride"], f["offset"], torch.storage.TypedStorage, getattr(torch, f["dtype"]),
        f["device"], f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], f["requires_grad"],
        f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"], f["event_sync_required"])
    # Kernels on other devices read this memory through a second mapping of their own (ipc_alias).
    ipc_alias.remember(tensor.untyped_storage().data_ptr(), f["storage_size_bytes"], f["handle"],
                       f["storage_offset_bytes"])
    return tensor
