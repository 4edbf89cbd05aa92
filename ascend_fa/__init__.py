"""ascend-fa: attention quantization for Huawei Ascend NPUs.

Primitives (NZ layout, per-head INT8) and backend selection are imported eagerly;
the heavier product modules (calibration, KV cache, attention, FP8 conversion) load
on first attribute access so ``import ascend_fa`` stays light and never imports
torch_npu.
"""

from __future__ import annotations

import importlib
from typing import Any

from .atb_ops import (
    ACL_FORMAT_FRACTAL_NZ,
    ACL_FORMAT_ND,
    c0,
    dequantize_per_head,
    nd_to_nz,
    nz_cache_shape,
    nz_to_nd,
    per_head_qparams,
    quantize_per_head,
)
from .backends import AttentionSpec, Backend, get_backend, list_backends, select_backend

__version__ = "0.1.0"

# Public names that live in product modules, loaded on first use: name -> module.
_LAZY: dict[str, str] = {
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
}

__all__ = [
    "ACL_FORMAT_FRACTAL_NZ",
    "ACL_FORMAT_ND",
    "AttentionSpec",
    "Backend",
    "__version__",
    "c0",
    "dequantize_per_head",
    "get_backend",
    "list_backends",
    "nd_to_nz",
    "nz_cache_shape",
    "nz_to_nd",
    "per_head_qparams",
    "quantize_per_head",
    "select_backend",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ascend_fa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
