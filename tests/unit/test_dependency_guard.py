"""The session's dev-dependency guard (tests/conftest.py ``DEPENDENCIES``) covers every module the
suite skips on when it is missing (``pytest.importorskip("m")``, ``find_spec("m") is None``): one
left out (verl, triton, ``vllm.utils.deep_gemm`` were) lets its tests skip unseen."""

from __future__ import annotations

import ast
import os

from tests.conftest import DEPENDENCIES

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def guarded_modules() -> set[str]:
    found = set()
    for folder, _, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py") or name == "conftest.py":
                continue
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("importorskip", "find_spec") \
                        and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    found.add(node.args[0].value)
    return found


def test_every_guarded_module_is_checked_at_session_start() -> None:
    checked = {module for module, _, _ in DEPENDENCIES}
    guarded = guarded_modules()
    assert {"vllm", "megatron.core", "verl", "triton", "vllm.utils.deep_gemm"} <= guarded
    assert guarded <= checked, sorted(guarded - checked)
