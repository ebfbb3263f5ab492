"""refit/ imports one way: no module imports itself back through others (no cycle), and none
imports a module of a layer above its own, not even inside a function or under TYPE_CHECKING.

A cycle hides an order in which the modules must be first imported; an import running back up
(the spec importing a drafter that imports the spec) lets the lower module grow on what was
built on it.  The graph is what each file names: ``import a.b``, ``from a.b import c`` (``a.b.c``
where that is a module), relative imports resolved, at any depth of the file.  The layers are
test_import_layering.py's flow, with the model's ground floor split out and the layers above
planning in order (the executor moves bytes, the control plane drives it, the engine side lands
it in any engine, integrations attach frameworks to them, and the commands and ``refit`` itself
sit on top)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Collection

ROOT = Path(__file__).resolve().parents[2]

# Lowest first; a module's layer is that of its longest prefix here.  A module may import its
# own layer's modules and those below, never those above.
LAYERS: list[tuple[str, ...]] = [
    ("refit.errors", "refit.dtypes", "refit.boxes", "refit.units", "refit.settings", "refit.quantization",
     "refit.catalog", "refit.validation", "refit.timeline", "refit.entrypoint", "refit.protocols", "refit.sides"),
    ("refit.archs",),  # the tensors of the model families
    ("refit.model_config",),  # ModelConfig
    ("refit.adapters", "refit.drafters"),  # configs beyond a plain model: LoRA, MTP layers, EAGLE heads
    ("refit.spec", "refit.casts"),
    ("refit.hf_checkpoint",),
    ("refit.layouts",),
    ("refit.plan", "refit.phases", "refit.predict", "refit.regions"),
    ("refit.planners", "refit.plan_schema"),  # plan_schema: plan files read back, checked (pydantic)
    ("refit.reshard", "refit.executor"),
    ("refit.control",),
    ("refit.engine",),  # the engine side any engine shares: the Landing contract, the host-driven refit
    ("refit.integrations",),
    # `refit` itself (the package's names: refit.Client, ...), and the extension points, which name
    # the protocols of every layer together
    ("refit", "refit.cli", "refit.cli_parser", "refit.bench", "refit.extension_points"),
]


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of refit (a package: its ``__init__.py``)."""
    out = {}
    for path in sorted((ROOT / "refit").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(node: ast.AST, package: str, mods: Collection[str]) -> list[str]:
    """The refit modules import statement ``node`` of a module of ``package`` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package, up level - 1
            up = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
        return []
    out = []
    for name in names:
        while name and name not in mods:  # `import refit.x.y` of a name defined in refit.x
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph() -> dict[str, dict[str, list[str]]]:
    """Module -> {refit module it imports -> ["file:line", ...]}."""
    mods = modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node, package, mods):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"  # type: ignore[attr-defined]
                if target != name and where not in edges.get(target, []):
                    edges.setdefault(target, []).append(where)
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int | None:
    """The layer of ``module``'s longest prefix in `LAYERS` (None: in none)."""
    matches = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or (p != "refit" and module.startswith(p + "."))]
    return max(matches)[1] if matches else None


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} ({', '.join(graph[a][b])})"
                                                  for a in c for b in c if b in graph[a])
             for c in cycles(graph)]
    assert not found, "import cycles in refit/ (move the shared piece down, or pass it in):\n" + "\n".join(found)


def test_every_module_has_a_layer() -> None:
    missing = [m for m in modules() if layer_of(m) is None]
    assert not missing, f"add these modules to LAYERS: {missing}"


def test_no_import_runs_back_up() -> None:
    up = [f"{a} -> {b} ({', '.join(where)})" for a, edges in import_graph().items() for b, where in edges.items()
          if layer_of(b) is not None and layer_of(a) is not None and layer_of(b) > layer_of(a)]
    assert not up, "imports of a higher layer (see LAYERS):\n" + "\n".join(up)


def test_the_checks_see_cycles_layers_and_submodules() -> None:
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
    assert layer_of("refit.spec") < layer_of("refit.layouts.vllm") < layer_of("refit.executor.bound") \
        < layer_of("refit.control.agent") < layer_of("refit.engine.host") < layer_of("refit.integrations.vllm.engine") \
        < layer_of("refit")
    mods = {"refit", "refit.executor", "refit.executor.copies", "refit.spec"}
    for code, want in [("from refit.executor import copies as c, CopyBatch", ["refit.executor.copies", "refit.executor"]),
                       ("import refit.spec.ModelSpec", ["refit.spec"]),
                       ("from . import copies", ["refit.executor.copies"]),
                       ("from ..spec import ModelSpec", ["refit.spec"]),
                       ("import torch", [])]:
        assert imported(ast.parse(code).body[0], "refit.executor", mods) == want, code


MAX_LINES = 400  # a library module longer than this is split by what it does (docs/architecture.md)


def test_no_library_module_over_400_lines() -> None:
    """Generated protobuf modules (refit/control/v1) aside: their length is protoc's."""
    long = {name: n for name, path in modules().items()
            if not name.startswith("refit.control.v1") and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
