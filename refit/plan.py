"""The plan: a static, serialisable schedule of box transfers, computed once, replayed every step.

A plan names boxes of canonical tensors only.  Each end of a transfer maps the box onto its own
local tensors with its layout (`refit.layouts`), so both ends derive the same byte order — row-major
over the box — and nothing but the plan itself ever needs to be agreed on.

``stage`` orders work: stage 0 moves boxes between *source* ranks (the broadcast baseline gathers
each full tensor on one root that way); stage 1 moves boxes from source ranks to destination ranks.
Transfers are grouped into buckets of at most ``bucket_bytes``, each bucket one (stage, sender, receiver) pair.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from refit.boxes import Index, split_box, volume
from refit.casts import CASTABLE, run_spec
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.quantization import FORMATS, is_quantized
from refit.spec import ModelSpec

PLAN_FORMAT = 1
# Largest transfer bucket when the caller names none (`refit plan`, `make_plan`, the coordinator).
DEFAULT_BUCKET_BYTES = 256 * 2**20
PlacementKind = Literal["colocated", "disaggregated"]
WHOLE = -1  # the phase key of an unphased plan's one phase (`Plan.phase_ranges`, `refit.phases`)


@dataclass(frozen=True)
class Placement:
    """Which GPU each rank of each side runs on.  Colocated: source rank i and destination rank i
    share GPU i.  Disaggregated: sources on GPUs [0, S), destinations on [S, S + D)."""

    kind: PlacementKind
    src_gpus: tuple[int, ...]
    dst_gpus: tuple[int, ...]

    @classmethod
    def make(cls, kind: str, num_src: int, num_dst: int) -> "Placement":
        if kind == "colocated":
            return cls("colocated", tuple(range(num_src)), tuple(range(num_dst)))
        if kind == "disaggregated":
            return cls("disaggregated", tuple(range(num_src)), tuple(range(num_src, num_src + num_dst)))
        raise InvalidInput(f"unknown placement {kind!r}: colocated or disaggregated")

    @property
    def num_gpus(self) -> int:
        return max(self.src_gpus + self.dst_gpus) + 1


class Transfer(NamedTuple):
    stage: int
    sender: int  # a source rank
    receiver: int  # a destination rank at stage 1; at stage 0 another source rank (a gather)
    tensor: str
    start: Index
    size: Index

    @property
    def numel(self) -> int:
        return volume(self.size)


class Bucket(NamedTuple):  # a NamedTuple: a 1T plan makes 6 * 10^4 of them
    stage: int
    sender: int  # as in `Transfer`
    receiver: int
    first: int  # transfers[first:first + count] belong to this bucket
    count: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    model: str
    model_digest: str
    src_layout: str
    dst_layout: str
    placement: Placement
    planner: str
    bucket_bytes: int
    tensors: dict[str, tuple[str, Index]]  # canonical name -> (dtype, shape)
    transfers: tuple[Transfer, ...] = field(repr=False)
    buckets: tuple[Bucket, ...] = field(repr=False)
    # A phased plan (`refit.phases`): layers per phase, and (phase key, first bucket) per phase in
    # run order.  Written out only when phased, so that unphased plans keep their ids.
    phase_layers: int = 0
    phases: tuple[tuple[int, int], ...] = ()
    # Dtype casts on the way (`refit.casts`): tensor -> the trainers' dtype, where it differs from
    # the dtype in ``tensors`` (the engines', which the wire carries).  Written out only when
    # there are some, so that plans without casts keep their ids.
    casts: dict[str, str] = field(default_factory=dict)
    # Quantization on the way (`refit.quantization`): (format, the dtype quantized from) when the
    # engines hold the model quantized and the trainers quantize their shards before sending;
    # ``tensors`` then lists the quantized weights and their scales.  Written out only when set.
    quantization: tuple[str, str] | tuple[()] = ()

    def phase_ranges(self) -> list[tuple[int, int, int]]:
        """(phase key, first bucket, end bucket) of every phase, in run order; an unphased plan is
        one phase, keyed `WHOLE`."""
        if not self.phase_layers:
            return [(WHOLE, 0, len(self.buckets))]
        ends = [first for _, first in self.phases[1:]] + [len(self.buckets)]
        return [(key, first, end) for (key, first), end in zip(self.phases, ends)]

    def spec_for(self, held: ModelSpec, source: bool) -> ModelSpec:
        """The spec a side holding ``held`` runs this plan with: a trainer's with the plan's casts
        applied (`refit.casts`); refused if that is not this plan's model."""
        return run_spec(held, self.casts, {n: dt for n, (dt, _) in self.tensors.items()}, self.model_digest, source,
                        self.quantization)

    def transfer_bytes(self, t: Transfer) -> int:
        return t.numel * DTYPE_BYTES[self.tensors[t.tensor][0]]

    def src_gpu(self, t: Transfer | Bucket) -> int:
        return self.placement.src_gpus[t.sender]

    def dst_gpu(self, t: Transfer | Bucket) -> int:
        gpus = self.placement.src_gpus if t.stage == 0 else self.placement.dst_gpus
        return gpus[t.receiver]

    def is_local(self, t: Transfer | Bucket) -> bool:
        return self.src_gpu(t) == self.dst_gpu(t)

    @functools.cached_property
    def gathers(self) -> bool:
        """Whether stage 1 sends *whole* tensors gathered on source roots (the broadcast baseline):
        a receiver then keeps only the part its pieces cover, and stage 1 reads the roots'
        gathered tensors, not their shards.  Otherwise every box lands whole on its receiver.
        (Cached: the executor asks once per bucket and transfer, and the answer scans every bucket.)"""
        return self.planner == "broadcast" or any(b.stage == 0 for b in self.buckets)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        names = list(self.tensors)
        index = {n: i for i, n in enumerate(names)}
        out: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "model": self.model,
            "model_digest": self.model_digest,
            "src_layout": self.src_layout,
            "dst_layout": self.dst_layout,
            "placement": {"kind": self.placement.kind, "src_gpus": list(self.placement.src_gpus),
                          "dst_gpus": list(self.placement.dst_gpus)},
            "planner": self.planner,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[n, self.tensors[n][0], list(self.tensors[n][1])] for n in names],
            # [stage, sender, receiver, tensor index, start, size]
            # (start/size stay tuples: json writes them as the same arrays, and copying 10^5 of
            # them is a tenth of a 1T-model plan's time)
            "transfers": [(stage, s, d, index[name], start, size) for stage, s, d, name, start, size in self.transfers],
            # [stage, sender, receiver, first transfer, count, bytes]
            "buckets": [list(b) for b in self.buckets],
        }
        if self.phase_layers > 0:
            out["phase_layers"] = self.phase_layers
            out["phases"] = [list(p) for p in self.phases]
        if self.casts:
            out["casts"] = sorted([name, dtype] for name, dtype in self.casts.items())
        if self.quantization:
            out["quantization"] = list(self.quantization)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The plan ``to_dict`` wrote; a malformed one (a plan file edited or cut short, a
        message of another version) is refused with `RefitError` naming what is wrong."""
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise InvalidInput(f"plan format {d.get('format') if isinstance(d, dict) else d!r} is not {PLAN_FORMAT}")
        try:
            names = [n for n, _, _ in d["tensors"]]
            p = d["placement"]
            plan = cls(
                model=d["model"], model_digest=d["model_digest"], src_layout=d["src_layout"],
                dst_layout=d["dst_layout"],
                placement=Placement(p["kind"], tuple(p["src_gpus"]), tuple(p["dst_gpus"])),
                planner=d["planner"], bucket_bytes=d["bucket_bytes"],
                tensors={n: (dt, tuple(shape)) for n, dt, shape in d["tensors"]},
                transfers=tuple(Transfer(s, a, b, names[i], tuple(st), tuple(sz))
                                for s, a, b, i, st, sz in d["transfers"]),
                buckets=tuple(Bucket(*b) for b in d["buckets"]),
                phase_layers=int(d.get("phase_layers", 0)),
                phases=tuple((int(k), int(f)) for k, f in d.get("phases", ())),
                casts={str(n): str(dt) for n, dt in d.get("casts", ())},
                quantization=tuple(str(x) for x in d.get("quantization", ())),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InvalidInput(f"malformed plan: {type(e).__name__} {str(e)[:120]}") from None
        plan.check()
        return plan

    def check(self) -> None:
        """Refuse a plan that contradicts itself: buckets that do not tile the transfers in order,
        a transfer unlike its bucket's (stage, sender, receiver), a rank the placement lacks, a box
        outside its tensor, a byte count that does not add up, phases out of order."""
        if self.placement.kind not in ("colocated", "disaggregated") or not self.placement.src_gpus \
                or not self.placement.dst_gpus or min(self.placement.src_gpus + self.placement.dst_gpus) < 0:
            raise InvalidInput(f"malformed plan: placement {self.placement}")
        if self.bucket_bytes <= 0:
            raise InvalidInput(f"malformed plan: bucket size {self.bucket_bytes}")
        for name, (dtype, shape) in self.tensors.items():
            if dtype not in DTYPE_BYTES or any(type(n) is not int or n < 0 for n in shape):
                raise InvalidInput(f"malformed plan: tensor {name} of {dtype} {list(shape)}")
        if self.quantization and (len(self.quantization) != 2 or self.quantization[0] not in FORMATS
                                  or self.quantization[1] not in CASTABLE):
            raise InvalidInput(f"malformed plan: quantization {list(self.quantization)}")
        for name, dtype in self.casts.items():
            quantized = bool(self.quantization) and is_quantized(name)
            target = self.quantization[1] if quantized else self.tensors.get(name, ("?",))[0]
            if name not in self.tensors or dtype not in CASTABLE or target not in CASTABLE:
                raise InvalidInput(f"malformed plan: cast of {name} from {dtype}")
        ranks = {0: len(self.placement.src_gpus), 1: len(self.placement.dst_gpus)}
        nsrc, tensors, transfers = ranks[0], self.tensors, self.transfers
        end = 0
        for bi, (stage, src, dst, first, count, nbytes) in enumerate(self.buckets):
            if stage not in ranks or not (0 <= src < nsrc and 0 <= dst < ranks[stage]) or first != end or count < 1:
                raise InvalidInput(f"malformed plan: bucket {bi} {list(self.buckets[bi])} (transfers so far {end}, "
                                 f"{nsrc} source and {ranks[1]} destination ranks)")
            end = first + count
            total = 0
            for t in transfers[first:end]:
                dtype, shape = tensors[t.tensor]
                if (t.stage, t.sender, t.receiver) != (stage, src, dst) or len(t.start) != len(shape) \
                        or len(t.size) != len(shape) \
                        or not all(0 <= a and 0 <= n and a + n <= dim for a, n, dim in zip(t.start, t.size, shape)):
                    raise InvalidInput(f"malformed plan: transfer {t} in bucket {bi} of ({stage}, {src}, {dst}), "
                                     f"tensor shape {list(shape)}")
                total += volume(t.size) * DTYPE_BYTES[dtype]
            if total != nbytes:
                raise InvalidInput(f"malformed plan: bucket {bi} says {nbytes} bytes, its transfers add up to {total}")
        if end != len(transfers):
            raise InvalidInput(f"malformed plan: buckets cover {end} of its {len(transfers)} transfers")
        keys, firsts = [k for k, _ in self.phases], [f for _, f in self.phases]
        if self.phase_layers < 0 or (self.phases and not self.phase_layers) \
                or (self.phase_layers and self.buckets and not self.phases) \
                or keys != sorted(set(keys)) or firsts != sorted(set(firsts)) \
                or (firsts and (firsts[0] != 0 or firsts[-1] >= len(self.buckets))):
            raise InvalidInput(f"malformed plan: phases {list(self.phases)[:4]} of {len(self.buckets)} buckets")

    @property
    def plan_hash(self) -> str:
        """Stable hash of everything the plan says: equal plans, equal hashes, on any machine.
        (Not the control plane's ``plan_id``, which `Client.create_plan` returns and
        `Client.refit` takes: that one also names the trainer and engine groups.)"""
        return self._id_and_size[0]

    @property
    def json_bytes(self) -> int:
        """Size of the plan as compact JSON (what `refit plan --out` writes)."""
        return self._id_and_size[1]

    @functools.cached_property
    def _id_and_size(self) -> tuple[str, int]:
        # (check_circular off: to_dict builds a tree, and marking 10^6 arrays costs 10-20% of the dump)
        blob = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True, check_circular=False)
        return hashlib.sha256(blob.encode()).hexdigest()[:16], len(blob)


# Transfers grouped by (stage, sender, receiver), in plan order, and their byte counts (two lists: packing
# then sums and copies a group without a Python step per transfer); one such dict per item size,
# so that packing can put the widest dtype first without sorting every group.
Pairs = dict[tuple[int, int, int], tuple[list[Transfer], list[int]]]


def pack_buckets(transfers: list[Transfer], plan_tensors: dict[str, tuple[str, Index]], bucket_bytes: int,
                 src_gpus: tuple[int, ...], dst_gpus: tuple[int, ...]) -> tuple[list[Transfer], list[Bucket]]:
    """Split transfers to fit ``bucket_bytes`` and pack them, per (stage, sender, receiver) pair and widest
    dtype first, into buckets.  Order: stage, then local copies, then remote pairs in rounds of the GPU distance
    ``(dst_gpu - src_gpu) mod G`` so that in each round every GPU sends to one peer and receives
    from one peer."""
    itemsizes = {n: DTYPE_BYTES[dt] for n, (dt, _) in plan_tensors.items()}
    by_itemsize: dict[int, Pairs] = {}
    for t in transfers:
        itemsize = itemsizes[t.tensor]
        pairs = by_itemsize.setdefault(itemsize, {})
        group = pairs.get((t.stage, t.sender, t.receiver))
        if group is None:
            group = pairs[t.stage, t.sender, t.receiver] = ([], [])
        group[0].append(t)
        group[1].append(volume(t.size) * itemsize)
    return pack_pairs(by_itemsize, bucket_bytes, src_gpus, dst_gpus)


def pack_pairs(by_itemsize: dict[int, Pairs], bucket_bytes: int, src_gpus: tuple[int, ...],
               dst_gpus: tuple[int, ...]) -> tuple[list[Transfer], list[Bucket]]:
    """`pack_buckets` of transfers a planner has already grouped by item size and pair, and sized."""
    num_gpus = max(src_gpus + dst_gpus) + 1
    # Widest dtype first (stable): every transfer in a bucket buffer then starts at a multiple of
    # its own item size (a float32 router bias after a bfloat16 box of odd size would not).
    widest_first = [(itemsize, by_itemsize[itemsize]) for itemsize in sorted(by_itemsize, reverse=True)]

    out_t: list[Transfer] = []
    out_b: list[Bucket] = []
    append = out_t.append
    new = tuple.__new__  # Bucket(...) without the Python-level __new__ of a NamedTuple
    keys = set().union(*by_itemsize.values()) if len(by_itemsize) > 1 else next(iter(by_itemsize.values()), {})
    # stage, then rounds of GPU distance, then GPUs (one rank per GPU and side: no two pairs tie)
    ordered = sorted(((stage, ((src_gpus if stage == 0 else dst_gpus)[d] - src_gpus[s]) % num_gpus, src_gpus[s],
                       (src_gpus if stage == 0 else dst_gpus)[d]), (stage, s, d)) for stage, s, d in keys)
    for _, key in ordered:
        stage, s, d = key
        first, nbytes = len(out_t), 0
        for itemsize, pairs in widest_first:
            group = pairs.get(key)
            if group is None:
                continue
            total = sum(group[1])
            if nbytes + total <= bucket_bytes:  # the common case: the whole group fits the bucket
                out_t.extend(group[0])
                nbytes += total
                continue
            for t, b in zip(*group):
                if nbytes + b > bucket_bytes:
                    if b > bucket_bytes:  # rare: cut into pieces that fit, in row-major order
                        for t, b in _split(t, itemsize, bucket_bytes):
                            if nbytes and nbytes + b > bucket_bytes:
                                out_b.append(new(Bucket, (stage, s, d, first, len(out_t) - first, nbytes)))
                                first, nbytes = len(out_t), 0
                            append(t)
                            nbytes += b
                        continue
                    if nbytes:
                        out_b.append(new(Bucket, (stage, s, d, first, len(out_t) - first, nbytes)))
                        first, nbytes = len(out_t), 0
                append(t)
                nbytes += b
        out_b.append(new(Bucket, (stage, s, d, first, len(out_t) - first, nbytes)))
    return out_t, out_b


def _split(t: Transfer, itemsize: int, bucket_bytes: int) -> list[tuple[Transfer, int]]:
    return [(Transfer(t.stage, t.sender, t.receiver, t.tensor, start, size), volume(size) * itemsize)
            for start, size in split_box((t.start, t.size), max(1, bucket_bytes // itemsize))]


def summarize(plan: Plan, spec: ModelSpec, dst_total_bytes: int, seconds: float | None = None) -> dict[str, Any]:
    """The numbers `refit plan` prints: bytes by kind and the largest per-GPU remote volumes."""
    num_gpus = plan.placement.num_gpus
    send = [0] * num_gpus
    recv = [0] * num_gpus
    local = remote = 0
    src_gpus, dst_gpus = plan.placement.src_gpus, plan.placement.dst_gpus
    for stage, s, d, _, _, nbytes in plan.buckets:  # (`Plan.is_local`, inlined: 10^5 buckets at 1T)
        sg, dg = src_gpus[s], (src_gpus if stage == 0 else dst_gpus)[d]
        if sg == dg:
            local += nbytes
        else:
            remote += nbytes
            send[sg] += nbytes
            recv[dg] += nbytes
    out: dict[str, Any] = {
        "plan_hash": plan.plan_hash,
        "model": plan.model,
        "src": plan.src_layout,
        "dst": plan.dst_layout,
        "placement": plan.placement.kind,
        "planner": plan.planner,
        "num_gpus": num_gpus,
        "total_bytes": dst_total_bytes,
        "local_bytes": local,
        "remote_bytes": remote,
        "max_send_bytes": max(send),
        "max_recv_bytes": max(recv),
        "num_transfers": len(plan.transfers),
        "num_buckets": len(plan.buckets),
        "plan_json_bytes": plan.json_bytes,
        "bucket_bytes": plan.bucket_bytes,
    }
    if plan.phase_layers:
        out["num_phases"] = len(plan.phases)
    if seconds is not None:
        out["plan_seconds"] = round(seconds, 6)
    return out
