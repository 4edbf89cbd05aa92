"""Op layer: every Ascend op ascend-fa depends on, defined once.

Each op is a ``torch.library`` custom op in the ``ascend_fa`` namespace whose default
kernel is the PyTorch implementation (the CPU/CUDA emulation), with a fake kernel for
shape propagation and a plain-Python golden reference ``<op>_ref`` for tests. The NPU
backend registers ``npu`` kernels for these ops after importing torch_npu.

Nothing here imports from ``ascend_fa.backends`` or the product layer.
"""

from __future__ import annotations

from .attention import (
    PagedAttentionInfo,
    check_mla_attention,
    check_paged_attention,
    dynamic_query_scale,
    mla_paged_attention_ref,
    mla_prefill_attention_ref,
    paged_attention_ref,
    prefill_attention_ref,
)
from .cache import (
    CacheGeometry,
    check_reshape_and_cache,
    check_reshape_and_cache_mla,
    reshape_and_cache_mla_ref,
    reshape_and_cache_ref,
)
from .constants import (
    ACL_FORMAT_FRACTAL_NZ,
    ACL_FORMAT_ND,
    FP8_BLOCK,
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    INT8_MAX,
    INT8_MIN,
    NZ_ROW_ALIGN,
    SCALE_EPS,
    c0,
)
from .layout import (
    nd_to_nz,
    nd_to_nz_ref,
    nz_cache_shape,
    nz_shape,
    nz_to_nd,
    nz_to_nd_ref,
)
from .params import (
    FusedInferAttentionParams,
    FusedInferAttentionV2Params,
    PagedAttentionQuantParams,
    QuantizeParams,
    ScatterPaKvCacheParams,
)
from .quant import (
    absmax_scale,
    c8_codes,
    c8_held_scale,
    dequantize_per_head,
    dequantize_per_head_ref,
    dynamic_fake_quant,
    fake_quant_per_head,
    fp8_codes,
    int8_codes,
    per_head_qparams,
    quantize_per_head,
    quantize_per_head_ref,
    saturated,
)

__all__ = [
    "CacheGeometry",
    "FusedInferAttentionParams",
    "FusedInferAttentionV2Params",
    "PagedAttentionInfo",
    "PagedAttentionQuantParams",
    "QuantizeParams",
    "ScatterPaKvCacheParams",
    "check_mla_attention",
    "check_paged_attention",
    "check_reshape_and_cache",
    "check_reshape_and_cache_mla",
    "dynamic_query_scale",
    "mla_paged_attention_ref",
    "mla_prefill_attention_ref",
    "paged_attention_ref",
    "prefill_attention_ref",
    "reshape_and_cache_mla_ref",
    "reshape_and_cache_ref",
    "ACL_FORMAT_FRACTAL_NZ",
    "ACL_FORMAT_ND",
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "FP8_KV_DTYPE",
    "INT8_MAX",
    "INT8_MIN",
    "NZ_ROW_ALIGN",
    "SCALE_EPS",
    "absmax_scale",
    "c0",
    "c8_codes",
    "c8_held_scale",
    "fp8_codes",
    "dequantize_per_head",
    "dynamic_fake_quant",
    "fake_quant_per_head",
    "int8_codes",
    "saturated",
    "dequantize_per_head_ref",
    "nd_to_nz",
    "nd_to_nz_ref",
    "nz_cache_shape",
    "nz_shape",
    "nz_to_nd",
    "nz_to_nd_ref",
    "per_head_qparams",
    "quantize_per_head",
    "quantize_per_head_ref",
]
