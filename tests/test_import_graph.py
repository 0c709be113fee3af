"""lora_lab's modules import each other without a circle: the graph of who imports whom is a stack of floors, each
module using only floors below it.

The graph is read from the source with :mod:`ast`, not by importing anything. Its rules:

* a node is a file; a package's ``__init__.py`` is a node of its own, named after the package;
* every import statement counts, at module level or inside a function, a class, a ``try`` or an ``if``: a circle
  hidden behind a deferred import is still a circle;
* ``if TYPE_CHECKING:`` imports count too: an annotation that names another module's class depends on that
  module as much as a call does, and moving an import under ``TYPE_CHECKING`` only hides a circle;
* ``import a.b.c`` and ``from a.b import c`` (``c`` a submodule) are an edge to ``a.b.c``; the parent packages that
  Python runs first are not edges, or every module would depend on ``lora_lab/__init__.py`` (which imports the
  library's top level) and the whole graph would be one circle that says nothing;
* ``from a.b import name``, where the package ``a.b`` only re-exports ``name`` from a submodule, is an edge to the
  submodule that defines ``name``: that is the code depended on, the ``__init__`` only forwards it. A module inside
  ``a.b`` that takes a name from ``a.b``'s own ``__init__`` depends on that ``__init__`` as well (the name must be
  bound there before the module finishes), so such an import also gets an edge to ``a.b``;
* relative imports are resolved against the importing module's package.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root / package``, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_package(modules: dict[str, Path], name: str) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _definer(modules: dict[str, Path], package: str, name: str, seen: frozenset = frozenset()) -> str:
    """The module that defines ``name`` which ``package``'s ``__init__`` re-exports; ``package`` if it defines it
    itself (or the chain cannot be followed cheaply)."""
    if (package, name) in seen or not _is_package(modules, package):
        return package
    tree = ast.parse(modules[package].read_text(), filename=str(modules[package]))
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _absolute(node, package, is_package=True)
        for alias in node.names:
            if (alias.asname or alias.name) != name or source is None:
                continue
            if f"{source}.{alias.name}" in modules:
                return f"{source}.{alias.name}"
            if source in modules:
                return _definer(modules, source, alias.name, seen | {(package, name)})
    return package


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str | None:
    """The absolute module name of ``from <node.module> import ...`` written in module ``importer``."""
    if not node.level:
        return node.module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or None


def _known(modules: dict[str, Path], dotted: str) -> str | None:
    """``dotted`` if it is a module here, else its longest prefix that is one (``None`` outside the package)."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(root: Path, package: str) -> dict[str, dict[str, list[str]]]:
    """``graph[a][b]``: where (``path:line``) module ``a`` imports module ``b``, for every module of ``package``."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in modules}
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        where = f"{path.relative_to(root).as_posix()}:"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_known(modules, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, importer, _is_package(modules, importer))
                if source is None or _known(modules, source) is None:
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        targets.append(f"{source}.{alias.name}")
                        continue
                    defined_in = _definer(modules, source, alias.name) if source in modules else None
                    targets.append(defined_in or _known(modules, source))
                    if defined_in not in (None, source) and importer.startswith(source + "."):
                        targets.append(source)
            for target in targets:
                lines = graph[importer].setdefault(target, []) if target is not None else []
                if target is not None and f"{where}{node.lineno}" not in lines:
                    lines.append(f"{where}{node.lineno}")
    return graph


def circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one module, plus modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is ~100 modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def floors(graph: dict[str, dict[str, list[str]]]) -> dict[str, int]:
    """Each module's floor: 0 when it imports nothing of the package, else one above the highest it imports (the
    members of a circle share one floor)."""
    component_of = {}
    for component in circles(graph):
        for member in component:
            component_of[member] = tuple(component)
    floor: dict[str, int] = {}

    def height(node: str) -> int:
        if node not in floor:
            members = component_of.get(node, (node,))
            below = [succ for member in members for succ in graph[member] if succ not in members]
            level = 1 + max((height(succ) for succ in below), default=-1)
            for member in members:
                floor[member] = level
        return floor[node]

    for node in graph:
        height(node)
    return floor


def describe(graph: dict[str, dict[str, list[str]]], component: list[str]) -> str:
    edges = [f"    {a} -> {b}  ({', '.join(graph[a][b])})" for a in component for b in component if b in graph[a]]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_lora_lab_has_no_import_circle():
    graph = import_graph(ROOT, "lora_lab")
    assert "lora_lab.targets" in graph["lora_lab.layer"]  # the walk sees the package (no vacuous pass)
    found = circles(graph)
    assert not found, f"{len(found)} import circle(s) in lora_lab:\n" + "\n".join(describe(graph, c) for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_deferred_import_closes_a_circle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n",
                      "pkg/b.py": "def f():\n    from pkg.a import x\n    return x\n"})
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"]]


def test_a_type_checking_import_closes_a_circle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
                      "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"})
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"]]


def test_a_re_exported_name_is_an_edge_to_the_module_that_defines_it(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from pkg.sub import thing\n",
                      "pkg/sub/__init__.py": "from .impl import thing as thing\n", "pkg/sub/impl.py": "thing = 1\n",
                      "pkg/user.py": "from pkg.sub import thing\n", "pkg/other.py": "from pkg import thing\n"})
    graph = import_graph(tmp_path, "pkg")
    assert set(graph["pkg.user"]) == set(graph["pkg.sub"]) == set(graph["pkg"]) == {"pkg.sub.impl"}
    assert set(graph["pkg.other"]) == {"pkg.sub.impl", "pkg"}  # pkg.other is inside pkg: it needs pkg's __init__


def test_a_module_taking_a_name_from_its_own_package_init_is_a_circle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from pkg.a import x\nfrom pkg.b import y\n",
                      "pkg/a.py": "x = 1\n", "pkg/b.py": "def y():\n    from pkg import x\n    return x\n"})
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.b"]]


def test_relative_imports_and_self_imports(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/sub/__init__.py": "from . import a\n",
                      "pkg/sub/a.py": "from ..b import f\n", "pkg/b.py": "from .sub import a\n",
                      "pkg/c.py": "import pkg.c\n"})
    graph = import_graph(tmp_path, "pkg")
    assert set(graph["pkg.sub"]) == {"pkg.sub.a"}
    assert set(graph["pkg.sub.a"]) == {"pkg.b"}
    assert circles(graph) == [["pkg.b", "pkg.sub.a"], ["pkg.c"]]


def test_floors_stack_what_imports_nothing_at_the_bottom(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from pkg import top\n", "pkg/base.py": "",
                      "pkg/mid.py": "from pkg.base import x\n", "pkg/top.py": "import pkg.mid\nimport pkg.base\n"})
    assert floors(import_graph(tmp_path, "pkg")) == {"pkg": 3, "pkg.top": 2, "pkg.mid": 1, "pkg.base": 0}
