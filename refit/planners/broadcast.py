"""The full-tensor broadcast baseline — what most RL frameworks do today.

For every full tensor (each layer's slice of a stacked canonical tensor counts as one): gather it
on one source rank (the root), then send the *whole* tensor to every destination rank that needs
any part of it; the destination keeps its slice.  Roots rotate over the source ranks holding the
largest part, so the gather work is spread.
"""

from __future__ import annotations

from typing import ClassVar

from refit.boxes import Box, intersect, volume
from refit.dtypes import DTYPE_BYTES
from refit.layouts import Layout, all_holdings
from refit.plan import Placement, Plan, Transfer, pack_buckets
from refit.planners.base import source_index, sources_for
from refit.spec import ModelSpec


def full_units(spec: ModelSpec, tensor: str) -> list[Box]:
    """The full tensors frameworks broadcast one by one: one per layer of a stacked tensor."""
    t = spec[tensor]
    if not t.layers:
        return [((0,) * len(t.shape), t.shape)]
    inner = t.shape[1:]
    return [((pos,) + (0,) * len(inner), (1,) + inner) for pos in range(t.shape[0])]


class BroadcastPlanner:
    name: ClassVar[str] = "broadcast"

    def plan(self, spec: ModelSpec, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int) -> Plan:
        index = source_index(spec, src)
        sgpu = placement.src_gpus
        needs: dict[str, list[tuple[int, Box]]] = {}
        for d, held in enumerate(all_holdings(spec, dst)):
            for tensor, boxes in held.items():
                needs.setdefault(tensor, []).extend((d, b) for b in boxes)
        transfers: list[Transfer] = []
        sent = [0] * placement.num_gpus
        for tensor in spec.tensors:
            itemsize = DTYPE_BYTES[tensor.dtype]
            for unit in full_units(spec, tensor.name):
                receivers = sorted({d for d, b in needs.get(tensor.name, ()) if intersect(unit, b)})
                if not receivers:
                    continue
                parts = sources_for(index, tensor.name, unit, f"destination ranks {receivers}")
                # Root: the source rank whose GPU has broadcast the fewest bytes so far.
                holders = sorted({r for _, ranks in parts for r in ranks})
                root = min(holders, key=lambda r: (sent[sgpu[r]], r))
                for part, ranks in parts:
                    if root in ranks:
                        continue
                    s = next((r for r in ranks if sgpu[r] == sgpu[root]), ranks[0])
                    transfers.append(Transfer(0, s, root, tensor.name, part[0], part[1]))
                sent[sgpu[root]] += volume(unit[1]) * itemsize * len(receivers)
                for d in receivers:
                    transfers.append(Transfer(1, root, d, tensor.name, unit[0], unit[1]))
        tensors = {t.name: (t.dtype, t.shape) for t in spec.tensors}
        transfers, buckets = pack_buckets(transfers, tensors, bucket_bytes, sgpu, placement.dst_gpus)
        return Plan(spec.name, spec.digest(), src.describe(), dst.describe(), placement, self.name, bucket_bytes,
                    tensors, tuple(transfers), tuple(buckets))
