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

from planners.base import source_index, sources_for
from refit.boxes import Box, Index
from refit.dtypes import DTYPE_BYTES
from refit.layouts import Layout, all_holdings
from refit.plan import Pairs, Placement, Plan, Transfer, pack_pairs
from refit.spec import ModelSpec


class P2PPlanner:
    name = "p2p"

    def plan(self, spec: ModelSpec, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int) -> Plan:
        index = source_index(spec, src)
        sgpu, dgpu = placement.src_gpus, placement.dst_gpus
        send = [0] * placement.num_gpus
        # Transfers by item size and (stage, src, dst) pair, in the order they are chosen (what
        # `pack_pairs` takes).
        by_itemsize: dict[int, Pairs] = {}
        # (bytes, dst, tensor, box, candidate sources, item size)
        open_items: list[tuple[int, int, str, Box, list[int], int]] = []
        # (tensor, box) -> its parts: (start, size, bytes, the one source rank or -1, holders, the
        # first holder on each source GPU); dp replicas ask for the same boxes.
        parts_cache: dict[tuple[str, Box], list[tuple[Index, Index, int, int, list[int], dict[int, int]]]] = {}
        new = tuple.__new__  # Transfer(...) without the Python-level __new__ of a NamedTuple: 10^5 of them
        for d, held in enumerate(all_holdings(spec, dst)):
            dg = dgpu[d]
            for tensor, boxes in held.items():
                itemsize = DTYPE_BYTES[spec[tensor].dtype]
                pairs = by_itemsize.setdefault(itemsize, defaultdict(list))
                for box in boxes:
                    parts = parts_cache.get((tensor, box))
                    if parts is None:
                        parts = parts_cache[tensor, box] = [
                            (start, size, prod(size) * itemsize, ranks[0] if len(ranks) == 1 else -1, ranks,
                             {} if len(ranks) == 1 else {sgpu[r]: r for r in reversed(ranks)})
                            for (start, size), ranks in sources_for(index, tensor, box, f"destination rank {d}")]
                    for start, size, nbytes, s, ranks, on_gpu in parts:
                        if s < 0:  # replicas: the one on the destination's GPU, or balance later
                            s = on_gpu.get(dg, -1)
                            if s < 0:
                                open_items.append((nbytes, d, tensor, (start, size), ranks, itemsize))
                                continue
                        pairs[1, s, d].append((new(Transfer, (1, s, d, tensor, start, size)), nbytes))
                        if sgpu[s] != dg:
                            send[sgpu[s]] += nbytes
        # Balance the free choices, largest first (stable order on ties keeps plans reproducible):
        # each to the candidate whose GPU has sent least, the lowest rank on ties (ranks are sorted).
        for nbytes, d, tensor, part, ranks, itemsize in sorted(open_items, key=itemgetter(0), reverse=True):
            s, low = ranks[0], send[sgpu[ranks[0]]]
            for r in ranks:
                if send[sgpu[r]] < low:
                    s, low = r, send[sgpu[r]]
            send[sgpu[s]] += nbytes
            by_itemsize[itemsize][1, s, d].append((Transfer(1, s, d, tensor, part[0], part[1]), nbytes))
        tensors = {t.name: (t.dtype, t.shape) for t in spec.tensors}
        transfers, buckets = pack_pairs(by_itemsize, bucket_bytes, sgpu, dgpu)
        return Plan(spec.name, spec.digest(), src.describe(), dst.describe(), placement, self.name, bucket_bytes,
                    tensors, tuple(transfers), tuple(buckets))
