"""The staging window of a phased refit: one buffer that the staged tensors of every phase view.

Any engine whose landing stages tensors it re-processes can use it (vLLM's:
`refit.integrations.vllm.landing`).

A phased plan (`refit.phases`) writes one window of layers after another, and the engine
re-processes each window as soon as it has landed (`refit.engine.landing.Landing.landed`).  So the
staged tensors of different phases are never needed at the same time: they all view ONE uint8
buffer, sized for the phase with the most staged bytes on this rank.  Each view starts at a 64-byte boundary (any
dtype's alignment, and a cache line) and is ``.view(dtype).view(shape)`` of its bytes.

Padding.  Elements of a local tensor that no piece covers (vocab padding rows) are never written
by the data plane; staged separately they stay zero, but in the window they hold whatever the
previous phase wrote there.  `Window.zero_padded` clears them before their phase is written.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from refit.errors import InvalidInput
from refit.layouts import LocalTensor
from refit.spec import ModelSpec

ALIGN = 64


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def local_phase(spec: ModelSpec, lt: LocalTensor, window_layers: int) -> int:
    """The phase key of local tensor ``lt``: the one its pieces' canonical rows fall in (a stacked
    tensor's rows are dim 0 of its pieces' boxes)."""
    from refit.phases import phase_key

    keys = {phase_key(spec, p.tensor, row, window_layers) for p in lt.pieces
            for row in (range(p.start[0], p.start[0] + p.size[0]) if spec[p.tensor].layers else (0,))}
    if len(keys) != 1:
        raise InvalidInput(f"refit: {lt.name} holds rows of {len(keys)} phases ({sorted(keys)}) with window_layers="
                         f"{window_layers}: it cannot be staged one window at a time; use window_layers=0")
    return keys.pop()


def covers_all(lt: LocalTensor) -> bool:
    """Whether the pieces of ``lt`` cover every element of it (no padding)."""
    return sum(math.prod(p.size) for p in lt.pieces) == math.prod(lt.shape)


class Window:
    """Views for ``staged`` local tensors, by phase, into one zeroed buffer on ``device``."""

    def __init__(self, spec: ModelSpec, staged: list[LocalTensor], window_layers: int, device: torch.device) -> None:
        self.phase_of = {lt.name: local_phase(spec, lt, window_layers) for lt in staged}
        offsets: dict[str, int] = {}
        self.phase_nbytes: dict[int, int] = defaultdict(int)  # aligned bytes each phase stages here
        for lt in staged:
            key = self.phase_of[lt.name]
            offsets[lt.name] = self.phase_nbytes[key]
            self.phase_nbytes[key] += aligned(lt.nbytes)
        self.keys = sorted(self.phase_nbytes)
        self.buffer = torch.zeros(max(self.phase_nbytes.values(), default=0), dtype=torch.uint8, device=device)
        self.views: dict[str, torch.Tensor] = {}
        self._padded: dict[int, list[torch.Tensor]] = defaultdict(list)
        for lt in staged:
            start = offsets[lt.name]
            view = self.buffer[start:start + lt.nbytes].view(getattr(torch, lt.dtype)).view(lt.shape)
            self.views[lt.name] = view
            if not covers_all(lt):
                self._padded[self.phase_of[lt.name]].append(view)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def next_key(self, key: int | None) -> int | None:
        """The first phase of this rank after ``key`` (None: the first one), or None."""
        return next((k for k in self.keys if key is None or k > key), None)

    def zero_padded(self, key: int | None) -> None:
        """Zero the staged tensors of phase ``key`` that have padding (before that phase is written)."""
        for view in self._padded.get(key, []) if key is not None else []:
            view.zero_()
