"""Argument mapping of the ``npu`` kernels: ``ascend_fa`` ops -> torch_npu calls.

Each function takes the torch_npu module, the release it is (one of
:data:`~ascend_fa.backends.npu_capabilities.RELEASES`) and the op's arguments as the
public API validated them, and makes the documented calls. Which keywords exist is
read from the capability table (:data:`~ascend_fa.backends.npu_capabilities.CALLS`),
never from an ``if`` on the version; the rule ids in the comments are the table's.

==============================  ====================================================
op (``ascend_fa::``)            torch_npu calls
==============================  ====================================================
``reshape_and_cache`` NZ        ``npu_quantize`` (int8 per head) or the C8 tensor
                                ops (int8 per channel), ``npu_scatter_pa_kv_cache``
``reshape_and_cache`` ND        the same quantization, ``_npu_reshape_and_cache``
``reshape_and_cache_mla``       the same; latent and rope in one call whose
                                operands agree in dtype
``paged_attention`` float       ``npu_fused_infer_attention_score`` over the ND
                                paged layout ``[NB, BS, Hkv*D]``
``paged_attention`` int8-KV     ``npu_fused_infer_attention_score`` over NZ int8,
                                bf16 per-channel antiquant scales ``[Hkv, 1, D]``
                                (per-head scales expanded over ``D``, C8 scales
                                as they are)
``paged_attention`` FAQuant     ``npu_quantize``, ``_npu_paged_attention_quant``
                                (ATB) over ND int8 caches
``mla_paged_attention``         ``npu_fused_infer_attention_score_v2``
                                (``BSND_NBSD``, NZ latent and rope)
``quantize_static``             ``npu_quantize`` (``div_mode=False``: scale and
                                offset in the input dtype, ``[K]`` vectors)
``dynamic_quant``               ``npu_dynamic_quant``
``quant_matmul``                ``npu_quant_matmul`` (int32 bias, ``deq_scale``)
``quant_matmul_dynamic``        ``npu_quant_matmul`` (``pertoken_scale``)
==============================  ====================================================
"""

from __future__ import annotations

import torch

from ..atb_ops import INT8_MAX, INT8_MIN, c0, c8_codes
from ..atb_ops.attention import PagedAttentionInfo, dynamic_query_scale
from ..atb_ops.linear import OUT_DTYPES
from ..atb_ops.params import (
    FusedInferAttentionParams,
    FusedInferAttentionV2Params,
    PagedAttentionQuantParams,
    QuantizeParams,
    ScatterPaKvCacheParams,
)
from .npu_capabilities import call_spec

__all__ = [
    "valid_tokens",
    "quantize_rows",
    "scatter_into_cache",
    "reshape_and_cache",
    "reshape_and_cache_mla",
    "paged_attention",
    "mla_paged_attention",
    "quantize_static",
    "dynamic_quant",
    "quant_matmul",
    "quant_matmul_dynamic",
]


def valid_tokens(
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(slots, keep)``: the int32 slots of the tokens to write and, when some are
    padding, the token indices kept (``None``: all are written).

    [cache.slots] the device takes slots in ``[0, NB*BS - 1]`` only, so padding
    slots (< 0) are filtered here and never reach it.
    """
    pad = slot_mapping < 0
    if bool(pad.any()):
        keep = (~pad).nonzero().squeeze(1)
        return slot_mapping.index_select(0, keep).to(torch.int32), keep
    return slot_mapping.to(torch.int32), None


def quantize_rows(tnpu, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` -> int8 codes through ``npu_quantize``.

    [quantize.args] symmetric: ``zero_points=None``, ``div_mode=True`` (divide by
    the scale, as :func:`~ascend_fa.atb_ops.quantize_per_head` does), qint8. The
    per-head scale is expanded over ``D`` (as loaders expand ``[H, 1]`` scales) so
    ``axis=-1`` of ``[T, H*D]`` is per channel.
    """
    t, h, d = x.shape
    params = QuantizeParams()
    scales = scale.to(torch.float32).repeat_interleave(d).contiguous()
    codes = tnpu.npu_quantize(
        x.reshape(t, h * d).contiguous(),
        scales,
        None,
        *params.args(),
        **params.kwargs(),
    )
    return _int8(codes).view(t, h, d)


def _int8(codes: torch.Tensor) -> torch.Tensor:
    if codes.is_quantized:  # a qint8 tensor carries its codes as int_repr
        return codes.int_repr()
    if codes.dtype != torch.int8:
        return codes.view(torch.int8)
    return codes


def scatter_into_cache(
    tnpu,
    release: str,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    layout: str,
) -> None:
    """A pure copy of ``key`` / ``value`` ``[T, N, D]`` (every slot valid) into the
    caches. NZ: ``npu_scatter_pa_kv_cache`` (7.2.0 on), with ``cache_mode`` only
    where the release's schema has it [scatter.cache_mode]; ND: ATB
    ``_npu_reshape_and_cache`` on plain (not format-cast) caches, which ATB then
    treats as ND [atb.reshape_and_cache.nd]."""
    key, value = key.contiguous(), value.contiguous()
    if layout == "nz":
        params = ScatterPaKvCacheParams("nz")
        sig = call_spec(release, "npu_scatter_pa_kv_cache").signature
        kwargs = params.kwargs() if sig.accepts("cache_mode") else {}
        tnpu.npu_scatter_pa_kv_cache(
            key, value, key_cache, value_cache, slots, **kwargs
        )
    else:
        tnpu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)


def reshape_and_cache(
    tnpu,
    release: str,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layout: str,
) -> None:
    """GQA cache write: quantize first (int8 caches), then one scatter of K and V
    in the caches' dtype [scatter.dtypes]."""
    slots, keep = valid_tokens(slot_mapping)
    if slots.numel() == 0:
        return
    if keep is not None:
        key, value = key.index_select(0, keep), value.index_select(0, keep)
    if k_scale is not None:
        key = _quantize_kv(tnpu, key, k_scale)
        value = _quantize_kv(tnpu, value, v_scale)
    scatter_into_cache(tnpu, release, key, value, key_cache, value_cache, slots, layout)


def _quantize_kv(tnpu, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of ``x`` ``[T, Hkv, D]`` for the cache.

    Per head ``[Hkv]``: ``npu_quantize`` (fp32 divide). Per channel ``[Hkv, D]``
    (C8): vllm-ascend writes its C8 cache with plain tensor ops in the activation
    dtype, ``clamp(round(x * (1 / s)), -128, 127)`` (vllm-project/vllm-ascend
    @182b75ea ``vllm_ascend/attention/attention_v1.py`` ``_quantize_kv_to_int8``),
    not ``npu_quantize``; the same ops here write the bytes that consumer writes
    (and the CPU reference, :func:`~ascend_fa.atb_ops.c8_codes`).
    """
    if scale.dim() == 2:
        t, h, d = x.shape
        return c8_codes(x, scale.view(1, h, d)).to(torch.int8)
    return quantize_rows(tnpu, x, scale)


def _as_bytes(x: torch.Tensor, cache: torch.Tensor):
    """``x`` ``[T, 1, W]`` and its cache reinterpreted as int8 (same bytes).

    An NZ cache ``[NB, W // C0, BS, C0]`` of a 2-byte dtype viewed as int8 is
    ``[NB, W // C0, BS, 2*C0]``: exactly the int8 NZ layout of the ``2*W`` bytes of
    each token, so an int8 scatter of ``x``'s bytes lands every byte where the
    2-byte scatter would. ND caches are plain rows either way.
    """
    return x.contiguous().view(torch.int8), cache.view(torch.int8)


def reshape_and_cache_mla(
    tnpu,
    release: str,
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    layout: str,
) -> None:
    """MLA cache write: the latent ``[T, R]`` is the "key" (int8 with ``k_scale``),
    the RoPE part ``[T, Dr]`` the "value" (never quantized).

    [cache.mla_no_mixed_dtypes] the scatter takes one dtype for all four operands,
    so when the latent is int8 and the rope bfloat16 both are passed as their bytes
    (int8 views, see :func:`_as_bytes`): one call whose dtypes agree and that writes
    the same bytes as two separate writes would.
    """
    slots, keep = valid_tokens(slot_mapping)
    if slots.numel() == 0:
        return
    if keep is not None:
        latent, rope = latent.index_select(0, keep), rope.index_select(0, keep)
    lat = latent.unsqueeze(1)
    if k_scale is not None:
        lat = quantize_rows(tnpu, lat, k_scale)
    rp = rope.unsqueeze(1)
    lc, rc = latent_cache, rope_cache
    if lat.dtype != rp.dtype:
        lat, lc = _as_bytes(lat, lc)
        rp, rc = _as_bytes(rp, rc)
    scatter_into_cache(tnpu, release, lat, rp, lc, rc, slots, layout)


def _lengths(seq_lens: torch.Tensor) -> list[int]:
    # SymInt[] arguments are host integers (one per batch entry).
    return [int(n) for n in seq_lens.cpu().tolist()]


def paged_attention(
    tnpu,
    release: str,
    info: PagedAttentionInfo,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
) -> torch.Tensor:
    """GQA decode, ``query`` ``[B, H, D]`` -> ``[B, H, D]``."""
    b, h, d = query.shape
    hkv, bs, nb = info.num_kv_heads, info.block_size, info.num_blocks
    table = block_table.to(torch.int32).contiguous()
    if info.mode == "faquant":
        return _faquant_decode(
            tnpu, info, query, key_cache, value_cache, table, seq_lens, scale,
            k_scale, v_scale, q_scale,
        )  # fmt: skip
    params = FusedInferAttentionParams(
        num_heads=h,
        num_key_value_heads=hkv,
        scale=float(scale),
        block_size=bs,
        inner_precise=1 if info.mode == "int8_kv" else 0,
    )
    kwargs = params.kwargs(quantized=info.mode == "int8_kv")
    if info.mode == "int8_kv":
        # [fia.int8nz.kv_layout] per-head NZ [NB, Hkv, D // 32, BS, 32] (the same
        # bytes as our [NB, Hkv*D // 32, BS, 32] when D % 32 == 0).
        cols = c0(key_cache.dtype)
        key = key_cache.view(nb, hkv, d // cols, bs, cols)
        value = value_cache.view(nb, hkv, d // cols, bs, cols)
        # [fia.int8nz.antiquant_scale] bf16, contiguous, [Hkv, 1, D] for BNSD
        # (per-channel mode 0): a per-head scale is expanded over D, a C8 scale
        # [Hkv, D] maps channel for channel, as vllm-ascend's _prepare_c8_scales
        # views it (vllm-project/vllm-ascend@182b75ea attention_v1.py).
        for name, s in (("key", k_scale), ("value", v_scale)):
            kwargs[f"{name}_antiquant_scale"] = _antiquant_scale(s, hkv, d)
    else:
        # [fia.pa.kv_layout] float KV as the documented ND paged layout
        # [NB, BS, Hkv*D] (the same bytes as our ND [NB, BS, Hkv, D]).
        key = key_cache.view(nb, bs, hkv * d)
        value = value_cache.view(nb, bs, hkv * d)
    out, _ = tnpu.npu_fused_infer_attention_score(
        query.reshape(b, h, 1, d).contiguous(),
        key,
        value,
        block_table=table,
        actual_seq_lengths_kv=_lengths(seq_lens),
        **kwargs,
    )
    return out.reshape(b, h, d)


def _antiquant_scale(scale: torch.Tensor, hkv: int, d: int) -> torch.Tensor:
    """FIA's per-channel antiquant scale ``[Hkv, 1, D]`` bf16 contiguous from a
    per-head ``[Hkv]`` or per-channel ``[Hkv, D]`` scale."""
    s = scale.to(torch.bfloat16)
    if s.dim() == 2:
        return s.view(hkv, 1, d).contiguous()
    return s.view(hkv, 1, 1).expand(hkv, 1, d).contiguous()


def _faquant_decode(
    tnpu,
    info: PagedAttentionInfo,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    q_scale: torch.Tensor,
) -> torch.Tensor:
    """FAQuant decode through ATB ``_npu_paged_attention_quant`` over ND int8
    caches, the arguments placed as op-plugin's own test places them
    [atb.pa_quant.args]."""
    h, hkv = info.num_heads, info.num_kv_heads
    g = h // hkv
    params = PagedAttentionQuantParams(
        num_kv_heads=hkv, num_heads=h, scale=float(scale), out_dtype=query.dtype
    )
    codes = quantize_rows(tnpu, query, q_scale)
    # ATB folds the per-head scales into two descale vectors over query heads:
    # scores = (q . k) * qk_descale[h] * scale, out = (P . v) * v_descale[h].
    qk_descale = (q_scale.float() * k_scale.float().repeat_interleave(g)).contiguous()
    v_descale = v_scale.float().repeat_interleave(g).contiguous()
    out = torch.empty_like(query)
    # [atb.pa_quant.context_lens] a host int32 tensor
    context_lens = seq_lens.to(device="cpu", dtype=torch.int32)
    tnpu._npu_paged_attention_quant(
        codes,
        key_cache,
        value_cache,
        params.num_kv_heads,
        params.num_heads,
        params.scale,
        table,
        context_lens,
        params.quant_type,
        params.outdtype,
        qk_descale,
        v_descale,
        out,
    )
    return out


def mla_paged_attention(
    tnpu,
    release: str,
    info: PagedAttentionInfo,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
) -> torch.Tensor:
    """MLA decode through ``npu_fused_infer_attention_score_v2`` (``BSND_NBSD``).

    FAKQuant quantizes ``q_nope`` per token and head with plain tensor ops
    (``rowmax|q| / 127``, or the static ``q_scale``), the same division, rounding
    and saturation as the reference, and passes the scales as
    ``dequant_scale_query`` ``[B, 1, H]`` [fia2.mla.quant_args].
    """
    b, h, r = q_nope.shape
    dr = q_rope.shape[-1]
    nb, bs = info.num_blocks, info.block_size
    lcols, rcols = c0(latent_cache.dtype), c0(rope_cache.dtype)
    # [fia2.mla.layout] one-head NZ views: [NB, 1, R // C0, BS, C0]
    latent = latent_cache.view(nb, 1, r // lcols, bs, lcols)
    params = FusedInferAttentionV2Params(
        num_query_heads=h, softmax_scale=float(scale), block_size=bs
    )
    kwargs = params.kwargs(quantized=k_scale is not None)
    if k_scale is not None:
        qs = (
            dynamic_query_scale(q_nope)
            if q_scale is None
            else q_scale.to(torch.float32).view(1, h).expand(b, h)
        )
        codes = torch.div(q_nope.float(), qs.unsqueeze(-1)).round_()
        query = codes.clamp_(INT8_MIN, INT8_MAX).to(torch.int8).view(b, 1, h, r)
        ks = k_scale.to(torch.float32).contiguous()
        kwargs.update(
            dequant_scale_query=qs.reshape(b, 1, h).contiguous(),
            dequant_scale_key=ks,
            dequant_scale_value=ks,
        )
    else:
        query = q_nope.reshape(b, 1, h, r).contiguous()
    out, _ = tnpu.npu_fused_infer_attention_score_v2(
        query,
        latent,
        latent,
        query_rope=q_rope.reshape(b, 1, h, dr).contiguous(),
        key_rope=rope_cache.view(nb, 1, dr // rcols, bs, rcols),
        block_table=block_table.to(torch.int32).contiguous(),
        actual_seq_kvlen=_lengths(seq_lens),
        **kwargs,
    )
    # NBSD [H, B, 1, R] -> [B, H, R]
    return out.permute(1, 2, 0, 3).reshape(b, h, r).to(q_nope.dtype)


# -- W8A8 linears ---------------------------------------------------------------------
def quantize_static(
    tnpu,
    release: str,
    x: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    div_mode: bool,
) -> torch.Tensor:
    """Per-tensor static codes of ``x`` ``[M, K]`` through ``npu_quantize``.

    [quantize.mul_mode] ``div_mode=False`` (what vllm-ascend's W8A8 apply calls,
    with ``1 / input_scale``): scales and zero_points in the input's dtype, each
    the ``[1]`` value repeated over ``K`` as vllm-ascend's
    ``process_weights_after_loading`` repeats ``input_scale`` / ``input_offset``;
    the kernel refused values a cast would change before this call
    [quantize.mul_mode.scale_dtype]. ``div_mode=True``: float32 scales and, for a
    non-zero offset, int32 zero points [quantize.args].
    """
    k = x.shape[1]
    if div_mode:
        scales = scale.to(torch.float32).reshape(1).expand(k).contiguous()
        zero = None
        if bool((offset != 0).any()):
            zero = offset.to(torch.int32).reshape(1).expand(k).contiguous()
    else:
        scales = scale.to(x.dtype).reshape(1).expand(k).contiguous()
        zero = offset.to(x.dtype).reshape(1).expand(k).contiguous()
    params = QuantizeParams(div_mode=bool(div_mode))
    codes = tnpu.npu_quantize(x, scales, zero, *params.args(), **params.kwargs())
    return _int8(codes)


def dynamic_quant(
    tnpu, release: str, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes and fp32 scales of ``x`` ``[M, K]`` through
    ``npu_dynamic_quant`` [dynamic_quant.args].

    The device leaves an all-zero row undefined (``0 / 0``); its scale is 0, so
    the row's codes are set to 0 here: the op's documented safe value, and the
    matmul output of that row (scaled by 0) does not depend on them anyway.
    """
    codes, scale = tnpu.npu_dynamic_quant(x)
    codes = _int8(codes)
    scale = scale.to(torch.float32).reshape(x.shape[0])
    codes = torch.where(scale[:, None] > 0, codes, torch.zeros_like(codes))
    return codes, scale


def _weight_kn(weight: torch.Tensor) -> torch.Tensor:
    # [qmm.args] x2 is [K, N]: vllm-ascend stores weight.transpose(0, 1)
    # .contiguous() after loading (methods/w8a8_static.py, w8a8_dynamic.py).
    return weight.t().contiguous()


def quant_matmul(
    tnpu,
    release: str,
    x_q: torch.Tensor,
    weight: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    """``(x_q @ weight^T + quant_bias) * deq_scale`` through ``npu_quant_matmul``
    with an int32 bias and a float32 or int64 (fp32 bits) scale [qmm.args]."""
    return tnpu.npu_quant_matmul(
        x_q.contiguous(),
        _weight_kn(weight),
        deq_scale.contiguous(),
        bias=quant_bias,
        output_dtype=OUT_DTYPES[out_dtype],
    )


def quant_matmul_dynamic(
    tnpu,
    release: str,
    x_q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    """``x_q @ weight^T * weight_scale * pertoken_scale + bias`` through
    ``npu_quant_matmul(pertoken_scale=...)`` [qmm.args]: float32 scales and a
    float32 bias (a float16 bias is not in the page's table for a float16 output;
    float32 holds any float16/bfloat16 value exactly)."""
    return tnpu.npu_quant_matmul(
        x_q.contiguous(),
        _weight_kn(weight),
        weight_scale.to(torch.float32).contiguous(),
        pertoken_scale=pertoken_scale.to(torch.float32).contiguous(),
        bias=None if bias is None else bias.to(torch.float32).contiguous(),
        output_dtype=OUT_DTYPES[out_dtype],
    )
