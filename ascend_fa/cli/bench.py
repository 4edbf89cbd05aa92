"""``ascend-fa bench NAME``: the benchmarks in :mod:`ascend_fa.benchmarks`.

Every benchmark measures its baseline in the same run and prints ratios, never
absolute claims (see :func:`ascend_fa.benchmarks.benchmark_modules`).
"""

from __future__ import annotations

import argparse

COMMAND = "bench"
HELP = (
    "run a benchmark (prints a table with ratios against a baseline from the same run)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ascend_fa.benchmarks import benchmark_modules

    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for module in benchmark_modules():
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
