"""`refit.executor.table_copy.table_rows` cuts copies into balanced pieces without changing what
is copied: applied to bytes on the CPU, the pieces give what the original memcpys give."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from refit.executor.memcpys import Memcpy
from refit.executor.table_copy import table_rows


def _apply(rows: list[tuple[int, int, int, int, int, int]], src: bytes, size: int) -> bytearray:
    out = bytearray(size)
    for dst, dp, s, sp, w, h in rows:
        for r in range(h):
            out[dst + r * dp:dst + r * dp + w] = src[s + r * sp:s + r * sp + w]
    return out


@st.composite
def copies(draw: st.DrawFn) -> tuple[list[Memcpy], int]:
    """Disjoint destination slabs in one buffer, sources anywhere in another."""
    out, pos = [], 0
    for _ in range(draw(st.integers(1, 6))):
        width = draw(st.integers(1, 300))
        height = draw(st.integers(1, 9))
        dpitch = width + draw(st.integers(0, 40))
        spitch = width + draw(st.integers(0, 40))
        src = draw(st.integers(0, 500))
        out.append(Memcpy(pos, dpitch, src, spitch, width, height))
        pos += dpitch * height
    return out, pos


@settings(max_examples=200, deadline=None)
@given(copies(), st.sampled_from([16, 64, 100, 1 << 18]))
def test_pieces_copy_what_the_memcpys_copy(case: tuple[list[Memcpy], int], piece: int) -> None:
    memcpys, size = case
    rng = random.Random(size)
    src = bytes(rng.randrange(256) for _ in range(500 + 49 * 340))
    whole = [(m.dst, m.dpitch, m.src, m.spitch, m.width, m.height) for m in memcpys]
    rows = table_rows(memcpys, piece)
    assert _apply(rows, src, size) == _apply(whole, src, size)
    assert all(w * h <= max(piece, w) and w <= piece for _, _, _, _, w, h in rows)


def test_grid_gives_peer_pulls_the_gpu_and_same_gpu_copies_a_slice() -> None:
    """Measured on 2x H200 on 2026-11-22 (bench/RESULTS.md, case
    "qwen3-30b-moe megatron:tp2ep2 → vllm:tp2, 2× H200, CUDA IPC", its history: push instead of pull,
    table-kernel grids): a same-GPU table kernel on a full
    grid beside a peer pull costs 5 ms per refit; the default keeps it to one block per SM.
    (`REFIT_TABLE_BLOCKS`' parsing: tests/unit/test_settings.py.)"""
    from refit import settings
    from refit.executor.table_copy import grid

    with settings.using(**settings.Settings.from_env({}).run_values()):
        assert (grid(peer=True), grid(peer=False), grid(peer=False, beside=True)) == (528, 132, 33)
    with settings.using(table_blocks=(264, 66, 16)):
        assert (grid(peer=True), grid(peer=False), grid(peer=False, beside=True)) == (264, 66, 16)


def test_kernel_source_defaults_are_the_packages_kernel() -> None:
    """The probe of variants (bench/probes/probe_table_kernel.py) and the package compile one template."""
    from refit.executor.table_copy import kernel_source

    src = kernel_source()
    assert "#define UNROLL 4" in src and "typedef unsigned long long IDX;" in src and "copy_table" in src
    assert "typedef unsigned int IDX;" in kernel_source(8, "unsigned int")


def _fake_cupy(monkeypatch, with_from_external: bool) -> list:
    """A stand-in `cupy` module that records how a stream handle was wrapped (cupy needs CUDA)."""
    import sys
    import types

    made: list = []

    class Stream:
        pass

    if with_from_external:
        Stream.from_external = classmethod(lambda cls, obj: made.append(("from_external", obj.__cuda_stream__())) or "s")
    cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=lambda h: made.append(("ExternalStream", h)) or "s")
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return made


def test_cupy_stream_uses_the_stream_protocol_where_cupy_has_it(monkeypatch) -> None:
    from refit.executor.table_copy import cupy_stream

    made = _fake_cupy(monkeypatch, with_from_external=True)
    cupy_stream(0x7F00)
    assert made == [("from_external", (0, 0x7F00))]  # protocol version 0, the raw handle


def test_cupy_stream_falls_back_to_external_stream_on_older_cupy(monkeypatch) -> None:
    from refit.executor.table_copy import cupy_stream

    made = _fake_cupy(monkeypatch, with_from_external=False)
    cupy_stream(0x7F00)
    assert made == [("ExternalStream", 0x7F00)]
