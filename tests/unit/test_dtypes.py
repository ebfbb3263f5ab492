"""Unit tests of refit.dtypes and refit.units: the one dtype table against torch and the
safetensors library themselves, and the one byte formatter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from refit.dtypes import DTYPE_BYTES, DTYPES, FROM_SAFETENSORS, TO_SAFETENSORS
from refit.hf_checkpoint import read_safetensors_header
from refit.units import GiB, KiB, MiB, fmt_bytes


@pytest.mark.parametrize("name", list(DTYPES))
def test_each_dtype_matches_torch_and_the_safetensors_library(tmp_path, name):
    d = DTYPES[name]
    t = getattr(torch, d.torch)
    assert torch.empty(0, dtype=t).element_size() == d.nbytes == DTYPE_BYTES[name]
    assert str(t) == f"torch.{name}"  # refit's names are torch's
    path = str(tmp_path / "one.safetensors")
    save_file({"x": torch.randn(3, 5).to(t)}, path)  # the library writes its own header code
    header = read_safetensors_header(path)
    assert header["x"]["dtype"] == d.safetensors == TO_SAFETENSORS[name]
    assert FROM_SAFETENSORS[d.safetensors] == name
    assert header["x"]["data_offsets"] == [0, 15 * d.nbytes]


def test_fmt_bytes_uses_binary_units():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(KiB) == "1.0 KiB" and fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(256 * MiB) == "256.0 MiB"
    assert fmt_bytes(61_064_245_248) == "56.9 GiB"  # Qwen3-30B-A3B in bf16
    assert fmt_bytes(3 * 1024 * GiB) == "3.0 TiB" and fmt_bytes(5000 * 1024 * GiB) == "5000.0 TiB"
