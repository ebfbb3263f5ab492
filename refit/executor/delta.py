"""Delta refits: a bucket sent as only the words that changed since the last refit (issue 48).

An RL step moves every float32 master weight a little, but at RL learning rates few of the
engine-dtype (bfloat16) values change: the update crosses a rounding boundary for a few percent of
the elements.  A sender keeps, per bucket, the bytes it last sent (`DeltaCache`); each delta refit
it compares the bucket's new bytes with them, word by word (a word: the narrowest element of the
bucket's transfers, so an FP8 byte or a bfloat16 value is one word), and sends the cheapest of

* ``INDEX``: the changed words' positions (int32, padded to 8 bytes) then their values — few;
* ``MASK``: one bit per word (little-endian within a byte, padded to 8 bytes) then the changed
  values — many;
* ``FULL``: the bucket's bytes as they are — when neither is smaller, or nothing was sent before.

The receiver first fills its bucket buffer with what its destination holds now (the previous
version: the bytes a full refit would overwrite), applies the changed words, and lands the buffer
as a full refit would: the engine's bytes are identical to a full refit's.  That needs the
destination to hold exactly the last version sent — which the control plane guarantees by falling
back to full refits (`refit.control`), and the sender by sending FULL for a bucket it has no
cache of.

Encoding and decoding are torch operations on the buffers' own device (CPU for the tests, the GPU
in production); one host sync per bucket (the count of changed words sizes the message).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from refit.errors import RefitFailed
from refit.executor.copies import CopyBatch, Pair
from refit.executor.triton_support import triton_importable

if TYPE_CHECKING:
    from refit.executor.device import Device
    from refit.executor.transports import Comm

Remaining = Callable[[], float]


class WireStep(Protocol):
    """What a delta refit runs of one step: `refit.executor.bound.BoundStep` is one (bound runs
    the steps through `run_delta_step` and imports this module, so a step is named here by its
    shape)."""

    pack: CopyBatch
    unpack: CopyBatch
    sends: list[tuple[int, int, torch.Tensor]]
    recvs: list[tuple[int, int, torch.Tensor]]
    words: list[int]
    refill: list[Pair]

    def refill_batch(self, dma: bool) -> CopyBatch: ...


class WireStage(Protocol):
    """One stage's steps (`refit.executor.bound.BoundStage`)."""

    @property
    def steps(self) -> Sequence[WireStep]: ...


class Wired(Protocol):
    """A member's bound schedule as `full_stats` counts it (`refit.executor.bound.Bound`)."""

    @property
    def stages(self) -> Sequence[WireStage]: ...


FULL, INDEX, MASK = 0, 1, 2
MODES = {FULL: "full", INDEX: "index", MASK: "mask"}
HEADER_WORDS = 4  # int64: mode, payload bytes, changed words, word size
HEADER_BYTES = HEADER_WORDS * 8
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class DeltaStats:
    """What a (delta) refit sent over the wire, summed over a member's buckets or a whole refit.
    ``full_bytes``: what a full refit sends; ``wire_bytes``: what this one sent (payloads and
    headers); ``words``/``changed``: words compared and words that differed."""

    buckets: int = 0
    delta_buckets: int = 0  # sent as INDEX or MASK (the rest FULL)
    words: int = 0
    changed: int = 0
    wire_bytes: int = 0
    full_bytes: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.words if self.words else 0.0

    def __add__(self, other: "DeltaStats") -> "DeltaStats":
        return DeltaStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_json(self) -> dict[str, float | int]:
        return {"changed_fraction": round(self.changed_fraction, 6), "wire_bytes": self.wire_bytes,
                "full_bytes": self.full_bytes, "delta_buckets": self.delta_buckets, "buckets": self.buckets}


def word_size(itemsizes: list[int], offsets: list[int], nbytes: int) -> int:
    """The word a bucket is compared in: the largest power of two (≤ 8) dividing every transfer's
    element size and byte offset and the bucket's size."""
    g = math.gcd(nbytes, *itemsizes, *offsets) if itemsizes else nbytes
    w = 8
    while w > 1 and g % w:
        w //= 2
    return w


def mask_bytes(words: int) -> int:
    """A MASK payload's bit field: a bit per word, padded to 8 bytes so the values after it stay aligned."""
    return -(-words // 64) * 8


def _positions(changed: int) -> int:
    """An INDEX payload's int32 positions, padded to 8 bytes (aligned values after them)."""
    return -(-changed // 2) * 8


def payload_bytes(mode: int, words: int, changed: int, word: int) -> int:
    if mode == FULL:
        return words * word
    if mode == INDEX:
        return _positions(changed) + changed * word
    return mask_bytes(words) + changed * word


def choose(words: int, changed: int, word: int) -> int:
    """The cheapest encoding of ``changed`` of ``words`` words (ties: the simpler)."""
    sizes = {FULL: payload_bytes(FULL, words, changed, word)}
    if words < 2 ** 31:  # positions are int32
        sizes[INDEX] = payload_bytes(INDEX, words, changed, word)
    sizes[MASK] = payload_bytes(MASK, words, changed, word)
    return min(sizes, key=lambda m: (sizes[m], m))


def _bits(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def encode(new: torch.Tensor, last: torch.Tensor | None, word: int, out: torch.Tensor) -> tuple[int, int, int]:
    """Encode bucket bytes ``new`` (uint8) against ``last`` (the same size, what was sent before;
    None: nothing was) into ``out`` (uint8, at least ``new``'s size).  Returns (mode, payload
    bytes, changed words); for FULL nothing is written to ``out``: send ``new`` itself.  ``last``
    is left alone: the caller refreshes its cache once the bucket is on its way."""
    words = new.numel() // word
    if last is None:
        return FULL, new.numel(), words
    if _kernels(new):
        return encode_with_kernels(new, last, word, out)
    a, b = new.view(_WORD[word]), last.view(_WORD[word])
    diff = a != b
    where = diff.nonzero().squeeze(1)
    changed = where.numel()  # the one host sync: the count sizes the message
    mode = choose(words, changed, word)
    if mode == FULL:
        return FULL, new.numel(), changed
    if mode == INDEX:
        pos = out[:changed * 4].view(torch.int32)
        pos.copy_(where)
        start = _positions(changed)
        out[changed * 4:start].zero_()  # no stray bytes on the wire
    else:
        nmask = mask_bytes(words)
        padded = torch.zeros(nmask * 8, dtype=torch.uint8, device=new.device)
        padded[:words] = diff
        out[:nmask] = (padded.view(nmask, 8) * _bits(new.device)).sum(1, dtype=torch.uint8)
        start = nmask
    vals = out[start:start + changed * word].view(_WORD[word])
    torch.index_select(a, 0, where, out=vals)
    return mode, start + changed * word, changed


def encode_with_kernels(new: torch.Tensor, last: torch.Tensor, word: int, out: torch.Tensor) -> tuple[int, int, int]:
    """`encode` through the Triton kernels (`refit.executor.delta_kernels`): the same payload."""
    from refit.executor import delta_kernels as dk

    a, b = new.view(_WORD[word]), last.view(_WORD[word])
    words = a.numel()
    scratch = torch.empty(-(-words // dk.BLOCK) * (dk.BLOCK // 8), dtype=torch.uint8, device=new.device)
    mask, starts, changed = dk.count_changed(a, b, scratch)
    mode = choose(words, changed, word)
    if mode == FULL:
        return FULL, new.numel(), changed
    if mode == INDEX:
        start = _positions(changed)
        pos = out[:changed * 4].view(torch.int32)
        out[changed * 4:start].zero_()
    else:
        start = mask_bytes(words)
        out[:start].copy_(mask[:start])
        pos = None
    if changed:
        dk.gather(a, mask, starts, out[start:start + changed * word].view(_WORD[word]), pos)
    return mode, start + changed * word, changed


def decode(payload: torch.Tensor, mode: int, changed: int, word: int, current: torch.Tensor) -> None:
    """Apply an INDEX or MASK ``payload`` (uint8) to ``current`` (uint8 bucket bytes holding the
    previous version), in place."""
    cur = current.view(_WORD[word])
    words = cur.numel()
    if mode == MASK and _kernels(current):
        decode_mask_with_kernels(payload, changed, word, cur)
        return
    if mode == INDEX:
        where = payload[:changed * 4].view(torch.int32).long()
        start = _positions(changed)
    elif mode == MASK:
        nmask = mask_bytes(words)
        bits = payload[:nmask].unsqueeze(1).bitwise_and(_bits(payload.device)).ne(0).view(-1)[:words]
        where = bits.nonzero().squeeze(1)
        start = nmask
        if where.numel() != changed:
            raise ValueError(f"delta: mask holds {where.numel()} changed words, header says {changed}")
    else:
        raise ValueError(f"delta: no payload to apply for mode {MODES.get(mode, mode)}")
    vals = payload[start:start + changed * word].view(_WORD[word])
    cur.index_copy_(0, where, vals)


def decode_mask_with_kernels(payload: torch.Tensor, changed: int, word: int, cur: torch.Tensor) -> None:
    """A MASK payload applied through the Triton kernels (`refit.executor.delta_kernels`)."""
    from refit.executor import delta_kernels as dk

    nmask = mask_bytes(cur.numel())
    wrote = dk.scatter_masked(cur, payload[:nmask], payload[nmask:nmask + changed * word].view(_WORD[word]))
    if wrote != changed:
        raise ValueError(f"delta: mask holds {wrote} changed words, header says {changed}")


def _kernels(t: torch.Tensor) -> bool:
    """The Triton path: CUDA buffers of fewer than 2**31 words (int32 positions), Triton present."""
    return t.is_cuda and t.numel() < 2 ** 31 and triton_importable("delta refits on CUDA use the torch path")


class DeltaCache:
    """A sender's copy of the bytes it last sent, per bucket (keyed by the caller: phase and
    bucket).  Lives on the buffers' device: engine-dtype bytes of everything the member sends over
    a wire (2 bytes per bfloat16 parameter).  Emptied when a refit fails or runs full without it."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, key: tuple[int, int], nbytes: int) -> torch.Tensor | None:
        t = self.last.get(key)
        return t if t is not None and t.numel() == nbytes else None

    def keep(self, key: tuple[int, int], sent: torch.Tensor) -> None:
        t = self.last.get(key)
        if t is None or t.numel() != sent.numel() or t.device != sent.device:
            t = self.last[key] = torch.empty_like(sent)
        t.copy_(sent)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.last.values())

    def clear(self) -> None:
        self.last.clear()


# --------------------------------------------------------------------------------------------- in a refit


@dataclass
class DeltaRun:
    """One delta refit of one phase: the member's cache of what it last sent (`DeltaCache`,
    keyed ``(phase, bucket)``), whether this refit may encode against it (``on``: else every bucket
    goes FULL and refreshes the cache), and what was sent (``stats``)."""

    cache: DeltaCache
    phase: int
    on: bool
    stats: DeltaStats = field(default_factory=DeltaStats)
    scratch: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def buffer(self, side: str, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        t = self.scratch.get((side, slot))
        if t is None or t.numel() < nbytes:
            t = self.scratch[(side, slot)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t[:nbytes]


HEADER_TAG = 1 << 28  # gloo tags of the headers, apart from the buckets' own


def run_delta_step(step: WireStep, comm: "Comm", device: "Device", deadline: float, remaining: Remaining,
                   delta: DeltaRun) -> None:
    """One step of a delta refit, in three exchanges: pack and encode every send against the cache
    (`refit.executor.delta.encode`); swap headers (mode, payload bytes, changed words, word); fill
    the receive buffers that get a delta with what their blocks hold, swap the payloads, apply
    them (`decode`), unpack as a full refit does.  The engine's bytes end as a full refit's."""
    done = lambda: device.finish(deadline, comm.check, comm.stuck)  # noqa: E731  bounded by the deadline
    device.copy(step.pack)
    done()
    heads_out, payloads = [], []
    for i, ((peer, tag, buf), word) in enumerate(zip(step.sends, step.words)):
        key = (delta.phase, tag)
        last = delta.cache.get(key, buf.numel()) if delta.on else None
        out = delta.buffer("send", i, buf.numel(), buf.device)
        mode, nbytes, changed = encode(buf, last, word, out)
        payloads.append((peer, tag, buf if mode == FULL else out[:nbytes]))
        heads_out.append((peer, tag + HEADER_TAG,
                          torch.tensor([mode, nbytes, changed, word], dtype=torch.int64, device=buf.device)))
        delta.cache.keep(key, buf)
        s = delta.stats
        s.buckets += 1
        s.delta_buckets += mode != FULL
        s.words += buf.numel() // word
        s.changed += changed
        s.full_bytes += buf.numel()
        s.wire_bytes += nbytes + HEADER_BYTES
    heads_in = [(peer, tag + HEADER_TAG, torch.empty(HEADER_WORDS, dtype=torch.int64, device=buf.device))
                for peer, tag, buf in step.recvs]
    _settle(device)
    remaining()
    comm.wait(comm.post(heads_out, heads_in), remaining())
    done()
    heads = [tuple(int(x) for x in h.tolist()) for _, _, h in heads_in]
    if any(h[0] != FULL for h in heads) and step.refill:
        device.copy(step.refill_batch(device.torch.type == "cuda"))
        done()
    recvs = []
    for i, ((peer, tag, buf), (mode, nbytes, _, _)) in enumerate(zip(step.recvs, heads)):
        if mode == FULL and nbytes != buf.numel():
            raise RefitFailed(f"delta: bucket {tag} arrives with {nbytes} bytes, the plan says {buf.numel()}")
        into = buf if mode == FULL else delta.buffer("recv", i, nbytes, buf.device)
        if nbytes:
            recvs.append((peer, tag, into))
    sends = [p for p in payloads if p[2].numel()]
    remaining()
    comm.wait(comm.post(sends, recvs), remaining())
    done()
    for i, ((_, tag, buf), (mode, nbytes, changed, word)) in enumerate(zip(step.recvs, heads)):
        if mode != FULL and changed:
            decode(delta.buffer("recv", i, nbytes, buf.device), mode, changed, word, buf)
    _settle(device)
    device.copy(step.unpack)
    done()


def full_stats(bound: Wired) -> DeltaStats:
    """What a full refit of ``bound`` sends over its wires, counted as `run_delta_step` counts."""
    sent = [(buf.numel(), word) for st in bound.stages for step in st.steps
            for (_, _, buf), word in zip(step.sends, step.words)]
    nbytes, words = sum(n for n, _ in sent), sum(n // w for n, w in sent)
    return DeltaStats(buckets=len(sent), words=words, changed=words, wire_bytes=nbytes, full_bytes=nbytes)


def _settle(device: "Device") -> None:
    """Let this thread's stream finish what it issued (encode, decode: torch ops on the current
    stream) before the copy and comm streams touch the same buffers."""
    if device.torch.type == "cuda":
        torch.cuda.current_stream(device.torch).synchronize()
