"""`refit.settings`: every REFIT_* knob declared once, read once, refused clearly when wrong; a
run's members use member 0's run knobs (two real processes with different environments); the
docs' table is the declaration's."""

from __future__ import annotations

import ast
import json
import logging
import multiprocessing as mp
import os
import queue
import re
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist

from refit import settings
from refit.cli import main as refit_main
from refit.errors import InvalidInput

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_are_the_declared_ones_and_every_field_is_a_knob() -> None:
    s = settings.Settings.from_env({})
    assert {k.field for k in settings.KNOBS} == {f.name for f in s.__dataclass_fields__.values()}
    assert s.ipc == "auto" and s.nccl == "cupy" and s.table_blocks == (528, 132, 33) and s.uvloop and not s.trace
    assert settings.Settings.from_env({"REFIT_TABLE_BLOCKS": "264,66"}).table_blocks == (264, 66, 33)
    assert settings.Settings.from_env({"REFIT_TRACE": "1", "REFIT_UVLOOP": "0"}).trace is True
    assert "token" not in repr(settings.Settings.from_env({"REFIT_TOKEN": "s3cret"}))  # a secret stays out of logs


@pytest.mark.parametrize("name,value,message", [
    ("REFIT_IPC", "sideways", "must be one of auto, push, pull"),
    ("REFIT_NCCL", "mpi", "must be one of cupy, torch"),
    ("REFIT_TABLE_COPY", "maybe", "must be one of auto, on, off"),
    ("REFIT_TABLE_BLOCKS", "lots", "PEER,LOCAL"),
    ("REFIT_TABLE_BLOCKS", "1,2,3,4", "PEER,LOCAL"),
    ("REFIT_TABLE_BLOCKS", "0,1", "each in [1, 65535]"),
    ("REFIT_BATCH_MEMCPY", "some", "must be one of off, flat, all"),
    ("REFIT_TRACE", "loud", "1 or 0"),
    ("REFIT_TRACE", "yes", "1 or 0"),
    ("REFIT_UVLOOP", "true", "1 or 0"),
    ("REFIT_TABLE_BLOCKS", "99999999999999999999,1", "each in [1, 65535]"),
    ("REFIT_TEST_KILL", "garbage", "`src2@1` or `dst2@1:stop`"),
    ("REFIT_ADDRESS", "localhost", "HOST:PORT"),
    ("REFIT_ADDRESS", "host:99999", "HOST:PORT"),
    ("REFIT_ADDRESS", "a b:50051", "HOST:PORT"),
    ("REFIT_START_METHOD", "thread", "forkserver"),
])
def test_a_bad_value_is_refused_naming_the_knob(name: str, value: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(f"{name}={value!r}") + ".*" + re.escape(message)):
        settings.Settings.from_env({name: value})


def test_a_command_refuses_a_bad_value_before_it_runs(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REFIT_NCCL", "mpi")
    assert refit_main(["models"]) == 2
    assert "REFIT_NCCL='mpi': must be one of cupy, torch" in capsys.readouterr().err
    monkeypatch.setenv("REFIT_NCCL", "torch")
    monkeypatch.setenv("REFIT_TOKEN", "s3cret")
    assert refit_main(["settings", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {k.name for k in settings.KNOBS}
    assert rows["REFIT_NCCL"]["value"] == "torch" and rows["REFIT_NCCL"]["set_here"]
    assert rows["REFIT_TOKEN"]["value"] == "(set)"  # never the secret itself
    assert rows["REFIT_IPC"] == {**rows["REFIT_IPC"], "value": "auto", "default": "auto", "scope": "run"}
    monkeypatch.delenv("REFIT_NCCL")
    monkeypatch.delenv("REFIT_TOKEN")
    settings.reload()


def test_a_knob_no_longer_read_is_an_unknown_variable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "refit.settings"):
        settings.Settings.from_env({"REFIT_PULL_ORDER": "all"})
    assert "REFIT_PULL_ORDER is not a refit setting and is ignored" in caplog.text


def test_an_unknown_refit_variable_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "refit.settings"):
        s = settings.Settings.from_env({"REFIT_TOKN": "s3cret", "REFIT_VLLM_FULL": "1", "REFIT_ADDRESS": "[::1]:5"})
    assert "REFIT_TOKN is not a refit setting and is ignored; did you mean REFIT_TOKEN?" in caplog.text
    assert "REFIT_VLLM_FULL" not in caplog.text and s.address == "[::1]:5"  # a test's own variable; an IPv6 host


def test_run_values_replace_ours_and_a_difference_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    ours = settings.Settings.from_env({"REFIT_NCCL": "torch", "REFIT_TRACE": "1"})
    theirs = settings.Settings.from_env({"REFIT_TABLE_BLOCKS": "264,66,16"}).run_values()
    with caplog.at_level(logging.WARNING, "refit.settings"):
        used = ours.with_run_values(json.loads(json.dumps(theirs)), "engine rank 1")
    assert used.nccl == "cupy" and used.table_blocks == (264, 66, 16) and used.trace  # trace: per process
    assert "engine rank 1: REFIT_NCCL: this process says 'torch', the run's member 0 says 'cupy'" in caplog.text
    with pytest.raises(InvalidInput, match="not the run knobs"):
        ours.with_run_values({"nccl": "cupy"})


def test_the_docs_table_is_the_declaration() -> None:
    with open(os.path.join(ROOT, "docs", "performance.md")) as f:
        text = f.read()
    table = re.search(r"<!-- knobs:[^\n]*-->\n(.*?)\n<!-- /knobs -->", text, re.S)
    assert table and table.group(1) == settings.markdown_table(), \
        "docs/performance.md's knob table: paste refit.settings.markdown_table()'s output"


def test_no_library_module_reads_a_knob_of_its_own() -> None:
    """Knobs are read through `refit.settings` only: no REFIT_* name in os.environ / getenv elsewhere."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "refit")):
        for f in files:
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or path.endswith(os.path.join("refit", "settings.py")):
                continue
            with open(path) as fh:
                tree = ast.parse(fh.read())
            found += [f"{os.path.relpath(path, ROOT)}:{n.lineno}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)
                      and re.fullmatch(r"REFIT_[A-Z_]+", n.value) and not n.value.startswith("REFIT_STATUS")]
    assert not found, f"read these through refit.settings: {found}"


# ---------------------------------------------------------------------------------------------
# Two members in two processes, each with its own environment.


def _member(m: int, port: int, session: str, env: dict[str, str], out: Any) -> None:
    os.environ.update(env)
    from refit.executor.member import Budget, Member
    from refit.executor.seating import connect
    from refit.executor.shards import allocate
    from refit.executor.topology import Topology
    from refit.planners import make_plan
    from refit.sides import Side
    from tests.unit.test_member import DENSE

    r = make_plan(DENSE, "tp1", "tp1", "disaggregated", "p2p", 4096)
    ep = (Side.TRAINER, 0) if m == 0 else (Side.ENGINE, 0)
    layout = r.src if m == 0 else r.dst
    shm = f"/dev/shm/refit-{session.strip('/')}-{ep[0]}0"  # ipc on CPU: peers map each other's arenas
    own = {ep: allocate(list(layout.local_tensors(DENSE, 0)), torch.device("cpu"), shm)}
    member = Member(connect("127.0.0.1", port, session, 30.0), Topology.one_per_rank(r.plan.placement), m, "cpu",
                    own, DENSE, r.src, r.dst, ["trainer rank 0", "engine rank 0"], Budget(30.0), ipc=True)
    out.put((m, member.settings.run_values(), settings.current().trace, member.push))
    member.close()


def test_every_member_uses_member_zeros_run_knobs() -> None:
    """Before, each process read its own: a REFIT_NCCL that differed hung until the deadline."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    session = uuid.uuid4().hex[:8] + "/"
    envs = [{"REFIT_NCCL": "torch", "REFIT_IPC": "push", "REFIT_TABLE_BLOCKS": "264,66,16"},
            {"REFIT_NCCL": "cupy", "REFIT_IPC": "pull", "REFIT_TRACE": "1"}]
    procs = [ctx.Process(target=_member, args=(m, master.port, session, envs[m], out)) for m in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + 120
    while len(got) < 2 and time.monotonic() < deadline:
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        try:
            m, values, trace, push = out.get(timeout=1.0)
        except queue.Empty:
            continue
        got[m] = (values, trace, push)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    zero = settings.Settings.from_env(envs[0]).run_values()
    assert got[0][0] == got[1][0] == zero and zero["nccl"] == "torch" and zero["table_blocks"] == (264, 66, 16)
    assert got[0][2] is got[1][2] is True  # member 0's REFIT_IPC=push holds for both
    assert (got[0][1], got[1][1]) == (False, True)  # REFIT_TRACE is each process's own
