"""`refit.executor.bound._direct_region`: when a wire is one contiguous region of a tensor."""

from __future__ import annotations

import torch

from refit.executor.bound import _direct_region


def _wire_and_tensor() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(64, dtype=torch.uint8), torch.randint(0, 256, (256,), dtype=torch.uint8)


def test_adjacent_blocks_in_wire_order_are_direct() -> None:
    buf, t = _wire_and_tensor()
    pairs = [(buf[0:16], t[100:116]), (buf[16:64], t[116:164])]
    region = _direct_region(pairs, buf, 64)
    assert region is not None and region.data_ptr() == t[100:].data_ptr() and region.numel() == 64
    region.fill_(7)  # it is the tensor's own memory
    assert bool((t[100:164] == 7).all())


def test_gaps_swaps_strides_and_partial_cover_are_staged() -> None:
    buf, t = _wire_and_tensor()
    other = torch.zeros(64, dtype=torch.uint8)
    assert _direct_region([(buf[0:16], t[0:16]), (buf[16:64], t[20:68])], buf, 64) is None  # gap
    assert _direct_region([(buf[0:16], t[48:64]), (buf[16:64], t[0:48])], buf, 64) is None  # other order
    assert _direct_region([(buf[0:32], t[0:64:2])], buf, 32) is None  # strided local block
    assert _direct_region([(buf[0:16], t[0:16]), (buf[16:64], other[16:64])], buf, 64) is None  # two tensors
    assert _direct_region([(buf[0:32], t[0:32])], buf, 64) is None  # a receiver keeping part of the box
    assert _direct_region([], buf, 64) is None
