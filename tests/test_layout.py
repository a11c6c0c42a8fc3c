"""The package's house rules, checked: layers, no import cycles, small modules, old paths."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import grimp
import pytest

import dcp_datastates
from dcp_datastates import _moved

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dcp_datastates"
MAX_LINES = 500


def test_each_layer_imports_only_the_layers_below_it():
    """pyproject's import-linter contract (cli > checkpointers > save|load > snapshot > ...).

    In a process of its own: import-linter configures logging with ``dictConfig``, which
    disables every logger that exists, ours included, for the rest of the test session."""
    done = subprocess.run(
        [sys.executable, "-c", _LINT_IMPORTS], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


_LINT_IMPORTS = (
    "from importlinter.cli import lint_imports; "
    "raise SystemExit(lint_imports(no_cache=True, no_logo=True))"
)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_round_a_circle():
    graph = grimp.build_graph("dcp_datastates")
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # The package's __init__ re-exports the public names: it imports, nobody imports it back.
    assert not [m for m in edges if "dcp_datastates" in edges[m] and m != "dcp_datastates"]
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_the_size_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_each_subpackage_says_what_it_owns_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
        if init.parent.name != "integrations":
            assert "may import" in doc.lower(), f"{init.relative_to(ROOT)} names no imports"


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_import_path_gives_the_moved_module_and_names_the_new_one(old):
    new = f"dcp_datastates.{_moved.MOVED[old]}"
    if old.startswith("storage_s3") or old == "_s3_client":
        pytest.importorskip("s3fs")
    module = importlib.import_module(new)
    sys.modules.pop(f"dcp_datastates.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aliased = importlib.import_module(f"dcp_datastates.{old}")
    assert aliased is module  # one object: a patch through either name reaches the code
    assert module.__spec__.name == new  # the module's own identity is untouched
    assert any(new in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_the_public_names_and_a_user_path_still_import():
    from dcp_datastates.writer import DataStatesWriter  # an import a user may have written

    assert DataStatesWriter is dcp_datastates.DataStatesWriter
    assert dcp_datastates.reader.DataStatesReader is dcp_datastates.DataStatesReader
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        dcp_datastates.nonesuch  # noqa: B018


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_our_own_tests_and_scripts_use_no_old_path():
    """A monkeypatch through an old path would still work (same object), but the code we ship
    should read where things are."""
    old = {f"dcp_datastates.{o}" for o in _moved.MOVED}
    users = [*ROOT.glob("tests/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("examples/*.py")]
    users = [p for p in users if p.name != Path(__file__).name]
    found = {str(p.relative_to(ROOT)): sorted(_imported_modules(p) & old) for p in users}
    assert {p: names for p, names in found.items() if names} == {}
