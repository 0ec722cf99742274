"""The house rules of the package, read from its source with ``ast`` so that they stay true
(docs/architecture.md draws the layers):

- no import circle anywhere in ``deferfuse/``: imports inside functions count, since a circle
  of lazy imports is still two modules that cannot be understood (or moved) one without the other;
- no file over 900 lines;
- no ``_private`` name of one module used by another, whether imported (``from .x import _y``)
  or reached through an imported module (``x._y``): what is shared is public, in a module of its own;
- no ``os.environ`` outside ``config.py``, which reads every setting and variable.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict
from typing import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "deferfuse"
MAX_LINES = 900


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str) -> Iterator[tuple[ast.AST, str, str]]:
    """(node, imported module, imported name or '') for every import of a deferfuse module."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE.name:
                continue
            for alias in node.names:
                yield node, target, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE.name:
                    yield node, alias.name, ""


def _dependencies() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for _, target, name in _imports(module):
            submodule = f"{target}.{name}"
            dependency = submodule if submodule in MODULES else target
            if dependency in MODULES and dependency != module:
                graph[module].add(dependency)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in MODULES:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
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
                    circles.append(sorted(component))
    return circles


def test_no_import_circle():
    assert _circles(_dependencies()) == []


def test_no_file_is_too_long():
    long = {str(path.relative_to(PACKAGE)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_crosses_modules():
    crossings = []
    for module, tree in TREES.items():
        sibling_modules: dict[str, str] = {}   # local name -> deferfuse module it names
        for node, target, name in _imports(module):
            submodule = f"{target}.{name}"
            if name and submodule in MODULES:
                local = next(a.asname or a.name for a in node.names if a.name == name)
                sibling_modules[local] = submodule
            elif not name and isinstance(node, ast.Import):
                alias = next(a for a in node.names if a.name == target)
                if alias.asname:
                    sibling_modules[alias.asname] = target
            if name and _private(name) and submodule not in MODULES and target != module:
                crossings.append(f"{module}:{node.lineno} imports {name} from {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in sibling_modules and _private(node.attr) \
                    and sibling_modules[node.value.id] != module:
                crossings.append(f"{module}:{node.lineno} uses {sibling_modules[node.value.id]}.{node.attr}")
    assert crossings == []


def test_environment_is_read_in_config_only():
    readers = [f"{module}:{node.lineno}" for module, tree in TREES.items() if module != f"{PACKAGE.name}.config"
               for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
               and isinstance(node.value, ast.Name) and node.value.id == "os"]
    assert readers == []
