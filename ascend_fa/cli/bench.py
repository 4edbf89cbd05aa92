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
    "check_counts",
    "bench_parser",
    "run",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ascend_fa.benchmarks import benchmark_index

    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for info in benchmark_index():
        # add_help=False: "--help" after the name is the benchmark's, parsed in run.
        sub.add_parser(info.name, help=info.help, add_help=False)
    cmp = sub.add_parser(
        "compare",
        help="compare two --json result files side by side (change in percent; "
        "slowdowns beyond the measured spread are flagged)",
    )
    cmp.add_argument("a", metavar="A.json")
    cmp.add_argument("b", metavar="B.json")


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
    if not any("--backend" in a.option_strings for a in p._actions):
        from ascend_fa.benchmarks._device import add_backend_argument

        add_backend_argument(p)
    return p


#: Integer options that are not counts (any value is a valid seed).
_NOT_COUNTS = frozenset({"seed"})
#: Counts where 0 has a meaning although the default is not 0 ("0 skips them").
_ZERO_MEANS = frozenset({"long_window"})


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every integer option of a benchmark is a count or a size: > 0, or >= 0
    where its default is 0 or a negative placeholder (0 there means "the
    default") or 0 skips something. One line naming the option, before anything
    runs."""
    from ascend_fa.errors import InputError

    for action in parser._actions:
        if action.type is not int or action.dest in _NOT_COUNTS:
            continue
        zero = action.dest in _ZERO_MEANS
        low = 0 if zero or (action.default is not None and action.default <= 0) else 1
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value != action.default and value < low:
                raise InputError(
                    f"{action.option_strings[0]} must be >= {low}, got {value}"
                )


def _compare(a: str, b: str) -> int:
    from ascend_fa.benchmarks.results import compare_results, load_results
    from ascend_fa.tables import print_table

    doc_a, doc_b = load_results(a), load_results(b)
    headers, rows, regressions = compare_results(doc_a, doc_b)
    env_a, env_b = doc_a.get("environment", {}), doc_b.get("environment", {})
    for label, env in (("A", env_a), ("B", env_b)):
        print(
            f"{label}: ascend-fa {env.get('ascend_fa')}, torch {env.get('torch')}, "
            f"{env.get('device')}, git {env.get('git_revision')}"
        )
    if not rows:
        print("no matching records (same benchmark, backend, mode and parameters)")
        return 1
    print_table(headers, rows)
    print(f"{len(rows)} matching records, {regressions} regression(s)")
    return 0


def _resolve_backend(module, requested: str) -> str:
    """For a CPU-only benchmark: ``auto`` and ``cpu`` run on the CPU; another
    backend (usable here or not) is an error (one line)."""
    from ascend_fa.backends import get_backend
    from ascend_fa.errors import UnsupportedError

    name = get_backend(None if requested == "auto" else requested).name
    if name != "cpu":
        if requested == "auto":
            return "cpu"
        raise UnsupportedError(f"bench {module.NAME} runs on the cpu only, not {name}")
    return name


def run(args: argparse.Namespace) -> int:
    from ascend_fa.benchmarks import load_benchmark

    if args.bench == "compare":
        return _compare(args.a, args.b)
    module = load_benchmark(args.bench)
    parser = bench_parser(module)
    bench_args = parser.parse_args(args.extra_args)
    check_counts(parser, bench_args)
    if not hasattr(module, "BACKENDS"):
        # A benchmark that does not say which devices it runs on runs on the CPU.
        bench_args.backend = _resolve_backend(module, bench_args.backend)
    for key in ("verbose", "quiet"):
        if hasattr(args, key) and not hasattr(bench_args, key):
            setattr(bench_args, key, getattr(args, key))
    return int(module.run(bench_args) or 0)
