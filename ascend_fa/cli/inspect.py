"""``ascend-fa inspect DIR``: validate an FA artifact (ours or msModelSlim's).

The checks are :func:`ascend_fa.artifact.inspect_artifact`'s. Exit status 0 when
valid, 1 with the list of findings otherwise (a release of the target that cannot
load the artifact is a finding naming the release, the rule and its citation), 2
for a bad argument (an unknown ``--target`` or ``--consumer-version``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

COMMAND = "inspect"
HELP = "validate an FA artifact directory and print a summary"

__all__ = ["COMMAND", "HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="artifact directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--target",
        default=None,
        help="judge as this consumer does: mindie, vllm-ascend or vllm (default: "
        "the target recorded in the artifact)",
    )
    parser.add_argument(
        "--consumer-version",
        default=None,
        metavar="V",
        help="judge for this release of the target: vllm-ascend 0.13.0, 0.18.0, "
        "0.23.0.post1, 0.25.1rc1 or main; mindie 3.0.0 (default: the target's "
        "newest stable release, vllm-ascend 0.23.0.post1, mindie 3.0.0; "
        "--target vllm has no release table)",
    )


def _print(result: dict[str, Any]) -> None:
    from ascend_fa.artifact import FA_BRANCHES

    s = result["summary"]
    print(f"artifact {result['dir']}")
    if s:
        print(
            f"  target {s['target'] or '-'} {s.get('consumer_version') or ''}"
            f"  model_quant_type {s['model_quant_type']}"
            f"  fa_quant_type {s['fa_quant_type']}  kv_cache_type "
            f"{s['kv_cache_type']}  version {s['version']}"
        )
        print(
            f"  {s['tensors']} tensors in {len(s['weight_files'])} file(s), "
            f"{s['weight_bytes'] / 2**20:.1f} MiB; {s['description_entries']} "
            f"description entries; {s['fa_modules']} FA modules"
        )
    if result["layers"]:
        print(
            f"  {'module':<40} {'q heads':>7} {'kv heads':>8} "
            f"{'q scale min..max':>21} {'k scale min..max':>21} "
            f"{'v scale min..max':>21}"
        )
        for row in result["layers"]:
            cells = []
            for b in FA_BRANCHES:
                r = row.get(b)
                ok = r and r["min"] is not None
                cells.append(f"{r['min']:.3g}..{r['max']:.3g}" if ok else "-")
            q = row.get("fa_q", {}).get("heads", "-")
            print(
                f"  {row['module']:<40} {q!s:>7} {row['kv_heads']!s:>8} "
                f"{cells[0]:>21} {cells[1]:>21} {cells[2]:>21}"
            )
    for note in result.get("notes", []):
        print(f"note: {note}")
    if result["valid"]:
        print("valid")
    else:
        print(f"INVALID: {len(result['findings'])} finding(s)")
        for f in result["findings"]:
            print(f"  - {f}")


def run(args: argparse.Namespace) -> int:
    from ascend_fa.artifact import inspect_artifact

    result = inspect_artifact(
        args.dir, target=args.target, consumer_version=args.consumer_version
    )
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        _print(result)
    return 0 if result["valid"] else 1
