"""Where the Triton delta codec spends its time (`refit.executor.delta_kernels`) by block, row and
warps: the count kernel, the scan with its host sync, the gather, and the decode's popcount and
scatter; 256 MiB of bfloat16 words, 4% changed.  ``python bench/probes/delta_kernels_tune.py``
on a GPU; the module's constants are the fastest row found."""

from __future__ import annotations

import time
from typing import Callable

import torch
import triton

from refit.executor import delta_kernels as dk


def timed(fn: Callable[[], object], iters: int = 11) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2] * 1e3


def main() -> None:
    words = 128 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    last = torch.randint(-2**15, 2**15, (words,), dtype=torch.int16, device="cuda", generator=g)
    new = last.clone()
    new[torch.rand(words, device="cuda", generator=g) < 0.04] ^= 3
    copy = torch.empty_like(new)
    print(f"copy {timed(lambda: copy.copy_(new)):.3f} ms")
    want = None
    for block, row, wc, ws in [(2048, 32, 4, 2), (2048, 32, 4, 4), (4096, 32, 4, 4), (2048, 64, 4, 2),
                               (1024, 32, 2, 2), (4096, 32, 8, 4)]:
        blocks = triton.cdiv(words, block)
        counts = torch.empty(blocks, dtype=torch.int32, device="cuda")
        mask = torch.empty(blocks * block // 8, dtype=torch.uint8, device="cuda")
        t_count = timed(lambda: dk._count[(blocks,)](new, last, mask, counts, words, BLOCK=block, num_warps=wc))
        t_scan = timed(lambda: dk._starts(counts))
        starts, changed = dk._starts(counts)
        vals = torch.empty(changed, dtype=torch.int16, device="cuda")
        t_gather = timed(lambda: dk._gather[(blocks,)](new, mask, starts, vals, vals, words, mask.numel(), WRITE_POS=False,
                                                       BLOCK=block, ROW=row, num_warps=ws))
        want = vals.clone() if want is None else want
        cur = last.clone()
        t_pop = timed(lambda: dk._popcount[(blocks,)](mask, counts, mask.numel(), words, BLOCK=block, ROW=row,
                                                      num_warps=ws))
        t_scatter = timed(lambda: dk._scatter[(blocks,)](cur, mask, starts, vals, words, mask.numel(), BLOCK=block,
                                                         ROW=row, num_warps=ws))
        ok = torch.equal(vals, want) and torch.equal(cur, new)
        print(f"block {block} row {row} warps {wc}/{ws}: encode = count {t_count:.3f} + scan {t_scan:.3f} + gather "
              f"{t_gather:.3f} = {t_count + t_scan + t_gather:.3f}; decode = popcount {t_pop:.3f} + scan + scatter "
              f"{t_scatter:.3f} = {t_pop + t_scan + t_scatter:.3f} ms{'' if ok else ' WRONG'}")


if __name__ == "__main__":
    main()
