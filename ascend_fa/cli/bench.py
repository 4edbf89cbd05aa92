"""``ascend-fa bench NAME [options]``: the benchmarks in :mod:`ascend_fa.benchmarks`.

Every benchmark measures its baseline in the same run and prints ratios, never
absolute claims. The list of benchmarks is read without importing them; a
benchmark's own options (``ascend-fa bench NAME --help``) are parsed once it is
chosen.
"""

from __future__ import annotations

import argparse

COMMAND = "bench"
HELP = (
    "run a benchmark (prints a table with ratios against a baseline from the same run)"
)
#: The benchmark's own options are parsed by :func:`run` from the leftover argv.
TAKES_EXTRA_ARGS = True

__all__ = [
    "COMMAND",
    "HELP",
    "TAKES_EXTRA_ARGS",
    "add_arguments",
    "bench_parser",
    "run",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ascend_fa.benchmarks import benchmark_index

    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for info in benchmark_index():
        # add_help=False: "--help" after the name is the benchmark's, parsed in run.
        sub.add_parser(info.name, help=info.help, add_help=False)


def bench_parser(module) -> argparse.ArgumentParser:
    """The full option parser of one benchmark module: the common flags, then the
    module's own."""
    p = argparse.ArgumentParser(
        prog=f"ascend-fa bench {module.NAME}", description=module.HELP
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats (CI smoke run)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    module.add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ascend_fa.benchmarks import load_benchmark

    module = load_benchmark(args.bench)
    bench_args = bench_parser(module).parse_args(args.extra_args)
    for key in ("verbose", "quiet"):
        if hasattr(args, key) and not hasattr(bench_args, key):
            setattr(bench_args, key, getattr(args, key))
    return int(module.run(bench_args) or 0)
