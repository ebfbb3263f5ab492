"""The import flow is one-way: spec -> layouts -> plan -> refit.planners -> reshard / executor /
control / cli; planning never imports torch; the planners import nothing above them; and nothing in
refit/ imports the planners inside a function."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the planners (pure planning) may not import, directly or through what they import.
ABOVE_PLANNING = ("torch", "safetensors", "grpc", "refit.executor", "refit.control", "refit.integrations",
                  "refit.reshard", "refit.cli", "refit.bench", "refit.entrypoint")


def fresh(code: str) -> None:
    """Run ``code`` in a new interpreter (imports cached in this one would hide a cycle)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=120)


def _imports(path: str) -> list[tuple[ast.AST, str, bool]]:
    """(node, module name, inside a function) for every import statement of a file."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found.extend((node, n, id(node) in in_function) for n in names)
    return found


def _py_files(top: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield path, os.path.relpath(path, ROOT)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("first", ["refit.planners", "refit", "refit.spec", "refit.layouts", "refit.plan",
                                   "refit.hf_checkpoint", "refit.cli", "refit.planners.p2p",
                                   "refit.planners.registry", "refit.planners.base"])
def test_any_module_imports_first_and_planning_needs_no_torch(first):
    fresh(f"import sys, inspect, {first}, refit, refit.planners\n"
          "assert refit.make_plan is refit.planners.make_plan is refit.planners.registry.make_plan\n"
          "assert 'phase_layers' in inspect.signature(refit.make_plan).parameters\n"
          "assert refit.make_plan(refit.load_spec('qwen3-8b'), 'tp2', 'tp4').summary['num_gpus'] == 4\n"
          "assert 'torch' not in sys.modules, sorted(sys.modules)")


def test_the_planners_import_nothing_above_planning():
    fresh("import sys, refit.planners\n"
          f"above = [m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in {ABOVE_PLANNING!r})]\n"
          "assert not above, above")
    bad = [f"{rel}:{node.lineno} {name}" for path, rel in _py_files(os.path.join("refit", "planners"))
           for node, name, _ in _imports(path)
           if any(_within(name, a) for a in ABOVE_PLANNING)]
    assert not bad, f"refit.planners is pure planning: {bad}"


def test_refit_imports_the_planners_at_module_top():
    lazy = [f"{rel}:{node.lineno}" for path, rel in _py_files("refit")
            for node, name, in_function in _imports(path) if _within(name, "refit.planners") and in_function]
    assert not lazy, f"import refit.planners at module top instead: {lazy}"
