"""Paged KV-cache writes (``reshape_and_cache``), quantizing on write.

Token ``t`` with slot ``s = slot_mapping[t]`` goes to block ``s // BS``, row
``s % BS``; slots < 0 are padding and skipped. Feature ``c = h*D + d`` of that token
lands at:

======  ==============================  ==========================================
layout  cache shape                     element ``(s, c)`` at
======  ==============================  ==========================================
``nz``  ``[NB, Hkv*D // C0, BS, C0]``   ``[s // BS, c // C0, s % BS, c % C0]``
``nd``  ``[NB, BS, Hkv, D]``            ``[s // BS, s % BS, c // D, c % D]``
======  ==============================  ==========================================

The scales (fp32) decide what the caches hold:

=================  ==============  ===================================================
``k_scale``        cache dtype     codes (:mod:`.quant` has the numerics and why)
=================  ==============  ===================================================
None               the key dtype   the key unchanged
``[Hkv]``          int8            ``quantize_per_head(key, k_scale, axis=1)``: fp32
                                   divide (``npu_quantize(div_mode=True)``)
``[Hkv, D]``       int8            C8, per channel ``c = h*D + d``:
                                   ``c8_codes(key, k_scale)`` (vllm-ascend's write:
                                   reciprocal and product in the key dtype)
``[1]``/``[Hkv]``  float8_e4m3fn   ``fp8_codes(key, k_scale, fp8_rounding)``: ``key /
                                   s`` saturated at +-448, rounded to nearest even
                                   (``"nearest"``, vLLM on CUDA) or toward zero
                                   (``"trunc"``, vLLM on CPU)
=================  ==============  ===================================================
 MLA (:func:`check_reshape_and_cache_mla`) writes the latent ``[T, R]`` as a
one-head cache (int8 with ``k_scale`` ``[1]``) and the RoPE part ``[T, Dr]``
unquantized.

Ops (namespace ``ascend_fa``): ``reshape_and_cache`` and ``reshape_and_cache_mla``,
mutating the two caches in place. Their default kernel below is the CPU/CUDA
emulation; ``*_ref`` are per-token loops straight from the table above. Validation
(:func:`check_reshape_and_cache`) runs before any write and names the bad argument.

The kernel picks one of two write paths (same bytes either way):

* token-granular (decode, scattered slots): one ``index_copy_`` of every token's
  32-byte fractal rows at precomputed flat destinations;
* block-granular (prefill: the write covers whole blocks): each block is written
  by one strided copy that also transposes its whole 32-byte fractal rows into NZ
  (tokens are staged first only when they do not arrive as whole blocks in order).
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass

import torch

from .constants import FP8_KV_DTYPE, INT8_MAX, INT8_MIN, NZ_ROW_ALIGN, ROUND_MAGIC, c0
from .native import MAX_ROW_BYTES, native_kernels
from .quant import c8_codes, check_fp8_rounding, fp8_codes

__all__ = [
    "FLOAT_DTYPES",
    "KV_CACHE_DTYPES",
    "KV_LAYOUTS",
    "CacheGeometry",
    "cache_geometry",
    "check_layout",
    "check_scale",
    "check_kv_scale",
    "kv_scale_kind",
    "check_reshape_and_cache",
    "check_reshape_and_cache_mla",
    "direct_cpu_call",
    "direct_cpu_write",
    "nz_width_message",
    "reshape_and_cache_cpu",
    "reshape_and_cache_mla_cpu",
    "repeated_slot",
    "fp8_trunc_ref",
    "reshape_and_cache_ref",
    "reshape_and_cache_mla_ref",
    "token_rows_ref",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Every dtype a paged K/V cache may have: float, int8 (per head or C8), FP8 E4M3.
KV_CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8, FP8_KV_DTYPE)
KV_LAYOUTS = ("nz", "nd")


@dataclass(frozen=True)
class CacheGeometry:
    """What a paged cache tensor holds: ``NB`` blocks of ``BS`` tokens x ``width``."""

    num_blocks: int
    block_size: int
    width: int
    layout: str
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def _name(x: object) -> str:
    return type(x).__name__


def check_layout(fn: str, layout: object) -> str:
    if layout not in KV_LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {KV_LAYOUTS}, got {layout!r}")
    return str(layout)


def cache_geometry(fn: str, name: str, cache: object, layout: str) -> CacheGeometry:
    """Check ``cache`` is a contiguous paged cache in ``layout``; return its
    geometry."""
    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {_name(cache)}")
    want = "[NB, Hkv*D // C0, BS, C0]" if layout == "nz" else "[NB, BS, Hkv, D]"
    if cache.dim() != 4:
        raise ValueError(
            f"{fn}: {name} must be a 4-D {layout} cache {want}, got shape "
            f"{tuple(cache.shape)}"
        )
    if cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{fn}: {name} dtype must be float16, bfloat16, float32, int8 or "
            f"float8_e4m3fn, got {cache.dtype}"
        )
    if not cache.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be contiguous (the kernels address it by flat offsets)"
        )
    if layout == "nz":
        nb, n1, bs, cols = cache.shape
        if cols != c0(cache.dtype):
            raise ValueError(
                f"{fn}: {name} last dim must be C0 = {c0(cache.dtype)} for an "
                f"NZ {cache.dtype} cache {want}, got shape {tuple(cache.shape)}"
            )
        width = n1 * cols
    else:
        nb, bs, h, d = cache.shape
        width = h * d
    # 1-byte caches (int8, fp8) keep 32-row blocks: one 32x32-byte fractal
    align = 32 if cache.element_size() == 1 else NZ_ROW_ALIGN
    if bs % align:
        raise ValueError(
            f"{fn}: {name} block size {bs} is not a multiple of {align} "
            f"(required for {cache.dtype} caches)"
        )
    if nb <= 0 or width <= 0:
        raise ValueError(f"{fn}: {name} is empty, shape {tuple(cache.shape)}")
    return CacheGeometry(int(nb), int(bs), int(width), layout, cache.dtype)


def nz_width_message(fn: str, heads: int, dim: int, dtype: torch.dtype) -> str:
    """Why an NZ cache cannot hold ``heads`` x ``dim`` features of ``dtype``."""
    return (
        f"{fn}: an NZ cache needs Hkv*D = {heads * dim} to be a multiple of C0 = "
        f"{c0(dtype)} for {dtype} (each fractal holds C0 columns); use layout='nd' "
        "or pad the head dim"
    )


def check_scale(
    fn: str, name: str, scale: object, n: int, device: torch.device
) -> None:
    """``scale`` must be a finite, positive fp32 tensor ``[n]`` on ``device``."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {_name(scale)}")
    if scale.dtype != torch.float32:
        raise ValueError(
            f"{fn}: {name} must be float32 (scales are kept in fp32), got {scale.dtype}"
        )
    if tuple(scale.shape) != (n,):
        raise ValueError(
            f"{fn}: {name} must have shape [{n}], got {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(f"{fn}: {name} is on {scale.device}, expected {device}")
    if scale.device.type == "cpu" and n <= 4096:
        # a few values: one conversion to Python floats instead of five tensor ops
        # (NaN fails both comparisons)
        values = scale.tolist()
        idx = next((i for i, v in enumerate(values) if not 0 < v < math.inf), None)
    else:
        bad = ~(torch.isfinite(scale) & (scale > 0))
        idx = int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
    if idx is not None:
        raise ValueError(
            f"{fn}: {name} must be finite and > 0, got {float(scale[idx])} "
            f"at index {idx}"
        )


def kv_scale_kind(scale: torch.Tensor | None, cache_dtype: torch.dtype) -> str:
    """How a validated K/V scale applies: ``"none"`` (float cache), ``"head"``
    (int8 ``[Hkv]``), ``"channel"`` (C8 ``[Hkv, D]``) or ``"fp8"``."""
    if scale is None:
        return "none"
    if cache_dtype == FP8_KV_DTYPE:
        return "fp8"
    return "channel" if scale.dim() == 2 else "head"


def check_kv_scale(
    fn: str,
    name: str,
    scale: object,
    cache_dtype: torch.dtype,
    heads: int,
    dim: int,
    device: torch.device,
) -> None:
    """A K or V cache scale for a ``cache_dtype`` cache of ``heads`` x ``dim``:
    int8 takes ``[Hkv]`` (per head) or ``[Hkv, D]`` (C8, per channel ``h*D + d``),
    float8_e4m3fn ``[1]`` (per tensor) or ``[Hkv]`` (per head); fp32, finite, > 0."""
    if isinstance(scale, torch.Tensor):
        if cache_dtype == FP8_KV_DTYPE:
            shapes = [(1,), (heads,)]
            want = f"[1] or [{heads}] (FP8: per tensor, or per head [Hkv])"
        else:
            shapes = [(heads,), (heads, dim)]
            want = (
                f"[{heads}] or [{heads}, {dim}] ([Hkv] per head, [Hkv, D] per channel)"
            )
        if tuple(scale.shape) not in shapes:
            raise ValueError(
                f"{fn}: {name} must have shape {want} for a {cache_dtype} cache, "
                f"got {tuple(scale.shape)}"
            )
        check_scale(fn, name, scale.reshape(-1), scale.numel(), device)
        return
    check_scale(fn, name, scale, heads, device)


def _check_float(fn: str, name: str, x: object, rank: int, want: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {_name(x)}")
    if x.dim() != rank:
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{fn}: {name} dtype must be float16, bfloat16 or float32, got {x.dtype}"
        )
    return x


def _check_slots(
    fn: str,
    slot_mapping: object,
    n_tokens: int,
    geo: CacheGeometry,
    device: torch.device,
) -> None:
    num_slots, block_size = geo.num_slots, geo.block_size
    if not isinstance(slot_mapping, torch.Tensor):
        raise ValueError(
            f"{fn}: slot_mapping must be a tensor, got {_name(slot_mapping)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}"
        )
    if tuple(slot_mapping.shape) != (n_tokens,):
        raise ValueError(
            f"{fn}: slot_mapping must have shape [T] = [{n_tokens}], got "
            f"{tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != device:
        raise ValueError(
            f"{fn}: slot_mapping is on {slot_mapping.device}, expected {device}"
        )
    if n_tokens == 0:
        return
    # one reduction for both ends; a boolean-mask index would cost a parallel
    # nonzero + gather on every call, so it is only built when padding is present
    lo, hi = torch.aminmax(slot_mapping)
    if int(hi) >= num_slots:
        idx = int((slot_mapping >= num_slots).nonzero()[0, 0])
        raise ValueError(
            f"{fn}: slot_mapping[{idx}] = {int(slot_mapping[idx])} is out of "
            f"range: the cache has NB*BS = {num_slots} slots"
        )
    slot = _native_repeated_slot(slot_mapping, num_slots, block_size)
    if slot is False:
        valid = slot_mapping
        if int(lo) < 0:
            valid = torch.masked_select(slot_mapping, slot_mapping >= 0)
        slot = repeated_slot(valid, block_size)
    if slot is not None:
        raise ValueError(
            f"{fn}: slot_mapping writes slot {slot} more than once "
            "(the result would depend on write order)"
        )


def _native_repeated_slot(
    slots: torch.Tensor, num_slots: int, block_size: int
) -> int | None | bool:
    """:func:`repeated_slot` of the non-negative entries of CPU ``slots`` (all
    ``< num_slots``) in one native pass, or False when the native kernels are off
    or do not decide (then the caller sorts)."""
    if slots.device.type != "cpu" or slots.numel() < 2:
        return False
    kernels = native_kernels()
    if kernels is None:
        return False
    return kernels.repeated_slot(slots.contiguous(), num_slots, block_size)


def repeated_slot(slots: torch.Tensor, block_size: int) -> int | None:
    """The smallest slot that ``slots`` ``[N]`` (all >= 0) lists twice, or None.

    A prefill hands out whole blocks, each as ``BS`` consecutive slots starting at
    a block boundary: then two tokens can only collide by sharing a block, so the
    check sorts the ``N / BS`` block starts instead of all ``N`` slots (the shape
    test is two elementwise passes over ``N``)."""
    n = slots.numel()
    if n < 2:
        return None
    if n % block_size == 0 and n > block_size:
        rows = slots.view(-1, block_size)
        first = rows[:, :1]
        steps = torch.arange(block_size, device=slots.device, dtype=slots.dtype)
        if torch.equal(rows - first, steps.expand_as(rows)) and not bool(
            (first % block_size).any()
        ):
            slots = first.reshape(-1)
    ordered = torch.sort(slots).values
    dup = (ordered[1:] == ordered[:-1]).nonzero()
    if dup.numel():
        return int(ordered[int(dup[0, 0])])
    return None


def _check_pair(
    fn: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor
) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"{fn}: {names[0]} and {names[1]} must have the same shape and "
            f"dtype, got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} "
            f"{b.dtype}"
        )
    if a.device != b.device:
        raise ValueError(f"{fn}: {names[1]} is on {b.device}, expected {a.device}")


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    layout: str = "nz",
    fp8_rounding: str = "nearest",
) -> CacheGeometry:
    """Validate a ``reshape_and_cache`` call; raise ``ValueError`` naming the first
    bad argument. Nothing is written. Returns the cache geometry."""
    fn = "reshape_and_cache"
    layout = check_layout(fn, layout)
    check_fp8_rounding(fn, fp8_rounding)
    _check_float(fn, "key", key, 3, "[T, Hkv, D]")
    _check_float(fn, "value", value, 3, "[T, Hkv, D]")
    _check_pair(fn, ("key", "value"), key, value)
    t, hkv, d = key.shape
    geo = cache_geometry(fn, "key_cache", key_cache, layout)
    cache_geometry(fn, "value_cache", value_cache, layout)
    _check_pair(fn, ("key_cache", "value_cache"), key_cache, value_cache)
    if key_cache.device != key.device:
        raise ValueError(
            f"{fn}: key_cache is on {key_cache.device}, key on {key.device}"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            f"{fn}: k_scale and v_scale must be given together (int8 cache) "
            "or both be None (float cache)"
        )
    if k_scale is not None:
        if key_cache.dtype not in (torch.int8, FP8_KV_DTYPE):
            raise ValueError(
                f"{fn}: k_scale/v_scale given, so key_cache must be int8 or "
                f"float8_e4m3fn, got {key_cache.dtype}"
            )
        check_kv_scale(fn, "k_scale", k_scale, key_cache.dtype, hkv, d, key.device)
        check_kv_scale(fn, "v_scale", v_scale, key_cache.dtype, hkv, d, key.device)
    elif key_cache.dtype != key.dtype:
        raise ValueError(
            f"{fn}: key_cache dtype {key_cache.dtype} differs from key dtype "
            f"{key.dtype} (pass k_scale and v_scale for an int8 or float8_e4m3fn "
            "cache)"
        )
    if layout == "nd":
        if tuple(key_cache.shape[2:]) != (hkv, d):
            raise ValueError(
                f"{fn}: key_cache is [NB, BS, Hkv, D] = "
                f"{tuple(key_cache.shape)} but key has Hkv={hkv}, D={d}"
            )
    elif (hkv * d) % c0(key_cache.dtype):
        raise ValueError(nz_width_message(fn, hkv, d, key_cache.dtype))
    elif geo.width != hkv * d:
        raise ValueError(
            f"{fn}: key_cache holds Hkv*D = {geo.width} features per token "
            f"(shape {tuple(key_cache.shape)}) but key has Hkv*D = "
            f"{hkv}*{d} = {hkv * d}"
        )
    _check_slots(fn, slot_mapping, t, geo, key.device)
    return geo


def check_reshape_and_cache_mla(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    layout: str = "nz",
) -> tuple[CacheGeometry, CacheGeometry]:
    """Validate a ``reshape_and_cache_mla`` call (latent ``[T, R]``, rope
    ``[T, Dr]``)."""
    fn = "reshape_and_cache_mla"
    layout = check_layout(fn, layout)
    _check_float(fn, "latent", latent, 2, "[T, R]")
    _check_float(fn, "rope", rope, 2, "[T, Dr]")
    if rope.shape[0] != latent.shape[0]:
        raise ValueError(
            f"{fn}: rope has {rope.shape[0]} tokens but latent has {latent.shape[0]}"
        )
    if rope.device != latent.device:
        raise ValueError(f"{fn}: rope is on {rope.device}, latent on {latent.device}")
    t, r = latent.shape
    dr = rope.shape[1]
    lgeo = cache_geometry(fn, "latent_cache", latent_cache, layout)
    rgeo = cache_geometry(fn, "rope_cache", rope_cache, layout)
    for name, cache in (("latent_cache", latent_cache), ("rope_cache", rope_cache)):
        if cache.device != latent.device:
            raise ValueError(
                f"{fn}: {name} is on {cache.device}, latent on {latent.device}"
            )
    if (lgeo.num_blocks, lgeo.block_size) != (rgeo.num_blocks, rgeo.block_size):
        raise ValueError(
            f"{fn}: latent_cache has {lgeo.num_blocks} blocks of "
            f"{lgeo.block_size} but rope_cache has {rgeo.num_blocks} blocks of "
            f"{rgeo.block_size}"
        )
    if k_scale is not None:
        check_scale(fn, "k_scale", k_scale, 1, latent.device)
        if latent_cache.dtype != torch.int8:
            raise ValueError(
                f"{fn}: k_scale given, so latent_cache must be int8, got "
                f"{latent_cache.dtype}"
            )
    elif latent_cache.dtype != latent.dtype:
        raise ValueError(
            f"{fn}: latent_cache dtype {latent_cache.dtype} differs from latent "
            f"dtype {latent.dtype} (pass k_scale for an int8 cache)"
        )
    if rope_cache.dtype != rope.dtype:
        raise ValueError(
            f"{fn}: rope_cache dtype {rope_cache.dtype} must equal the rope "
            f"dtype {rope.dtype} (the RoPE part is never quantized)"
        )
    for name, geo, cache, width in (
        ("latent_cache", lgeo, latent_cache, r),
        ("rope_cache", rgeo, rope_cache, dr),
    ):
        if layout == "nz" and width % c0(cache.dtype):
            raise ValueError(nz_width_message(f"{fn}: {name}", 1, width, cache.dtype))
        if layout == "nd" and tuple(cache.shape[2:]) != (1, width):
            raise ValueError(
                f"{fn}: {name} must be [NB, BS, 1, {width}], got {tuple(cache.shape)}"
            )
        if geo.width != width:
            raise ValueError(
                f"{fn}: {name} holds {geo.width} features per token (shape "
                f"{tuple(cache.shape)}) but the input has {width}"
            )
    _check_slots(fn, slot_mapping, t, lgeo, latent.device)
    return lgeo, rgeo


# -- kernels ------------------------------------------------------------------------
#: Elements quantized per chunk and intra-op thread (a 1 MiB fp32 share, near the
#: L2 cache so the passes over it run at cache speed): the buffer is reused
#: across chunks, and on CPU across calls, since a fresh buffer costs page faults
#: on first touch every step. Larger chunks spill to memory on every pass; much
#: smaller ones pay the per-op overhead (and, with intra-op threads competing for
#: cores, a scheduling delay per op) more often.
_QUANT_CHUNK = 1 << 18
_SCRATCH = threading.local()


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


@functools.cache
def _narrow_truncates() -> bool:
    """Whether torch's int32 -> int8 cast keeps the low byte (C++ ``static_cast``
    semantics) on this build, checked once over all 256 codes at a length that
    takes the vectorized path. :func:`_quantize_rows` relies on it; a build that
    saturated instead would get the exact integer subtracted first."""
    codes = torch.arange(INT8_MIN, INT8_MAX + 1, dtype=torch.int32).repeat(64)
    magic = torch.tensor(ROUND_MAGIC).view(torch.int32)
    return torch.equal((codes + magic).to(torch.int8), codes.to(torch.int8))


def _quantize_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quantize_per_head(x, scale, axis=1)`` for ``x`` ``[T, H, D]``, chunked over
    tokens, in three passes over an fp32 scratch chunk plus the narrowing cast:

    1. widen a 16-bit chunk into the scratch (exact; fp32 input skips this);
    2. ``addcdiv``: ``ROUND_MAGIC + x / s`` -- the fp32 quotient ``q = fl(x / s)``
       exactly as :func:`~ascend_fa.atb_ops.quant.int8_codes` forms it (a true
       division, not a reciprocal), then the add rounds ``q`` half to even (see
       ``ROUND_MAGIC``), fusing ``torch.round`` into the divide's pass;
    3. clamp to ``[MAGIC - 128, MAGIC + 127]``: ``fl`` is monotonic, so a quotient
       beyond the int8 range (or +-inf) lands on the same bound as
       ``clamp(round(q))`` would;
    4. cast the fp32 bits as int32 to int8: the low byte is the code.

    Same codes bit for bit as ``quantize_per_head`` for every finite or infinite
    input (NaN inputs have no defined int8 code in either). The per-head scale is
    expanded over ``D`` (contiguous) so the divide streams both operands.
    """
    t = x.shape[0]
    per_token = max(x[0].numel(), 1) if t else 1
    # each intra-op thread takes its share of a chunk: keep the share L2-sized. With
    # several threads, chunks of at least 1M elements keep the op count low: when
    # the threads compete with other work for cores, every parallel op pays a
    # scheduling delay of its own
    threads = max(1, torch.get_num_threads())
    chunk = _QUANT_CHUNK if threads == 1 else max(_QUANT_CHUNK * threads, 1 << 20)
    if not x.is_cpu:  # device memory has no such cache to fit: few, large chunks
        chunk = 1 << 22
    step = max(1, chunk // per_token)
    out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    rows = min(step, t)
    buf = _scratch(rows * per_token, x.device).view(rows, *x.shape[1:])
    s = scale.to(device=x.device, dtype=torch.float32).view(1, -1, 1)
    s = s.expand(1, *x.shape[1:]).contiguous()
    magic = torch.tensor(ROUND_MAGIC, dtype=torch.float32, device=x.device)
    exact = _narrow_truncates()
    for start in range(0, t, step):
        part = buf[: min(step, t - start)]
        src = x[start : start + step]
        if src.dtype != torch.float32:
            part.copy_(src)
            src = part
        torch.addcdiv(magic, src, s, out=part)
        part.clamp_(ROUND_MAGIC + INT8_MIN, ROUND_MAGIC + INT8_MAX)
        bits = part.view(torch.int32)
        if not exact:
            bits.sub_(magic.view(torch.int32))
        out[start : start + step].copy_(bits)
    return out


def _encode(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    cache_dtype: torch.dtype,
    fp8_rounding: str = "nearest",
) -> torch.Tensor:
    """What the cache stores for ``x`` ``[T, H, D]`` (see the module doc's table)."""
    kind = kv_scale_kind(scale, cache_dtype)
    if kind == "none":
        return x
    if kind == "head":
        return _quantize_rows(x, scale)
    shape = (1, *scale.shape, 1) if scale.dim() == 1 else (1, *scale.shape)
    if kind == "fp8":
        return fp8_codes(x, scale.view(shape), fp8_rounding)
    return c8_codes(x, scale.view(shape)).to(torch.int8)


def _word(row_bytes: int) -> torch.dtype:
    """The widest element that tiles a row of ``row_bytes``: the NZ tile transpose
    moves whole 32-byte fractal rows, and its cost is per element moved (a 32-byte
    row as 2 complex128 words copies about 1.5x faster than as 4 int64 words and
    3x faster than as 32 int8). Only bits are moved, never arithmetic."""
    if row_bytes % 16 == 0:
        return torch.complex128
    if row_bytes % 8 == 0:
        return torch.int64
    return torch.uint8


def _wide(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[N, row]`` tensor as int64 words when a row is whole words:
    the scatter then moves 8 bytes per element instead of 1 or 2."""
    if (t.shape[-1] * t.element_size()) % 8 == 0:
        return t.view(torch.int64)
    return t


def _scatter_tokens(
    cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, layout: str
) -> None:
    """Token-granular scatter (few tokens, e.g. decode).

    NZ: the ``W // C0`` fractal rows of one token are ``C0``-element (32-byte) runs at
    flat row ``((blk * W//C0) + j) * BS + r`` of ``cache.view(-1, C0)``; the indices
    are computed once and one ``index_copy_`` moves every run as 4 int64 words.
    ND: one ``index_copy_`` of whole token rows.
    """
    if layout == "nd":
        width = rows.shape[1]
        _wide(cache.view(-1, width)).index_copy_(0, slots, _wide(rows))
        return
    nb, n1, bs, cols = cache.shape
    blk = torch.div(slots, bs, rounding_mode="floor")
    row = slots - blk * bs
    tiles = torch.arange(n1, device=slots.device, dtype=slots.dtype)
    index = ((blk * n1).unsqueeze(1) + tiles) * bs + row.unsqueeze(1)
    dst = _wide(cache.view(-1, cols))
    dst.index_copy_(0, index.view(-1), _wide(rows.view(-1, cols)))


def _block_plan(slots: torch.Tensor, bs: int):
    """How to write ``slots`` block by block, or None when the write leaves many of
    the blocks it touches partly filled (decode, scattered slots): then per-token
    scatter is cheaper.

    Returns ``(blocks, dest, partial)``: the touched block ids; per token, its row in
    a token-major staging buffer of ``len(blocks) * BS`` rows; and the positions in
    ``blocks`` of partly written blocks (their other rows are staged from the cache).
    ``dest`` is None when the tokens already are whole blocks in row order (a typical
    prefill), so nothing needs staging.
    """
    n = slots.numel()
    if n < 2 * bs:
        return None
    blk = torch.div(slots, bs, rounding_mode="floor")
    row = slots - blk * bs
    if n % bs == 0:
        b2, r2 = blk.view(-1, bs), row.view(-1, bs)
        if bool((b2 == b2[:, :1]).all()) and bool(
            (r2 == torch.arange(bs, device=slots.device)).all()
        ):
            # every block written whole, tokens in row order (slots are distinct)
            return b2[:, 0].contiguous(), None, None
    blocks, local, counts = torch.unique(blk, return_inverse=True, return_counts=True)
    partial = (counts < bs).nonzero().squeeze(1)
    # Staging re-reads (and re-shuffles) every partly written block, so the block
    # path only pays when nearly all touched blocks are written whole.
    if partial.numel() > max(1, blocks.numel() // 8):
        return None
    return blocks, local * bs + row, partial


#: Up to this many touched blocks, each block is written by its own strided copy
#: (no intermediate buffer); beyond, one ``channel_shuffle`` + ``index_copy_``
#: keeps the Python loop short.
_BLOCK_LOOP_MAX = 256


def _scatter_blocks(cache: torch.Tensor, rows: torch.Tensor, layout: str, plan) -> None:
    """Block-granular write (prefill): token rows are staged block by block (only
    when they are not already whole blocks in order), then each block is written
    with one copy that also does the NZ tile transpose ``[BS, W//C0, C0] ->
    [W//C0, BS, C0]`` on whole fractal rows, moved as 16-byte words. Rows of partly
    written blocks that this call does not touch are staged from the cache first,
    so they are written back unchanged."""
    blocks, dest, partial = plan
    nb = cache.shape[0]
    bs = cache.shape[2] if layout == "nz" else cache.shape[1]
    u = blocks.numel()
    row_bytes = rows.shape[1] * rows.element_size()
    # NZ moves whole 32-byte fractal rows; ND copies contiguous token rows, which
    # run at memcpy speed as plain 8-byte words
    if layout == "nz":
        word = _word(row_bytes)
    else:
        word = torch.int64 if row_bytes % 8 == 0 else torch.uint8
    wsize = torch.empty((), dtype=word).element_size()
    per = cache.shape[-1] * cache.element_size() // wsize if layout == "nz" else 0
    src = rows.view(word)
    words = src.shape[1]
    n1 = words // per if layout == "nz" else 0
    cache_blocks = cache.view(nb, -1).view(word)

    def from_nz(block: torch.Tensor) -> torch.Tensor:  # cache block -> [BS, W] view
        if layout == "nz":
            return block.view(n1, bs, per).transpose(0, 1).reshape(bs, words)
        return block.view(bs, words)

    if dest is None:
        stage = src
    else:
        stage = torch.empty(u * bs, words, dtype=word, device=rows.device)
        for j in partial.tolist():
            stage[j * bs : (j + 1) * bs].copy_(from_nz(cache_blocks[int(blocks[j])]))
        stage.index_copy_(0, dest, src)
    runs = _consecutive_runs(blocks.tolist())
    if len(runs) <= _BLOCK_LOOP_MAX:
        # One strided copy per run of consecutive block ids (a fresh sequence's
        # prefill is usually one run): the copy does the NZ tile transpose of all
        # the run's blocks at once, so the per-copy overhead is paid once per run.
        if layout == "nz":
            dst_all = cache_blocks.view(nb, n1, bs, per)
            src_all = stage.view(u, bs, n1, per).transpose(1, 2)
        else:
            dst_all, src_all = cache_blocks, stage.view(u, -1)
        # one call for all runs, two slices each: the copies are the same, the
        # per-copy Python and dispatch overhead (a fair share of a small write) is
        # paid once
        torch._foreach_copy_(
            [dst_all[b : b + n] for _, b, n in runs],
            [src_all[i : i + n] for i, _, n in runs],
        )
        return
    if layout == "nz":
        out = torch.native_channel_shuffle(stage.view(u, -1, per), bs).view(u, -1)
    else:
        out = stage.view(u, -1)
    cache_blocks.index_copy_(0, blocks, out)


def _consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first_block, length)`` of each maximal run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _valid(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots as int64 plus the token indices to keep (None: all are valid)."""
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        return slots.index_select(0, keep), keep
    return slots, None


def _write_all(
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    slot_mapping: torch.Tensor,
    layout: str,
    fp8_rounding: str = "nearest",
) -> None:
    """Write each ``(cache, x [T, H, D], scale)`` of one call. The caches share NB
    and BS (validated), so the slots are analysed once: padding filtered, and one
    plan (token- or block-granular) serves every cache. ``fp8_rounding`` applies to
    float8_e4m3fn caches."""
    if _write_native(writes, slot_mapping, layout):
        return
    slots, keep = _valid(slot_mapping)
    if slots.numel() == 0:
        return
    first = writes[0][0]
    plan = _block_plan(slots, first.shape[2] if layout == "nz" else first.shape[1])
    for cache, x, scale in writes:
        if keep is not None:
            x = x.index_select(0, keep)
        rows = _encode(x, scale, cache.dtype, fp8_rounding)
        rows = rows.reshape(x.shape[0], -1).contiguous()
        if plan is None:
            _scatter_tokens(cache, rows, slots, layout)
        else:
            _scatter_blocks(cache, rows, layout, plan)


def _row_width(cache: torch.Tensor, layout: str) -> int:
    """Elements one slot holds in a 4-D ``cache`` of ``layout``."""
    return cache.shape[1] * cache.shape[3] if layout == "nz" else cache[0, 0].numel()


def _native_fits(
    cache: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None, layout: str
) -> bool:
    """Whether the native kernel may write ``x`` ``[T, H, D]`` into ``cache``: a
    contiguous 4-D CPU cache whose slots are as wide as a token row, of the input's
    dtype (copy) or int8 with an fp32 ``[H]`` scale (quantize)."""
    if cache.dim() != 4 or x.dim() != 3 or not cache.is_contiguous():
        return False
    if cache.device.type != "cpu" or x.device.type != "cpu":
        return False
    if _row_width(cache, layout) != x.shape[1] * x.shape[2]:
        return False
    if layout == "nz" and cache.shape[3] != c0(cache.dtype):
        return False
    if scale is None:
        return x.dtype == cache.dtype
    return (
        cache.dtype == torch.int8
        and x.dtype in FLOAT_DTYPES
        and scale.device.type == "cpu"
        and tuple(scale.shape) == (x.shape[1],)
    )


def _write_native(
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    slot_mapping: torch.Tensor,
    layout: str,
) -> bool:
    """The CPU fast path (:mod:`.native`): one pass per token that quantizes (int8
    per head) or copies (float) its row straight into its slot; same bytes as the
    eager path. Returns False, having written nothing, when it does not apply: not
    on CPU, kernels disabled or unbuilt, a C8 / FP8 scale (eager only), or
    arguments the public wrappers' validation would refuse (the op can be called
    directly; the kernel addresses raw memory, so it only runs on a write whose
    every byte lands inside the caches, and the eager path raises otherwise)."""
    if slot_mapping.device.type != "cpu" or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        return False
    for cache, x, scale in writes:
        kind = kv_scale_kind(scale, cache.dtype)
        if kind not in ("none", "head") or not _native_fits(cache, x, scale, layout):
            return False
        # the kernel stages one token's int8 codes on its stack
        if kind == "head" and x.shape[1] * x.shape[2] > MAX_ROW_BYTES:
            return False
    t = writes[0][1].shape[0]
    if tuple(slot_mapping.shape) != (t,) or any(x.shape[0] != t for _, x, _ in writes):
        return False
    if t:
        top = int(slot_mapping.max())
        if any(top >= c.numel() // _row_width(c, layout) for c, _, _ in writes):
            return False
    kernels = native_kernels()
    if kernels is None:
        return False
    slots = slot_mapping.contiguous()
    for cache, x, scale in writes:
        x = x.contiguous()
        bs = cache.shape[2] if layout == "nz" else cache.shape[1]
        # NZ: the kernel copies each token's C0-column fractal rows (32 bytes for
        # 1- and 2-byte dtypes, 64 for fp32); ND (0): the whole row
        run = cache.shape[3] * cache.element_size() if layout == "nz" else 0
        if scale is None:
            kernels.copy_write(x, slots, cache, bs, run)
        else:
            s = scale.to(torch.float32).contiguous()
            kernels.quant_write(x, s, slots, cache, bs, run)
    return True


def _write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layout: str,
    fp8_rounding: str = "nearest",
) -> None:
    """The GQA cache write, shared by the op and the direct CPU call."""
    _write_all(
        [(key_cache, key, k_scale), (value_cache, value, v_scale)],
        slot_mapping,
        layout,
        fp8_rounding,
    )


def _write_mla(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    layout: str,
) -> None:
    """The MLA cache write (one latent "head", one rope "head"), shared by the op
    and the direct CPU call."""
    _write_all(
        [
            (latent_cache, latent.unsqueeze(1), k_scale),
            (rope_cache, rope.unsqueeze(1), None),
        ],
        slot_mapping,
        layout,
    )


def direct_cpu_call(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a validated op call may run its CPU implementation directly (the
    cache write :func:`reshape_and_cache_cpu`, the attention and linear kernels)
    instead of through ``torch.ops.ascend_fa`` (the op's Python dispatch costs
    about 0.3 ms a call, measured against the 0.3 ms of a whole 128-token write;
    a decode step calls several ops per layer): every tensor a plain
    CPU ``torch.Tensor`` (no subclass: fake, functional or other wrapper tensors
    go through the op), nothing traced by torch.compile, no torch function or
    dispatch mode active, and no input autograd would record. Those are the
    cases where the op's dispatch does nothing but run the same implementation
    and bump the caches' version counters, which the direct call does too."""
    if torch.compiler.is_compiling():
        return False
    # a mode (FakeTensorMode, a TorchDispatchMode, a TorchFunctionMode) must see
    # the op
    if torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.device.type != "cpu":
            return False
        if grad and t.requires_grad:
            return False
    return True


#: The cache write's name for :func:`direct_cpu_call`.
direct_cpu_write = direct_cpu_call


def _bump_versions(*caches: torch.Tensor) -> None:
    """What the op's ADInplaceOrView step does for its mutated arguments (inference
    tensors have no version counter; the op skips them too)."""
    for cache in caches:
        if not cache.is_inference():
            torch.autograd.graph.increment_version(cache)


def reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layout: str,
    fp8_rounding: str = "nearest",
) -> None:
    """``ascend_fa::reshape_and_cache``'s CPU implementation called directly, for
    arguments :func:`direct_cpu_write` accepts (validated by the caller)."""
    _write_kv(
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
    _bump_versions(key_cache, value_cache)


def reshape_and_cache_mla_cpu(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    layout: str,
) -> None:
    """``ascend_fa::reshape_and_cache_mla``'s CPU implementation called directly
    (see :func:`reshape_and_cache_cpu`)."""
    _write_mla(latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout)
    _bump_versions(latent_cache, rope_cache)


@torch.library.custom_op(
    "ascend_fa::reshape_and_cache", mutates_args=("key_cache", "value_cache")
)
def _reshape_and_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layout: str,
    fp8_rounding: str = "nearest",
) -> None:
    _write_kv(
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


@_reshape_and_cache_op.register_fake
def _(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    layout,
    fp8_rounding="nearest",
) -> None:
    return None


@torch.library.custom_op(
    "ascend_fa::reshape_and_cache_mla", mutates_args=("latent_cache", "rope_cache")
)
def _reshape_and_cache_mla_op(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    layout: str,
) -> None:
    _write_mla(latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout)


@_reshape_and_cache_mla_op.register_fake
def _(latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout) -> None:
    return None


# -- golden references ----------------------------------------------------------------
def _put_token_ref(
    cache: torch.Tensor, slot: int, row: torch.Tensor, layout: str
) -> None:
    """Write one token's ``W`` features, each to the position the table in the
    module doc gives for feature ``c`` (the index math per feature, vectorized over
    ``c``; independent of the kernels' run-based copies)."""
    c = torch.arange(row.numel())
    if layout == "nz":
        bs, cols = cache.shape[2], cache.shape[3]
        blk, r = divmod(slot, bs)
        cache[blk, c // cols, r, c % cols] = row.to(cache.dtype)
    else:
        bs, d = cache.shape[1], cache.shape[3]
        blk, r = divmod(slot, bs)
        cache[blk, r, c // d, c % d] = row.to(cache.dtype)


def _round_half_even_ref(quot: torch.Tensor) -> torch.Tensor:
    """Round half to even by hand (floor, then the fraction decides) and saturate
    to int8; no ``torch.round`` (the kernels use it)."""
    low = torch.floor(quot)
    frac = quot - low
    odd = torch.remainder(low, 2) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return torch.clamp(low + up.float(), INT8_MIN, INT8_MAX).to(torch.int8)


def _fp8_ref(y: torch.Tensor) -> torch.Tensor:
    """Nearest float8_e4m3fn value of every fp32 ``y`` (already within +-448), ties
    to the even code, found by searching the 127 non-negative finite codes for
    ``|y|`` and setting the sign bit from ``y`` (no cast of ``y``)."""
    codes = torch.arange(127, dtype=torch.uint8)  # 0x00 .. 0x7e (0x7f is NaN)
    values = codes.view(FP8_KV_DTYPE).float()
    flat = y.reshape(-1, 1).float()
    dist = (flat.abs() - values.unsqueeze(0)).abs()
    near = dist == dist.min(dim=1, keepdim=True).values
    even = near & (codes.unsqueeze(0) % 2 == 0)
    pick = torch.where(
        even.any(dim=1), even.float().argmax(dim=1), near.float().argmax(dim=1)
    )
    out = codes[pick] | (torch.signbit(flat.squeeze(1)).to(torch.uint8) << 7)
    return out.view(FP8_KV_DTYPE).view(y.shape)


def _f32(v: float) -> float:
    """``v`` rounded to the nearest fp32 (subnormals included), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def fp8_trunc_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Golden vLLM-CPU FP8 codes of ``x`` ``[T, H, D]`` with ``scale`` ``[1]`` or
    ``[H]``, one value at a time from the kernel's bit recipe (the module doc of
    :mod:`.quant` cites it): ``inv = fp32(1 / s)``, ``y = fp32(x * inv)``
    saturated at +-448; ``y == 0`` stores +0; else the fp32 bits ``b`` of
    ``fp32(y * 2**-120)`` give the code ``sign(b) | min((b >> 20) & 0x7f, 0x7e)``.
    Python floats and ``struct`` only (no torch rounding, no cast to float8)."""
    t, h, d = x.shape
    s = scale.float().reshape(-1).tolist()
    vals = x.float().reshape(t, h, d).tolist()
    out = torch.empty(t, h, d, dtype=torch.uint8)
    for i in range(t):
        for j in range(h):
            inv = _f32(1.0 / s[j if len(s) > 1 else 0])  # innocuous double rounding
            for k in range(d):
                y = min(max(_f32(vals[i][j][k] * inv), -448.0), 448.0)
                if y == 0.0:
                    out[i, j, k] = 0
                    continue
                (b,) = struct.unpack("<I", struct.pack("<f", _f32(y * 2.0**-120)))
                out[i, j, k] = ((b >> 24) & 0x80) | min((b >> 20) & 0x7F, 0x7E)
    return out.view(FP8_KV_DTYPE)


def _quantize_ref(
    x: torch.Tensor,
    scale: torch.Tensor,
    cache_dtype: torch.dtype = torch.int8,
    fp8_rounding: str = "nearest",
) -> torch.Tensor:
    """Golden codes of ``x`` ``[T, H, D]`` for each scale form of the module doc,
    written from the rules (fp32 / fp64 arithmetic, hand rounding), not from the
    kernels' helpers."""
    if cache_dtype == FP8_KV_DTYPE:
        if fp8_rounding == "trunc":
            return fp8_trunc_ref(x, scale)
        quot = x.float() / scale.float().view(1, -1, 1)
        return _fp8_ref(torch.clamp(quot, -448.0, 448.0))
    if scale.dim() == 2:
        # C8: scale held in the key dtype, its reciprocal rounded to that dtype, the
        # product (exact in fp64) rounded to that dtype
        held = scale.to(x.dtype)
        inv = (1.0 / held.float()).to(x.dtype)
        prod = (x.double() * inv.double().unsqueeze(0)).to(x.dtype)
        return _round_half_even_ref(prod.double())
    return _round_half_even_ref(x.float() / scale.float().view(1, -1, 1))


def token_rows_ref(cache: torch.Tensor, slot: int, layout: str) -> torch.Tensor:
    """The ``W`` features stored for ``slot`` (golden read-back, one element at a
    time)."""
    out = []
    if layout == "nz":
        _, n1, bs, cols = cache.shape
        blk, r = divmod(slot, bs)
        for c in range(n1 * cols):
            out.append(cache[blk, c // cols, r, c % cols])
    else:
        _, bs, h, d = cache.shape
        blk, r = divmod(slot, bs)
        for c in range(h * d):
            out.append(cache[blk, r, c // d, c % d])
    return torch.stack(out)


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    layout: str = "nz",
    fp8_rounding: str = "nearest",
) -> None:
    """Golden reference: one token at a time, in slot order, each feature placed by
    the layout table's index formula."""
    kq = (
        _quantize_ref(key, k_scale, key_cache.dtype, fp8_rounding)
        if k_scale is not None
        else key
    )
    vq = (
        _quantize_ref(value, v_scale, value_cache.dtype, fp8_rounding)
        if v_scale is not None
        else value
    )
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        _put_token_ref(key_cache, slot, kq[t].reshape(-1), layout)
        _put_token_ref(value_cache, slot, vq[t].reshape(-1), layout)


def reshape_and_cache_mla_ref(
    latent: torch.Tensor,
    rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    layout: str = "nz",
) -> None:
    """Golden reference of the MLA write, per token as in
    :func:`reshape_and_cache_ref`."""
    lq = (
        _quantize_ref(latent.unsqueeze(1), k_scale).squeeze(1)
        if k_scale is not None
        else latent
    )
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        _put_token_ref(latent_cache, slot, lq[t], layout)
        _put_token_ref(rope_cache, slot, rope[t], layout)
