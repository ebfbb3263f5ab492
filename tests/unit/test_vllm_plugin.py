"""The ``refit`` backend's registration and its reading of vLLM configs, without starting an engine."""

from __future__ import annotations

import importlib.util
from importlib.metadata import entry_points

import pytest

from refit.integrations.vllm.config import layout_text, spec_from_hf_config
from refit.layouts import resolve_layout
from refit.sides import Side
from tests.harness.tiny import TINY_CONFIGS, tiny_spec


def test_entry_point_declared() -> None:
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "refit"]
    if not eps:
        pytest.skip("refit is not installed with its metadata (pip install -e .)")
    assert eps[0].value == "refit.integrations.vllm.plugin:register"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_register_is_idempotent_and_lazy() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from refit.integrations.vllm.plugin import BACKEND, register

    register()
    register()  # vLLM loads general plugins more than once per process
    assert BACKEND in WeightTransferEngineFactory._registry
    from refit.integrations.vllm.engine import RefitWeightTransferEngine

    assert WeightTransferEngineFactory._registry[BACKEND]() is RefitWeightTransferEngine


def test_layout_and_spec_from_configs() -> None:
    spec = spec_from_hf_config("m", dict(TINY_CONFIGS["tiny-qwen3-moe"], dtype="float32"), "bfloat16")
    assert spec.digest() == tiny_spec("tiny-qwen3-moe").digest()  # vLLM's dtype wins over the config's
    assert layout_text(2, 1, False) == "vllm:tp2"
    assert layout_text(2, 2, True) == "vllm:tp2ep4dp2"
    assert resolve_layout(layout_text(2, 2, True), spec, Side.ENGINE).describe() == "vllm:tp2ep4dp2"
