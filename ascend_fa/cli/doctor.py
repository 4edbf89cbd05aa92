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
    status = 0 if info["main_job"]["can_run"] else 1
    if args.json:
        print(json.dumps(info, indent=2))
        return status
    print(
        f"ascend-fa {info['ascend_fa']}  torch {info['torch']}  python {info['python']}"
    )
    print(f"platform  {info['platform']}")
    print("packages:")
    for name, p in info["packages"].items():
        need = "required" if p["required"] else "optional"
        ver = p["version"] or f"missing ({p['install']})"
        print(f"  {name:<13} {ver}  [{need}]")
    tf = info["transformers"]
    state = "supported" if tf["supported"] else "NOT supported"
    version = tf["version"] or "missing"
    print(f"transformers {version}: {state} (supported: {tf['supported_range']})")
    demo = info["demo_model"]
    if demo["available"]:
        cache = "on" if demo["cache_enabled"] else "off"
        print(f"demo model: {demo['path']} (model cache {cache})")
    else:
        print(f"demo model: missing ({demo['reason']})")
    env = info["env"]
    for key, val in env.items():
        if val is not None or key == "ASCEND_FA_BACKEND":
            print(f"{key}={val if val is not None else '(unset)'}")
    paths = info["cpu_paths"]
    gemm = paths["int_gemm"]
    name = {"int_mm": "torch._int_mm (int8 GEMM)", "fp32": "fp32 GEMM chunks"}
    print(
        f"integer products (W8A8 linears, CPU): "
        f"{name.get(gemm['path'], 'unknown')} ({gemm['reason']})"
    )
    print(f"native CPU kernels: {paths['native']}")
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
    job = info["main_job"]
    if job["can_run"]:
        print("main job (ascend-fa calibrate): ready")
    else:
        missing = "; ".join(job["missing"])
        print(f"main job (ascend-fa calibrate): cannot run; missing {missing}")
    return status
