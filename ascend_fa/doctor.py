"""The ``doctor`` verb: what this installation can do (versions, backends, CANN)."""

from __future__ import annotations

import importlib.util
import os
import platform

__all__ = ["collect"]


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
