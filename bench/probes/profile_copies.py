"""Copy primitives on one or two GPUs, timed with CUDA events (one process; needs cupy).

What the executor can choose between, at the sizes of a qwen3-30b-moe refit (expert down-proj
halves are rows of 768 bytes, 1536 bytes apart):

* same GPU, contiguous:   ``copy_`` (cudaMemcpyAsync) vs ``torch._foreach_copy_`` over 2 MiB
                          chunks (the multi-tensor kernel) vs cupy ``memcpyAsync``
* same GPU, pitched rows: torch ``copy_`` (elementwise kernel) vs one ``cudaMemcpy2DAsync``
* GPU 1 -> GPU 0 (NVLink), contiguous and pitched: a memcpy on the *destination's* stream
  (pull), on the *source's* stream (push), and torch's cross-device ``copy_``; then both
  directions at once.

Run: python bench/probes/profile_copies.py [GiB per case, default 4]
"""

from __future__ import annotations

import statistics
import sys

import torch

GiB = 2**30


def timed(fn, streams: list[torch.cuda.Stream], reps: int = 5) -> float:
    """Median seconds of ``fn()`` (which issues work on ``streams``), fenced by events."""
    out = []
    for _ in range(reps + 1):
        for s in streams:
            s.synchronize()
        start = [torch.cuda.Event(enable_timing=True) for _ in streams]
        end = [torch.cuda.Event(enable_timing=True) for _ in streams]
        for e, s in zip(start, streams):
            e.record(s)
        fn()
        for e, s in zip(end, streams):
            e.record(s)
        for e in end:
            e.synchronize()
        out.append(max(a.elapsed_time(b) for a, b in zip(start, end)) / 1e3)
    return statistics.median(out[1:])


def main() -> None:
    from cupy.cuda import runtime

    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    n = int(gib * GiB) // 2  # int16 elements
    D = runtime.memcpyDefault
    ngpu = torch.cuda.device_count()
    s0 = torch.cuda.Stream(0)
    rows = n // 768  # pitched case: rows of 384 int16 out of 768

    def report(name: str, nbytes: int, sec: float) -> None:
        print(f"{name:58s} {sec * 1e3:8.2f} ms  {nbytes / sec / 1e9:8.1f} GB/s", flush=True)

    a = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, device="cuda:0")
    b = torch.empty_like(a)
    nb = n * 2
    with torch.cuda.stream(s0):
        report("same GPU contiguous: copy_", nb, timed(lambda: b.copy_(a), [s0]))
        chunks = 2**20  # 2 MiB of int16
        da, db = list(a.split(chunks)), list(b.split(chunks))
        report(f"same GPU contiguous: _foreach_copy_ ({len(da)} chunks)", nb, timed(lambda: torch._foreach_copy_(db, da), [s0]))
    report("same GPU contiguous: cupy memcpyAsync", nb,
           timed(lambda: runtime.memcpyAsync(b.data_ptr(), a.data_ptr(), nb, D, s0.cuda_stream), [s0]))
    src2 = a[: rows * 768].view(rows, 768)
    dst2 = torch.empty(rows, 384, dtype=torch.int16, device="cuda:0")
    half = rows * 384 * 2
    with torch.cuda.stream(s0):
        report("same GPU pitched rows (768 B of 1536): copy_ kernel", half, timed(lambda: dst2.copy_(src2[:, :384]), [s0]))
    report("same GPU pitched rows: memcpy2DAsync", half,
           timed(lambda: runtime.memcpy2DAsync(dst2.data_ptr(), 768, src2.data_ptr(), 1536, 768, rows, D, s0.cuda_stream), [s0]))
    assert torch.equal(dst2, src2[:, :384])
    if ngpu < 2:
        return

    with torch.cuda.device(0):
        try:
            runtime.deviceEnablePeerAccess(1)
        except runtime.CUDARuntimeError:
            pass
    with torch.cuda.device(1):
        try:
            runtime.deviceEnablePeerAccess(0)
        except runtime.CUDARuntimeError:
            pass
    s1 = torch.cuda.Stream(1)
    r = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, device="cuda:1")  # on GPU 1
    r2 = r[: rows * 768].view(rows, 768)
    back = torch.empty_like(r)  # on GPU 1, receives from GPU 0

    report("peer 1->0 contiguous: memcpy on dst stream (pull)", nb,
           timed(lambda: runtime.memcpyAsync(b.data_ptr(), r.data_ptr(), nb, D, s0.cuda_stream), [s0]))
    report("peer 1->0 contiguous: memcpy on src stream (push)", nb,
           timed(lambda: runtime.memcpyAsync(b.data_ptr(), r.data_ptr(), nb, D, s1.cuda_stream), [s1]))
    report("both ways contiguous: pulls on each dst stream", 2 * nb,
           timed(lambda: (runtime.memcpyAsync(b.data_ptr(), r.data_ptr(), nb, D, s0.cuda_stream),
                          runtime.memcpyAsync(back.data_ptr(), a.data_ptr(), nb, D, s1.cuda_stream)), [s0, s1]))
    report("both ways contiguous + same-GPU copy on each GPU", 2 * nb,
           timed(lambda: _both_plus_local(runtime, a, b, r, back, nb, D, s0, s1), [s0, s1]))
    with torch.cuda.stream(s1):
        report("peer 1->0 pitched: torch copy_ (kernel on GPU 1)", half, timed(lambda: dst2.copy_(r2[:, :384]), [s1]))
    report("peer 1->0 pitched: memcpy2D on dst stream (pull)", half,
           timed(lambda: runtime.memcpy2DAsync(dst2.data_ptr(), 768, r2.data_ptr(), 1536, 768, rows, D, s0.cuda_stream), [s0]))
    assert torch.equal(dst2, r2[:, :384].to("cuda:0"))
    report("peer 1->0 pitched: memcpy2D on src stream (push)", half,
           timed(lambda: runtime.memcpy2DAsync(dst2.data_ptr(), 768, r2.data_ptr(), 1536, 768, rows, D, s1.cuda_stream), [s1]))
    for width in (1536, 3072):  # wider rows, same bytes: how much does row width matter?
        h = half // width
        report(f"peer 1->0 pitched, rows of {width} B: memcpy2D pull", h * width,
               timed(lambda: runtime.memcpy2DAsync(b.data_ptr(), width, r.data_ptr(), 2 * width, width, h, D, s0.cuda_stream), [s0]))


def _both_plus_local(runtime, a, b, r, back, nb, D, s0, s1) -> None:
    runtime.memcpyAsync(b.data_ptr(), r.data_ptr(), nb, D, s0.cuda_stream)
    runtime.memcpyAsync(back.data_ptr(), a.data_ptr(), nb, D, s1.cuda_stream)
    # a same-GPU copy of the same size on other streams of each GPU (a colocated refit's local half)
    for dev, x in ((0, a), (1, r)):
        s = _side_stream(dev)
        y = _scratch(dev, x)
        runtime.memcpyAsync(y.data_ptr(), x.data_ptr(), nb, D, s.cuda_stream)
    for dev in (0, 1):
        (s0 if dev == 0 else s1).wait_stream(_side_stream(dev))


_SIDE: dict[int, torch.cuda.Stream] = {}
_SCRATCH: dict[int, torch.Tensor] = {}


def _side_stream(dev: int) -> torch.cuda.Stream:
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


def _scratch(dev: int, like: torch.Tensor) -> torch.Tensor:
    if dev not in _SCRATCH:
        _SCRATCH[dev] = torch.empty_like(like)
    return _SCRATCH[dev]


if __name__ == "__main__":
    main()
