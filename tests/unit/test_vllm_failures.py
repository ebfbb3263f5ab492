"""`refit.integrations.vllm.failures`: a refit error raised in a vLLM worker keeps its type for
the RL loop through the texts vLLM's processes wrap it in (its engine core's and, TP > 1, its
multiprocessing executor's), and nothing else is taken for one.  The live check, through real
vLLM processes, is tests/integration/test_vllm_backend.py
``test_a_failed_refit_reaches_the_loop_by_type_through_vllm_processes``."""

from __future__ import annotations

import pytest

from refit.errors import InvalidInput, RefitError, RefitFailed
from refit.integrations.vllm.failures import carried, refit_error_of, refit_errors


def raised_in_worker(error: RefitError) -> RefitError:
    with pytest.raises(type(error)) as e:
        with carried():
            raise error
    return e.value


@pytest.mark.parametrize("error", [RefitFailed("refit p version 3 failed: trainer/1 disconnected: killed\nmore"),
                                   InvalidInput("refit: update_info atomic needs an engine that stages whole versions")])
def test_a_refit_error_keeps_its_type_and_message_through_vllm(error: RefitError) -> None:
    message = str(error)
    worker = raised_in_worker(error)
    assert type(worker) is type(error)  # unchanged in one process, its message marked
    # vLLM's engine core (v1/engine/core.py), then TP > 1's executor inside it (multiproc_executor.py)
    for text in (f"Call to collective_rpc method failed: {worker}",
                 f"Call to collective_rpc method failed: Worker failed with error '{worker}', please check the "
                 f"stack trace above for the root cause"):
        with pytest.raises(type(error)) as e:
            with refit_errors():
                raise Exception(text)  # what vLLM's client raises in the loop
        assert str(e.value) == message and isinstance(e.value.__cause__, Exception)
    with pytest.raises(type(error)) as e:  # in one process: the worker's exception itself, unmarked
        with refit_errors():
            raise worker
    assert str(e.value) == message
    assert str(raised_in_worker(worker)) == str(worker)  # marked once


def test_other_errors_pass_through() -> None:
    assert refit_error_of(RuntimeError("Call to collective_rpc method failed: CUDA out of memory")) is None
    with pytest.raises(KeyError):
        with refit_errors():
            raise KeyError("x")
