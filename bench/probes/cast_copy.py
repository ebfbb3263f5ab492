"""How to cast thousands of tensors fastest on a GPU (the trainer side of a plan that casts):
a Python loop of ``copy_`` against ``torch._foreach_copy_`` (one multi-tensor launch per chunk).

    python bench/probes/cast_copy.py     # qwen3-30b-moe[:8]-like: 3072 expert tensors of 768x2048 + 64 big ones
"""

from __future__ import annotations

import time

import torch


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    dev = torch.device("cuda", 0)
    src = [torch.randn(768, 2048, device=dev) for _ in range(3072)] + \
          [torch.randn(4096, 2048, device=dev) for _ in range(64)]
    dst = [torch.empty(t.shape, dtype=torch.bfloat16, device=dev) for t in src]
    nbytes = sum(t.numel() * 6 for t in src)  # 4 read + 2 written per element

    def loop() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    def foreach() -> None:
        torch._foreach_copy_(dst, src)

    for name, fn in (("loop of copy_", loop), ("_foreach_copy_", foreach)):
        ms = timed(fn)
        print(f"{name:>16}: {ms:7.2f} ms for {len(src)} tensors, {nbytes / ms / 1e6:7.1f} GB/s")
    want = [s.to(torch.bfloat16) for s in src[:8]]
    print("foreach equal to .to(bfloat16):", all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                                for a, b in zip(dst[:8], want)))


if __name__ == "__main__":
    main()
