"""Batched block copies: thousands of small boxes must not mean thousands of kernel launches.

A `CopyBatch` is built once per plan from (destination view, source view) pairs and replayed
every refit.  Two things cut launches:

1. **Merging.** Blocks of equal shape and strides whose addresses step evenly on both sides (the
   16 expert tensors of a layer in an arena, the layers of a stacked box in a bucket buffer) become
   one strided view with an extra leading dimension.  Passes repeat, so a [layer][expert] grid of
   blocks collapses to a single copy.
2. **Multi-tensor launches.** What remains goes through ``torch._foreach_copy_``: on CUDA the
   list of dense, same-stride pairs is one multi-tensor-apply launch; strided pairs go in a second
   list (torch loops over those).  CPU runs the very same code.

A batch with a ``peer`` device reads from another GPU's memory (the ipc transport).  It runs as
one ``copy_`` per merged pair — torch's cross-device copy: ``cudaMemcpyAsync`` over NVLink (copy
engines) for contiguous pairs, a peer-access kernel for strided ones — issued by
`refit.executor.device.CudaDevice.pull` on a pair of streams of its own.
"""

from __future__ import annotations

from collections import defaultdict

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view)


def _key(dst: torch.Tensor, src: torch.Tensor) -> tuple:
    return (dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(), dst.dtype, src.dtype,
            tuple(dst.shape), dst.stride(), src.stride())


def _merge_pass(pairs: list[Pair]) -> tuple[list[Pair], bool]:
    """One pass: runs of evenly spaced pairs (same key) become one pair with a leading dim."""
    groups: dict[tuple, list[Pair]] = defaultdict(list)
    for d, s in pairs:
        groups[_key(d, s)].append((d, s))
    out: list[Pair] = []
    merged = False
    for items in groups.values():
        items.sort(key=lambda p: (p[0].storage_offset(), p[1].storage_offset()))
        i = 0
        while i < len(items):
            j = i + 1
            if j < len(items):
                dd = items[j][0].storage_offset() - items[i][0].storage_offset()
                ds = items[j][1].storage_offset() - items[i][1].storage_offset()
                while (j < len(items) and dd > 0 and ds >= 0  # as_strided takes no negative strides
                       and items[j][0].storage_offset() - items[j - 1][0].storage_offset() == dd
                       and items[j][1].storage_offset() - items[j - 1][1].storage_offset() == ds):
                    j += 1
            j = max(j, i + 1)
            if j - i == 1:
                out.append(items[i])
            else:
                (d0, s0), n = items[i], j - i
                out.append((d0.as_strided((n,) + tuple(d0.shape), (dd,) + d0.stride(), d0.storage_offset()),
                            s0.as_strided((n,) + tuple(s0.shape), (ds,) + s0.stride(), s0.storage_offset())))
                merged = True
            i = j
    return out, merged


def merge(pairs: list[Pair]) -> list[Pair]:
    """Merge evenly spaced blocks until nothing changes.  Destination blocks must be disjoint
    (each destination element is written once), which makes every merged view exact."""
    pairs = [(d, s) for d, s in pairs if d.numel()]
    for d, s in pairs:
        if d.shape != s.shape or d.dtype != s.dtype:
            raise ValueError(f"copy pair mismatch: {tuple(d.shape)}/{d.dtype} <- {tuple(s.shape)}/{s.dtype}")
    merged = True
    while merged and len(pairs) > 1:
        pairs, merged = _merge_pass(pairs)
    return pairs


class CopyBatch:
    """A fixed set of copies between fixed views; `run` issues them on the current stream."""

    def __init__(self, pairs: list[Pair], do_merge: bool = True, peer: torch.device | None = None) -> None:
        self.peer = peer
        self.blocks = len(pairs)
        pairs = merge(pairs) if do_merge else list(pairs)
        dense = [p for p in pairs if p[0].is_contiguous() and p[1].is_contiguous()]
        strided = [p for p in pairs if not (p[0].is_contiguous() and p[1].is_contiguous())]
        self._lists = [([d for d, _ in ps], [s for _, s in ps]) for ps in (dense, strided) if ps]
        self.copies = len(pairs)
        self.nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        self._pairs = pairs

    def run(self) -> None:
        if self.peer is not None:  # cross-device: plain copy_ per pair (foreach has no such fast path)
            for d, s in self._pairs:
                d.copy_(s)
            return
        for dsts, srcs in self._lists:
            torch._foreach_copy_(dsts, srcs)

    def __repr__(self) -> str:
        return f"CopyBatch({self.blocks} blocks -> {self.copies} copies, {self.nbytes} bytes)"
