"""`refit.executor.batch_memcpy` and the bulk split of peer pulls (`copies._split_bulk`).

No GPU here: the CUDA call is replaced by a stand-in that performs each copy with ``memmove``
on host memory, so the arrays handed to the driver (addresses, sizes, count, attributes) are
checked by moving real bytes.  The real calls ran on 2x H200 inside refit-bench (bench/RESULTS.md)."""

from __future__ import annotations

import ctypes

import torch

from refit.executor import batch_memcpy, copies
from refit.executor.memcpys import Memcpy


def _fake_driver(calls: list[dict]):
    def fn(dsts, srcs, sizes, n, attrs, idx, num_attrs, stream):
        a = attrs._obj
        calls.append({"n": n, "stream": stream.value, "order": a.srcAccessOrder, "src": a.srcLocHint.id,
                      "dst": a.dstLocHint.id, "num_attrs": num_attrs, "first": idx[0]})
        for i in range(n):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0
    return fn


def test_batch_moves_every_byte(monkeypatch) -> None:
    calls: list[dict] = []
    monkeypatch.setitem(batch_memcpy._BOUND, "cudaMemcpyBatchAsync", _fake_driver(calls))
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    pieces = [(0, 4096, 1000), (5000, 20000, 3000), (30000, 0, 4096)]  # (dst offset, src offset, bytes)
    b = batch_memcpy.BatchMemcpy([(dst.data_ptr() + d, src.data_ptr() + s, n) for d, s, n in pieces], 1, 0)
    b.launch(1234)
    for d, s, n in pieces:
        assert torch.equal(dst[d:d + n], src[s:s + n])
    assert calls == [{"n": 3, "stream": 1234, "order": 1, "src": 1, "dst": 0, "num_attrs": 1, "first": 0}]
    assert b.nbytes == 8096


def test_error_is_raised(monkeypatch) -> None:
    monkeypatch.setitem(batch_memcpy._BOUND, "cudaMemcpyBatchAsync", lambda *a: 1)
    b = batch_memcpy.BatchMemcpy([(16, 32, 8)], 0, 1)
    try:
        b.launch(0)
    except RuntimeError as e:
        assert "cudaMemcpyBatchAsync of 1 copies (8 bytes) failed: CUDA error 1" in str(e)
    else:
        raise AssertionError("no error")


def test_not_available_without_cuda_13() -> None:
    from refit import settings

    if not torch.cuda.is_available():
        assert not batch_memcpy.available()
    with settings.using(batch_memcpy="off"):
        assert not batch_memcpy.available()


def test_split_bulk_takes_big_flat_copies(monkeypatch) -> None:
    monkeypatch.setitem(batch_memcpy._BOUND, "cudaMemcpyBatchAsync", _fake_driver([]))
    monkeypatch.setattr(batch_memcpy, "available", lambda pitched=False: not pitched)
    big = [Memcpy(1 << 30 | i << 20, 0, 2 << 30 | i << 20, 0, 512 << 10, 1) for i in range(70)]
    pitched = [Memcpy(3 << 30 | i << 20, 1536, 4 << 30 | i << 20, 768, 768, 2048) for i in range(70)]
    flat_2d = [Memcpy(5 << 30, 768, 6 << 30, 768, 768, 1024)]  # equal pitches: one run of bytes
    small = [Memcpy(7 << 30, 0, 8 << 30, 0, 4096, 1)]
    big_rows = [Memcpy(9 << 30, 3 << 20, 10 << 30, 1 << 20, 1 << 20, 3)]  # 3 experts' blocks: 3 copies
    rest, bulk = copies._split_bulk(big + pitched + flat_2d + small + big_rows, 1, 0)
    assert bulk is not None and bulk.n == 74 and len(bulk.parts) == 1
    assert bulk.nbytes == 70 * (512 << 10) + 768 * 1024 + 3 * (1 << 20)
    flat = bulk.parts[0]
    assert [flat._dsts[i] for i in (71, 72, 73)] == [(9 << 30) + r * (3 << 20) for r in range(3)]
    assert [flat._srcs[i] for i in (71, 72, 73)] == [(10 << 30) + r * (1 << 20) for r in range(3)]
    assert rest == pitched + small
    # Few, big copies (merged arena blocks) stay one call each: no table, no batch.
    few, none = copies._split_bulk(big[:3], 1, 0)
    assert few == big[:3] and none is None


def _fake_driver_3d(calls: list[int]):
    def fn(n, ops, flags, stream):
        calls.append(n)
        for i in range(n):
            op = ops[i]
            assert op.src.type == op.dst.type == 1 and op.extent.depth == 1 and op.srcAccessOrder == 1
            for r in range(op.extent.height):
                ctypes.memmove(op.dst.ptr + r * op.dst.rowLength, op.src.ptr + r * op.src.rowLength, op.extent.width)
        return 0
    return fn


def test_pitched_batch_moves_every_byte(monkeypatch) -> None:
    """An expert's column slice (rows of 768 bytes, pitches differ) as one 3-D batch op."""
    calls: list[int] = []
    monkeypatch.setitem(batch_memcpy._BOUND, "cudaMemcpyBatchAsync", _fake_driver([]))
    monkeypatch.setitem(batch_memcpy._BOUND, "cudaMemcpy3DBatchAsync", _fake_driver_3d(calls))
    monkeypatch.setattr(batch_memcpy, "available", lambda pitched=False: True)
    src = torch.randint(-2**15, 2**15, (4, 512, 768), dtype=torch.int16)  # 4 experts [H, I]
    dst = torch.zeros(4, 512, 384, dtype=torch.int16)  # each keeps columns 384.. (its TP half)
    memcpys = [Memcpy(dst[e].data_ptr(), 768, src[e, :, 384:].data_ptr(), 1536, 768, 512) for e in range(4)]
    memcpys *= 20  # enough copies for the table threshold; the repeats rewrite the same bytes
    rest, bulk = copies._split_bulk(memcpys, 1, 0)
    assert rest == [] and bulk is not None and bulk.n == 80 and len(bulk.parts) == 1
    bulk.launch(0)
    assert calls == [80] and torch.equal(dst, src[:, :, 384:])
