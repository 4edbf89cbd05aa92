"""``ascend-fa doctor``: what this installation can do."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform

COMMAND = "doctor"
HELP = "print versions, every backend with its availability, and the selected backend"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _cann_info() -> dict[str, object]:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    return {
        "toolkit_home": home,
        "toolkit_home_exists": bool(home and os.path.isdir(home)),
        "torch_npu_installed": importlib.util.find_spec("torch_npu") is not None,
    }


def collect() -> dict[str, object]:
    import torch

    import ascend_fa
    from ascend_fa.backends import ENV_VAR, get_backend, list_backends

    backends = [
        {
            "name": i.name,
            "source": i.source,
            "available": i.available,
            "reason": i.reason,
            "priority": i.priority,
        }
        for i in list_backends()
    ]
    try:
        selected: str | None = get_backend().name
        selection_error = None
    except ValueError as exc:
        selected, selection_error = None, str(exc)
    cann = _cann_info()
    npu = next((b for b in backends if b["name"] == "npu"), None)
    cann["torch_npu_importable"] = bool(npu and npu["available"]) or (
        bool(npu)
        and cann["torch_npu_installed"]
        and "import torch_npu failed" not in str(npu["reason"])
    )
    return {
        "ascend_fa": ascend_fa.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "env": {ENV_VAR: os.environ.get(ENV_VAR)},
        "backends": backends,
        "selected": selected,
        "selection_error": selection_error,
        "cann": cann,
    }


def run(args: argparse.Namespace) -> int:
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
