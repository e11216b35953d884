"""The package's own imports form no circle: arrows point one way (cli -> followers, writers, readers, fleet ->
codec, storage -> format -> errors). Lazy imports inside functions count (they are dependencies all the same);
imports only type checkers see (``if TYPE_CHECKING:``) do not."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptstream

PACKAGE = Path(ckptstream.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name imported from a package is its submodule where one
    is so named)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_package():
    assert circles(import_graph()) == []


def test_the_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_follower_package_folders_point_one_way():
    """vllm_loader's folders: follow/ and adapters/ use inplace/ and the edge's client and observers; inplace/
    uses neither follow/ nor adapters/; follow/ does not use adapters/."""
    graph = import_graph()

    def uses(folder: str, other: str) -> list[str]:
        return sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(f"ckptstream.vllm_loader.{folder}")
                      for t in targets if t.startswith(f"ckptstream.vllm_loader.{other}"))

    assert uses("inplace", "follow") == [] and uses("inplace", "adapters") == []
    assert uses("follow", "adapters") == []


def test_the_follower_package_modules_stay_readable():
    """No module of vllm_loader over 600 lines: a module that grows past it holds more than one job."""
    folder = PACKAGE / "vllm_loader"
    long = {str(p.relative_to(folder)): n for p in folder.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
