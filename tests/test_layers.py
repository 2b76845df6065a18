"""The layers as tests: import-linter's contracts (pyproject.toml) hold, no two modules of ours import each other,
and our modules import ours only at their top.

import-linter's acyclic_siblings contract sees cycles between sibling modules only; a package that imports its
own submodules while they import the package back is a cycle too, so the module graph is checked here as well.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("store", "collector", "analyzer", "enforcer", "ui", "dags")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def import_cycles(*packages: str) -> list[str]:
    """Every import cycle between modules of `packages`, one per strongly connected group, as 'a -> b -> a'."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        # Tarjan's strongly connected components, iteratively: the graph is deep enough to hit the recursion limit
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
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
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    cycles = []
    for group in groups:
        first = min(group)
        back = min(m for m in graph.find_modules_directly_imported_by(first) if m in group)
        chain = graph.find_shortest_chain(importer=back, imported=first)
        cycles.append(" -> ".join((first, *chain)))
    return sorted(cycles)


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_contracts() -> None:
    """`make test` runs lint-imports itself and deselects this one; a bare `pytest` checks the contracts here."""
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_no_import_cycle_between_two_modules_of_ours() -> None:
    assert import_cycles(*PACKAGES) == []


def imports_inside_functions(root: Path, packages: tuple[str, ...]) -> list[str]:
    """'path:line: module' for every import of one of `packages` made inside a function or method."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names = [node.module]
                    elif isinstance(node, ast.Import):
                        names = [alias.name for alias in node.names]
                    else:
                        continue
                    found.extend(f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names
                                 if name.split(".")[0] in packages)
    return sorted(set(found))


def test_our_modules_import_each_other_at_the_top_only(tmp_path: Path) -> None:
    """A module's imports of ours stand at its top, where a reader sees what it depends on."""
    assert imports_inside_functions(ROOT, PACKAGES) == []
    (tmp_path / "store").mkdir()
    late = "import os\n\n\ndef f():\n    import os.path\n    from store import db\n"
    (tmp_path / "store" / "late.py").write_text(late)
    assert imports_inside_functions(tmp_path, ("store",)) == ["store/late.py:6: store"]


def test_cycle_finder_names_each_chain(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "cycleprobe"
    (pkg / "rules").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import cycleprobe.b\n",
        "b.py": "import cycleprobe.c\n",
        "c.py": "def f():\n    import cycleprobe.a  # inside a function is still an import\n",
        "clean.py": "import cycleprobe.a\n",
        # the package runs its submodules while they take a helper from the package: the analyzer's old rules shape
        "rules/__init__.py": "from cycleprobe.rules import one\n\n\ndef helper():\n    pass\n",
        "rules/one.py": "from cycleprobe.rules import helper\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cycleprobe") == [
        "cycleprobe.a -> cycleprobe.b -> cycleprobe.c -> cycleprobe.a",
        "cycleprobe.rules -> cycleprobe.rules.one -> cycleprobe.rules",
    ]


def test_contracts_refuse_each_kind_of_wrong_import(tmp_path: Path) -> None:
    """The contracts on a copy of the tree with one wrong import per contract: each one is reported broken."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0  # the copy itself is clean
    wrong = {
        "enforcer/probe_up.py": "import collector.spool\n",  # a lower layer importing a higher one
        "collector/probe_planner.py": "import enforcer.planner\n",  # past the gate and lanes
        "dags/probe_inner.py": "import analyzer.rollups\n",  # not an entry point
        "store/probe_heavy.py": "import streamlit\n",  # the core must install without the dashboard
        "analyzer/probe_a.py": "import analyzer.probe_b\n",
        "analyzer/probe_b.py": "import analyzer.probe_a\n",
    }
    for name, text in wrong.items():
        (tmp_path / name).write_text(text)
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    out = " ".join(done.stdout.split())  # rich wraps long contract names
    assert "kept, 5 broken" in out, out
    for expected in ("enforcer.probe_up -> collector.spool", "collector.probe_planner -> enforcer.planner",
                     "dags.probe_inner -> analyzer.rollups", "store.probe_heavy -> streamlit",
                     "No cycles are allowed in analyzer"):
        assert expected in out, expected
