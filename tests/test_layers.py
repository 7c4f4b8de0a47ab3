"""The package's layers point one way: no module cycle, and no two subpackages import each other.

Every import counts, a late one inside a function too (it is still a dependency), except those
only type checkers read. A top-level module (`slurmddp.protocol`, `errors`, `files`, ...) is a
layer of its own.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "slurmddp"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other slurmddp modules."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in named if t in modules]
                if len(targets) < len(named):
                    targets.append(node.module)
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_no_two_subpackages_import_each_other():
    edges = _imports(_modules())
    pairs = defaultdict(set)
    for module, targets in edges.items():
        for target in targets:
            if _layer(module) != _layer(target):
                pairs[_layer(module), _layer(target)].add(f"{module} -> {target}")
    both = {tuple(sorted(p)) for p in pairs if p[::-1] in pairs}
    assert not both, {p: sorted(pairs[p] | pairs[p[::-1]]) for p in both}


def test_no_module_cycle():
    edges = _imports(_modules())
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:  # depth first; a module met again on the path is a cycle
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module):], module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(edges.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(_modules()):
        visit(module)


def test_the_placement_modules_import_only_the_core():
    # slurmddp.rank is the bottom: a module of it imports only its own and the top-level modules.
    edges = _imports(_modules())
    core = {m for m in _modules() if m.count(".") == 1 and not (PACKAGE / _layer(m)).is_dir()}
    above = {m: sorted(t - core) for m, t in edges.items() if _layer(m) == "rank"
             and {x for x in t - core if _layer(x) != "rank"}}  # fmt: skip
    assert not above, above
