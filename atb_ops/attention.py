"""Paged attention over the (quantized) KV cache: decode and causal prefill, GQA and
MLA.

=========================  ===================================  =====================
op (``ascend_fa::``)        query                                caches
=========================  ===================================  =====================
``paged_attention``        ``[B, H, D]`` (one token / sequence)  K, V paged
``prefill_attention``      ``[B, S, H, D]`` (``S`` new tokens)    K, V paged
``mla_paged_attention``    ``q_nope [B, H, R]``,                 latent, rope paged
                           ``q_rope [B, H, Dr]``
``mla_prefill_attention``  ``[B, S, H, R]``, ``[B, S, H, Dr]``    latent, rope paged
=========================  ===================================  =====================

Sequence ``b`` has ``seq_lens[b]`` tokens in the cache, in the blocks listed by
``block_table[b]``; its query tokens are the *last* ``query_lens[b]`` of them
(default ``S``), so query row ``i`` sits at position ``seq_lens[b] - query_lens[b] + i``
and attends causally to positions ``<=`` that. Rows ``i >= query_lens[b]`` are padding
and come back as zeros.

Modes (chosen by which scales are given; ``g = H // Hkv``):

* ``float``: float caches, ``scores = scale * q.k``;
* ``int8_kv`` (antiquant): int8 caches with ``k_scale``/``v_scale`` ``[Hkv]``,
  ``k = codes * k_scale[h // g]``, or ``[Hkv, D]`` (C8, per channel), ``k[.., d] =
  codes * s[h // g, d]`` with ``s`` held in the query dtype as the device holds it
  (:func:`~.quant.c8_held_scale`); each of K and V may take either form;
* ``fp8_kv``: float8_e4m3fn caches with ``k_scale``/``v_scale`` ``[1]`` or
  ``[Hkv]`` (vLLM), ``k = float(codes) * k_scale``;
* ``faquant``: also ``q_scale`` ``[H]``; the query is quantized statically per head,
  ``scores = (q_codes . k_codes) * q_scale[h] * k_scale[h // g] * scale``;
* MLA ``fakquant``: int8 latent with ``k_scale`` ``[1]`` (V is the same latent);
  ``q_nope`` quantized per token and head, dynamically (``q_scale=None``,
  ``rowmax|q| / 127`` as vllm-ascend does) or statically (``q_scale`` ``[H]``, as MindIE
  does); ``scores = (q_codes . latent_codes) * q_s * k_scale * scale +
  (q_rope . rope) * scale``; the output is the latent ``[.., H, R]``.

Numerics: int8 operands are dequantized exactly (int8 x int8 products summed in fp32
are exact for ``D * 128 * 128 < 2**24``); scores, softmax and ``P.V`` run in fp32 and
the result is cast to the query dtype. The probabilities are *not* requantized (the
Ascend kernels do that internally; the selftest tolerance covers it). Per-head scales
are constant along the contraction, so the kernel applies them to the ``[g, L]``
scores and ``[g, D]`` outputs instead of dequantizing the whole ``[L, D]`` cache:
the same product up to one fp32 rounding, at ``1/D`` of the work. A per-channel K
scale varies along the contraction, so it is folded into the query instead
(``(q * s_k) . codes``), and a per-channel V scale multiplies the ``[g, D]``
output channel by channel: again the same sums up to fp32 rounding.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .cache import (
    FLOAT_DTYPES,
    cache_geometry,
    check_kv_scale,
    check_layout,
    check_scale,
    nz_width_message,
)
from .constants import FP8_KV_DTYPE, INT8_MAX, INT8_MIN, SCALE_EPS, c0
from .native import native_kernels
from .quant import c8_held_scale

__all__ = [
    "PagedAttentionInfo",
    "attention_mode",
    "check_paged_attention",
    "check_mla_attention",
    "dynamic_query_scale",
    "mla_attention_info",
    "paged_attention_cpu",
    "paged_attention_info",
    "gather_tokens_ref",
    "paged_attention_ref",
    "prefill_attention_ref",
    "release_workspace",
    "mla_paged_attention_ref",
    "mla_prefill_attention_ref",
]


@dataclass(frozen=True)
class PagedAttentionInfo:
    """Sizes and mode of one validated attention call (hashable; feeds the backend
    spec). ``head_dim`` is ``R`` for MLA and ``rope_dim`` its ``Dr``."""

    batch: int
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks: int
    layout: str
    mode: str
    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    rope_dim: int = 0


def attention_mode(
    cache_dtype: torch.dtype, q_scale: torch.Tensor | None, mla: bool = False
) -> str:
    if cache_dtype == FP8_KV_DTYPE:
        return "fp8_kv"
    if cache_dtype != torch.int8:
        return "float"
    if mla:
        return "fakquant"
    return "faquant" if q_scale is not None else "int8_kv"


def _name(x: object) -> str:
    return type(x).__name__


def _check_query(fn: str, name: str, q: object, rank: int, want: str) -> torch.Tensor:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {_name(q)}")
    if q.dim() != rank:
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{fn}: {name} dtype must be float16, bfloat16 or float32, got {q.dtype}"
        )
    if 0 in q.shape:
        raise ValueError(f"{fn}: {name} must not be empty, got shape {tuple(q.shape)}")
    return q


def _check_scale_arg(fn: str, scale: object) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{fn}: scale must be a float, got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{fn}: scale must be finite and > 0, got {scale!r}")


def _check_int_tensor(
    fn: str,
    name: str,
    t: object,
    shape: tuple[int, ...] | None,
    rank: int,
    want: str,
    device: torch.device,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {_name(t)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: {name} must be int32 or int64, got {t.dtype}")
    if t.dim() != rank or (shape is not None and tuple(t.shape) != shape):
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected {device}")
    return t


def _check_paging(
    fn: str,
    block_table: object,
    seq_lens: object,
    query_lens: torch.Tensor | None,
    batch: int,
    q_len: int,
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> int:
    bt = _check_int_tensor(
        fn,
        "block_table",
        block_table,
        None,
        2,
        f"[B, max_blocks] with B = {batch}",
        device,
    )
    if bt.shape[0] != batch:
        raise ValueError(
            f"{fn}: block_table must be [B, max_blocks] with B = {batch}, "
            f"got shape {tuple(bt.shape)}"
        )
    sl = _check_int_tensor(
        fn, "seq_lens", seq_lens, (batch,), 1, f"[B] = [{batch}]", device
    )
    if query_lens is not None:
        ql = _check_int_tensor(
            fn, "query_lens", query_lens, (batch,), 1, f"[B] = [{batch}]", device
        )
        bad = (ql < 0) | (ql > q_len)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{fn}: query_lens[{b}] = {int(ql[b])} must be in [0, S = {q_len}]"
            )
        need = ql.long()
    else:
        need = torch.full((batch,), q_len, dtype=torch.long, device=device)
    short = sl.long() < torch.clamp(need, min=1)
    if bool(short.any()):
        b = int(short.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: seq_lens[{b}] = {int(sl[b])} is shorter than its "
            f"{max(int(need[b]), 1)} query token(s) (the query tokens are "
            "the last ones of the sequence)"
        )
    max_blocks = bt.shape[1]
    cap = max_blocks * block_size
    over = sl.long() > cap
    if bool(over.any()):
        b = int(over.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: seq_lens[{b}] = {int(sl[b])} needs more blocks than "
            f"block_table holds ({max_blocks} blocks of {block_size} = {cap} "
            "tokens)"
        )
    used = torch.arange(max_blocks, device=device).unsqueeze(0) < (
        (sl.long() + block_size - 1) // block_size
    ).unsqueeze(1)
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{fn}: block_table[{b}, {j}] = {int(bt[b, j])} is out of range "
            f"[0, {num_blocks}) but sequence {b} uses that block"
        )
    return max_blocks


def _cache_blocks(cache: torch.Tensor, layout: str) -> tuple[int, int]:
    """``(NB, BS)`` of a paged cache in ``layout``."""
    if layout == "nz":
        return int(cache.shape[0]), int(cache.shape[2])
    return int(cache.shape[0]), int(cache.shape[1])


def paged_attention_info(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_kv_heads: int,
    q_scale: torch.Tensor | None,
    layout: str,
    *,
    prefill: bool = False,
) -> PagedAttentionInfo:
    """Sizes and mode of a GQA call read from shapes and dtypes alone.

    No validation (and no device sync): for arguments that :func:`check_paged_attention`
    accepted, or for a device kernel that must describe its call cheaply.
    """
    if prefill:
        b, s, h, d = query.shape
    else:
        (b, h, d), s = query.shape, 1
    nb, bs = _cache_blocks(key_cache, layout)
    return PagedAttentionInfo(
        batch=int(b),
        q_len=int(s),
        num_heads=int(h),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(d),
        block_size=bs,
        num_blocks=nb,
        max_blocks=int(block_table.shape[1]),
        layout=layout,
        mode=attention_mode(key_cache.dtype, q_scale),
        query_dtype=query.dtype,
        cache_dtype=key_cache.dtype,
    )


def mla_attention_info(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_scale: torch.Tensor | None,
    layout: str,
    *,
    prefill: bool = False,
) -> PagedAttentionInfo:
    """The MLA counterpart of :func:`paged_attention_info` (``head_dim`` is ``R``,
    ``rope_dim`` is ``Dr``)."""
    if prefill:
        b, s, h, r = q_nope.shape
    else:
        (b, h, r), s = q_nope.shape, 1
    nb, bs = _cache_blocks(latent_cache, layout)
    return PagedAttentionInfo(
        batch=int(b),
        q_len=int(s),
        num_heads=int(h),
        num_kv_heads=1,
        head_dim=int(r),
        block_size=bs,
        num_blocks=nb,
        max_blocks=int(block_table.shape[1]),
        layout=layout,
        mode=attention_mode(latent_cache.dtype, q_scale, mla=True),
        query_dtype=q_nope.dtype,
        cache_dtype=latent_cache.dtype,
        rope_dim=int(q_rope.shape[-1]),
    )


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    layout: str = "nz",
    query_lens: torch.Tensor | None = None,
    prefill: bool = False,
) -> PagedAttentionInfo:
    """Validate a GQA paged attention call (decode ``[B, H, D]`` or prefill
    ``[B, S, H, D]``); raise ``ValueError`` naming the first bad argument."""
    fn = "prefill_attention" if prefill else "paged_attention"
    layout = check_layout(fn, layout)
    if prefill:
        _check_query(fn, "query", query, 4, "[B, S, H, D]")
        b, s, h, d = query.shape
    else:
        _check_query(fn, "query", query, 3, "[B, H, D]")
        (b, h, d), s = query.shape, 1
        if query_lens is not None:
            raise ValueError(f"{fn}: query_lens is a prefill argument")
    if (
        isinstance(num_kv_heads, bool)
        or not isinstance(num_kv_heads, int)
        or num_kv_heads <= 0
    ):
        raise ValueError(
            f"{fn}: num_kv_heads must be a positive int, got {num_kv_heads!r}"
        )
    if h % num_kv_heads:
        raise ValueError(
            f"{fn}: the query's H = {h} heads are not a multiple of "
            f"num_kv_heads = {num_kv_heads}"
        )
    _check_scale_arg(fn, scale)
    geo = cache_geometry(fn, "key_cache", key_cache, layout)
    cache_geometry(fn, "value_cache", value_cache, layout)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"{fn}: key_cache and value_cache must have the same shape and "
            f"dtype, got {tuple(key_cache.shape)} {key_cache.dtype} and "
            f"{tuple(value_cache.shape)} {value_cache.dtype}"
        )
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.device != query.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, query on {query.device}")
    if layout == "nd" and tuple(key_cache.shape[2:]) != (num_kv_heads, d):
        raise ValueError(
            f"{fn}: key_cache is [NB, BS, Hkv, D] = {tuple(key_cache.shape)} "
            f"but num_kv_heads = {num_kv_heads} and the query has D = {d}"
        )
    if layout == "nz" and (num_kv_heads * d) % c0(key_cache.dtype):
        raise ValueError(nz_width_message(fn, num_kv_heads, d, key_cache.dtype))
    if geo.width != num_kv_heads * d:
        raise ValueError(
            f"{fn}: key_cache holds {geo.width} features per token (shape "
            f"{tuple(key_cache.shape)}) but num_kv_heads*D = "
            f"{num_kv_heads}*{d} = {num_kv_heads * d}"
        )
    if key_cache.dtype in (torch.int8, FP8_KV_DTYPE):
        if k_scale is None or v_scale is None:
            want = "[1] or [Hkv]" if key_cache.dtype == FP8_KV_DTYPE else "[Hkv]"
            raise ValueError(
                f"{fn}: {key_cache.dtype} caches need k_scale and v_scale {want}"
            )
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_kv_scale(fn, name, t, key_cache.dtype, num_kv_heads, d, query.device)
        if q_scale is not None:
            if key_cache.dtype == FP8_KV_DTYPE:
                raise ValueError(
                    f"{fn}: q_scale is given but the caches are float8_e4m3fn; "
                    "an FP8 KV cache is read with a float query"
                )
            if k_scale.dim() == 2 or v_scale.dim() == 2:
                raise ValueError(
                    f"{fn}: q_scale (FAQuant) takes per-head k_scale / v_scale "
                    "[Hkv]; per-channel [Hkv, D] scales (C8) go with a float query"
                )
            check_scale(fn, "q_scale", q_scale, h, query.device)
    else:
        for name, val in (
            ("k_scale", k_scale),
            ("v_scale", v_scale),
            ("q_scale", q_scale),
        ):
            if val is not None:
                raise ValueError(
                    f"{fn}: {name} is given but the caches are "
                    f"{key_cache.dtype}; scales apply to int8 caches only"
                )
    _check_paging(
        fn,
        block_table,
        seq_lens,
        query_lens,
        b,
        s,
        geo.block_size,
        geo.num_blocks,
        query.device,
    )
    return paged_attention_info(
        query, key_cache, block_table, num_kv_heads, q_scale, layout, prefill=prefill
    )


def check_mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    layout: str = "nz",
    query_lens: torch.Tensor | None = None,
    prefill: bool = False,
) -> PagedAttentionInfo:
    """Validate an MLA (absorbed) attention call; ``q_nope`` ``[B, H, R]`` /
    ``q_rope`` ``[B, H, Dr]`` (decode) or with an ``S`` axis after ``B`` (prefill)."""
    fn = "mla_prefill_attention" if prefill else "mla_paged_attention"
    layout = check_layout(fn, layout)
    rank, want = (4, "[B, S, H, {}]") if prefill else (3, "[B, H, {}]")
    _check_query(fn, "q_nope", q_nope, rank, want.format("R"))
    _check_query(fn, "q_rope", q_rope, rank, want.format("Dr"))
    if q_rope.shape[:-1] != q_nope.shape[:-1]:
        raise ValueError(
            f"{fn}: q_rope {tuple(q_rope.shape)} and q_nope "
            f"{tuple(q_nope.shape)} must agree on all but the last dim"
        )
    if q_rope.dtype != q_nope.dtype or q_rope.device != q_nope.device:
        raise ValueError(
            f"{fn}: q_rope must have q_nope's dtype and device, got "
            f"{q_rope.dtype} on {q_rope.device}"
        )
    if not prefill and query_lens is not None:
        raise ValueError(f"{fn}: query_lens is a prefill argument")
    if prefill:
        b, s, h, r = q_nope.shape
    else:
        (b, h, r), s = q_nope.shape, 1
    dr = q_rope.shape[-1]
    _check_scale_arg(fn, scale)
    lgeo = cache_geometry(fn, "latent_cache", latent_cache, layout)
    rgeo = cache_geometry(fn, "rope_cache", rope_cache, layout)
    for name, t in (("latent_cache", latent_cache), ("rope_cache", rope_cache)):
        if t.device != q_nope.device:
            raise ValueError(
                f"{fn}: {name} is on {t.device}, q_nope on {q_nope.device}"
            )
    if lgeo.width != r:
        raise ValueError(
            f"{fn}: latent_cache holds {lgeo.width} features per token "
            f"(shape {tuple(latent_cache.shape)}) but q_nope has R = {r}"
        )
    if rgeo.width != dr:
        raise ValueError(
            f"{fn}: rope_cache holds {rgeo.width} features per token "
            f"(shape {tuple(rope_cache.shape)}) but q_rope has Dr = {dr}"
        )
    if rope_cache.dtype in (torch.int8, FP8_KV_DTYPE):
        raise ValueError(
            f"{fn}: rope_cache must be a float cache (the RoPE part is never "
            f"quantized), got {rope_cache.dtype}"
        )
    if latent_cache.dtype == FP8_KV_DTYPE:
        raise ValueError(
            f"{fn}: latent_cache is float8_e4m3fn; MLA caches are float or int8 "
            "(FAKQuant)"
        )
    if (lgeo.num_blocks, lgeo.block_size) != (rgeo.num_blocks, rgeo.block_size):
        raise ValueError(
            f"{fn}: latent_cache has {lgeo.num_blocks} blocks of "
            f"{lgeo.block_size} but rope_cache has {rgeo.num_blocks} blocks of "
            f"{rgeo.block_size}"
        )
    if latent_cache.dtype == torch.int8:
        if k_scale is None:
            raise ValueError(
                f"{fn}: an int8 latent_cache needs k_scale [1] (fa_k.scale)"
            )
        check_scale(fn, "k_scale", k_scale, 1, q_nope.device)
        if q_scale is not None:
            check_scale(fn, "q_scale", q_scale, h, q_nope.device)
    else:
        for name, val in (("k_scale", k_scale), ("q_scale", q_scale)):
            if val is not None:
                raise ValueError(
                    f"{fn}: {name} is given but latent_cache is "
                    f"{latent_cache.dtype}; scales apply to int8 caches only"
                )
    _check_paging(
        fn,
        block_table,
        seq_lens,
        query_lens,
        b,
        s,
        lgeo.block_size,
        lgeo.num_blocks,
        q_nope.device,
    )
    return mla_attention_info(
        q_nope, q_rope, latent_cache, block_table, q_scale, layout, prefill=prefill
    )


# -- shared numerics ------------------------------------------------------------------
def dynamic_query_scale(q: torch.Tensor) -> torch.Tensor:
    """Per-token, per-head scale of ``q`` ``[..., R]``: ``max(rowmax|q| / 127, 2**-23)``
    in fp32, shape ``q.shape[:-1]`` (the floor keeps an all-zero row finite)."""
    return torch.clamp(q.float().abs().amax(dim=-1) / INT8_MAX, min=SCALE_EPS)


def _quantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes of ``q`` with ``scale`` broadcast over the last dim (fp32 division,
    ties to even, saturate) returned as exact fp32 integers."""
    codes = torch.div(q.float(), scale.unsqueeze(-1))
    return codes.round_().clamp_(INT8_MIN, INT8_MAX)


# -- kernels --------------------------------------------------------------------------
_WORKSPACE = threading.local()


def _workspace(device: torch.device) -> dict:
    """Scratch buffers for one call. On CPU they persist per thread across calls:
    a fresh multi-MiB buffer costs page faults on first touch every step (slower
    than the copies themselves); other devices have caching allocators."""
    if device.type != "cpu":
        return {}
    buffers = getattr(_WORKSPACE, "buffers", None)
    if buffers is None:
        buffers = _WORKSPACE.buffers = {}
    return buffers


def release_workspace() -> None:
    """Free this thread's CPU scratch buffers kept between attention calls."""
    _WORKSPACE.__dict__.pop("buffers", None)


def _buffer(
    ws: dict | None,
    key: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A scratch tensor of ``shape``, reused across the sequences of one call: fresh
    multi-MiB allocations per sequence cost more (page faults) than the copies."""
    numel = math.prod(shape)
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = ws.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = ws[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _gather(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    layout: str,
    ws: dict | None = None,
    key: str = "",
    heads: int = 1,
) -> torch.Tensor:
    """The blocks ``blocks`` ``[B, n]`` of ``B`` sequences as fp32
    ``[B, heads, n*BS, W/heads]``.

    One ``index_select`` pulls the blocks (as int64 words: 8 bytes per element
    moved); then a single strided ``copy_`` does the NZ -> ND tile transpose
    (``[n, Hkv, D//C0, BS, C0] -> [Hkv, n, BS, D//C0, C0]``), the split into
    per-head matrices and the int8/fp16 -> fp32 cast at once. Each head's
    ``[L, D]`` matrix comes out contiguous, which is what BLAS wants for ``q k^T``
    and ``P v`` (a head-interleaved ``[L, Hkv*D]`` operand is several times slower).
    """
    b_sz, n = blocks.shape
    flat = cache.view(cache.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 8 == 0:
        flat = flat.view(torch.int64)
    raw = _buffer(ws, key + "raw", (b_sz * n, flat.shape[1]), flat.dtype, cache.device)
    torch.index_select(flat, 0, blocks.reshape(-1), out=raw)
    picked = raw.view(cache.dtype)
    if layout == "nz":
        _, n1, bs, cols = cache.shape
        d = n1 * cols // heads
        out = _buffer(
            ws, key + "f32", (b_sz, heads, n * bs, d), torch.float32, cache.device
        )
        if d % cols == 0:
            src = picked.view(b_sz, n, heads, d // cols, bs, cols)
            out.view(b_sz, heads, n, bs, d // cols, cols).copy_(
                src.permute(0, 2, 1, 4, 3, 5)
            )
        else:
            # A head does not fill whole fractal columns (e.g. int8 D = 16 or 48):
            # tiles -> token rows [.., BS, Hkv*D] first, then split the heads.
            rows = _buffer(ws, key + "rows", (b_sz, n, bs, n1 * cols), cache.dtype,
                           cache.device)  # fmt: skip
            rows.view(b_sz, n, bs, n1, cols).copy_(
                picked.view(b_sz, n, n1, bs, cols).transpose(2, 3)
            )
            out.view(b_sz, heads, n, bs, d).copy_(
                rows.view(b_sz, n, bs, heads, d).permute(0, 3, 1, 2, 4)
            )
    else:
        bs = cache.shape[1]
        d = picked.numel() // (b_sz * n * bs * heads)
        out = _buffer(
            ws, key + "f32", (b_sz, heads, n * bs, d), torch.float32, cache.device
        )
        src = picked.view(b_sz, n, bs, heads, d).permute(0, 3, 1, 2, 4)
        out.view(b_sz, heads, n, bs, d).copy_(src)
    return out


#: fp32 score elements per chunk of query rows (64 MiB): long prompts are processed
#: in row chunks so the ``[H, S, L]`` score matrix never exists whole.
_SCORE_CHUNK = 1 << 24

#: Decode gathers the K/V of several sequences at once (fewer, larger ops) while
#: the fp32 copies of one group stay under this many bytes.
_DECODE_GROUP_BYTES = 1 << 29


def _causal_mask(
    i0: int, i1: int, n_q: int, n_ctx: int, device: torch.device
) -> torch.Tensor:
    """``[i1 - i0, n_ctx]`` True where a context position lies after query row
    ``i`` (at position ``n_ctx - n_q + i``)."""
    pos = torch.arange(n_ctx - n_q + i0, n_ctx - n_q + i1, device=device).unsqueeze(1)
    return torch.arange(n_ctx, device=device).unsqueeze(0) > pos


def _kv_scale(
    scale: torch.Tensor | None, hkv: int, query_dtype: torch.dtype
) -> torch.Tensor | None:
    """A K/V scale as the fp32 factor the kernels apply: ``[Hkv, 1]`` per head
    (a ``[1]`` FP8 scale broadcast over the heads) or ``[Hkv, D]`` per channel, the
    latter held in the query dtype as the device holds C8 scales."""
    if scale is None:
        return None
    if scale.dim() == 2:
        return c8_held_scale(scale, query_dtype)
    return scale.float().expand(hkv).reshape(hkv, 1)


def _gqa_decode_group(
    qop, coef, v_scale, key_cache, value_cache, blocks, lens, hkv, layout, ws
):
    """Decode for a group of sequences in one go: ``qop`` ``[G, H, D]``, ``blocks``
    ``[G, n]`` (unused entries already replaced by a valid id), ``lens`` ``[G]``
    (a list of ints)."""
    b_sz, h, d = qop.shape
    g = h // hkv
    k = _gather(key_cache, blocks, layout, ws, "k", heads=hkv)
    v = _gather(value_cache, blocks, layout, ws, "v", heads=hkv)
    n_ctx = k.shape[2]
    short = min(lens) < n_ctx
    if short and key_cache.dtype.is_floating_point:
        # Masked means masked: rows past a sequence's length (the unused tail of
        # its last block, or padding blocks of a shorter sequence in the group) may
        # hold anything, NaN and inf included, and 0 * NaN is NaN in P.V. Zero them
        # so the -inf scores below and the P.V product never see them.
        for i, n_i in enumerate(lens):
            if n_i < n_ctx:
                k[i, :, n_i:].zero_()
                v[i, :, n_i:].zero_()
    q = qop.reshape(b_sz * hkv, g, d)
    scores = torch.bmm(q, k.view(b_sz * hkv, n_ctx, d).transpose(1, 2))
    scores = scores.view(b_sz, hkv, g, n_ctx).mul_(coef.view(1, hkv, g, 1))
    if short:  # shorter sequences of the group: mask their padding
        pos = torch.arange(n_ctx, device=qop.device).unsqueeze(0)
        pad = pos >= torch.tensor(lens, device=qop.device).unsqueeze(1)
        scores.masked_fill_(pad.view(b_sz, 1, 1, n_ctx), float("-inf"))
    probs = torch.softmax(scores.view(b_sz * hkv, g, n_ctx), dim=-1)
    o = torch.bmm(probs, v.view(b_sz * hkv, n_ctx, d)).view(b_sz, hkv, g, d)
    if v_scale is not None:
        o.mul_(v_scale.view(1, hkv, 1, -1))
    return o.reshape(b_sz, h, d)


def _native_decode(qop, coef, vsc, key_cache, value_cache, block_table, seq_lens,
                   hkv, layout):  # fmt: skip
    """The decode step by the native fused kernel
    (``atb_ops/csrc/gqa_decode.c``), or None where it does not
    apply: not int8 caches on the CPU, an NZ head that does not fill whole
    fractal columns, or the native kernels off."""
    if key_cache.dtype != torch.int8 or value_cache.dtype != torch.int8:
        return None
    if qop.device.type != "cpu" or seq_lens.device.type != "cpu":
        return None
    b_sz, h, d = qop.shape
    if layout == "nz" and d % 32:
        return None
    if not (key_cache[0].is_contiguous() and value_cache[0].is_contiguous()):
        return None
    kernels = native_kernels()
    if kernels is None:
        return None
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(b_sz, h, d, dtype=torch.float32)
    rc = _run_sequences(kernels, qop.contiguous(), coef.reshape(-1).contiguous(),
                    key_cache, value_cache, table, lens, hkv, layout == "nz",
                    out)  # fmt: skip
    if rc == -1:
        raise ValueError(
            "paged_attention: a sequence length is outside [1, block_table "
            f"columns * block_size] ({lens.tolist()})"
        )
    if rc == -2:
        raise ValueError("paged_attention: block_table names a block outside the cache")
    if rc != 0:
        raise MemoryError("paged_attention: no memory for the decode scratch rows")
    if vsc is not None:
        out.view(b_sz, hkv, h // hkv, d).mul_(vsc.view(1, hkv, 1, -1))
    return out


def _run_sequences(kernels, q, coef, key_cache, value_cache, table, lens, hkv, nz, out):
    """The kernel over all sequences, split across up to
    ``torch.get_num_threads()`` threads (the call releases the GIL)."""
    seqs = q.shape[0]
    parts = max(1, min(torch.get_num_threads(), seqs))
    args = (q, coef, key_cache, value_cache, table, lens, hkv, nz, out)
    if parts == 1:
        return kernels.gqa_decode(*args, (0, seqs))
    bounds = [seqs * i // parts for i in range(parts + 1)]
    pool = _decode_pool(parts - 1)
    futures = [
        pool.submit(kernels.gqa_decode, *args, (bounds[i], bounds[i + 1]))
        for i in range(1, parts)
    ]
    rcs = [kernels.gqa_decode(*args, (bounds[0], bounds[1]))]
    rcs += [f.result() for f in futures]
    return next((rc for rc in rcs if rc != 0), 0)


_POOL: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _decode_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads for :func:`_run_sequences`, one per process: a
    forked child has none of its parent's threads, so it makes its own (a pool
    inherited across a fork would queue work no thread runs)."""
    key = (os.getpid(), workers)
    with _POOL_LOCK:
        pool = _POOL.get(key)
        if pool is None:
            pool = _POOL[key] = ThreadPoolExecutor(
                workers, thread_name_prefix="ascend-fa-decode"
            )
        return pool


def _gqa_decode(qop, coef, vsc, key_cache, value_cache, block_table, lens, hkv,
                layout):  # fmt: skip
    """Decode, one query token per sequence: ``qop`` ``[B, H, D]`` fp32 (the
    query operand), ``lens`` ``[B]`` ints -> fp32 ``[B, H, D]``. Groups of
    sequences share one gather / bmm / softmax each; short sequences are padded to
    the group's longest and masked. One group (a decode batch whose K/V copies fit
    :data:`_DECODE_GROUP_BYTES`, e.g. every batch-1 step) returns its result
    as is; a group whose sequences all use the same number of blocks takes the
    block table's columns as they are."""
    b_sz, h, d = qop.shape
    bs = key_cache.shape[2] if layout == "nz" else key_cache.shape[1]
    ws = _workspace(qop.device)
    need = [-(-n // bs) for n in lens]
    per_seq = max(need) * bs * hkv * d * 4 * 2
    group = max(1, _DECODE_GROUP_BYTES // per_seq)
    outs = []
    for b0 in range(0, b_sz, group):
        b1 = min(b_sz, b0 + group)
        n = max(need[b0:b1])
        blocks = block_table[b0:b1, :n].long()
        if min(need[b0:b1]) < n:
            used = torch.arange(n, device=blocks.device).unsqueeze(0) < torch.tensor(
                need[b0:b1], device=blocks.device
            ).unsqueeze(1)
            blocks = torch.where(used, blocks, blocks[:, :1])
        outs.append(_gqa_decode_group(
            qop[b0:b1], coef, vsc, key_cache, value_cache, blocks, lens[b0:b1], hkv,
            layout, ws))  # fmt: skip
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _gqa_operands(query, hkv, scale, k_scale, v_scale, q_scale):
    """``query`` ``[B, S, H, D]`` -> ``(qop, coef, v_scale)``: the fp32 query
    operand (int8 codes as exact fp32 integers in FAQuant; C8's per-channel K
    scale folded in), the fp32 score factor ``[Hkv, g, 1, 1]`` and the fp32 V
    factor (``[Hkv, 1]`` or ``[Hkv, D]``, or None)."""
    h, d = query.shape[2], query.shape[3]
    g = h // hkv
    ks = _kv_scale(k_scale, hkv, query.dtype)
    vsc = _kv_scale(v_scale, hkv, query.dtype)
    if q_scale is not None:
        qop = _quantize(query, q_scale.view(1, 1, h))
        coef = q_scale * ks.view(hkv).repeat_interleave(g) * scale
    elif ks is not None and ks.shape[1] > 1:
        # per channel: s_k varies along the contraction, so fold it into the query
        qop = query.float() * ks.repeat_interleave(g, dim=0).view(1, 1, h, d)
        coef = torch.full((h,), float(scale), device=query.device)
    else:
        qop = query.float()
        coef = (
            ks.view(hkv).repeat_interleave(g) * scale
            if ks is not None
            else torch.full((h,), float(scale), device=query.device)
        )
    return qop, coef.float().view(hkv, g, 1, 1), vsc


def _gqa_attention(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_lens,
    num_kv_heads,
    scale,
    k_scale,
    v_scale,
    q_scale,
    layout,
):
    """``query`` ``[B, S, H, D]`` -> fp32 ``[B, S, H, D]`` (see the module doc)."""
    b_sz, s_len, h, d = query.shape
    hkv = num_kv_heads
    g = h // hkv
    qop, coef, vsc = _gqa_operands(query, hkv, scale, k_scale, v_scale, q_scale)
    lens = seq_lens.tolist()
    if s_len == 1:
        out = _native_decode(qop[:, 0], coef, vsc, key_cache, value_cache,
                             block_table, seq_lens, hkv, layout)  # fmt: skip
        if out is not None:
            return out.unsqueeze(1)
        out = _gqa_decode(qop[:, 0], coef, vsc, key_cache, value_cache, block_table,
                          lens, hkv, layout)  # fmt: skip
        return out.unsqueeze(1)
    out = torch.zeros(b_sz, s_len, h, d, dtype=torch.float32, device=query.device)
    qlens = query_lens.tolist() if query_lens is not None else [s_len] * b_sz
    bs = key_cache.shape[2] if layout == "nz" else key_cache.shape[1]
    ws = _workspace(query.device)
    for b in range(b_sz):
        n_ctx, n_q = lens[b], qlens[b]
        if n_q == 0:
            continue
        blocks = block_table[b : b + 1, : (n_ctx + bs - 1) // bs].long()
        k = _gather(key_cache, blocks, layout, ws, "k", heads=hkv)[0, :, :n_ctx]
        v = _gather(value_cache, blocks, layout, ws, "v", heads=hkv)[0, :, :n_ctx]
        # GQA without repeat_kv: the g query heads of a KV head share one matmul.
        qb = qop[b, :n_q].view(n_q, hkv, g, d).permute(1, 2, 0, 3)
        rows = max(1, _SCORE_CHUNK // (h * n_ctx))
        for i0 in range(0, n_q, rows):
            i1 = min(n_q, i0 + rows)
            m = i1 - i0
            qc = qb[:, :, i0:i1].reshape(hkv, g * m, d)
            scores = torch.bmm(qc, k.transpose(1, 2)).view(hkv, g, m, n_ctx)
            scores.mul_(coef)
            scores.masked_fill_(
                _causal_mask(i0, i1, n_q, n_ctx, query.device), float("-inf")
            )
            probs = torch.softmax(scores.view(hkv, g * m, n_ctx), dim=-1)
            o = torch.bmm(probs, v)
            if vsc is not None:
                o.mul_(vsc.view(hkv, 1, -1))
            out[b, i0:i1] = o.view(hkv, g, m, d).permute(2, 0, 1, 3).reshape(m, h, d)
    return out


def _mla_attention(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    query_lens,
    scale,
    k_scale,
    q_scale,
    layout,
):
    """``q_nope`` ``[B, S, H, R]``, ``q_rope`` ``[B, S, H, Dr]`` -> fp32
    ``[B, S, H, R]``."""
    b_sz, s_len, h, r = q_nope.shape
    if k_scale is not None:
        qs = (
            dynamic_query_scale(q_nope)
            if q_scale is None
            else q_scale.float().view(1, 1, h).expand(b_sz, s_len, h)
        )
        qop = _quantize(q_nope, qs)
        coef = qs * (k_scale.float() * scale)
        out_scale = k_scale.float()
    else:
        qop = q_nope.float()
        coef = torch.full((b_sz, s_len, h), float(scale), device=q_nope.device)
        out_scale = None
    qr = q_rope.float()
    out = torch.zeros(b_sz, s_len, h, r, dtype=torch.float32, device=q_nope.device)
    lens = seq_lens.tolist()
    qlens = query_lens.tolist() if query_lens is not None else [s_len] * b_sz
    bs = latent_cache.shape[2] if layout == "nz" else latent_cache.shape[1]
    ws = _workspace(q_nope.device)
    for b in range(b_sz):
        n_ctx, n_q = lens[b], qlens[b]
        if n_q == 0:
            continue
        blocks = block_table[b, : (n_ctx + bs - 1) // bs].long()
        lat = _gather(latent_cache, blocks.view(1, -1), layout, ws, "lat")[0, 0, :n_ctx]
        rope = _gather(rope_cache, blocks.view(1, -1), layout, ws, "rope")[0, 0, :n_ctx]
        rows = max(1, _SCORE_CHUNK // (h * n_ctx))
        for i0 in range(0, n_q, rows):
            i1 = min(n_q, i0 + rows)
            m = i1 - i0
            # rows ordered (token, head): [m*H, L]
            scores = qop[b, i0:i1].reshape(m * h, r) @ lat.T
            scores.mul_(coef[b, i0:i1].reshape(m * h, 1))
            scores.addmm_(qr[b, i0:i1].reshape(m * h, -1), rope.T, alpha=float(scale))
            if n_q > 1:
                mask = _causal_mask(i0, i1, n_q, n_ctx, q_nope.device)
                scores.view(m, h, n_ctx).masked_fill_(mask.unsqueeze(1), float("-inf"))
            o = torch.softmax(scores, dim=-1) @ lat
            if out_scale is not None:
                o.mul_(out_scale)
            out[b, i0:i1] = o.view(m, h, r)
    return out


# -- custom ops -----------------------------------------------------------------------
@torch.library.custom_op("ascend_fa::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    layout: str,
) -> torch.Tensor:
    return paged_attention_cpu(
        query, key_cache, value_cache, block_table, seq_lens, num_kv_heads, scale,
        k_scale, v_scale, q_scale, layout,
    )  # fmt: skip


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    layout: str,
) -> torch.Tensor:
    """``ascend_fa::paged_attention``'s implementation (the CPU / CUDA emulation),
    also called directly for validated arguments that
    :func:`~.cache.direct_cpu_call` accepts: a decode step calls it once per
    layer, and the op's dispatch would cost more than a short context's
    arithmetic."""
    out = _gqa_attention(
        query.unsqueeze(1),
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        None,
        num_kv_heads,
        scale,
        k_scale,
        v_scale,
        q_scale,
        layout,
    )
    return out.squeeze(1).to(query.dtype)


@_paged_attention_op.register_fake
def _(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    num_kv_heads,
    scale,
    k_scale,
    v_scale,
    q_scale,
    layout,
):
    return torch.empty_like(query)


@torch.library.custom_op("ascend_fa::prefill_attention", mutates_args=())
def _prefill_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    num_kv_heads: int,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    layout: str,
) -> torch.Tensor:
    out = _gqa_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_lens,
        num_kv_heads,
        scale,
        k_scale,
        v_scale,
        q_scale,
        layout,
    )
    return out.to(query.dtype)


@_prefill_attention_op.register_fake
def _(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_lens,
    num_kv_heads,
    scale,
    k_scale,
    v_scale,
    q_scale,
    layout,
):
    return torch.empty_like(query)


@torch.library.custom_op("ascend_fa::mla_paged_attention", mutates_args=())
def _mla_paged_attention_op(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    layout: str,
) -> torch.Tensor:
    out = _mla_attention(
        q_nope.unsqueeze(1),
        q_rope.unsqueeze(1),
        latent_cache,
        rope_cache,
        block_table,
        seq_lens,
        None,
        scale,
        k_scale,
        q_scale,
        layout,
    )
    return out.squeeze(1).to(q_nope.dtype)


@_mla_paged_attention_op.register_fake
def _(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    scale,
    k_scale,
    q_scale,
    layout,
):
    return torch.empty_like(q_nope)


@torch.library.custom_op("ascend_fa::mla_prefill_attention", mutates_args=())
def _mla_prefill_attention_op(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    scale: float,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    layout: str,
) -> torch.Tensor:
    out = _mla_attention(
        q_nope,
        q_rope,
        latent_cache,
        rope_cache,
        block_table,
        seq_lens,
        query_lens,
        scale,
        k_scale,
        q_scale,
        layout,
    )
    return out.to(q_nope.dtype)


@_mla_prefill_attention_op.register_fake
def _(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    query_lens,
    scale,
    k_scale,
    q_scale,
    layout,
):
    return torch.empty_like(q_nope)


# -- golden references ----------------------------------------------------------------
def gather_tokens_ref(
    cache: torch.Tensor, block_row: torch.Tensor, n_tokens: int, layout: str
) -> torch.Tensor:
    """Golden read of one sequence: token ``t`` from block ``block_row[t // BS]``, row
    ``t % BS``, one token at a time; returns ``[n_tokens, W]`` in the cache dtype."""
    bs = cache.shape[2] if layout == "nz" else cache.shape[1]
    rows = []
    for t in range(n_tokens):
        blk = int(block_row[t // bs])
        if layout == "nz":
            rows.append(cache[blk, :, t % bs, :].reshape(-1))
        else:
            rows.append(cache[blk, t % bs].reshape(-1))
    return torch.stack(rows)


def _softmax_rows(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1)


def _dequant_scale_ref(scale: torch.Tensor, query_dtype: torch.dtype) -> torch.Tensor:
    """The factor of ``codes [L, Hkv, D]`` in fp64: per channel ``[1, Hkv, D]``
    (the scale rounded to the query dtype first), else ``[1, Hkv or 1, 1]``."""
    if scale.dim() == 2:
        return scale.to(query_dtype).double().unsqueeze(0)
    return scale.double().view(1, -1, 1)


def prefill_attention_ref(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    *,
    num_kv_heads,
    scale,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    layout="nz",
    query_lens=None,
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """Golden GQA prefill: dequantize the cache (and the query codes in FAQuant), then
    per sequence and head ``softmax(scale * q k^T + causal) v`` in ``compute_dtype``.
    Returns ``[B, S, H, D]`` in ``compute_dtype`` (padding rows zero)."""
    b_sz, s_len, h, d = query.shape
    g = h // num_kv_heads
    cd = compute_dtype
    if q_scale is not None:
        q = _quantize(query, q_scale.view(1, 1, h)).double() * q_scale.double().view(
            1, 1, h, 1
        )
    else:
        q = query.double()
    out = torch.zeros(b_sz, s_len, h, d, dtype=cd)
    qlens = query_lens.tolist() if query_lens is not None else [s_len] * b_sz
    for b in range(b_sz):
        n_ctx, n_q = int(seq_lens[b]), qlens[b]
        if n_q == 0:
            continue
        ks = gather_tokens_ref(key_cache, block_table[b], n_ctx, layout)
        vs = gather_tokens_ref(value_cache, block_table[b], n_ctx, layout)
        k = ks.double().view(n_ctx, num_kv_heads, d)
        v = vs.double().view(n_ctx, num_kv_heads, d)
        if k_scale is not None:
            k = k * _dequant_scale_ref(k_scale, query.dtype)
            v = v * _dequant_scale_ref(v_scale, query.dtype)
        k, v = k.to(cd), v.to(cd)
        mask = torch.arange(n_ctx).unsqueeze(0) > torch.arange(
            n_ctx - n_q, n_ctx
        ).unsqueeze(1)
        for hh in range(h):
            qh = q[b, :n_q, hh].to(cd)
            s = (qh @ k[:, hh // g].T) * scale
            s = s.masked_fill(mask, float("-inf"))
            out[b, :n_q, hh] = _softmax_rows(s) @ v[:, hh // g]
    return out


def paged_attention_ref(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    *,
    num_kv_heads,
    scale,
    k_scale=None,
    v_scale=None,
    q_scale=None,
    layout="nz",
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """Golden decode: :func:`prefill_attention_ref` with one query token per sequence;
    ``[B, H, D]`` in ``compute_dtype``."""
    return prefill_attention_ref(
        query.unsqueeze(1),
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        num_kv_heads=num_kv_heads,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        q_scale=q_scale,
        layout=layout,
        compute_dtype=compute_dtype,
    ).squeeze(1)


def mla_prefill_attention_ref(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    *,
    scale,
    k_scale=None,
    q_scale=None,
    layout="nz",
    query_lens=None,
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """Golden MLA prefill from the dequantized latent and dequantized query codes:
    ``softmax(scale * (q_nope c^T + q_rope r^T) + causal) c``; ``[B, S, H, R]``."""
    b_sz, s_len, h, r = q_nope.shape
    cd = compute_dtype
    if k_scale is not None:
        qs = (
            dynamic_query_scale(q_nope)
            if q_scale is None
            else q_scale.float().view(1, 1, h).expand(b_sz, s_len, h)
        )
        qn = _quantize(q_nope, qs).double() * qs.double().unsqueeze(-1)
    else:
        qn = q_nope.double()
    out = torch.zeros(b_sz, s_len, h, r, dtype=cd)
    qlens = query_lens.tolist() if query_lens is not None else [s_len] * b_sz
    for b in range(b_sz):
        n_ctx, n_q = int(seq_lens[b]), qlens[b]
        if n_q == 0:
            continue
        lat = gather_tokens_ref(latent_cache, block_table[b], n_ctx, layout).double()
        if k_scale is not None:
            lat = lat * float(k_scale[0])
        rope = gather_tokens_ref(rope_cache, block_table[b], n_ctx, layout).to(cd)
        lat = lat.to(cd)
        mask = torch.arange(n_ctx).unsqueeze(0) > torch.arange(
            n_ctx - n_q, n_ctx
        ).unsqueeze(1)
        for hh in range(h):
            s = qn[b, :n_q, hh].to(cd) @ lat.T + q_rope[b, :n_q, hh].to(cd) @ rope.T
            s = (s * scale).masked_fill(mask, float("-inf"))
            out[b, :n_q, hh] = _softmax_rows(s) @ lat
    return out


def mla_paged_attention_ref(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    *,
    scale,
    k_scale=None,
    q_scale=None,
    layout="nz",
    compute_dtype=torch.float64,
) -> torch.Tensor:
    """Golden MLA decode; ``[B, H, R]`` in ``compute_dtype``."""
    return mla_prefill_attention_ref(
        q_nope.unsqueeze(1),
        q_rope.unsqueeze(1),
        latent_cache,
        rope_cache,
        block_table,
        seq_lens,
        scale=scale,
        k_scale=k_scale,
        q_scale=q_scale,
        layout=layout,
        compute_dtype=compute_dtype,
    ).squeeze(1)
