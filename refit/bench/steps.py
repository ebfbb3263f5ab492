"""Synthetic optimizer steps for ``refit-bench --step-lr``: weights that change between refits as
an RL trainer's do.

Why: a delta refit (``--delta``) sends only the engine-dtype words that changed since the last
refit, so what it saves depends on how many change; canonical values of a new seed change every
word.  Here each endpoint keeps float32 *masters* for its pieces and every refit follows one
Adam-like step, ``master -= lr * u``, with ``u`` of magnitude about 1 (Adam's normalised update:
sign times 0.5 to 1.5); the trainer's shards then take ``master`` cast to their dtype (torch
``copy_``: round to nearest even), so at RL learning rates only the few values whose master crosses
a rounding boundary change.

Every number is a pure function of (tensor, canonical index, step): initial masters and updates are
hashed (`refit.executor.values.expected_bits`, with salts apart from the bench's seeds) and built
exactly in float32 from integers below 2**24 and powers of two; the step is one float32 multiply
then one subtract, as separate ops (no fused multiply-add).  So CPU and CUDA compute the same bits,
and sources and destinations each keep `Masters` over their *own* pieces, advanced in lockstep: a
destination knows what the engine must hold after step ``s`` without any data from a source.
"""

from __future__ import annotations

import math

import torch

from refit.boxes import split_box
from refit.errors import InvalidInput
from refit.executor.shards import Shards, Verdict, _ndim
from refit.executor.values import DEFAULT_CHUNK, check_box, expected_bits, fill_box, int_view
from refit.layouts import Piece
from refit.regions import slices
from refit.spec import ModelSpec

Index = tuple[int, ...]

FLOATING = ("bfloat16", "float16", "float32")  # dtypes that get masters; others keep fixed canonical values
# Salts of the hash, as `values.name_salt` seeds: far from the bench's seeds (1, 2, ... per planner)
# so a master is never a canonical value.
MASTER_SEED = 0x5EED_0000_0000
STEP_SEED = MASTER_SEED + 1  # step s hashes with STEP_SEED + s
FIXED_SEED = MASTER_SEED - 1  # non-floating pieces: canonical values of this seed, every step
_INIT_SCALE = 2.0 ** -26  # masters uniform in [-1/16, 1/16): (k - 2**22) * 2**-26, k < 2**23
_UPDATE_SCALE = 2.0 ** -23  # |u| = (k + 2**22) * 2**-23 in [0.5, 1.5)


def _hash(tensor: str, shape: Index, start: Index, size: Index, seed: int, device: torch.device) -> torch.Tensor:
    """32 hashed bits per element of the box (int64 in [0, 2**32), box-shaped)."""
    return expected_bits(tensor, shape, start, size, seed, 4, device).long() & 0xFFFFFFFF


def initial(tensor: str, shape: Index, start: Index, size: Index, device: torch.device) -> torch.Tensor:
    """Initial float32 masters of a box: uniform in [-1/16, 1/16), a weight's magnitude, exact."""
    k = _hash(tensor, shape, start, size, MASTER_SEED, device) >> 9  # 23 bits
    return (k - (1 << 22)).to(torch.float32).mul_(_INIT_SCALE)


def update(tensor: str, shape: Index, start: Index, size: Index, step: int, device: torch.device) -> torch.Tensor:
    """Step ``step``'s normalised update of a box (float32): sign × (0.5 + uniform[0, 1)), exact."""
    h = _hash(tensor, shape, start, size, STEP_SEED + step, device)
    signed = ((h >> 9) + (1 << 22)) * (1 - 2 * (h & 1))  # |.| < 2**24: exact in float32
    return signed.to(torch.float32).mul_(_UPDATE_SCALE)


def float32_lr(lr: float) -> float:
    """``lr`` rounded to float32: the factor both ends multiply by, whatever the backend's scalar path."""
    return float(torch.tensor(lr, dtype=torch.float32).item())


class _Box:
    """One piece's float32 masters, box-shaped, on the piece's device."""

    def __init__(self, piece: Piece, shape: Index, device: torch.device) -> None:
        self.piece, self.shape = piece, shape
        self.master = torch.empty(piece.size, dtype=torch.float32, device=device)
        for start, size in self.chunks():
            self.master[slices(start, size)] = initial(piece.tensor, shape, self.at(start), size, device)

    def chunks(self) -> list[tuple[Index, Index]]:
        """Sub-boxes (box-relative) small enough that the hash's int64 temporaries stay bounded."""
        return split_box(((0,) * len(self.piece.size), self.piece.size), DEFAULT_CHUNK)

    def at(self, sub_start: Index) -> Index:
        return tuple(b + s for b, s in zip(self.piece.start, sub_start))

    def step(self, step: int, lr: float) -> None:
        for start, size in self.chunks():
            u = update(self.piece.tensor, self.shape, self.at(start), size, step, self.master.device)
            self.master[slices(start, size)].sub_(u.mul_(lr))  # two roundings, in this order, everywhere


class Masters:
    """float32 masters of every floating piece of one endpoint's shards, stepped in lockstep with
    every other endpoint's (`step`), cast into a trainer's shards (`cast_into`) or checked against
    an engine's (`verify`).  Pieces of other dtypes keep canonical values of a fixed seed."""

    def __init__(self, shards: Shards, spec: ModelSpec) -> None:
        if spec.config.quantization:
            raise InvalidInput(f"--step-lr with a quantized destination ({spec.config.quantization}, --dst-dtype) "
                               "is not supported yet: the synthetic step runs on unquantized weights")
        self.spec, self.steps = spec, 0
        self.boxes: dict[tuple[str, int], _Box] = {}  # (local tensor, piece number) -> masters
        for lt in shards.locals:
            if lt.dtype in FLOATING:
                device = shards.tensors[lt.name].device
                for i, p in enumerate(lt.pieces):
                    self.boxes[(lt.name, i)] = _Box(p, spec[p.tensor].shape, device)

    @property
    def nbytes(self) -> int:
        return sum(b.master.numel() * 4 for b in self.boxes.values())

    def step(self, lr: float) -> None:
        """One synthetic Adam-like step of size ``lr`` on every master: ``master -= lr * u``."""
        self.steps += 1
        lr32 = float32_lr(lr)
        with torch.no_grad():
            for box in self.boxes.values():
                box.step(self.steps, lr32)

    def cast_into(self, shards: Shards) -> None:
        """Write every piece of ``shards`` (a trainer's: those this was built for) as its masters
        cast to the local dtype; pieces of other dtypes as canonical values of `FIXED_SEED`."""
        for lt, local, i, p in self._pieces(shards):
            view = local[slices(p.local_start, p.size)]
            box = self.boxes.get((lt, i))
            if box is None:
                fill_box(view, p.tensor, self.spec[p.tensor].shape, p.start, FIXED_SEED)
            else:
                view.copy_(box.master)

    def verify(self, shards: Shards) -> Verdict:
        """Every element of every piece of ``shards`` (an engine's) bit-exact against the masters
        cast to its dtype (padding is not checked: ``stray`` is 0)."""
        checked = bad = 0
        first = None
        for lt, local, i, p in self._pieces(shards):
            view = local[slices(p.local_start, p.size)]
            box = self.boxes.get((lt, i))
            if box is None:
                n, desc = check_box(view, p.tensor, self.spec[p.tensor].shape, p.start, FIXED_SEED)
            else:
                n, desc = _compare(view, box)
            checked += math.prod(p.size)
            bad += n
            if desc and first is None:
                first = f"{lt}: {desc} (after step {self.steps})"
        return Verdict(checked, bad, 0, first)

    def _pieces(self, shards: Shards) -> list[tuple[str, torch.Tensor, int, Piece]]:
        """(local tensor name, its canonical-ndim view, piece number, piece) of every piece."""
        out = []
        for lt in shards.locals:
            local = shards.tensors[lt.name].view(lt.view_shape(_ndim(self.spec, lt)))
            out += [(lt.name, local, i, p) for i, p in enumerate(lt.pieces)]
        return out


def _compare(actual: torch.Tensor, box: _Box) -> tuple[int, str | None]:
    """Elements of ``actual`` whose bits differ from ``box``'s masters cast to its dtype, and the first."""
    bad, first = 0, None
    for start, size in box.chunks():
        got = int_view(actual[slices(start, size)].contiguous())
        want = int_view(box.master[slices(start, size)].to(actual.dtype))
        diff = got != want
        n = int(diff.sum().item())
        if n and first is None:
            pos = tuple(int(x) for x in diff.nonzero()[0].tolist())
            where = tuple(s + q for s, q in zip(box.at(start), pos))
            mask = (1 << (8 * actual.element_size())) - 1
            first = (f"{box.piece.tensor}{list(where)}: got bits 0x{int(got[pos].item()) & mask:x}, "
                     f"expected 0x{int(want[pos].item()) & mask:x}")
        bad += n
    return bad, first
