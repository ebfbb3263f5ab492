"""The test harness's own guards (tests/harness/procs.py, marks.py, run_cache.py): a helper
process that dies fails the waiting test at once, quoting its log; a test that starts a vLLM
engine without the ``vllm`` marker fails; checkpoint digests depend on content only."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import pytest

from tests.harness import marks
from tests.harness.procs import ProcessDied, recv_answer, spawn_logged
from tests.harness.run_cache import checkpoint_digest

CTX = mp.get_context("spawn")


def _dies(conn, code: int) -> None:
    print("about to fail: the last words", flush=True)
    sys.stderr.write("a line on stderr\n")
    sys.stderr.flush()
    os._exit(code)


def _answers(conn) -> None:
    conn.send(("ok", 42))
    os._exit(0)  # gone right after its answer: the answer still counts


def test_a_dead_process_fails_the_wait_at_once_with_its_log() -> None:
    parent, child = CTX.Pipe()
    proc, log = spawn_logged(CTX, _dies, (child, 3), "guard")
    t0 = time.monotonic()
    with pytest.raises(ProcessDied, match=r"(?s)exit code 3.*the last words.*a line on stderr"):
        recv_answer(parent, proc, 300, "helper", log)
    assert time.monotonic() - t0 < 60  # not the 300 s timeout


def test_an_answer_sent_before_exiting_is_read() -> None:
    parent, child = CTX.Pipe()
    proc, log = spawn_logged(CTX, _answers, (child,), "guard")
    assert recv_answer(parent, proc, 60, "helper", log) == ("ok", 42)
    proc.join(10)


class _Item:
    nodeid = "tests/x.py::test_y"

    def __init__(self, marked: bool) -> None:
        self.marked = marked

    def get_closest_marker(self, name: str):
        return object() if self.marked and name == "vllm" else None


def test_an_engine_start_in_a_test_without_the_vllm_mark_fails() -> None:
    try:
        marks.set_item(_Item(marked=False))
        with pytest.raises(pytest.fail.Exception, match="not marked `vllm`"):
            marks.require_vllm_mark()
        marks.set_item(_Item(marked=True))
        marks.require_vllm_mark()  # passes
        marks.set_item(None)
        marks.require_vllm_mark()  # outside pytest's tests: no check
    finally:
        marks.set_item(None)


def test_checkpoint_digest_is_content_only(tmp_path) -> None:
    for d, extra in (("a", b""), ("b", b""), ("c", b"x")):
        os.makedirs(tmp_path / d)
        (tmp_path / d / "config.json").write_bytes(b"{}")
        (tmp_path / d / "model.safetensors").write_bytes(b"weights" + extra)
    assert checkpoint_digest(str(tmp_path / "a")) == checkpoint_digest(str(tmp_path / "b"))
    assert checkpoint_digest(str(tmp_path / "a")) != checkpoint_digest(str(tmp_path / "c"))
