"""``ascend-fa selftest [--backend NAME] [--json]``: every cache write, attention
variant and W8A8 linear op on a backend against the CPU golden references (see
:mod:`ascend_fa.selftest`). Prints a table (op, shapes, max error, budget, status)
or, with ``--json``, one JSON document. Exit status 1 when any case fails; 2 (one
line) when the backend cannot be used here, e.g. ``npu`` without torch_npu."""

from __future__ import annotations

import argparse
import json

COMMAND = "selftest"
HELP = "run every cache/attention/linear op on a backend vs the CPU reference"

__all__ = ["COMMAND", "HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default=None, help="backend name (default: the selected backend)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON document"
    )


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def run(args: argparse.Namespace) -> int:
    from ascend_fa.benchmarks._util import print_table
    from ascend_fa.selftest import run_selftest

    result = run_selftest(args.backend, seed=args.seed)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    release = f", torch_npu {result.release}" if result.release else ""
    print_table(
        ["op", "shapes", "max error", "budget", "status", "detail"],
        [
            [r.op, r.shapes, _num(r.max_error), _num(r.budget), r.status, r.detail]
            for r in result.rows
        ],
        title=f"ascend-fa selftest on backend {result.backend!r} "
        f"(device {result.device}{release})",
    )
    c = result.counts
    print(f"{c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped")
    return 0 if result.ok else 1
