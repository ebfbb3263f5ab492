"""Deterministic canonical values, computable for any box without the full tensor.

Every element of canonical tensor ``T`` at linear index ``i`` has the value whose *bits* are
``hash(salt(T, seed), i)`` (low 8/16/32 bits, by dtype width).  Sources fill their pieces with
it and destinations check theirs against it, so a refit is verified bit for bit on every element
while no process ever holds a whole canonical tensor.

Values are random bit patterns (NaNs included), so they are written and compared through an
integer view of the same width — never as floats.  The hash stays inside int64 without overflow
(32-bit state, 31-bit multipliers), so CPU and CUDA compute identical bits.  Work is chunked so
the int64 temporaries stay bounded however large the box.
"""

from __future__ import annotations

import hashlib
import math

import torch

from refit.boxes import Index, split_box
from refit.dtypes import DTYPES
from refit.regions import slices

DEFAULT_CHUNK = 1 << 24  # elements per chunk: a few int64 temporaries of 128 MiB at most

TORCH_DTYPES = {name: getattr(torch, d.torch) for name, d in DTYPES.items()}  # refit.dtypes, as torch dtypes
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_M32 = 0xFFFFFFFF


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as signed integers of the same width (bit-exact copies and compares)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def copy_bits(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    """Copy every tensor of ``src`` into ``dst``'s tensor of the same name, bit for bit, in one
    batched copy finished before returning (as integers: a float copy on CUDA canonicalizes NaN
    payloads)."""
    names = list(dst)
    if not names:
        return
    with torch.no_grad():
        torch._foreach_copy_([int_view(dst[n]) for n in names], [int_view(src[n]) for n in names])
    for d in {t.device for t in dst.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(d)


def name_salt(tensor: str, seed: int) -> tuple[int, int]:
    """Two 32-bit salts from a tensor name and a seed; stable across processes and machines."""
    digest = hashlib.blake2b(f"{seed}\0{tensor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer (lowbias32-style) in place on int64 values in [0, 2**32).
    Multipliers are below 2**31 so no product leaves int64: identical results on every backend."""
    h ^= h >> 16
    h.mul_(0x7FEB352D).bitwise_and_(_M32)
    h ^= h >> 15
    h.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    h ^= h >> 16
    return h


def _linear_index(shape: Index, start: Index, size: Index, device: torch.device) -> torch.Tensor:
    """Canonical row-major linear index of every element of box ``start/size`` (int64, box-shaped)."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    idx = torch.zeros((1,) * len(size), dtype=torch.int64, device=device)
    for d, (s, n, st) in enumerate(zip(start, size, strides)):
        view = [1] * len(size)
        view[d] = n
        idx = idx + (torch.arange(s, s + n, dtype=torch.int64, device=device) * st).view(view)
    return idx


def expected_bits(tensor: str, shape: Index, start: Index, size: Index, seed: int, width: int,
                  device: torch.device) -> torch.Tensor:
    """The canonical values of one box as signed integers of ``width`` bytes (box-shaped)."""
    s1, s2 = name_salt(tensor, seed)
    idx = _linear_index(shape, start, size, device)
    h = _mix((idx & _M32) ^ s1)
    h ^= (idx >> 32) ^ s2  # high half of the index: tensors of more than 2**32 elements
    del idx
    h = _mix(h)
    bits = 8 * width
    if bits < 32:
        h &= (1 << bits) - 1
    h -= (h >> (bits - 1)) << bits  # to the signed range of the target width, exactly
    return h.to(_INT_OF_WIDTH[width])


def _chunks(size: Index, chunk: int) -> list[tuple[Index, Index]]:
    return split_box(((0,) * len(size), size), max(1, chunk))


def fill_box(out: torch.Tensor, tensor: str, shape: Index, box_start: Index, seed: int = 0,
             chunk: int = DEFAULT_CHUNK) -> None:
    """Write canonical values into ``out``, a (possibly strided) view of box ``box_start`` of
    canonical ``tensor`` of ``shape``; ``out`` has the box's shape (canonical ndim)."""
    target = int_view(out)
    for sub_start, sub_size in _chunks(tuple(out.shape), chunk):
        start = tuple(b + s for b, s in zip(box_start, sub_start))
        vals = expected_bits(tensor, shape, start, sub_size, seed, out.element_size(), out.device)
        target[slices(sub_start, sub_size)].copy_(vals)


def check_box(actual: torch.Tensor, tensor: str, shape: Index, box_start: Index, seed: int = 0,
              chunk: int = DEFAULT_CHUNK) -> tuple[int, str | None]:
    """Count elements of ``actual`` (a view of a box, as in `fill_box`) whose bits differ from the
    canonical values; also describe the first one (canonical coordinates, got/expected bits)."""
    got_all = int_view(actual)
    bad, first = 0, None
    for sub_start, sub_size in _chunks(tuple(actual.shape), chunk):
        start = tuple(b + s for b, s in zip(box_start, sub_start))
        want = expected_bits(tensor, shape, start, sub_size, seed, actual.element_size(), actual.device)
        got = got_all[slices(sub_start, sub_size)]
        diff = got != want
        n = int(diff.sum().item())
        if n and first is None:
            flat = int(diff.reshape(-1).nonzero()[0].item())
            pos = []
            for extent in reversed(sub_size):
                pos.append(flat % extent)
                flat //= extent
            pos = tuple(reversed(pos))
            where = tuple(s + p for s, p in zip(start, pos))
            mask = (1 << (8 * actual.element_size())) - 1
            first = (f"{tensor}{list(where)}: got bits 0x{int(got[pos].item()) & mask:x}, "
                     f"expected 0x{int(want[pos].item()) & mask:x}")
        bad += n
    return bad, first
