"""An atomic refit's switch on CUDA (`refit.executor.values.copy_bits`, what `AgentShare._switch` runs): `make test-gpu`.

The switch puts an engine's staged version in place with one batched copy.  On CUDA a float copy
(`torch._foreach_copy_` of bfloat16) canonicalizes NaN payloads — found by `refit-bench --via grpc
--atomic`, whose random bits include NaNs — so the switch copies integer views; this checks every
bit survives, NaN patterns included.  Without a CUDA device the test skips with its reason.
"""

from __future__ import annotations

import pytest
import torch

from refit.executor.values import copy_bits, int_view

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu runs these on a GPU machine)")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_the_switch_keeps_every_bit(dtype: torch.dtype) -> None:
    shapes = [(1000, 64), (7,), (3, 5, 129), (1 << 20,)]
    live = {f"t{i}": torch.zeros(s, dtype=dtype, device="cuda") for i, s in enumerate(shapes)}
    staged = {n: torch.empty_like(t) for n, t in live.items()}
    for t in staged.values():
        t.view(torch.uint8).random_()  # every byte value: every bit pattern, NaN payloads included
    copy_bits(live, staged)
    for n in live:
        assert torch.equal(int_view(live[n]), int_view(staged[n])), n
