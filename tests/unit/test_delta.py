"""The delta codec (`refit.executor.delta`): every encoding decodes to the new bytes exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from refit.executor.delta import FULL, INDEX, MASK, DeltaCache, choose, decode, encode, payload_bytes, word_size


def _pair(words: int, word: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(0, 256, (words * word,), dtype=torch.uint8, generator=g)
    new = last.clone()
    changed = torch.rand(words, generator=g) < fraction
    new.view(words, word)[changed] = torch.randint(0, 256, (int(changed.sum()), word), dtype=torch.uint8, generator=g)
    return new, last


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 3000), word=st.sampled_from([1, 2, 4, 8]), fraction=st.sampled_from([0.0, 0.003, 0.05, 0.5, 1.0]),
       seed=st.integers(0, 2**16))
def test_round_trip_is_bit_exact(words: int, word: int, fraction: float, seed: int) -> None:
    new, last = _pair(words, word, fraction, seed)
    out = torch.empty_like(new)
    mode, nbytes, changed = encode(new, last, word, out)
    assert changed == int((new.view(words, word) != last.view(words, word)).any(1).sum()) or word > 1
    assert nbytes == payload_bytes(mode, words, changed, word) <= new.numel()
    current = last.clone()
    if mode == FULL:
        current.copy_(new)
    elif changed:
        decode(out[:nbytes], mode, changed, word, current)
    assert torch.equal(current, new)


def test_encoding_follows_density() -> None:
    assert choose(10_000, 10, 2) == INDEX  # 10 changes: positions and values
    assert choose(10_000, 3_000, 2) == MASK  # 30%: a bit per word beats 4-byte positions
    assert choose(10_000, 9_800, 2) == FULL  # nearly all: the bytes as they are
    assert choose(10_000, 0, 2) == INDEX and payload_bytes(INDEX, 10_000, 0, 2) == 0


def test_first_refit_is_full() -> None:
    new = torch.arange(64, dtype=torch.uint8)
    assert encode(new, None, 2, torch.empty_like(new)) == (FULL, 64, 32)


def test_word_is_the_narrowest_aligned_element() -> None:
    assert word_size([2, 2], [0, 4096], 8192) == 2  # bfloat16 weights
    assert word_size([1, 4], [0, 128], 256) == 1  # FP8 bytes and float32 scales
    assert word_size([4], [0], 4096) == 4
    assert word_size([2], [0], 6) == 2


def test_cache_keeps_a_copy() -> None:
    cache = DeltaCache()
    sent = torch.arange(16, dtype=torch.uint8)
    cache.keep((0, 3), sent)
    sent.zero_()
    assert cache.get((0, 3), 16)[5] == 5 and cache.get((0, 3), 8) is None and cache.nbytes == 16


def test_delta_refits_over_gloo_land_what_a_full_refit_lands() -> None:
    """Two members in threads, a wire between them (disaggregated: gloo): delta refits of a source
    that changes a little, a lot, and not at all each leave the destination byte for byte as a full
    refit of the same source does, and send less."""
    import uuid

    import torch.distributed as dist

    from refit.executor.member import Budget, Member
    from refit.executor.seating import connect
    from refit.executor.shards import allocate, fill_sentinel, fill_source
    from refit.executor.topology import Topology
    from refit.planners import make_plan
    from refit.sides import Side
    from tests.harness.procs import together
    from tests.unit.test_member import DENSE

    r = make_plan(DENSE, "tp1", "tp2", "disaggregated", "p2p", 4096)
    topo = Topology.one_per_rank(r.plan.placement)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    session = uuid.uuid4().hex[:8]
    src = allocate(list(r.src.local_tensors(DENSE, 0)), torch.device("cpu"))
    dsts = [allocate(list(r.dst.local_tensors(DENSE, k)), torch.device("cpu")) for k in range(2)]
    for d in dsts:
        fill_sentinel(d)
    names = [topo.describe_member(m) for m in range(len(topo.members))]
    own = [{(Side.TRAINER, 0): src}, {(Side.ENGINE, 0): dsts[0]}, {(Side.ENGINE, 1): dsts[1]}]

    def member(m: int) -> Member:
        store = connect("127.0.0.1", master.port, session, 30.0)
        return Member(store, topo, m, "cpu", own[m], DENSE, r.src, r.dst, names, Budget(30.0)).prepare(r.plan)

    members = together([lambda m=m: member(m) for m in range(3)], 60.0)
    assert all(isinstance(m, Member) for m in members), members
    sender = members[0]

    def refit(delta: bool) -> list[bytes]:
        out = together([lambda m=m: m.refit(Budget(20.0), delta=delta) for m in members], 60.0)
        assert all(isinstance(s, float) for s in out), out
        return [bytes(d.memory()[0].numpy().tobytes()) for d in dsts]

    fill_source(src, DENSE, 3)
    first = refit(True)  # nothing sent before: every bucket full
    assert sender.last_delta.delta_buckets == 0 and sender.last_delta.wire_bytes >= sender.last_delta.full_bytes
    g = torch.Generator().manual_seed(0)
    for fraction in (0.01, 0.0, 0.6):
        flat = src.memory()[0].view(torch.int32)
        pick = torch.rand(flat.numel(), generator=g) < fraction
        flat[pick] ^= 0x5A5A
        landed = refit(True)
        stats = sender.last_delta
        assert stats.buckets and stats.full_bytes == sender.last_delta.full_bytes
        if fraction < 0.05:
            assert stats.delta_buckets == stats.buckets and stats.wire_bytes < stats.full_bytes / 4, stats
        assert landed == refit(False), f"delta refit at {fraction} differs from a full refit"
        refit(True)  # the full refit emptied the cache: this one is full again, and fills it
    assert landed != first
    for m in members:
        m.close()


KERNEL_CASE = """
import torch
from refit.executor.delta import FULL, MASK, INDEX, decode, decode_mask_with_kernels, encode, encode_with_kernels
g = torch.Generator().manual_seed(0)
for words, word, fraction in [(5000, 2, 0.01), (5000, 2, 0.3), (4097, 1, 0.05), (333, 4, 0.2), (2048, 8, 0.02),
                              (100, 2, 0.0), (30000, 2, 0.04), (30000, 2, 0.002), (20000, 2, 0.97), (9, 1, 0.5)]:
    last = torch.randint(0, 256, (words * word,), dtype=torch.uint8, generator=g)
    new = last.clone()
    pick = torch.rand(words, generator=g) < fraction
    new.view(words, word)[pick] = torch.randint(0, 256, (int(pick.sum()), word), dtype=torch.uint8, generator=g)
    a, b = torch.empty_like(new), torch.empty_like(new)
    want = encode(new, last, word, a)
    got = encode_with_kernels(new, last, word, b)
    assert want == got, (words, word, fraction, want, got)
    assert torch.equal(a[:want[1]], b[:got[1]]) or want[0] == FULL, (words, word, fraction)
    if got[0] == MASK:
        cur = last.clone()
        decode_mask_with_kernels(b[:got[1]], got[2], word, cur.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]))
        assert torch.equal(cur, new)
print("kernels agree")
"""


def test_triton_kernels_write_the_torch_path_s_payloads() -> None:
    """The CUDA kernels (`refit.executor.delta_kernels`), run by Triton's interpreter on CPU in a
    child process (the interpreter is chosen when triton is imported), give byte for byte the
    payloads of the torch path, and decode them."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", KERNEL_CASE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "kernels agree" in r.stdout, r.stderr[-3000:]
