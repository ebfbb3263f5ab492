"""The control plane under the lowest grpcio / protobuf refit declares (pyproject.toml's base
dependencies).  The round trip itself (tests/harness/grpc_compat_check.py) runs in this environment always, and
in a second interpreter holding grpcio 1.66.0 / protobuf 5.29.1 when REFIT_OLD_GRPC_PYTHON names
one (a venv built as that file's docstring says; torch may come from PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "tests", "harness", "grpc_compat_check.py")


def run_check(python: str, extra_path: str = "") -> str:
    path = os.pathsep.join(p for p in (ROOT, extra_path) if p)
    out = subprocess.run([python, CHECK], cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_round_trip_here() -> None:
    assert run_check(sys.executable).startswith("OK grpcio=")


@pytest.mark.skipif(not os.environ.get("REFIT_OLD_GRPC_PYTHON"), reason="REFIT_OLD_GRPC_PYTHON not set")
def test_round_trip_under_lowest_versions() -> None:
    line = run_check(os.environ["REFIT_OLD_GRPC_PYTHON"], os.environ.get("REFIT_OLD_GRPC_EXTRA_PATH", ""))
    assert line == "OK grpcio=1.66.0 protobuf=5.29.1", line
