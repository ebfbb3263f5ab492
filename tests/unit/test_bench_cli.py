"""`refit-bench`'s command line as a user meets it: what it refuses (one line, status 2) before
any worker process, Ray cluster or agent starts, what ``--help`` teaches, and how a ``--via grpc``
rank that dies or stays silent is reported (a named worker failure, status 3, never a traceback)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from refit.bench import cli

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model", "qwen3-30b-moe", "--src", "tp2", "--dst", "tp2", "--iters", "1", "--warmup", "0"]


def _nothing_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the bench gets as far as starting workers, agents or a Ray connection."""
    import refit.bench.direct as direct
    import refit.bench.via_grpc as via_grpc

    def started(*a: Any, **k: Any) -> Any:
        raise AssertionError("workers were started for bad input")

    monkeypatch.setattr(direct, "run_job", started)
    monkeypatch.setattr(via_grpc, "run_grpc", started)
    try:
        import refit.bench.on_ray as on_ray
    except ImportError:  # no ray: nothing to guard
        return
    monkeypatch.setattr(on_ray, "connect", started)


@pytest.mark.parametrize("argv,msg", [
    (["--timeout", "0"], "--timeout must be more than 0 seconds, got 0"),
    (["--timeout", "-5"], "--timeout must be more than 0 seconds, got -5"),
    (["--link-mb", "-1"], "--link-mb must be more than 0, got -1"),
    (["--link-mb", "0"], "--link-mb must be more than 0, got 0"),
])
def test_bad_numbers_are_refused_before_any_worker(monkeypatch, capsys, argv, msg) -> None:
    _nothing_may_start(monkeypatch)
    with pytest.raises(SystemExit) as e:
        cli.main(SMALL + ["--cpu"] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_grpc_on_cpu_refuses_ipc_instead_of_running_gloo(monkeypatch, capsys) -> None:
    _nothing_may_start(monkeypatch)
    rc = cli.main(SMALL + ["--cpu", "--via", "grpc", "--transport", "ipc"])
    err = capsys.readouterr().err
    assert rc == 2 and "--transport ipc is refused" in err and "Traceback" not in err, err


def test_ray_bad_input_is_refused_before_joining_a_cluster(monkeypatch, capsys) -> None:
    """``--ray auto`` starts a local Ray cluster when none runs: what is wrong whatever the
    cluster is said first."""
    pytest.importorskip("ray")
    _nothing_may_start(monkeypatch)
    rc = cli.main(SMALL + ["--ray", "auto", "--bucket-mb", "0.001"])
    err = capsys.readouterr().err
    assert rc == 2 and "--bucket-mb 0.001: bucket size 1048 bytes is too small (at least 4096)" in err, err
    rc = cli.main(SMALL + ["--ray", "auto", "--cpu", "--transport", "ipc"])
    err = capsys.readouterr().err
    assert rc == 2 and "Ray nodes share no memory" in err, err


def test_ray_address_nobody_answers_is_one_line_not_a_hang() -> None:
    """`ray.init` retries an address where no cluster runs for minutes (log spam, ignoring
    --timeout); the bench says so at once.  A real subprocess, a real closed port."""
    pytest.importorskip("ray")
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("RAY_ADDRESS", None)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "refit.bench", *SMALL, "--ray", f"127.0.0.1:{port}",
                              "--timeout", "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--ray 127.0.0.1:{port}: no Ray cluster answers there" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == "" and time.monotonic() - t0 < 60


def test_ray_address_not_host_port_is_refused() -> None:
    pytest.importorskip("ray")
    from refit.bench.on_ray import _probe
    from refit.errors import RefitError

    for bad in ("head-node", "ray://head:10001", ":6379", "head:port"):
        with pytest.raises(RefitError, match="expected host:port"):
            _probe(bad, "--ray", 1.0, required=True)
    _probe("head-node", "$RAY_ADDRESS", 1.0, required=False)  # left to Ray


def test_help_teaches(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "refit-bench --model qwen3-30b-moe --src tp4ep8 --dst tp8" in out  # the README's first example
    assert "exit status:" in out and "3  a worker failed" in out and "2  bad input" in out
    assert "megatron:tp4ep8" in out  # the layout grammar, as `refit plan --help` has it
    flat = " ".join(out.split())
    assert "disaggregated: each side on devices of its own" in flat and "broadcast: the full" in flat
    assert "``" not in out  # no reStructuredText quotes leaking from the module docstring


# ------------------------------------------------------------------ --via grpc: the rank pipes


def _exit_at_once(conn: Any) -> None:
    os._exit(9)


def _silent(conn: Any) -> None:
    time.sleep(60)


def _ranks(target: Any, timeout: float) -> Any:
    """A `_Ranks` of one real rank process running ``target`` (not an agent: the pipe handling
    is what is under test)."""
    from refit.bench.via_grpc import _Ranks

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child,), daemon=True)
    p.start()
    child.close()
    ranks = object.__new__(_Ranks)
    ranks.procs, ranks.conns, ranks.names, ranks.roles = [p], [parent], ["engine 0"], ["engine"]
    ranks.timeout = timeout
    return ranks


def test_grpc_rank_that_died_is_a_named_worker_failure() -> None:
    from refit.bench.launch import WorkerFailure

    ranks = _ranks(_exit_at_once, 30.0)
    ranks.procs[0].join(10)
    with pytest.raises(WorkerFailure, match=r"engine 0 \(pid \d+\) died \(exit code 9\) before answering 'ready'"):
        ranks.ask([0], "ready")
    with pytest.raises(WorkerFailure, match="engine 0 .* died .* before answering 'fill'"):
        ranks.ask([0], "fill", 1)


def test_grpc_silent_rank_waits_at_most_the_timeout() -> None:
    from refit.bench.launch import WorkerFailure

    ranks = _ranks(_silent, 0.5)

    def hung(*_: Any) -> None:
        raise AssertionError("waited past --timeout")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(WorkerFailure, match="engine 0 did not answer 'ready' within 0.5 s"):
            ranks.ask([0], "ready")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        ranks.procs[0].kill()
        ranks.procs[0].join(5)


def test_grpc_failed_refit_is_exit_3_not_a_traceback(monkeypatch, capsys) -> None:
    """A refit the coordinator reports failed (an agent left mid-refit) ends the bench with status
    3 and the coordinator's reason.  Mocked: the rank processes (a stand-in answering every
    command) and `Client.refit` (raising what it raises for a failed refit); the coordinator
    server and the planning are real."""
    import refit.bench.via_grpc as via_grpc
    from refit.control.client import Client, RefitFailed, RefitResult

    class Ranks:
        procs = [None] * 4

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def ask(self, which: list[int], cmd: str, arg: Any = None, timeout: float | None = None) -> list[Any]:
            return [None for _ in which]

        def of(self, role: str) -> list[int]:
            return [0, 1] if role == "trainer" else [2, 3]

        def close(self) -> None:
            pass

    def refit(self: Any, plan_id: str, version: int, timeout: float | None = None, **options: bool) -> Any:
        raise RefitFailed(RefitResult("r1", plan_id, version, False, "engine/1 disconnected during the refit",
                                      0.0, 0, {}))

    monkeypatch.setattr(via_grpc, "_Ranks", Ranks)
    monkeypatch.setattr(Client, "create_plan", lambda self, *a, **k: {"plan_id": "p1"})
    monkeypatch.setattr(Client, "refit", refit)
    rc = cli.main(SMALL + ["--cpu", "--via", "grpc", "--timeout", "10"])
    err = capsys.readouterr().err
    assert rc == 3 and "refit run failed: engine/1 disconnected during the refit" in err and "Traceback" not in err, err
