"""Public paged-KV-cache and attention API: what an inference engine calls each step.

Shape letters: ``B`` sequences, ``S`` query tokens per sequence (prefill), ``T`` tokens
written, ``H`` query heads, ``Hkv`` KV heads (``g = H // Hkv``), ``D`` head dim,
``NB`` blocks of ``BS`` tokens, ``C0`` NZ fractal width (16 for 2-byte, 32 for int8),
``R`` MLA latent width, ``Dr`` MLA RoPE width.

===================  ===================================================
cache ``layout``     K / V cache shape
===================  ===================================================
``"nz"`` (default)   ``[NB, Hkv*D // C0, BS, C0]`` (``nz_cache_shape``)
``"nd"``             ``[NB, BS, Hkv, D]``
===================  ===================================================

Functions:

* :func:`reshape_and_cache` / :func:`reshape_and_cache_mla` — write new tokens into the
  paged cache, quantizing to int8 when scales are given;
* :func:`paged_attention` / :func:`mla_paged_attention` — decode, one query token per
  sequence;
* :func:`prefill_attention` / :func:`mla_prefill_attention` — the prefill path: ``S``
  query tokens per sequence, causal, over the *paged* cache. Write the prompt's K/V
  first with :func:`reshape_and_cache`, then attend; the query tokens are the last
  ``query_lens[b]`` (default ``S``) tokens of each sequence, so the same call serves
  whole prompts and chunked prefill. There is no separate dense path: a dense
  ``[B, S, Hkv, D]`` prompt is exactly a paged cache with one block table per sequence.

Every call takes one route: it validates its arguments once (errors name the
argument; nothing is written on error), builds a hashable
:class:`~ascend_fa.backends.AttentionSpec`, asks ``backend`` (a name or instance;
default: the backend selected for the spec, ``$ASCEND_FA_BACKEND`` or the tensors'
device) whether it can run it, and calls ``torch.ops.ascend_fa.<op>``, which runs
the kernel registered for the tensors' device: the PyTorch emulation on ``cpu`` and
``cuda``, the torch_npu mapping on ``npu``. A spec the device cannot run is refused
with :class:`~ascend_fa.errors.UnsupportedError` listing every reason (rule, value
and torch_npu release on the NPU) before any device call.

On CPU the emulation keeps its attention scratch buffers (the fp32 copies of the
gathered K/V) per thread between calls, so a decode loop does not page-fault fresh
memory every step; :func:`release_workspace` frees them.
"""

from __future__ import annotations

import torch

from .atb_ops.attention import (
    check_mla_attention,
    check_paged_attention,
    paged_attention_cpu,
    paged_attention_info,
    release_workspace,
)
from .atb_ops.cache import (
    cache_geometry,
    check_reshape_and_cache,
    check_reshape_and_cache_mla,
    direct_cpu_call,
    reshape_and_cache_cpu,
    reshape_and_cache_mla_cpu,
)
from .backends import Backend, CapabilityError, get_backend, select_backend
from .backends.base import AttentionSpec, attention_spec, cache_write_spec
from .errors import InputError, UnsupportedError

__all__ = [
    "reshape_and_cache",
    "reshape_and_cache_mla",
    "paged_attention",
    "prefill_attention",
    "mla_paged_attention",
    "mla_prefill_attention",
    "release_workspace",
    "resolve_backend",
]


def resolve_backend(
    spec: AttentionSpec, backend: str | Backend | None = None
) -> Backend:
    """The backend that runs ``spec``: ``backend`` if given (it must support the spec),
    else :func:`~ascend_fa.backends.select_backend`. Raises
    :class:`~ascend_fa.errors.UnsupportedError` listing the reasons when nothing
    fits."""
    try:
        if backend is None:
            return select_backend(spec)
        chosen = get_backend(backend) if isinstance(backend, str) else backend
        if not isinstance(chosen, Backend):
            raise InputError(
                f"backend must be a name or a Backend, got {type(backend).__name__}"
            )
        chosen.require(spec)
        return chosen
    except CapabilityError as exc:
        raise UnsupportedError(str(exc)) from exc


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    layout: str = "nz",
    fp8_rounding: str = "nearest",
    backend: str | Backend | None = None,
    check: bool = True,
) -> None:
    """Write ``key``, ``value`` ``[T, Hkv, D]`` into the paged caches, in place.

    ``slot_mapping`` ``[T]`` int32/int64: token ``t`` goes to block
    ``slot // BS``, row ``slot % BS``; negative slots are skipped. With ``k_scale``,
    ``v_scale`` ``[Hkv]`` fp32 the caches are int8 and receive
    ``quantize_per_head(key, k_scale, axis=1)``; otherwise they have the key dtype.
    float8_e4m3fn caches take ``[1]`` or ``[Hkv]`` scales and round as
    ``fp8_rounding`` says: ``"nearest"`` (vLLM's CUDA cache write) or ``"trunc"``
    (toward zero, vLLM's CPU cache write; :func:`~ascend_fa.atb_ops.fp8_codes`).
    Out-of-range or repeated slots and any shape/dtype mismatch raise before anything
    is written. ``check=False`` skips that validation: only for arguments equal in
    everything it checks to a call that passed it (an engine step writes the same
    slots, shapes and dtypes into every layer's caches and checks the first).
    """
    if check:
        geo = check_reshape_and_cache(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale,
            v_scale,
            layout,
            fp8_rounding,
        )
    else:
        geo = cache_geometry("reshape_and_cache", "key_cache", key_cache, layout)
    spec = cache_write_spec(
        key_dtype=key.dtype,
        cache_dtype=key_cache.dtype,
        num_kv_heads=key.shape[1],
        head_dim=key.shape[2],
        block_size=geo.block_size,
        layout=layout,
        device_type=key.device.type,
    )
    resolve_backend(spec, backend)
    args = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if direct_cpu_call(args):
        reshape_and_cache_cpu(*args, layout, fp8_rounding)
    else:
        torch.ops.ascend_fa.reshape_and_cache(*args, layout, fp8_rounding)


def reshape_and_cache_mla(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    layout: str = "nz",
    backend: str | Backend | None = None,
) -> None:
    """Write MLA ``latent`` ``[T, R]`` and ``rope`` ``[T, Dr]`` into their caches.

    ``latent_cache`` is a one-head cache (NZ ``[NB, R // C0, BS, C0]``), int8 when
    ``k_scale`` ``[1]`` fp32 (``fa_k.scale``) is given; ``rope_cache`` (NZ
    ``[NB, Dr // C0, BS, C0]``) keeps the rope dtype: the RoPE part is never quantized.
    """
    lgeo, _ = check_reshape_and_cache_mla(
        latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
    )
    spec = cache_write_spec(
        key_dtype=latent.dtype,
        cache_dtype=latent_cache.dtype,
        num_kv_heads=1,
        head_dim=latent.shape[1],
        block_size=lgeo.block_size,
        layout=layout,
        device_type=latent.device.type,
        mla=True,
        rope_dim=rope.shape[1],
    )
    resolve_backend(spec, backend)
    args = (latent, rope, latent_cache, rope_cache, slot_mapping, k_scale)
    if direct_cpu_call(args):
        reshape_and_cache_mla_cpu(*args, layout)
    else:
        torch.ops.ascend_fa.reshape_and_cache_mla(*args, layout)


def paged_attention(
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
    backend: str | Backend | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Decode attention over the paged cache; returns ``[B, H, D]`` in the query dtype.

    ``query`` ``[B, H, D]`` (the newest token of each sequence, already in the cache);
    ``block_table`` ``[B, max_blocks]`` int32; ``seq_lens`` ``[B]`` int32 (tokens in
    the cache, including the query token). Modes: float caches; int8 caches with
    ``k_scale``/``v_scale`` ``[Hkv]`` (int8-KV); plus ``q_scale`` ``[H]`` (FAQuant:
    the query is quantized per head and the scores are int8 x int8 dot products
    scaled by ``q_scale[h] * k_scale[h // g] * scale``).

    ``check=False`` skips the validation, as in :func:`reshape_and_cache` (an engine
    step attends every layer with the same block table and lengths, and caches,
    scales and query of the same shapes and dtypes: it checks the first layer's
    call). Plain CPU tensors run the op's implementation without the op's dispatch
    (:func:`~ascend_fa.atb_ops.cache.direct_cpu_call`), as the cache write does.
    """
    if check:
        info = check_paged_attention(
            query, key_cache, value_cache, block_table, seq_lens,
            num_kv_heads=num_kv_heads, scale=scale, k_scale=k_scale,
            v_scale=v_scale, q_scale=q_scale, layout=layout,
        )  # fmt: skip
    else:
        info = paged_attention_info(
            query, key_cache, block_table, num_kv_heads, q_scale, layout
        )
    spec = attention_spec("decode", info, query.device.type)
    resolve_backend(spec, backend)
    args = (query, key_cache, value_cache, block_table, seq_lens, k_scale, v_scale,
            q_scale)  # fmt: skip
    if direct_cpu_call(args):
        return paged_attention_cpu(
            query, key_cache, value_cache, block_table, seq_lens, num_kv_heads,
            float(scale), k_scale, v_scale, q_scale, layout,
        )  # fmt: skip
    return torch.ops.ascend_fa.paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, num_kv_heads,
        float(scale), k_scale, v_scale, q_scale, layout,
    )  # fmt: skip


def prefill_attention(
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
    query_lens: torch.Tensor | None = None,
    layout: str = "nz",
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Causal prefill over the paged cache; ``query`` ``[B, S, H, D]`` -> same shape.

    Query row ``i`` of sequence ``b`` is token ``seq_lens[b] - query_lens[b] + i`` and
    attends to cache positions ``<=`` that. ``query_lens`` ``[B]`` (default: all
    ``S``) lets sequences with fewer new tokens pad their rows; padded rows return 0.
    Modes and scales as in :func:`paged_attention`.
    """
    info = check_paged_attention(
        query, key_cache, value_cache, block_table, seq_lens,
        num_kv_heads=num_kv_heads, scale=scale, k_scale=k_scale, v_scale=v_scale,
        q_scale=q_scale, layout=layout, query_lens=query_lens, prefill=True,
    )  # fmt: skip
    spec = attention_spec("prefill", info, query.device.type)
    resolve_backend(spec, backend)
    return torch.ops.ascend_fa.prefill_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_lens,
        num_kv_heads, float(scale), k_scale, v_scale, q_scale, layout,
    )  # fmt: skip


def mla_paged_attention(
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
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """MLA (absorbed) decode, FAKQuant when the latent cache is int8.

    ``q_nope`` ``[B, H, R]`` (already multiplied by ``W_UK``), ``q_rope``
    ``[B, H, Dr]``; ``k_scale`` ``[1]`` is ``fa_k.scale`` (V is the same latent, same
    scale). ``q_scale=None`` quantizes ``q_nope`` per token and head dynamically
    (``rowmax|q| / 127``); ``q_scale`` ``[H]`` quantizes it statically. Returns the
    latent output ``[B, H, R]`` in the query dtype (the caller applies ``W_UV``).
    """
    info = check_mla_attention(
        q_nope, q_rope, latent_cache, rope_cache, block_table, seq_lens,
        scale=scale, k_scale=k_scale, q_scale=q_scale, layout=layout,
    )  # fmt: skip
    spec = attention_spec("mla_decode", info, q_nope.device.type)
    resolve_backend(spec, backend)
    return torch.ops.ascend_fa.mla_paged_attention(
        q_nope, q_rope, latent_cache, rope_cache, block_table, seq_lens,
        float(scale), k_scale, q_scale, layout,
    )  # fmt: skip


def mla_prefill_attention(
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
    query_lens: torch.Tensor | None = None,
    layout: str = "nz",
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """MLA causal prefill: ``q_nope`` ``[B, S, H, R]``, ``q_rope`` ``[B, S, H, Dr]`` ->
    ``[B, S, H, R]``; positions and ``query_lens`` as in :func:`prefill_attention`."""
    info = check_mla_attention(
        q_nope, q_rope, latent_cache, rope_cache, block_table, seq_lens,
        scale=scale, k_scale=k_scale, q_scale=q_scale, layout=layout,
        query_lens=query_lens, prefill=True,
    )  # fmt: skip
    spec = attention_spec("mla_prefill", info, q_nope.device.type)
    resolve_backend(spec, backend)
    return torch.ops.ascend_fa.mla_prefill_attention(
        q_nope, q_rope, latent_cache, rope_cache, block_table, seq_lens, query_lens,
        float(scale), k_scale, q_scale, layout,
    )  # fmt: skip
