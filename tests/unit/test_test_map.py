"""Every library module has a test file: ``tests/{unit,integration}/test_<name>.py`` importing it,
or a row in the table of tests/README.md naming the files that cover it.  And every row is true:
its module exists and so does each test file it names (or it says ``none`` and why)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGES = ("refit",)
ROW = re.compile(r"^\|\s*`(?P<module>[\w.]+)`[^|]*\|(?P<files>[^|]*)\|\s*$")


def library_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module under the packages (a package: its ``__init__.py``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_modules(path: Path) -> set[str]:
    """The modules a test file imports (``import a.b``, ``from a.b import c``: a.b and a.b.c), or
    runs (``"-m", "a.b"``)."""
    source = path.read_text()
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    out.update(re.findall(r"""["']-m["'],\s*["']([\w.]+)["']""", source))
    return out


def same_named_tests(module: str) -> list[Path]:
    """``unit/test_<name>.py`` and ``integration/test_<name>.py`` that import ``module``."""
    name = module.rsplit(".", 1)[-1]
    return [p for p in (TESTS / "unit" / f"test_{name}.py", TESTS / "integration" / f"test_{name}.py")
            if p.exists() and module in imported_modules(p)]


def table() -> dict[str, list[str]]:
    """The README's rows: module -> the test files named (relative to tests/), [] for ``none``."""
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in (TESTS / "README.md").read_text().splitlines():
        if line.startswith("## Which test file covers each library module"):
            in_table = True
            continue
        if in_table and line.startswith("## "):
            break
        m = ROW.match(line) if in_table else None
        if m:
            assert m["module"] not in rows, f"tests/README.md names {m['module']} twice"
            cell = m["files"].strip()
            rows[m["module"]] = [] if cell.startswith("none") else re.findall(r"`([^`]+)`", cell)
            assert cell.startswith("none: ") or rows[m["module"]], f"tests/README.md: {line!r} names no test file"
    return rows


def test_table_is_found() -> None:
    assert len(table()) > 10


def test_every_module_has_a_test_file_or_a_row() -> None:
    rows = table()
    missing = [m for m in library_modules() if m not in rows and not same_named_tests(m)]
    assert not missing, ("these modules have no tests/{unit,integration}/test_<name>.py that imports them and no "
                         f"row in tests/README.md's table: {missing}")


def test_every_row_names_a_module_and_test_files_that_exist() -> None:
    modules = library_modules()
    bad = [f"{m}: no such module" for m in table() if m not in modules]
    bad += [f"{m}: no tests/{f}" for m, files in table().items() for f in files
            if not (f.startswith(("unit/", "integration/", "gpu/")) and (TESTS / f).is_file())]
    assert not bad, f"tests/README.md's table is out of date: {bad}"


def test_the_check_sees_a_module_with_neither() -> None:
    """The map itself: a same-named file that does not import its module does not cover it."""
    assert same_named_tests("refit.control.coordinator") == [TESTS / "unit" / "test_coordinator.py"]
    assert same_named_tests("refit.integrations.ray.coordinator") == []  # test_coordinator is the control plane's
    assert "refit.integrations.ray.coordinator" in table()
    assert "refit.no_such_module" not in library_modules()
