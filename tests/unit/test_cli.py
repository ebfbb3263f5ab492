"""The `refit` command line as a user meets it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from refit.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_models_lists_the_catalog(capsys):
    rc, out, _ = run(capsys, "models")
    assert rc == 0
    for name in ("qwen3-30b-moe", "qwen3-235b-moe", "qwen3-8b", "qwen3-32b", "llama3.1-8b", "llama3.1-70b"):
        assert name in out
    assert "30.53B" in out and "56.9 GiB" in out and " GB" not in out  # the units `plan` uses
    rc, out, _ = run(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["qwen3-235b-moe"]["params"] == 235_093_634_560


def test_plan_json_has_the_summary_fields(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "tp4ep8", "--dst", "tp8", "--json",
                     "--out", str(out_file))
    assert rc == 0
    doc = json.loads(out)
    s = doc["summary"]
    for key in ("total_bytes", "local_bytes", "remote_bytes", "max_send_bytes", "max_recv_bytes", "num_transfers",
                "plan_hash", "plan_seconds"):
        assert key in s
    assert "plan_id" not in s  # the control plane's id (create_plan), not the content hash
    assert doc["src"]["layout"] == "megatron:tp4ep8etp1dp2" and doc["dst"]["world_size"] == 8
    assert s["local_bytes"] + s["remote_bytes"] == s["total_bytes"]
    assert json.loads(out_file.read_text())["format"] == 1


def test_plan_text_prints_resolved_layouts(capsys):
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2")
    assert rc == 0
    assert "megatron:tp2ep2etp1dp1" in out and "edp=1" in out and "plan_hash" in out


def test_plan_from_a_trainer_of_another_dtype_casts(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "fsdp:dp2", "--dst", "tp2",
                     "--src-dtype", "float32", "--out", str(out_file))
    assert rc == 0 and "cast on the trainers    float32->bfloat16: 15 tensors" in out
    casts = dict(json.loads(out_file.read_text())["casts"])
    assert len(casts) == 15 and set(casts.values()) == {"float32"}
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-30b-moe", "--src", "fsdp:dp2", "--dst", "tp2",
                     "--src-dtype", "bfloat16", "--json")
    assert rc == 0 and "casts" not in json.loads(out)["summary"]  # the model's own dtype: nothing cast


@pytest.mark.parametrize("argv,msg", [
    (["plan", "--model", "qwen9", "--src", "tp2", "--dst", "tp2"], "unknown model 'qwen9'"),
    (["plan", "--model", "qwen3-30b-moe", "--src", "tp3", "--dst", "tp2"], "attention heads (32) is not divisible by tp (3)"),
    (["plan", "--model", "qwen3-30b-moe", "--src", "tp2", "--dst", "foo:tp2"], "unknown framework 'foo'"),
    (["plan", "--model", "qwen3-30b-moe", "--src", "tp2", "--dst", "tp2", "--bucket-mb", "0.001"], "too small"),
    (["layout", "--model", "qwen3-8b", "tp2", "--rank", "5"], "rank 5 is outside"),
])
def test_bad_input_is_one_clear_line(capsys, argv, msg):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and msg in err and "Traceback" not in err


def test_console_script_help_teaches(tmp_path):
    out = subprocess.run([sys.executable, "-m", "refit.cli", "plan", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "megatron:tp4ep8" in out.stdout and "--placement" in out.stdout and "--json" in out.stdout


def test_layout_lists_a_ranks_tensors(capsys):
    rc, out, _ = run(capsys, "layout", "--model", "qwen3-30b-moe", "megatron:tp4ep8", "--rank", "3")
    assert rc == 0 and "decoder.layers.47.mlp.experts.linear_fc2.weight15" in out


def test_version_flag(capsys):
    from refit import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_plan_out_into_a_missing_folder_is_one_line(capsys, tmp_path):
    rc, _, err = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2",
                     "--out", str(tmp_path / "nope" / "plan.json"))
    assert rc == 2 and "does not exist" in err and "Traceback" not in err


def test_broken_pipe_is_quiet():
    """`refit layout ... | head -1`: the reader goes away; no traceback, exit 141 (as SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "-m", "refit.cli", "layout", "--model", "qwen3-235b-moe", "megatron:tp1",
                             "--rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    rc = proc.wait(60)
    err = proc.stderr.read().decode()
    assert rc == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_entrypoint_maps_errors():
    from refit.entrypoint import run_main
    from refit.errors import RefitError

    def bad() -> int:
        raise RefitError("two\nlines")

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert run_main(bad) == 2 and run_main(interrupted) == 130 and run_main(lambda: 0) == 0


def test_one_error_base_with_bad_input_and_failed_refits_under_it(capsys):
    """`refit.RefitError` is the base of what refit raises on purpose; bad input is an
    `InvalidInput` (a ValueError, exit 2) raised before any byte moves, a refit that started and
    failed a `RefitFailed` (a RuntimeError, exit 3) — the client's, the executor's peer errors and
    the agents' cancellations among them."""
    import refit
    from refit.control.client import RefitFailed as ClientRefitFailed
    from refit.control.dataplane import Cancelled
    from refit.entrypoint import run_main
    from refit.executor.transports import PeerError

    assert issubclass(refit.InvalidInput, refit.RefitError) and issubclass(refit.InvalidInput, ValueError)
    assert issubclass(refit.RefitFailed, refit.RefitError) and issubclass(refit.RefitFailed, RuntimeError)
    for cls in (ClientRefitFailed, PeerError, Cancelled):
        assert issubclass(cls, refit.RefitFailed), cls
    with pytest.raises(refit.InvalidInput, match="unknown model"):
        refit.load_spec("no-such-model")

    def failed() -> int:
        raise PeerError("engine/1 died")

    assert run_main(failed, "refit") == 3
    assert capsys.readouterr().err.strip() == "refit: error: engine/1 died"


def test_plan_in_phases(capsys, tmp_path):
    # Qwen3-8B: 36 layers in windows of 4, plus embeddings, final norm and LM head: 12 phases.
    out_file = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2", "--phase-layers", "4",
                     "--json", "--out", str(out_file))
    assert rc == 0 and json.loads(out)["summary"]["num_phases"] == 12
    doc = json.loads(out_file.read_text())
    assert doc["phase_layers"] == 4 and [k for k, _ in doc["phases"]] == list(range(12))
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2", "--phase-layers", "4")
    assert rc == 0 and "phases" in out and "12  (4 layers each" in out
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2", "--json")
    assert "num_phases" not in json.loads(out)["summary"]
    for argv, msg in ((["--phase-layers", "-1"], "--phase-layers must be >= 0, got -1"),
                      (["--phase-layers", "2", "--planner", "broadcast"], "cannot be cut into phases")):
        rc, _, err = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2", *argv)
        assert rc == 2 and msg in err and "Traceback" not in err


def test_serve_after_global_verbose_flag(capsys):
    """`refit -v serve ...` reaches serve's own parser (it was an AttributeError traceback for
    `refit -v serve`, and `refit -v serve --help` was refused as an unknown argument)."""
    with pytest.raises(SystemExit) as e:
        main(["-v", "serve", "--help"])
    assert e.value.code == 0 and "--token-file" in capsys.readouterr().out


def test_serve_verbose_logs_each_refit():
    """`refit serve -v` says it logs refits: it logged registrations and plans, and of refits only
    the failed ones.  One refit (agents that move nothing) is logged with its id, plan, version,
    outcome and seconds."""
    import signal

    from refit.control.agent import EngineAgent, TrainerAgent
    from refit.control.client import Client
    from refit.control.dataplane import NoopDataPlane
    from tests.harness.tiny import tiny_spec

    proc = subprocess.Popen([sys.executable, "-m", "refit.cli", "serve", "-v", "--port", "0"], stderr=subprocess.PIPE,
                            text=True)
    agents = []
    try:
        line = proc.stderr.readline()
        while line and "listening on" not in line:
            line = proc.stderr.readline()
        assert line, "refit serve exited before listening"
        address = line.split()[-1]
        for cls, group, layout in ((TrainerAgent, "t", "megatron:tp1"), (EngineAgent, "e", "vllm:tp1")):
            agents.append(cls(address, group=group, rank=0, spec=tiny_spec("tiny-qwen3-moe"), layout=layout,
                              data_plane=NoopDataPlane()).start())
        with Client(address) as client:
            plan_id = client.create_plan("t", "e")["plan_id"]
            result = client.refit(plan_id, version=1)
    finally:
        for a in agents:
            a.stop()
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    assert result.ok
    assert f"refit {result.refit_id} of plan {plan_id} (version 1): committed in " in err, err


def test_plan_out_honors_the_umask(capsys, tmp_path):
    """`plan --out` wrote its file 0600 (tempfile.mkstemp), whatever the umask."""
    import os

    out_file = tmp_path / "plan.json"
    old = os.umask(0o027)
    try:
        rc, _, _ = run(capsys, "plan", "--model", "qwen3-8b", "--src", "tp2", "--dst", "tp2", "--out", str(out_file))
    finally:
        os.umask(old)
    assert rc == 0 and out_file.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("argv,words", [(["--port", "99999"], "argument --port: 99999 is not a port"),
                                        (["--port", "http"], "argument --port: 'http' is not a port number"),
                                        (["--timeout", "0"], "--timeout must be a number of seconds in (0,"),
                                        (["--drop-engines-after", "-1"], "--drop-engines-after must be a number")])
def test_serve_refuses_bad_options_before_listening(capsys, argv, words):
    """A port out of range was taken modulo 65536 by gRPC (99999 listened on 34463)."""
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2 and words in capsys.readouterr().err
