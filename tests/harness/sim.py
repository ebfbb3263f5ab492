"""A reference run of a plan on numpy arrays, used by the property tests.

Every canonical element gets a unique id (its position among all elements of the model), so a
destination element holding the id of the same canonical index proves it received exactly that
source element.  Write counts prove each element arrived once.
"""

from __future__ import annotations

import numpy as np

from refit.layouts import Layout
from refit.plan import Plan
from refit.regions import PieceIndex, slices
from refit.spec import ModelSpec


def canonical_ids(spec: ModelSpec) -> dict[str, np.ndarray]:
    out, base = {}, 1  # 0 is left for padding
    for t in spec.tensors:
        out[t.name] = np.arange(base, base + t.numel, dtype=np.int64).reshape(t.shape)
        base += t.numel
    return out


def rank_arrays(spec: ModelSpec, layout: Layout, rank: int, canon: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """A rank's local tensors: filled from ``canon`` through the pieces (padding 0), or all -1."""
    out = {}
    for lt in layout.local_tensors(spec, rank):
        arr = np.full(lt.shape, 0 if canon is not None else -1, dtype=np.int64)
        if canon is not None:
            for p in lt.pieces:
                view = arr.reshape(lt.view_shape(len(spec[p.tensor].shape)))
                view[slices(p.local_start, p.size)] = canon[p.tensor][slices(p.start, p.size)]
        out[lt.name] = arr
    return out


def run_plan(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, canon: dict[str, np.ndarray]):
    """Execute ``plan``; returns (destination arrays per rank, write counts per rank)."""
    src_arrays = [rank_arrays(spec, src, r, canon) for r in range(src.world_size)]
    src_index = [PieceIndex(src.local_tensors(spec, r)) for r in range(src.world_size)]
    dst_arrays = [rank_arrays(spec, dst, r, None) for r in range(dst.world_size)]
    dst_index = [PieceIndex(dst.local_tensors(spec, r)) for r in range(dst.world_size)]
    counts = [{k: np.zeros(v.shape, dtype=np.int64) for k, v in d.items()} for d in dst_arrays]
    # Stage-0 staging on a root: canonical-shaped arrays plus a mask of what has arrived.
    staging: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    def ndim(tensor: str) -> int:
        return len(spec[tensor].shape)

    def gather(rank: int, tensor: str, box) -> np.ndarray:
        buf = np.full(box[1], -1, dtype=np.int64)
        filled = np.zeros(box[1], dtype=bool)
        for r in src_index[rank].regions(tensor, box):
            lt = src_index[rank].tensors[r.local]
            local = src_arrays[rank][r.local].reshape(lt.view_shape(ndim(tensor)))
            buf[slices(r.box_start, r.size)] = local[slices(r.local_start, r.size)]
            filled[slices(r.box_start, r.size)] = True
        if (rank, tensor) in staging:
            data, mask = staging[(rank, tensor)]
            sl = slices(*box)
            buf[~filled] = data[sl][~filled]
            filled |= mask[sl]
        assert filled.all(), f"source rank {rank} sends {tensor} {box} it does not hold"
        return buf

    for b in plan.buckets:
        for t in plan.transfers[b.first:b.first + b.count]:
            box = (t.start, t.size)
            buf = gather(t.sender, t.tensor, box)
            if t.stage == 0:
                shape = spec[t.tensor].shape
                data, mask = staging.setdefault((t.receiver, t.tensor), (np.zeros(shape, np.int64), np.zeros(shape, bool)))
                data[slices(*box)] = buf
                mask[slices(*box)] = True
                continue
            for r in dst_index[t.receiver].regions(t.tensor, box):
                lt = dst_index[t.receiver].tensors[r.local]
                vs = lt.view_shape(ndim(t.tensor))
                dst_arrays[t.receiver][r.local].reshape(vs)[slices(r.local_start, r.size)] = buf[slices(r.box_start, r.size)]
                counts[t.receiver][r.local].reshape(vs)[slices(r.local_start, r.size)] += 1
    return dst_arrays, counts


def check_destination(spec: ModelSpec, dst: Layout, canon, dst_arrays, counts) -> None:
    """Every piece element holds its canonical id and was written once; padding never written."""
    for rank in range(dst.world_size):
        expected = rank_arrays(spec, dst, rank, canon)
        for lt in dst.local_tensors(spec, rank):
            covered = np.zeros(lt.shape, dtype=bool)
            for p in lt.pieces:
                covered.reshape(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)] = True
            got, cnt = dst_arrays[rank][lt.name], counts[rank][lt.name]
            bad = covered & (got != expected[lt.name])
            assert not bad.any(), f"rank {rank} {lt.name}: {int(bad.sum())} wrong elements"
            assert (cnt[covered] == 1).all(), f"rank {rank} {lt.name}: element written {cnt[covered].max()} times"
            assert (cnt[~covered] == 0).all(), f"rank {rank} {lt.name}: padding written"
