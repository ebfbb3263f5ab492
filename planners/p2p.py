"""The shard-to-shard planner: every destination box comes straight from a source rank holding it.

1. Intersect each destination rank's boxes with the distinct source boxes of the same tensor.
2. Among replicas (dp, cp, TP-replicated norms…) pick the source on the destination's own GPU;
   otherwise balance: largest parts first, each to the replica whose GPU has sent least so far
   (the LPT rule, which keeps the largest per-GPU send volume close to its minimum).
3. Split and pack into buckets (`refit.plan.pack_buckets`).
"""

from __future__ import annotations

from planners.base import source_index, sources_for
from refit.boxes import Box, volume
from refit.dtypes import DTYPE_BYTES
from refit.layouts import Layout, all_holdings
from refit.plan import Placement, Plan, Transfer, pack_buckets
from refit.spec import ModelSpec


class P2PPlanner:
    name = "p2p"

    def plan(self, spec: ModelSpec, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int) -> Plan:
        index = source_index(spec, src)
        sgpu, dgpu = placement.src_gpus, placement.dst_gpus
        send = [0] * placement.num_gpus
        chosen: list[tuple[int, int, str, Box]] = []  # (src, dst, tensor, box)
        open_items: list[tuple[int, int, str, Box, list[int]]] = []  # (bytes, dst, tensor, box, candidates)
        parts_cache: dict[tuple[str, Box], list[tuple[Box, list[int]]]] = {}
        for d, held in enumerate(all_holdings(spec, dst)):
            for tensor, boxes in held.items():
                itemsize = DTYPE_BYTES[spec[tensor].dtype]
                for box in boxes:
                    key = (tensor, box)
                    if key not in parts_cache:
                        parts_cache[key] = sources_for(index, tensor, box, f"destination rank {d}")
                    for part, ranks in parts_cache[key]:
                        if len(ranks) == 1:  # the common case at scale (experts): no choice to make
                            s = ranks[0]
                        else:
                            local = [r for r in ranks if sgpu[r] == dgpu[d]]
                            if not local:
                                open_items.append((volume(part[1]) * itemsize, d, tensor, part, ranks))
                                continue
                            s = local[0]
                        chosen.append((s, d, tensor, part))
                        if sgpu[s] != dgpu[d]:
                            send[sgpu[s]] += volume(part[1]) * itemsize
        # Balance the free choices, largest first (stable order on ties keeps plans reproducible).
        for i in sorted(range(len(open_items)), key=lambda i: -open_items[i][0]):
            nbytes, d, tensor, part, ranks = open_items[i]
            s = min(ranks, key=lambda r: (send[sgpu[r]], r))
            send[sgpu[s]] += nbytes
            chosen.append((s, d, tensor, part))
        transfers = [Transfer(1, s, d, tensor, box[0], box[1]) for s, d, tensor, box in chosen]
        tensors = {t.name: (t.dtype, t.shape) for t in spec.tensors}
        transfers, buckets = pack_buckets(transfers, tensors, bucket_bytes, sgpu, dgpu)
        return Plan(spec.name, spec.digest(), src.describe(), dst.describe(), placement, self.name, bucket_bytes,
                    tensors, tuple(transfers), tuple(buckets))
