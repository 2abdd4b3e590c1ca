"""The shape of the code, checked: the layers of pyproject's import-linter contracts
hold, and no two modules import each other, directly or around a loop (imports inside
functions count: they tie modules together as much as the ones at the top)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

from pinfeed_server import engine
from tests.launcher import REPO


def test_the_layers_hold() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"  # import-linter's command
    out = subprocess.run([lint_imports, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_import_cycles() -> None:
    graph = grimp.build_graph("pinfeed", "pinfeed_server")
    assert len(graph.modules) > 60  # every package was read (a folder without __init__ is not)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    """The check above cannot pass by finding nothing: a loop it must see."""
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def _isort_key(name: str) -> tuple[int, str]:
    """``__all__``'s order as ruff keeps it (RUF022): constants, classes, the rest."""
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def test_the_engine_has_a_front_door() -> None:
    """What the service uses of the engine, re-exported by ``pinfeed_server.engine`` (the
    service imports nothing else from inside it: pyproject's contract, checked above)."""
    assert engine.__all__ == sorted(engine.__all__, key=_isort_key)
    for name in engine.__all__:
        assert hasattr(engine, name), name
    assert {"DataPlaneServer", "LoaderEngine", "prepare"} <= set(engine.__all__)
