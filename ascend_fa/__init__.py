"""ascend-fa: attention quantization for Huawei Ascend NPUs.

Every public name loads on first attribute access, so ``import ascend_fa`` (and the
``ascend-fa`` command's ``--help``) imports neither torch nor transformers, and it
never imports torch_npu.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names, loaded on first use: name -> module.
_LAZY: dict[str, str] = {
    # op layer: NZ layout and per-head INT8 primitives
    "ACL_FORMAT_FRACTAL_NZ": "ascend_fa.atb_ops",
    "ACL_FORMAT_ND": "ascend_fa.atb_ops",
    "c0": "ascend_fa.atb_ops",
    "dequantize_per_head": "ascend_fa.atb_ops",
    "nd_to_nz": "ascend_fa.atb_ops",
    "nz_cache_shape": "ascend_fa.atb_ops",
    "nz_to_nd": "ascend_fa.atb_ops",
    "per_head_qparams": "ascend_fa.atb_ops",
    "quantize_per_head": "ascend_fa.atb_ops",
    # device layer: backends and selection
    "AttentionSpec": "ascend_fa.backends",
    "Backend": "ascend_fa.backends",
    "get_backend": "ascend_fa.backends",
    "list_backends": "ascend_fa.backends",
    "select_backend": "ascend_fa.backends",
    # calibration engine
    "recall_window": "ascend_fa.calibration",
    # paged KV cache and attention
    "reshape_and_cache": "ascend_fa.attention",
    "reshape_and_cache_mla": "ascend_fa.attention",
    "paged_attention": "ascend_fa.attention",
    "mla_paged_attention": "ascend_fa.attention",
    "prefill_attention": "ascend_fa.attention",
    "mla_prefill_attention": "ascend_fa.attention",
    "PagedKVCache": "ascend_fa.kvcache",
    "enable_paged_int8_attention": "ascend_fa.emulation",
    "QuantizedKVRuntime": "ascend_fa.emulation",
    # DeepSeek FP8 block weights
    "quantize_blockwise": "ascend_fa.fp8",
    "dequantize_blockwise": "ascend_fa.fp8",
    "quantize_checkpoint": "ascend_fa.fp8",
    "dequantize_checkpoint": "ascend_fa.fp8",
    # library verbs (what the CLI commands call)
    "calibrate": "ascend_fa.calibration.job",
    "export_artifact": "ascend_fa.artifact",
    "inspect_artifact": "ascend_fa.artifact",
    "run_eval": "ascend_fa.evaluation",
    "run_emulate": "ascend_fa.emulation.verb",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ascend_fa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
