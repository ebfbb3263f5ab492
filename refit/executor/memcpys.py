"""The copy-engine descriptors of a copy between two views: `Memcpy` (one ``cudaMemcpy2DAsync``)
and `memcpy_plan`, which turns (address, shape, strides) of both views into them.

Pure arithmetic, no torch: tested on CPU against torch's own copy (tests/unit/test_memcpy_plan.py).
Apart from `refit.executor.copies` because both it and `refit.executor.table_copy` (a table of
these descriptors run as one kernel, which `copies` builds) speak of `Memcpy`.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Memcpy(NamedTuple):
    """One ``cudaMemcpy2DAsync``: ``height`` rows of ``width`` bytes, ``dpitch`` / ``spitch``
    bytes apart (height 1 is a plain memcpy).  Addresses are absolute."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def _coalesce(shape: tuple[int, ...], dstr: tuple[int, ...], sstr: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(size, dst stride, src stride) per dim, size-1 dims dropped, dims merged where both views
    step through them as through one."""
    dims = [(n, d, s) for n, d, s in zip(shape, dstr, sstr) if n != 1]
    out: list[tuple[int, int, int]] = []
    for n, d, s in dims:
        if out and out[-1][1] == d * n and out[-1][2] == s * n:
            out[-1] = (out[-1][0] * n, d, s)
        else:
            out.append((n, d, s))
    return out or [(1, 1, 1)]


def memcpy_plan(dst: tuple[int, tuple[int, ...], tuple[int, ...]], src: tuple[int, tuple[int, ...], tuple[int, ...]],
                itemsize: int, limit: int = 4096) -> list[Memcpy] | None:
    """The 2-D memcpys that copy view ``src`` into view ``dst``, each given as (address of the
    first element, shape, strides in elements); None when the innermost dim is not contiguous on
    both sides (copy engines move rows, not scattered elements) or when it would take more than
    ``limit`` calls.  Pure arithmetic, so it is tested on CPU against torch's own copy."""
    (dptr, shape, dstr), (sptr, sshape, sstr) = dst, src
    if tuple(shape) != tuple(sshape):
        raise ValueError(f"memcpy of {shape} from {sshape}")
    if math.prod(shape) == 0:
        return []
    dims = _coalesce(tuple(shape), tuple(dstr), tuple(sstr))
    n, d, s = dims[-1]
    if d != 1 or s != 1:
        return None
    width = n * itemsize
    height, dpitch, spitch = 1, width, width
    if len(dims) >= 2:
        height, dpitch, spitch = dims[-2][0], dims[-2][1] * itemsize, dims[-2][2] * itemsize
        if dpitch < width or spitch < width:  # rows overlap: not a pitched copy
            return None
    outer = dims[:-2]
    count = math.prod(o[0] for o in outer)
    if count > limit:
        return None
    out = []
    for flat in range(count):
        doff = soff = 0
        for size, ds, ss in reversed(outer):
            flat, k = divmod(flat, size)
            doff += k * ds
            soff += k * ss
        out.append(Memcpy(dptr + doff * itemsize, dpitch, sptr + soff * itemsize, spitch, width, height))
    return out
