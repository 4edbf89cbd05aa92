"""Benchmarks: each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` and measures its baseline in the same run (ratios, never
absolute claims). Adding one is adding a module.

:func:`benchmark_index` lists them by reading each module's ``NAME`` and ``HELP``
from its source (``ast``), without importing it, so ``ascend-fa --help`` and
``ascend-fa bench --help`` answer without loading torch; :func:`load_benchmark`
imports one when it runs.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = [
    "BenchmarkInfo",
    "benchmark_index",
    "benchmark_modules",
    "benchmark_names",
    "load_benchmark",
]


@dataclass(frozen=True)
class BenchmarkInfo:
    """One benchmark: its command ``name``, one-line ``help`` and module name."""

    name: str
    help: str
    module: str


def _constants(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in ("NAME", "HELP")
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                out[node.targets[0].id] = value
    return out


def benchmark_index() -> list[BenchmarkInfo]:
    """Every benchmark module of this package (sorted by module name), read from
    source."""
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        consts = _constants(Path(__path__[0]) / f"{info.name}.py")
        if "NAME" in consts:
            out.append(
                BenchmarkInfo(
                    consts["NAME"], consts.get("HELP", ""), f"{__name__}.{info.name}"
                )
            )
    return out


def benchmark_names() -> list[str]:
    """``NAME`` of every benchmark (what ``ascend-fa bench`` accepts)."""
    return [b.name for b in benchmark_index()]


def load_benchmark(name: str) -> ModuleType:
    """Import the benchmark called ``name`` (``ValueError`` listing the names)."""
    for info in benchmark_index():
        if info.name == name:
            return importlib.import_module(info.module)
    raise ValueError(
        f"unknown benchmark {name!r}; benchmarks: {', '.join(benchmark_names())}"
    )


def benchmark_modules() -> Iterator[ModuleType]:
    """Every benchmark module, imported."""
    for info in benchmark_index():
        yield importlib.import_module(info.module)
