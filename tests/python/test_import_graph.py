"""The safepoint package imports its own modules as a DAG: no module imports (at module level or
inside a function) a module that imports it back, directly or through others. Read from the
sources with ast, without importing anything."""

from __future__ import annotations

import ast
import os
import re

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE = os.path.join(REPO, "python", "safepoint")


def native_modules() -> set[str]:
    """The compiled modules of the package (safepoint._core, ...): the targets CMakeLists.txt
    builds with nanobind_add_module or Python_add_library. They import no package module."""
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        text = f.read()
    names = re.findall(r"(?:nanobind_add_module|Python_add_library)\((\w+)", text)
    return {f"safepoint.{n}" for n in names}


def package_modules() -> dict[str, str]:
    """Module name -> source path of every .py file of python/safepoint ("" for a compiled
    module)."""
    out = dict.fromkeys(native_modules(), "")
    for root, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PACKAGE))[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = os.path.join(root, f)
    return out


def imported_modules(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules `name` imports anywhere in its source (every `import safepoint.x`
    and `from safepoint.x import y` statement, including those inside functions). `from P import
    y` imports P's module, or P.y where y is a module of the package; importing a submodule
    runs its package's __init__ first, but that edge is left out: every module has it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package that holds `name`
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs)
            if len(subs) < len(node.names):  # some names are attributes of `target` itself
                found.add(target)
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of `graph` as [a, b, ..., a], or [] when it is a DAG (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_package_imports_its_modules_without_a_cycle():
    modules = package_modules()
    assert "safepoint._checkpointer" in modules and "safepoint._api" in modules
    assert "safepoint._core" in modules
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()
             if path}
    assert "safepoint._api" in graph["safepoint._ckpt_restore"]  # the walk sees imports
    # Checkpointer is made of parts by job, each in its own module (_ckpt_base says which)
    assert {"safepoint._ckpt_save", "safepoint._ckpt_restore",
            "safepoint._ckpt_status"} <= graph["safepoint._checkpointer"]
    assert "safepoint._ckpt_preemption" in graph["safepoint._ckpt_save"]
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in python/safepoint: " + " -> ".join(cycle)


def test_no_module_of_the_package_passes_1000_lines():
    """A module that grows past this is split by job (as Checkpointer was: _ckpt_base)."""
    long = {}
    for name, path in package_modules().items():
        if path:
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > 1000:
                long[name] = n
    assert not long, f"modules over 1,000 lines: {long}"


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, True),
])
def test_find_cycle_tells_a_dag_from_a_cycle(graph, cycle):
    assert bool(find_cycle(graph)) == cycle


def test_function_level_imports_count(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    modules = {"pkg": str(pkg / "__init__.py"), "pkg.a": str(pkg / "a.py"),
               "pkg.b": str(pkg / "b.py")}
    graph = {n: imported_modules(n, p, modules) for n, p in modules.items()}
    assert graph["pkg.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
