"""The architecture as rules that fail when broken: layers import one way, no import cycles (function-local
imports included), no torch in the planner, small modules.

    flexshard  ->  solvers  ->  topology  ->  core
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "topology", "solvers", "flexshard")
ALLOWED = {  # a layer may import itself and the layers to its right
    "core": {"core"},
    "topology": {"core", "topology"},
    "solvers": {"core", "topology", "solvers"},
    "flexshard": set(PACKAGES),
}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported project module, line) for every import in the file, at any depth (function-local too)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in PACKAGES:
                found.append((target, node.lineno))
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target, line in _imports(name, path, modules):
            if target != name:
                g.add_edge(name, target, line=line)
    return g


def test_layers_import_one_way():
    bad = [
        f"{a} imports {b} (line {d['line']})"
        for a, b, d in _graph().edges(data=True)
        if b.split(".")[0] not in ALLOWED[a.split(".")[0]]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, cycles


@pytest.mark.parametrize("package", ["core", "solvers"])
def test_no_torch_below_the_runtime(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "torch"
            ]
    assert not bad, bad


OPTIONAL_PEERS = ("torchrec", "fbgemm_gpu")


def _top_level_imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of the imports a file runs when it is imported (not those inside functions)."""
    found, stack = [], [ast.parse(path.read_text(), str(path))]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found += [(a.name, child.lineno) for a in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level:
                found.append((child.module or "", child.lineno))
            stack.append(child)
    return found


def test_torchrec_is_an_optional_peer():
    """Only flexshard/torchrec/ imports TorchRec (and fbgemm) when it is imported; nothing outside it
    imports it, so every other module imports without TorchRec installed."""
    bad = []
    for name, path in _modules().items():
        if name == "flexshard.torchrec" or name.startswith("flexshard.torchrec."):
            continue
        for target, line in _top_level_imports(path):
            if target.split(".")[0] in OPTIONAL_PEERS:
                bad.append(f"{name}:{line} imports {target}")
        bad += [
            f"{name}:{line} imports {t}"
            for t, line in _imports(name, path, _modules())
            if t == "flexshard.torchrec" or t.startswith("flexshard.torchrec.")
        ]
    assert not bad, bad


def test_the_peer_rule_sees_a_top_level_import(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text("import os\ndef f():\n    import torchrec\nif os:\n    from torchrec import x\n")
    assert _top_level_imports(planted) == [("os", 1), ("torchrec", 5)]


def test_modules_stay_small():
    big = {
        str(p.relative_to(ROOT)): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, big


def test_the_rules_see_a_cycle_and_a_layer_break(tmp_path, monkeypatch):
    """The checks above are not vacuous: a planted cycle and an upward import are found."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "solvers" / "a.py").write_text("def f():\n    from solvers.b import g\n")
    (tmp_path / "solvers" / "b.py").write_text("from solvers import a\nimport flexshard.c\n")
    (tmp_path / "flexshard" / "c.py").write_text("")
    graph = _graph()
    assert ["solvers.a", "solvers.b"] in [sorted(c) for c in nx.strongly_connected_components(graph)]
    with pytest.raises(AssertionError, match="solvers.b imports flexshard.c"):
        test_layers_import_one_way()
