"""``ascend-fa doctor``: what this installation can do (see
:func:`ascend_fa.doctor.collect`)."""

from __future__ import annotations

import argparse
import json

COMMAND = "doctor"
HELP = "print versions, every backend with its availability, and the selected backend"

__all__ = ["COMMAND", "HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ascend_fa.doctor import collect

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0 if info["selected"] else 1
    print(
        f"ascend-fa {info['ascend_fa']}  torch {info['torch']}  python {info['python']}"
    )
    print(f"platform  {info['platform']}")
    env = info["env"]
    for key, val in env.items():
        print(f"{key}={val if val is not None else '(unset)'}")
    print("backends:")
    for b in info["backends"]:
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        print(f"  {b['name']:<8} {state}  [{b['source']}, priority {b['priority']}]")
    if info["selected"]:
        print(f"selected backend: {info['selected']}")
    else:
        print(f"selected backend: none ({info['selection_error']})")
    cann = info["cann"]
    print(
        "CANN toolkit:",
        cann["toolkit_home"] or "not found (ASCEND_TOOLKIT_HOME unset)",
    )
    print(
        f"torch_npu installed: {cann['torch_npu_installed']}  "
        f"importable: {cann['torch_npu_importable']}"
    )
    return 0 if info["selected"] else 1
