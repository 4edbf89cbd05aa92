"""The layering rules of the architecture, checked on the source with ``ast``.

* imports only go down: ``atb_ops`` imports only ``atb_ops``; ``backends`` only
  ``backends`` and ``atb_ops``;
* nothing outside ``ascend_fa/cli/`` (and ``__main__``) imports ``ascend_fa.cli``;
* no import cycle between modules (function-local imports count);
* no ``_private`` name imported from another module;
* no ``module._modules[...] = ...`` writes;
* product modules are at most 700 lines;
* ``import ascend_fa`` loads neither torch nor torch_npu.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "ascend_fa": "ascend_fa",
    "backends": "ascend_fa.backends",
    "atb_ops": "ascend_fa.atb_ops",
}
MAX_PRODUCT_LINES = 700


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            is_pkg = rel[-1] == "__init__"
            parts = rel[:-1] if is_pkg else rel
            out[".".join((pkg, *parts))] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _owner(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> list[tuple[str, str, list[str], int]]:
    """``(importer, imported module, names, line)`` for imports of our modules."""
    edges = []
    for mod, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                tgt = _resolve(mod, is_pkg, node.level, node.module)
                for alias in node.names:
                    sub = f"{tgt}.{alias.name}"
                    if sub in MODULES:
                        edges.append((mod, sub, [], node.lineno))
                    elif _owner(tgt):
                        edges.append((mod, _owner(tgt), [alias.name], node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _owner(alias.name):
                        edges.append((mod, _owner(alias.name), [], node.lineno))
    return [e for e in edges if e[1] and e[1].startswith("ascend_fa")]


EDGES = _edges()


def test_imports_only_go_down():
    bad = []
    for src, dst, _names, line in EDGES:
        if src.startswith("ascend_fa.atb_ops") and not dst.startswith(
            "ascend_fa.atb_ops"
        ):
            bad.append(f"{src}:{line} -> {dst}")
        if src.startswith("ascend_fa.backends") and not dst.startswith(
            ("ascend_fa.backends", "ascend_fa.atb_ops")
        ):
            bad.append(f"{src}:{line} -> {dst}")
    assert not bad, bad


def test_only_the_cli_imports_the_cli():
    bad = [
        f"{src}:{line}"
        for src, dst, _n, line in EDGES
        if dst.startswith("ascend_fa.cli")
        and not src.startswith("ascend_fa.cli")
        and src != "ascend_fa.__main__"
    ]
    assert not bad, bad


def test_no_import_cycle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst, _n, _line in EDGES:
        if src != dst:
            graph[src].add(dst)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_no_private_name_crosses_modules():
    bad = [
        f"{src}:{line} imports {n} from {dst}"
        for src, dst, names, line in EDGES
        for n in names
        if n.startswith("_") and not n.startswith("__") and src != dst
    ]
    assert not bad, bad


def test_no_direct_modules_writes():
    bad = []
    for mod, (path, _pkg) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                for t in targets:
                    if (
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Attribute)
                        and t.value.attr == "_modules"
                    ):
                        bad.append(f"{mod}:{node.lineno}")
    assert not bad, bad


def test_product_modules_are_small():
    big = []
    for mod, (path, _pkg) in MODULES.items():
        if mod.startswith(("ascend_fa.backends", "ascend_fa.atb_ops")):
            continue
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_PRODUCT_LINES:
            big.append(f"{mod}: {n} lines")
    assert not big, big


@pytest.mark.parametrize("module", ["ascend_fa", "ascend_fa.cli"])
def test_import_is_light(module):
    code = (
        f"import sys, {module}; "
        "print(int('torch' in sys.modules), int('torch_npu' in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["0", "0"], f"import {module} loaded torch/torch_npu: {out}"
