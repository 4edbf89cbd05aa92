"""``ascend-fa bench NAME``: the benchmarks in :mod:`ascend_fa.benchmarks`.

Each benchmark module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; adding one is adding a module. Every benchmark measures its
baseline in the same run and prints ratios, never absolute claims.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

COMMAND = "bench"
HELP = (
    "run a benchmark (prints a table with ratios against a baseline from the same run)"
)


def _bench_modules():
    import ascend_fa.benchmarks as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if hasattr(module, "NAME"):
            yield module


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for module in _bench_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        p.add_argument(
            "--quick",
            action="store_true",
            help="small sizes and few repeats (CI smoke run)",
        )
        p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
