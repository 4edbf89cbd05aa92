"""Typed parameter objects mirroring the torch_npu / ATB operator arguments.

Each dataclass holds the *non-tensor* arguments of one device call, validated on
construction, and renders them as the exact keyword (or positional) arguments the
torch_npu function takes (:meth:`kwargs` / :meth:`args`). The NPU backend builds them
from an :class:`~ascend_fa.atb_ops.attention.PagedAttentionInfo`; the tests' strict
fake of torch_npu binds the rendered arguments to each release's schema.

=====================================  ==========================================
dataclass                              torch_npu call
=====================================  ==========================================
:class:`QuantizeParams`                ``npu_quantize(x, scales, zero_points, dtype,
                                       axis, div_mode=...)``
:class:`ScatterPaKvCacheParams`        ``npu_scatter_pa_kv_cache(..., cache_mode=...)``
:class:`FusedInferAttentionParams`     ``npu_fused_infer_attention_score(...)``
                                       (GQA decode, int8-KV antiquant)
:class:`PagedAttentionQuantParams`     ``_npu_paged_attention_quant(...)`` (ATB,
                                       FAQuant)
:class:`FusedInferAttentionV2Params`   ``npu_fused_infer_attention_score_v2(...)``
                                       (MLA FAKQuant)
=====================================  ==========================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .constants import ACL_DTYPE_BFLOAT16, ACL_DTYPE_FLOAT16

__all__ = [
    "CACHE_MODES",
    "QuantizeParams",
    "ScatterPaKvCacheParams",
    "FusedInferAttentionParams",
    "PagedAttentionQuantParams",
    "FusedInferAttentionV2Params",
    "acl_out_dtype",
]

#: ``npu_scatter_pa_kv_cache`` cache modes: ``PA_NZ`` writes ``[NB, W//C0, BS, C0]``,
#: ``Norm`` writes ND ``[NB, BS, Hkv, D]``.
CACHE_MODES = {"nz": "PA_NZ", "nd": "Norm"}

#: ``query_quant_mode`` of the v2 fused attention: 3 = per-token, per-head dynamic.
QUANT_MODE_PER_TOKEN_HEAD = 3
#: ``key/value_(anti)quant_mode`` 0 = per-channel (our per-head scale expanded over D).
QUANT_MODE_PER_CHANNEL = 0
#: ATB ``_npu_paged_attention_quant`` quant type used for int8 Q, K, V.
PA_QUANT_TYPE_QKV = 3


def _positive_int(cls: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{cls}: {name} must be a positive int, got {value!r}")


def _finite_scale(cls: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}: scale must be a float, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{cls}: scale must be finite and > 0, got {value!r}")


def acl_out_dtype(dtype: torch.dtype) -> int:
    """ATB ``outdtype`` code of an fp16/bf16 output (1 = fp16, 27 = bf16)."""
    codes = {torch.float16: ACL_DTYPE_FLOAT16, torch.bfloat16: ACL_DTYPE_BFLOAT16}
    if dtype not in codes:
        raise ValueError(
            f"acl_out_dtype: ATB paged attention outputs fp16 or bf16, got {dtype}"
        )
    return codes[dtype]


@dataclass(frozen=True)
class QuantizeParams:
    """``npu_quantize(x, scales, zero_points, dtype, axis, div_mode=True)``.

    ``div_mode=True`` divides by the scale (as :func:`quantize_per_head` does); the
    per-head scale is expanded over ``D`` so ``axis=-1`` indexes ``Hkv*D`` features.
    """

    axis: int = -1
    div_mode: bool = True

    def args(self) -> tuple[Any, ...]:
        return (torch.qint8, self.axis)

    def kwargs(self) -> dict[str, Any]:
        return {"div_mode": self.div_mode}


@dataclass(frozen=True)
class ScatterPaKvCacheParams:
    """``npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
    cache_mode=...)``: a pure copy into the paged cache; ``layout`` is ours."""

    layout: str = "nz"

    def __post_init__(self) -> None:
        if self.layout not in CACHE_MODES:
            raise ValueError(
                f"ScatterPaKvCacheParams: layout must be one of {sorted(CACHE_MODES)}, "
                f"got {self.layout!r}"
            )

    @property
    def cache_mode(self) -> str:
        return CACHE_MODES[self.layout]

    def kwargs(self) -> dict[str, Any]:
        return {"cache_mode": self.cache_mode}


@dataclass(frozen=True)
class FusedInferAttentionParams:
    """Scalar arguments of ``npu_fused_infer_attention_score`` for paged GQA decode.

    ``input_layout="BNSD"`` with ``q`` ``[B, N, 1, D]``; antiquant modes 0 are
    per-channel. ``inner_precise``: 0 = high precision, 1 = high performance (bit 0
    of the documented mode; bit 1 would add invalid-row correction). The int8 NZ
    antiquant path supports only 1; float16 KV may use 0.
    """

    num_heads: int
    num_key_value_heads: int
    scale: float
    block_size: int
    input_layout: str = "BNSD"
    inner_precise: int = 1
    key_antiquant_mode: int = QUANT_MODE_PER_CHANNEL
    value_antiquant_mode: int = QUANT_MODE_PER_CHANNEL

    def __post_init__(self) -> None:
        name = type(self).__name__
        _positive_int(name, "num_heads", self.num_heads)
        _positive_int(name, "num_key_value_heads", self.num_key_value_heads)
        _positive_int(name, "block_size", self.block_size)
        _finite_scale(name, self.scale)
        if self.inner_precise not in (0, 1):
            raise ValueError(
                f"{name}: inner_precise must be 0 (high precision) or 1 (high "
                f"performance) for one query token, got {self.inner_precise!r}"
            )
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                f"{name}: num_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def kwargs(self, *, quantized: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_heads": self.num_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "input_layout": self.input_layout,
            "scale": float(self.scale),
            "block_size": self.block_size,
            "inner_precise": self.inner_precise,
        }
        if quantized:
            out["key_antiquant_mode"] = self.key_antiquant_mode
            out["value_antiquant_mode"] = self.value_antiquant_mode
        return out


@dataclass(frozen=True)
class PagedAttentionQuantParams:
    """Scalar arguments of the ATB op ``_npu_paged_attention_quant`` (FAQuant decode).

    Positional order: ``(q_i8, k_cache, v_cache, num_kv_heads, num_heads, scale,
    block_table, context_lens, quant_type, outdtype, qk_descale, v_descale, out)``.
    """

    num_kv_heads: int
    num_heads: int
    scale: float
    out_dtype: torch.dtype
    quant_type: int = PA_QUANT_TYPE_QKV

    def __post_init__(self) -> None:
        name = type(self).__name__
        _positive_int(name, "num_kv_heads", self.num_kv_heads)
        _positive_int(name, "num_heads", self.num_heads)
        _finite_scale(name, self.scale)
        acl_out_dtype(self.out_dtype)

    @property
    def outdtype(self) -> int:
        return acl_out_dtype(self.out_dtype)


@dataclass(frozen=True)
class FusedInferAttentionV2Params:
    """Scalar arguments of ``npu_fused_infer_attention_score_v2`` for MLA FAKQuant.

    ``input_layout="BSND_NBSD"``: query ``[B, S, N, R]`` in, output ``[N, B, S, R]``.
    ``query_quant_mode=3``: the int8 query carries a per-token, per-head dequant
    scale; K and V (the same latent) use mode 0 with the one-element ``fa_k.scale``
    (per-channel mode covers per-tensor; the page allows only per-tensor here).
    """

    num_query_heads: int
    softmax_scale: float
    block_size: int
    num_key_value_heads: int = 1
    input_layout: str = "BSND_NBSD"
    query_quant_mode: int = QUANT_MODE_PER_TOKEN_HEAD
    key_quant_mode: int = QUANT_MODE_PER_CHANNEL
    value_quant_mode: int = QUANT_MODE_PER_CHANNEL

    def __post_init__(self) -> None:
        name = type(self).__name__
        _positive_int(name, "num_query_heads", self.num_query_heads)
        _positive_int(name, "block_size", self.block_size)
        _finite_scale(name, self.softmax_scale)

    def kwargs(self, *, quantized: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_query_heads": self.num_query_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "softmax_scale": float(self.softmax_scale),
            "input_layout": self.input_layout,
            "block_size": self.block_size,
        }
        if quantized:
            out["query_quant_mode"] = self.query_quant_mode
            out["key_quant_mode"] = self.key_quant_mode
            out["value_quant_mode"] = self.value_quant_mode
        return out
