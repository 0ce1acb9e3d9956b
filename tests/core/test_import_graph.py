"""The package's import graph has no cycle: every ``import`` and ``from ... import`` statement
anywhere in a module counts, relative or absolute, resolved to the package's own modules: at module
level, inside a function (a lazy import is still an upward dependency), and under
``if TYPE_CHECKING:`` (the names it brings in tie the two modules together as surely as a run-time
import does, and a cycle there is one refactoring away from an import-time cycle). Only the
adapters (``integration``) and the demo import vLLM."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vllm_npu_offload"
NAME = "vllm_npu_offload"
VLLM_IMPORTERS = ("integration", "demo")  # the adapters, and the demo that runs a vLLM engine


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _statements(path: Path):
    """(absolute module, imported names) of every import statement anywhere in ``path``: ``import
    a.b`` gives ("a.b", ()), ``from .x import y, z`` ("<package>.x", ("y", "z"))."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, tuple(a.name for a in node.names)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports (``from .pkg import sub`` counts as ``pkg.sub`` when that is a
    module, else as ``pkg``)."""
    out: set[str] = set()
    for target, names in _statements(path):
        if not names:
            out.add(target)
        for name in names:
            sub = f"{target}.{name}"
            out.add(sub if sub in modules else target)
    out.discard(module_name(path))
    return {m for m in out if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_statement_counts(tmp_path, monkeypatch):
    """Imports inside functions, classes and ``if TYPE_CHECKING:``, relative and absolute, module or
    name: each is an edge to the package module it names."""
    pkg = tmp_path / NAME
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
                                      "from ..a import f\n")
    (pkg / "c.py").write_text(f"class K:\n    def m(self):\n        import {NAME}.d\n")
    (pkg / "d.py").write_text(f"from {NAME}.sub import X\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    g = import_graph()
    assert g[f"{NAME}.a"] == {f"{NAME}.sub.b"}
    assert g[f"{NAME}.sub.b"] == {f"{NAME}.a", f"{NAME}.c"}
    assert g[f"{NAME}.c"] == {f"{NAME}.d"} and g[f"{NAME}.d"] == {f"{NAME}.sub"}
    assert cycles(g) == [[f"{NAME}.a", f"{NAME}.sub.b"]]


def test_only_the_adapters_import_vllm():
    """No import of vLLM anywhere (functions included) outside ``integration`` and the demo: the core
    runs on a machine without vLLM."""
    bad = []
    for p in PKG.rglob("*.py"):
        if p.relative_to(PKG).parts[0] in VLLM_IMPORTERS:
            continue
        bad += [f"{p.relative_to(PKG)}: {t}" for t, _ in _statements(p) if t.split(".")[0] == "vllm"]
    assert bad == []
