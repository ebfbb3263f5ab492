"""Many copies in one driver call: ``cudaMemcpyBatchAsync`` (1-D) and ``cudaMemcpy3DBatchAsync``
(pitched 2-D), CUDA 13 forms.

Frameworks allocate a tensor per parameter (vLLM) or per expert (Megatron's SequentialMLP, TE's
grouped linear), so a pull from a peer GPU is thousands of separate contiguous blocks.  One
``cudaMemcpyAsync`` each costs more host time than the wire takes (`refit.executor.table_copy`
says how much); an SM kernel over a table issues them all at once but its loads from a single
peer are a fifth slower than copy engines (bench/RESULTS.md, case
"qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC", its history: batched copy-engine
pulls for framework-style allocations).  The batch APIs hand
the driver all copies of a batch in one call each (plain runs of bytes, and pitched blocks such as
an expert's column slice) and let it run them on the copy engines.

The arrays (destinations, sources, sizes, one attribute record) are built once per plan, so a
refit pays one call per batch.  Bound with ctypes against the CUDA runtime torch already loaded:
no extra dependency, and `available` says False (callers fall back) where the symbol or a GPU is
missing.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Sequence

from refit import settings

log = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: copy engines, not SMs


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class _PtrOperand(ctypes.Structure):  # cudaMemcpy3DOperand with type cudaMemcpyOperandTypePointer
    _fields_ = [("type", ctypes.c_int), ("ptr", ctypes.c_void_p), ("rowLength", ctypes.c_size_t),
                ("layerHeight", ctypes.c_size_t), ("locHint", _MemLocation)]


class _Extent(ctypes.Structure):
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class _BatchOp3D(ctypes.Structure):
    _fields_ = [("src", _PtrOperand), ("dst", _PtrOperand), ("extent", _Extent), ("srcAccessOrder", ctypes.c_int),
                ("flags", ctypes.c_uint)]


_OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer


def _runtime() -> "ctypes.CDLL | None":
    for name in ("libcudart.so.13", "libcudart.so"):  # the one torch loaded answers to its soname
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_BOUND: dict[str, "ctypes._CFuncPtr | None"] = {}  # runtime function name -> bound function (or None)


def _bind(name: str, argtypes: list) -> "ctypes._CFuncPtr | None":
    """The runtime's function ``name`` with its CUDA 13 signature, or None where it is missing."""
    if name not in _BOUND:
        fn = getattr(_runtime(), name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
        _BOUND[name] = fn
    return _BOUND[name]


def _function() -> "ctypes._CFuncPtr | None":
    return _bind("cudaMemcpyBatchAsync", [
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
        ctypes.c_void_p])


def _function_3d() -> "ctypes._CFuncPtr | None":
    return _bind("cudaMemcpy3DBatchAsync",
                 [ctypes.c_size_t, ctypes.POINTER(_BatchOp3D), ctypes.c_ulonglong, ctypes.c_void_p])


def mode() -> str:
    """``REFIT_BATCH_MEMCPY``: ``off`` (the table kernel alone), ``flat`` (1-D copies batched
    beside it) or ``all`` (pitched ones batched too).  A small gain on 2 GPUs and a large loss on 4,
    so batching is opt-in: bench/RESULTS.md, case
    "qwen3-30b-moe megatron:tp4ep4 → vllm:tp4, 4× H200, CUDA IPC", its history: batched
    copy-engine pulls turned off by default."""
    return settings.current().batch_memcpy


def available(pitched: bool = False) -> bool:
    """Whether CUDA 13's ``cudaMemcpyBatchAsync`` (``pitched``: ``cudaMemcpy3DBatchAsync``) can
    be called here and `mode` allows it."""
    if mode() == "off" or (pitched and mode() != "all"):
        return False
    try:
        import torch

        if not torch.cuda.is_available() or int((torch.version.cuda or "0").split(".")[0]) < 13:
            return False  # CUDA 12.8's form takes an extra argument: not bound here
    except ImportError:
        return False
    return (_function_3d() if pitched else _function()) is not None


class BatchMemcpy:
    """Fixed 1-D copies ``(dst, src, nbytes)`` from device ``src_device`` into ``dst_device``."""

    def __init__(self, copies: Sequence[tuple[int, int, int]], src_device: int, dst_device: int) -> None:
        fn = _function()
        if fn is None:
            raise RuntimeError("cudaMemcpyBatchAsync is not available in this CUDA runtime")
        self._fn = fn
        self.n = len(copies)
        self.nbytes = sum(c[2] for c in copies)
        self._dsts = (ctypes.c_void_p * self.n)(*(c[0] for c in copies))
        self._srcs = (ctypes.c_void_p * self.n)(*(c[1] for c in copies))
        self._sizes = (ctypes.c_size_t * self.n)(*(c[2] for c in copies))
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(_LOCATION_DEVICE, src_device),
                                        _MemLocation(_LOCATION_DEVICE, dst_device), _PREFER_OVERLAP_WITH_COMPUTE)
        self._attr_index = (ctypes.c_size_t * 1)(0)  # one attribute record for copies 0..n-1

    def launch(self, stream: int) -> None:
        if not self.n:
            return
        err = self._fn(self._dsts, self._srcs, self._sizes, self.n, ctypes.byref(self._attrs), self._attr_index, 1,
                       ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"cudaMemcpyBatchAsync of {self.n} copies ({self.nbytes} bytes) failed: CUDA error {err}")


class BatchMemcpy2D:
    """Fixed pitched copies ``(dst, dpitch, src, spitch, width, height)`` (bytes) from device
    ``src_device`` into ``dst_device``: one ``cudaMemcpy3DBatchAsync`` op each, depth 1."""

    def __init__(self, copies: Sequence[tuple[int, int, int, int, int, int]], src_device: int, dst_device: int) -> None:
        fn = _function_3d()
        if fn is None:
            raise RuntimeError("cudaMemcpy3DBatchAsync is not available in this CUDA runtime")
        self._fn = fn
        self.n = len(copies)
        self.nbytes = sum(c[4] * c[5] for c in copies)
        self._ops = (_BatchOp3D * self.n)()
        for op, (dst, dpitch, src, spitch, width, height) in zip(self._ops, copies):
            # Pointer operands count rows and layers in bytes; layerHeight is the rows per layer.
            op.src = _PtrOperand(_OPERAND_POINTER, src, spitch, height, _MemLocation(_LOCATION_DEVICE, src_device))
            op.dst = _PtrOperand(_OPERAND_POINTER, dst, dpitch, height, _MemLocation(_LOCATION_DEVICE, dst_device))
            op.extent = _Extent(width, height, 1)
            op.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
            op.flags = _PREFER_OVERLAP_WITH_COMPUTE

    def launch(self, stream: int) -> None:
        if not self.n:
            return
        err = self._fn(self.n, self._ops, 0, ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"cudaMemcpy3DBatchAsync of {self.n} copies ({self.nbytes} bytes) failed: "
                               f"CUDA error {err}")


class CopyEngineBatch:
    """The batched part of a peer pull: its 1-D copies and, where allowed, its pitched ones."""

    def __init__(self, flat: Sequence[tuple[int, int, int]], pitched: Sequence[tuple[int, int, int, int, int, int]],
                 src_device: int, dst_device: int) -> None:
        self.parts: list[BatchMemcpy | BatchMemcpy2D] = []
        if flat:
            self.parts.append(BatchMemcpy(flat, src_device, dst_device))
        if pitched:
            self.parts.append(BatchMemcpy2D(pitched, src_device, dst_device))
        self.n = sum(p.n for p in self.parts)
        self.nbytes = sum(p.nbytes for p in self.parts)

    def launch(self, stream: int) -> None:
        for p in self.parts:
            p.launch(stream)
