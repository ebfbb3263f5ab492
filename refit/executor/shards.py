"""One endpoint's local tensors, allocated as views of a single flat arena.

Why an arena: the whole shard is then shared with *one* handle (a CUDA IPC handle, or a
``/dev/shm`` file on CPU), and any process can rebuild the views of a peer's shard from the
peer's layout alone — offsets follow from the local tensor list, so nothing but the handle
travels.  Sources are filled with canonical values (`refit.executor.values`), padding with
zeros; destinations start as a sentinel byte pattern so a missed write cannot look like a zero.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch

from refit.errors import InvalidInput
from refit.executor.topology import Endpoint, endpoint_name
from refit.executor.values import TORCH_DTYPES, check_box, fill_box, int_view
from refit.layouts import Layout
from refit.layouts.base import LocalTensor
from refit.regions import slices
from refit.spec import ModelSpec, check_tensor_table

ALIGN = 512  # bytes; keeps every view aligned for any dtype and for vectorised copies
SENTINEL = 0xA5  # destination bytes before the first refit


def arena_offsets(tensors: Sequence[LocalTensor], scattered: bool = False) -> tuple[dict[str, int], int]:
    """Byte offset of each local tensor in the arena, and the arena size (deterministic, so a
    peer rebuilds the views from the layout alone).

    ``scattered`` lays the tensors out the way frameworks
    leave them rather than packed in layout order: in reverse order (Megatron's DDP buffers hold
    parameters in reverse) with irregular gaps between them (separate allocations, as vLLM makes
    one per parameter).  Then equal blocks of neighbouring tensors no longer sit at evenly spaced
    addresses, so copies cannot be merged across tensors — the case a real refit meets."""
    offsets, pos = {}, 0
    for i, lt in enumerate(reversed(tensors) if scattered else tensors):
        offsets[lt.name] = pos
        pos += -(-lt.nbytes // ALIGN) * ALIGN + (ALIGN * (1 + i * 7 % 5) if scattered else 0)
    return offsets, max(pos, ALIGN)


def views(arena: torch.Tensor, tensors: Sequence[LocalTensor], scattered: bool = False) -> dict[str, torch.Tensor]:
    """The local tensors as views of ``arena`` (uint8, laid out by `arena_offsets`)."""
    offsets, total = arena_offsets(tensors, scattered)
    if arena.numel() < total:
        raise ValueError(f"arena of {arena.numel()} bytes is smaller than the {total} its layout needs")
    out = {}
    for lt in tensors:
        off = offsets[lt.name]
        out[lt.name] = arena[off:off + lt.nbytes].view(TORCH_DTYPES[lt.dtype]).view(lt.shape)
    return out


@dataclass
class Shards:
    """An endpoint's local tensors (``tensors``: local name -> view) and the arena behind them.
    ``path`` names the /dev/shm file backing a CPU arena that peers map (None otherwise)."""

    locals: list[LocalTensor]
    arena: torch.Tensor
    tensors: dict[str, torch.Tensor] = field(repr=False)
    path: str | None = None

    @property
    def nbytes(self) -> int:
        return self.arena.numel() or sum(t.numel() * t.element_size() for t in self.tensors.values())

    def memory(self) -> list[torch.Tensor]:
        """The byte buffers behind the tensors: the arena, or each tensor of `allocate_each`."""
        if self.arena.numel():
            return [self.arena]
        return [t.view(-1).view(torch.uint8) for t in self.tensors.values() if t.numel()]


Own = Union[Shards, Mapping[str, torch.Tensor]]  # an endpoint's tensors: an arena (bench) or separate tensors


def allocate(tensors: Sequence[LocalTensor], device: torch.device, shm_path: str | None = None,
             scattered: bool = False) -> Shards:
    """Allocate an arena on ``device``.  With ``shm_path`` (CPU only) the arena is a shared
    mapping of that file, so a process on the same "device" can map it too.  ``scattered``: lay it
    out as frameworks leave their parameters (`arena_offsets`)."""
    _, total = arena_offsets(tensors, scattered)
    if shm_path is not None:
        if device.type != "cpu":
            raise ValueError("shm_path is for CPU arenas; CUDA arenas are shared through CUDA IPC")
        arena = torch.from_file(shm_path, shared=True, size=total, dtype=torch.uint8)
    else:
        arena = torch.empty(total, dtype=torch.uint8, device=device)
    return Shards(list(tensors), arena, views(arena, tensors, scattered), shm_path)


def allocate_each(tensors: Sequence[LocalTensor], device: torch.device) -> Shards:
    """One allocation per tensor, in layout (model) order, as vLLM's model init makes its
    parameters; the `Shards` has no arena."""
    each = {lt.name: torch.empty(lt.shape, dtype=TORCH_DTYPES[lt.dtype], device=device) for lt in tensors}
    return Shards(list(tensors), torch.empty(0, dtype=torch.uint8, device=device), each)


def fill_source(shards: Shards, spec: ModelSpec, seed: int) -> None:
    """Canonical values (of ``seed``) in every piece; zeros in padding."""
    for m in shards.memory():
        m.zero_()
    for lt in shards.locals:
        local = shards.tensors[lt.name].view(lt.view_shape(_ndim(spec, lt)))
        for p in lt.pieces:
            fill_box(local[slices(p.local_start, p.size)], p.tensor, spec[p.tensor].shape, p.start, seed)


def fill_sentinel(shards: Shards) -> None:
    for m in shards.memory():
        m.fill_(SENTINEL)


@dataclass(frozen=True)
class Verdict:
    """What `verify` found on one endpoint: elements checked, wrong ones (and the first), and
    ``stray``: padding elements that no longer hold the sentinel (writes where none belong)."""

    checked: int
    mismatches: int
    stray: int
    first: str | None

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.stray == 0


def verify(shards: Shards, spec: ModelSpec, seed: int) -> Verdict:
    """Check every element of every piece bit-exact against the canonical values of ``seed``."""
    checked = bad = stray = 0
    first = None
    for lt in shards.locals:
        local = shards.tensors[lt.name].view(lt.view_shape(_ndim(spec, lt)))
        covered = 0
        for p in lt.pieces:
            n, desc = check_box(local[slices(p.local_start, p.size)], p.tensor, spec[p.tensor].shape, p.start, seed)
            checked += math.prod(p.size)
            covered += math.prod(p.size)
            bad += n
            if desc and first is None:
                first = f"{lt.name}: {desc}"
        if covered < math.prod(lt.shape):
            n = _stray(local, lt)
            stray += n
            if n and first is None:
                first = f"{lt.name}: {n} padding elements were overwritten"
    return Verdict(checked, bad, stray, first)


def _stray(local: torch.Tensor, lt: LocalTensor) -> int:
    """Padding elements (covered by no piece) whose bits differ from the sentinel."""
    mask = torch.ones(local.shape, dtype=torch.bool, device=local.device)
    for p in lt.pieces:
        mask[slices(p.local_start, p.size)] = False
    got = int_view(local)
    sentinel = torch.full((local.element_size(),), SENTINEL, dtype=torch.uint8, device=local.device).view(got.dtype)
    return int((got[mask] != sentinel).sum().item())


def _ndim(spec: ModelSpec, lt: LocalTensor) -> int:
    """The canonical ndim pieces of ``lt`` are expressed in (all pieces of a local agree)."""
    return len(spec[lt.pieces[0].tensor].shape) if lt.pieces else len(lt.shape)


def check_own(ep: Endpoint, tensors: Shards | Mapping[str, torch.Tensor], layout: Layout, spec: ModelSpec,
              device: torch.device | None, who: str, some: bool = False) -> None:
    """Refuse an endpoint's tensors unlike its layout's local tensors (names, shapes, dtypes) or
    off ``device`` (None: any), before anything is shared or bound: a dtype of the same width
    would otherwise take the bits of another, and a wrong shape surface as a torch error mid-bind.
    ``some``: the tensors may be some of the local tensors only."""
    table = tensors.tensors if isinstance(tensors, Shards) else tensors
    names = {v: k for k, v in TORCH_DTYPES.items()}
    found = {n: (tuple(t.shape), names.get(t.dtype, str(t.dtype).removeprefix("torch."))) for n, t in table.items()}
    where = f"{who}: {endpoint_name(ep)} of {layout.describe()}"
    expected = {lt.name: (lt.shape, lt.dtype) for lt in layout.local_tensors(spec, ep[1])}
    derived = getattr(layout, "derived_tensors", None)
    if derived is not None:  # what the executor derives from cut blocks (`refit.executor.shared_blocks`), once added
        expected.update({lt.name: (lt.shape, lt.dtype) for lt in derived(spec, ep[1]) if lt.name in found})
    if some:
        expected = {n: v for n, v in expected.items() if n in found}
    check_tensor_table(found, expected, where)
    for n, t in table.items():
        if device is not None and (t.device.type != device.type
                                   or (device.type == "cuda" and t.device.index != device.index)):
            raise InvalidInput(f"{where}: {n!r} is on {t.device}, this member drives {device}")


def remove_file(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
