"""Many plain copies in one driver call: ``cudaMemcpyBatchAsync`` (CUDA 12.8+; the CUDA 13 form).

Frameworks allocate a tensor per parameter (vLLM) or per expert (Megatron's SequentialMLP, TE's
grouped linear), so a pull from a peer GPU is thousands of separate contiguous blocks.  One
``cudaMemcpyAsync`` each costs more host time than the wire takes (`refit.executor.table_copy`
says how much); an SM kernel over a table issues them all at once but its loads from a single
peer reach ~300 GB/s where copy engines reach ~375 (measured on 2x H200).  The batch API hands
the driver all 1-D copies of a batch in one call and lets it run them on the copy engines.

The arrays (destinations, sources, sizes, one attribute record) are built once per plan, so a
refit pays one call per batch.  Bound with ctypes against the CUDA runtime torch already loaded:
no extra dependency, and `available` says False (callers fall back) where the symbol or a GPU is
missing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Sequence

log = logging.getLogger(__name__)

_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: copy engines, not SMs


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


_FN: "ctypes._CFuncPtr | None | bool" = None  # None: not looked up yet; False: not there


def _function() -> "ctypes._CFuncPtr | None":
    global _FN
    if _FN is None:
        _FN = False
        for name in ("libcudart.so.13", "libcudart.so"):
            try:
                fn = ctypes.CDLL(name).cudaMemcpyBatchAsync
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                           ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes),
                           ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p]
            _FN = fn
            break
    return _FN or None


def available() -> bool:
    """``REFIT_BATCH_MEMCPY=off`` turns it off (for comparison); else whether CUDA 13's
    ``cudaMemcpyBatchAsync`` can be called here."""
    if os.environ.get("REFIT_BATCH_MEMCPY", "auto") == "off":
        return False
    try:
        import torch

        if not torch.cuda.is_available() or int((torch.version.cuda or "0").split(".")[0]) < 13:
            return False  # CUDA 12.8's form takes an extra argument: not bound here
    except ImportError:
        return False
    return _function() is not None


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
