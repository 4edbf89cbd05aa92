"""The ascend-fa vLLM plugin: Ascend-quantized artifacts served by real vLLM on a
CPU, with the device's integer numerics.

vLLM runs :func:`register` in each of its processes (entry point
``vllm.general_plugins`` -> ``ascend_fa = ascend_fa.serving:register`` in
pyproject.toml). It registers the quantization method ``"ascend"``
(:mod:`.vllm_config`), which reads the artifact's
``quant_model_description.json`` and runs its W8A8 / W8A8_DYNAMIC linears with
:mod:`ascend_fa.linear.modules` (the ``eval`` / ``emulate`` code).

The plugin is inert where vllm-ascend serves (its ``"ascend"`` method is the real
one): when ``vllm_ascend`` is importable or the platform is not vLLM's CPU
platform. Nothing here imports vLLM until :func:`register` runs.
"""

from __future__ import annotations

import importlib.util

__all__ = ["inactive_reason", "register"]


def inactive_reason() -> str | None:
    """Why the plugin stays inert in this process (None: it registers)."""
    if importlib.util.find_spec("vllm_ascend") is not None:
        return "vllm_ascend is installed (its 'ascend' quantization serves)"
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:  # no vLLM here (or a broken one): nothing to serve
        return f"vLLM is not importable here ({type(exc).__name__}: {exc})"

    if not current_platform.is_cpu():
        return f"vLLM's platform is {current_platform.device_type!r}, not 'cpu'"
    return None


def register() -> None:
    """vLLM's ``general_plugins`` hook: register the ``"ascend"`` quantization
    on vLLM's CPU platform (idempotent: vLLM may call it more than once)."""
    if inactive_reason() is not None:
        return
    from . import vllm_config  # noqa: F401  (registers on import)
