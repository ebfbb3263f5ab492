"""The delta codec's Triton kernels on CUDA (`refit.executor.delta_kernels`): `make test-gpu`.

Triton's interpreter (tests/unit/test_delta.py) runs one block at a time, on small buckets; here
the kernels run on a GPU over buckets of thousands of blocks.  Every payload, encoded many times,
must be the torch path's on the CPU byte for byte, and decode back to the new bucket.  Without a
CUDA device every test skips.
"""

from __future__ import annotations

import pytest
import torch

from refit.executor.delta import FULL, decode, encode
from refit.executor.triton_support import triton_importable

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]


@pytest.mark.parametrize("words,word,fraction", [(8_000_000, 2, 0.04), (8_000_000, 2, 0.25), (3_000_001, 2, 0.001),
                                                 (2_000_000, 4, 0.1), (5_000_000, 1, 0.02)])
def test_kernel_payloads_equal_the_cpu_path(words: int, word: int, fraction: float) -> None:
    if not triton_importable("the kernel tests skip"):
        pytest.skip("triton is not installed: the codec on CUDA uses the torch path")
    g = torch.Generator().manual_seed(words + word)
    last = torch.randint(0, 256, (words * word,), dtype=torch.uint8, generator=g)
    new = last.clone()
    pick = torch.rand(words, generator=g) < fraction
    new.view(words, word)[pick] ^= 0x5A
    want_out = torch.empty_like(new)
    want = encode(new, last, word, want_out)
    assert want[0] != FULL
    new_d, last_d = new.cuda(), last.cuda()
    out = torch.empty_like(new_d)
    for _ in range(5):
        out.fill_(0xEE)
        got = encode(new_d, last_d, word, out)
        assert got == want
        assert torch.equal(out[:got[1]].cpu(), want_out[:want[1]])
    cur = last_d.clone()
    decode(out[:got[1]], got[0], got[2], word, cur)
    assert torch.equal(cur.cpu(), new)
