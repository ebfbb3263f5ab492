"""`refit.timeline`: a refit's control steps written per process under REFIT_CONTROL_TRACE, nothing
otherwise; and the probe that merges them (bench/probes/control_breakdown.py) takes each step's
median offset from the call."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest

from refit import settings
from refit.errors import InvalidInput
from refit.timeline import mark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe():
    spec = importlib.util.spec_from_file_location("control_breakdown",
                                                  os.path.join(ROOT, "bench", "probes", "control_breakdown.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_marks_are_written_only_when_asked(tmp_path) -> None:
    prefix = str(tmp_path / "steps")
    with settings.using(control_trace=""):
        mark("nothing")
    assert not os.listdir(tmp_path)
    with settings.using(control_trace=prefix):
        mark("coordinator: Refit received")
        mark("engine: result sent")
    [name] = os.listdir(tmp_path)
    assert name == f"steps.{os.getpid()}"
    lines = (tmp_path / name).read_text().splitlines()
    stamps = [int(line.split(" ", 1)[0]) for line in lines]
    assert [line.split(" ", 1)[1] for line in lines] == ["coordinator: Refit received", "engine: result sent"]
    assert stamps == sorted(stamps)


def test_a_trace_that_cannot_be_written_is_refused_at_start_and_never_fails_a_refit(tmp_path, caplog) -> None:
    """Refused when the settings are read (`refit settings`, `refit serve` exit 2 naming it); a file
    that becomes unwritable later turns tracing off in that process, with one warning, and the
    step it traced goes on (it killed an agent's loop, or failed every coordinator Refit)."""
    for bad in (str(tmp_path / "no-such-folder" / "steps"), str(tmp_path) + os.sep):
        with pytest.raises(InvalidInput, match="REFIT_CONTROL_TRACE=.*a path prefix in a folder this process may"):
            settings.Settings.from_env({"REFIT_CONTROL_TRACE": bad})
    assert settings.Settings.from_env({"REFIT_CONTROL_TRACE": str(tmp_path / "steps")}).control_trace
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / f"steps.{os.getpid()}").mkdir()  # the trace file's name is a folder: open fails
    with settings.using(control_trace=str(tmp_path / "taken" / "steps")), \
            caplog.at_level(logging.WARNING, "refit.timeline"):
        mark("coordinator: Refit received")
        mark("engine: result sent")
    assert caplog.text.count("control tracing is off in this process") == 1


def test_the_probe_merges_processes_into_one_timeline_per_refit(tmp_path) -> None:
    probe = _probe()
    # two refits over two processes' files, the second slower; a phased step reached twice
    (tmp_path / "s.1").write_text("1000 client: Refit sent\n3000 coordinator: Refit received\n"
                                  "10000 client: Refit sent\n14000 coordinator: Refit received\n")
    (tmp_path / "s.2").write_text("5000 trainer/0: at the start barrier\n6000 trainer/0: at the start barrier\n"
                                  "18000 trainer/0: at the start barrier\n")
    steps = probe.read_steps(str(tmp_path / "s"))
    assert [s for _, s in steps][:2] == ["client: Refit sent", "coordinator: Refit received"]
    line = probe.timeline(steps, last=2)
    assert dict(line) == {"client: Refit sent": 0.0, "coordinator: Refit received": 3.0,
                          "trainer/0: at the start barrier": 6.0, "trainer/0: at the start barrier #2": 5.0}
    assert probe.timeline(steps, last=1)[1] == ("coordinator: Refit received", 4.0)
