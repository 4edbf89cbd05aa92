"""Benchmarks: each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` and measures its baseline in the same run (ratios, never
absolute claims). :func:`benchmark_modules` discovers them; adding one is adding a
module. ``ascend-fa bench NAME`` is the command line over them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from types import ModuleType

__all__ = ["benchmark_modules", "benchmark_names"]


def benchmark_modules() -> Iterator[ModuleType]:
    """Every benchmark module of this package, sorted by module name."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME"):
            yield module


def benchmark_names() -> list[str]:
    """``NAME`` of every benchmark (what ``ascend-fa bench`` accepts)."""
    return [m.NAME for m in benchmark_modules()]
