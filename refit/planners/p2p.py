"""The shard-to-shard planner: every destination box comes straight from a source rank holding it.

1. Intersect each destination rank's boxes with the distinct source boxes of the same tensor.
2. Among replicas (dp, cp, TP-replicated norms…) pick the source on the destination's own GPU;
   otherwise balance: largest parts first, each to the replica whose GPU has sent least so far
   (the LPT rule, which keeps the largest per-GPU send volume close to its minimum).
3. Split and pack into buckets (`refit.plan.pack_pairs`).
"""

from __future__ import annotations

from collections import defaultdict
from math import prod
from operator import itemgetter
from typing import ClassVar

from refit.boxes import Box, Index
from refit.dtypes import DTYPE_BYTES
from refit.layouts import Layout, all_holdings
from refit.plan import Pairs, Placement, Plan, Transfer, pack_pairs
from refit.planners.base import source_index, source_parts
from refit.spec import ModelSpec


def _group() -> tuple[list[Transfer], list[int]]:
    return [], []


class P2PPlanner:
    name: ClassVar[str] = "p2p"

    def plan(self, spec: ModelSpec, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int) -> Plan:
        index = source_index(spec, src)
        sgpu, dgpu = placement.src_gpus, placement.dst_gpus
        send = [0] * placement.num_gpus
        # Transfers by item size and (stage, sender, receiver) pair, in the order they are chosen (what
        # `pack_pairs` takes).
        by_itemsize: dict[int, Pairs] = {}
        # (bytes, dst, tensor, box, candidate sources, item size)
        open_items: list[tuple[int, int, str, Box, list[int], int]] = []
        # (tensor, box) -> its parts (start, size, holders): dp replicas ask for the same boxes
        parts_cache: dict[tuple[str, Box], list[tuple[Index, Index, list[int]]]] = {}
        on_gpu: dict[int, dict[int, int]] = {}  # id(holders) -> source GPU -> first holder on it
        new = tuple.__new__  # Transfer(...) without the Python-level __new__ of a NamedTuple: 10^5 of them
        for d, held in enumerate(all_holdings(spec, dst)):
            dg = dgpu[d]
            rows: dict[int, dict[int, tuple[list[Transfer], list[int]]]] = {}  # item size -> src -> to d
            for tensor, boxes in held.items():
                itemsize = DTYPE_BYTES[spec[tensor].dtype]
                row = rows.get(itemsize)
                if row is None:
                    row = rows[itemsize] = defaultdict(_group)
                for box in boxes:
                    parts = parts_cache.get((tensor, box))
                    if parts is None:
                        parts = parts_cache[tensor, box] = source_parts(index, tensor, box, f"destination rank {d}")
                    for start, size, ranks in parts:
                        if len(ranks) == 1:  # the common case at scale (experts): no choice to make
                            s = ranks[0]
                        else:  # replicas: the one on the destination's GPU, or balance later
                            gpus = on_gpu.get(id(ranks))
                            if gpus is None:
                                gpus = on_gpu[id(ranks)] = {sgpu[r]: r for r in reversed(ranks)}
                            s = gpus.get(dg, -1)
                            if s < 0:
                                open_items.append((prod(size) * itemsize, d, tensor, (start, size), ranks, itemsize))
                                continue
                        group = row[s]
                        group[0].append(new(Transfer, (1, s, d, tensor, start, size)))
                        group[1].append(prod(size) * itemsize)
            for itemsize, row in rows.items():
                pairs = by_itemsize.setdefault(itemsize, {})
                for s, transfers in row.items():
                    pairs[1, s, d] = transfers
        if open_items:  # what each GPU sends so far, from the choices made (summed per pair)
            for pairs in by_itemsize.values():
                for (_, s, d), (_, sizes) in pairs.items():
                    if sgpu[s] != dgpu[d]:
                        send[sgpu[s]] += sum(sizes)
        # Balance the free choices, largest first (stable order on ties keeps plans reproducible):
        # each to the candidate whose GPU has sent least, the lowest rank on ties (ranks are sorted).
        for nbytes, d, tensor, part, ranks, itemsize in sorted(open_items, key=itemgetter(0), reverse=True):
            s, low = ranks[0], send[sgpu[ranks[0]]]
            for r in ranks:
                if send[sgpu[r]] < low:
                    s, low = r, send[sgpu[r]]
            send[sgpu[s]] += nbytes
            group = by_itemsize[itemsize].setdefault((1, s, d), _group())
            group[0].append(Transfer(1, s, d, tensor, *part))
            group[1].append(nbytes)
        tensors = {t.name: (t.dtype, t.shape) for t in spec.tensors}
        transfers, buckets = pack_pairs(by_itemsize, bucket_bytes, sgpu, dgpu)
        return Plan(spec.name, spec.digest(), src.describe(), dst.describe(), placement, self.name, bucket_bytes,
                    tensors, tuple(transfers), tuple(buckets))
