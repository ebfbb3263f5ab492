"""`refit.control.trainer_wire`: a trainer's tensors cast and quantized for the wire; the weights
drivers quantize on landing keep buffers that hold nothing, and come back quantized for checksums."""

from __future__ import annotations

import torch

from refit.control.trainer_wire import TrainerWire
from refit.executor.quantize import quantize

QUANTIZE = (("fp8", "bfloat16"), {"w": ("w_scale_inv", (2, 1)), "v": ("v_scale_inv", (1, 1))})


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(256, 128, generator=g).to(torch.bfloat16),
            "v": torch.randn(64, 128, generator=g).to(torch.bfloat16),
            "norm": torch.randn(128, generator=g)}


def test_landed_weights_keep_no_bytes_on_the_wire_and_come_back_for_checksums() -> None:
    wire = TrainerWire()
    wire.add("p", {"norm": "bfloat16"}, QUANTIZE)
    tensors = _tensors()
    full = wire.cast("p", tensors)
    q, s = quantize("fp8", tensors["w"])
    assert torch.equal(full["w"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(full["w_scale_inv"], s)
    assert full["norm"].dtype == torch.bfloat16 and wire.unquantized["p"]["w"] is tensors["w"]
    wire.landed["p"] = {"w"}
    sent = wire.cast("p", tensors, {"w"})
    assert sent["w"].shape == (256, 128) and sent["w"].untyped_storage().nbytes() == 1  # no float8 copy kept
    assert sent["w"].data_ptr() != full["w"].data_ptr()  # a new address: the members are built again
    assert sent["v"].data_ptr() == full["v"].data_ptr()
    again = wire.as_sent("p", sent)
    assert torch.equal(again["w"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again["w_scale_inv"], s)
    assert sent["w"].untyped_storage().nbytes() == 1  # the refit's buffers stay as they were
    assert wire.cast("p", tensors, {"w"})["w"].data_ptr() == sent["w"].data_ptr()  # stable: no rebuild each refit
    back = wire.cast("p", tensors)  # no longer landed: a whole buffer again
    assert torch.equal(back["w"].view(torch.uint8), q.view(torch.uint8))
    assert wire.as_sent("p", back) is back


def test_a_one_element_buffer_is_never_a_placeholder() -> None:
    wire = TrainerWire()
    wire.add("p", {}, QUANTIZE)
    tensors = _tensors()
    first = wire.cast("p", tensors, {"v"})["v_scale_inv"]
    assert wire.cast("p", tensors, {"v"})["v_scale_inv"].data_ptr() == first.data_ptr()
