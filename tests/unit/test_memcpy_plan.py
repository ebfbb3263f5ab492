"""`memcpy_plan` (the copy-engine path of the executor) checked on CPU: the 2-D memcpys it
plans, carried out byte by byte on host memory, must equal torch's own copy — for random views
(slices, steps, transposes) of random tensors.  On GPUs the same descriptors go to
``cudaMemcpy2DAsync``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.executor.memcpys import Memcpy, memcpy_plan


def _desc(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape), t.stride()


def _emulate(calls: list[Memcpy], dst_base: torch.Tensor, src_base: torch.Tensor) -> None:
    """cudaMemcpy2D semantics on the bytes of two CPU storages."""
    d_bytes = dst_base.view(torch.uint8).reshape(-1)
    s_bytes = src_base.view(torch.uint8).reshape(-1)
    d0, s0 = dst_base.data_ptr(), src_base.data_ptr()
    for m in calls:
        for r in range(m.height):
            do, so = m.dst - d0 + r * m.dpitch, m.src - s0 + r * m.spitch
            d_bytes[do:do + m.width] = s_bytes[so:so + m.width]


@st.composite
def views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, tuple[slice, ...], tuple[slice, ...], bool]:
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    view_shape = [draw(st.integers(1, n)) for n in shape]

    def cut(n: int, m: int) -> slice:
        step = draw(st.sampled_from([1, 1, 1, 2])) if m * 2 <= n else 1
        start = draw(st.integers(0, n - (m - 1) * step - 1))
        return slice(start, start + (m - 1) * step + 1, step)

    src_cut = tuple(cut(n, m) for n, m in zip(shape, view_shape))
    dst_shape = [m + draw(st.integers(0, 3)) for m in view_shape]
    dst_cut = tuple(cut(n, m) for n, m in zip(dst_shape, view_shape))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    src = torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=gen)
    dst = torch.randint(-2**15, 2**15, dst_shape, dtype=torch.int16, generator=gen)
    return src, dst, src_cut, dst_cut, draw(st.booleans()) and ndim >= 2


@settings(max_examples=400, deadline=None)
@given(views())
def test_memcpy_plan_equals_torch_copy(case) -> None:
    src, dst, src_cut, dst_cut, transpose = case
    s, d = src[src_cut], dst[dst_cut]
    if transpose and s.shape[-1] == s.shape[-2] and d.shape[-1] == d.shape[-2]:
        s = s.transpose(-1, -2)  # innermost dim no longer contiguous on one side
    expected = dst.clone()
    expected[dst_cut].copy_(s)
    calls = memcpy_plan(_desc(d), _desc(s), s.element_size())
    if calls is None:  # only element-strided innermost dims are left to torch
        inner = [(ds, ss) for n, ds, ss in zip(s.shape, d.stride(), s.stride()) if n != 1][-1]
        assert inner != (1, 1)
        return
    _emulate(calls, dst, src)
    assert torch.equal(dst, expected)


def test_memcpy_plan_collapses_a_grid_of_rows() -> None:
    """[experts, rows, half of the columns]: experts and rows fold into one pitched 2-D copy;
    with a gap between experts on one side, one 2-D copy per expert."""
    src = torch.zeros(4, 8, 6, dtype=torch.int16)
    dst = torch.zeros(4, 8, 3, dtype=torch.int16)
    calls = memcpy_plan(_desc(dst), _desc(src[:, :, 3:]), 2)
    assert calls == [(dst.data_ptr(), 6, src[:, :, 3:].data_ptr(), 12, 6, 32)]
    gapped = torch.zeros(4, 9, 6, dtype=torch.int16)[:, :8, 3:]
    calls = memcpy_plan(_desc(dst), _desc(gapped), 2)
    assert calls is not None and len(calls) == 4
    assert all((m.width, m.height, m.dpitch, m.spitch) == (6, 8, 6, 12) for m in calls)
    # contiguous on both sides: one plain copy of everything
    calls = memcpy_plan(_desc(dst), _desc(dst.clone()), 2)
    assert calls is not None and len(calls) == 1 and calls[0].height == 1 and calls[0].width == dst.numel() * 2


def test_memcpy_plan_refuses_element_strides_and_huge_counts() -> None:
    src = torch.zeros(6, 6, dtype=torch.int16)
    assert memcpy_plan(_desc(src.t().contiguous()), _desc(src.t()), 2) is None
    grid = torch.zeros(10, 10, 2, 4, dtype=torch.int16)[:, :5, :, :2]  # 10 slabs of 10 rows
    assert len(memcpy_plan(_desc(grid.contiguous()), _desc(grid), 2) or []) == 10
    assert memcpy_plan(_desc(grid.contiguous()), _desc(grid), 2, limit=5) is None


def test_engine_split_sends_many_small_copies_to_the_table_and_keeps_big_ones_apart() -> None:
    """`engine_split` on CPU tensors (pure address arithmetic): many small pitched same-GPU copies
    (a pack of 384-byte rows) all become memcpys for one table kernel; a few small ones, or small
    ones beside big ones, stay with torch (unless the big ones run as a table kernel: `join_table`);
    every pull is a memcpy."""
    from refit.executor.copies import DMA_MIN_BYTES, engine_split, join_table

    src = torch.zeros(200, 64, 768, dtype=torch.bfloat16)
    dst = torch.zeros(200, 64, 192, dtype=torch.bfloat16)
    small = [(dst[i], src[i, :, 192:384]) for i in range(200)]  # 24 KiB each, 384-byte rows
    calls, rest = engine_split(small, peer=False)
    assert len(calls) == 200 and rest == []
    assert all(c.width == 384 and c.dpitch == 384 and c.spitch == 1536 and c.height == 64 for c in calls)
    calls, rest = engine_split(small[:10], peer=False)  # too few for a table: torch's copies
    assert calls == [] and len(rest) == 10
    big_src = torch.zeros(DMA_MIN_BYTES // 2, dtype=torch.bfloat16)
    big = (torch.zeros_like(big_src), big_src)
    calls, rest = engine_split(small + [big], peer=False)
    assert len(calls) == 1 and len(rest) == 200
    calls, rest = join_table(calls, rest + [(dst[0, :, ::2], src[0, :, ::8])])  # a table kernel: they join it
    assert len(calls) == 201 and len(rest) == 1  # but the element-strided pair: torch's
    calls, rest = engine_split(small[:10], peer=True)
    assert len(calls) == 10 and rest == []


def test_same_gpu_copies_beside_other_work_take_the_table() -> None:
    """A stage's same-GPU moves with nothing beside them are a table kernel, big or few (it runs
    nearer a device copy than the copy engines); beside a peer table kernel (which fills every SM)
    any of them; beside an NCCL pipeline many of them (their host calls held the pipeline back),
    not a few big ones; other big copies stay on the copy engines.  ``REFIT_TABLE_COPY`` rules."""
    from refit import settings
    from refit.executor import table_copy
    from refit.executor.copies import CopyBatch

    with settings.using(table_copy="auto"):
        big = [Memcpy(dst=(i + 1) << 30, dpitch=1536, src=(i + 200) << 30, spitch=3072, width=1536, height=6144)
               for i in range(table_copy.MIN_CALLS + 1)]  # 9 MiB each: over MAX_MEAN_BYTES
        few = big[:8]
        assert not table_copy.enabled(big) and not table_copy.enabled(few)
        assert table_copy.enabled(few, beside_kernel=True) and table_copy.enabled(big, beside_kernel=True)
        assert table_copy.enabled(big, beside_pipeline=True) and not table_copy.enabled(few, beside_pipeline=True)
        assert not table_copy.enabled([], beside_kernel=True)
        assert table_copy.enabled(few, alone=True) and table_copy.enabled(big, alone=True)
        assert not table_copy.enabled([], alone=True)
        with settings.using(table_copy="off"):
            assert not table_copy.enabled(big, beside_kernel=True) and not table_copy.enabled(big, alone=True)
        cases = [(False, False, False, big, False), (False, False, True, big, True), (False, False, True, few, True),
                 (True, False, False, big, True), (True, False, False, few, False), (False, True, False, few, True)]
        for beside, beside_kernel, alone, memcpys, table in cases:  # the batch asks with its own flags
            batch = CopyBatch([], beside=beside, beside_kernel=beside_kernel, alone=alone)
            batch.memcpys = memcpys
            assert batch.table is table
