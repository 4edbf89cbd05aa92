"""FRACTAL_NZ layout: the tiled layout Ascend cube units read matrices in.

A matrix ``[..., M, N]`` is cut into fractals of 16 rows by ``C0`` columns
(``C0 = c0(dtype)``: 32 bytes of one row). Fractals are stored column-tile major:

============  =======================================  ======================
layout        shape                                    element ``(m, n)`` at
============  =======================================  ======================
ND            ``[..., M, N]``                          ``[..., m, n]``
FRACTAL_NZ    ``[..., ceil(N/C0), ceil(M/16)*16, C0]``  ``[..., n//C0, m, n%C0]``
============  =======================================  ======================

Padding (rows ``M..ceil(M/16)*16`` and columns ``N..ceil(N/C0)*C0``) is zero.

Ops defined here (namespace ``ascend_fa``): ``nd_to_nz`` and ``nz_to_nd``. Their
default kernel is the PyTorch implementation below, which is what the CPU and CUDA
backends run; ``nd_to_nz_ref`` / ``nz_to_nd_ref`` are per-element golden loops.
"""

from __future__ import annotations

import math

import torch

from .constants import NZ_ROW_ALIGN, c0

__all__ = [
    "nd_to_nz",
    "nz_to_nd",
    "nd_to_nz_ref",
    "nz_to_nd_ref",
    "nz_shape",
    "nz_cache_shape",
]


def nz_shape(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
) -> tuple[int, ...]:
    """NZ shape of an ND tensor of ``shape`` ``[..., M, N]`` and ``dtype``."""
    if len(shape) < 2:
        raise ValueError(
            f"NZ needs a tensor of rank >= 2 ([..., M, N]), got shape {tuple(shape)}"
        )
    *batch, m, n = shape
    cols = c0(dtype)
    return (
        *batch,
        math.ceil(n / cols),
        math.ceil(m / NZ_ROW_ALIGN) * NZ_ROW_ALIGN,
        cols,
    )


def nz_cache_shape(
    num_blocks: int, block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, ...]:
    """Shape of a paged KV cache in NZ: ``(NB, Hkv*D // C0, BS, C0)``.

    Each block is one ``[BS, Hkv*D]`` matrix (tokens x features). ``Hkv*D`` must be a
    multiple of ``C0`` (``D`` alone need not be) and ``BS`` a multiple of 16
    (32 for 1-byte dtypes, whose fractal is 32 rows deep on the device).
    """
    for arg, val in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(
                f"nz_cache_shape: {arg} must be a positive int, got {val!r}"
            )
    cols = c0(dtype)
    width = num_heads * head_dim
    if width % cols:
        raise ValueError(
            f"nz_cache_shape: num_heads*head_dim = {num_heads}*{head_dim} = {width} "
            f"is not a multiple of C0 = {cols} for {dtype}"
        )
    row_align = 32 if cols == 32 else NZ_ROW_ALIGN
    if block_size % row_align:
        raise ValueError(
            f"nz_cache_shape: block_size = {block_size} is not a multiple of "
            f"{row_align} (required for {dtype} NZ caches)"
        )
    return (num_blocks, width // cols, block_size, cols)


def _check_rank(x: torch.Tensor, name: str, rank: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dim() < rank:
        raise ValueError(f"{name}: expected rank >= {rank}, got shape {tuple(x.shape)}")


#: Rows per band in the pack copy (2048 rows x 32 bytes = 64 KiB per column tile).
_ROW_BAND = 2048


def _wide_view(t: torch.Tensor, cols: int) -> torch.Tensor | None:
    """View a contiguous tensor whose last dim holds whole 32-byte fractal rows as
    int64 words, so the tile shuffle moves 8 bytes per element instead of 1 or 2.
    Returns None when the view is not possible (then the caller copies natively)."""
    width = cols * t.element_size()
    if width % 8 or not t.is_contiguous() or (t.shape[-1] * t.element_size()) % 8:
        return None
    if t.dtype.is_complex or t.dtype == torch.bool:
        return None
    try:  # size-1 dims can make a sliced tensor "contiguous" with odd strides
        return t.view(torch.int64)
    except RuntimeError:
        return None


def _nd_to_nz_impl(x: torch.Tensor) -> torch.Tensor:
    *batch, m, n = x.shape
    cols = c0(x.dtype)
    out = torch.empty(nz_shape(x.shape, x.dtype), dtype=x.dtype, device=x.device)
    n1, mp = out.shape[-3], out.shape[-2]
    full = n // cols
    if mp > m:
        out[..., :, m:, :].zero_()
    if full:
        src = x[..., : full * cols] if full * cols != n else x
        dst = out[..., :full, :m, :]
        wide_src = _wide_view(src, cols)
        if wide_src is not None:
            words = cols * x.element_size() // 8
            dst = out.view(torch.int64)[..., :full, :m, :]
            tiles = wide_src.reshape(*batch, m, full, words).transpose(-3, -2)
        else:
            tiles = src.reshape(*batch, m, full, cols).transpose(-3, -2)
        # Copy in bands of rows: each band writes one contiguous run per column tile,
        # so the fresh output is touched (page faults, TLB) a run at a time instead
        # of 32 bytes in every tile per source row.
        for r0 in range(0, m, _ROW_BAND):
            dst[..., r0 : r0 + _ROW_BAND, :].copy_(tiles[..., r0 : r0 + _ROW_BAND, :])
    if n1 > full:
        rem = n - full * cols
        out[..., full, :m, :rem].copy_(x[..., full * cols :])
        out[..., full, :m, rem:].zero_()
    return out


def _nz_to_nd_impl(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    *batch, n1, mp, cols = x.shape
    out = torch.empty(*batch, m, n, dtype=x.dtype, device=x.device)
    full = n // cols
    if full:
        src = x[..., :full, :m, :]
        wide_dst = _wide_view(out, cols) if full * cols == n else None
        if wide_dst is not None and x.is_contiguous():
            words = cols * x.element_size() // 8
            src_w = x.view(torch.int64)[..., :full, :m, :]
            wide_dst.view(*batch, m, full, words).copy_(src_w.transpose(-3, -2))
        else:
            dst = out[..., : full * cols].unflatten(-1, (full, cols))
            dst.copy_(src.transpose(-3, -2))
    if n1 > full:
        rem = n - full * cols
        out[..., full * cols :].copy_(x[..., full, :m, :rem])
    return out


def _validate_nz(x: torch.Tensor, m: int, n: int) -> None:
    _check_rank(x, "nz_to_nd: x", 3)
    for arg, val in (("m", m), ("n", n)):
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"nz_to_nd: {arg} must be a positive int, got {val!r}")
    cols = c0(x.dtype)
    expected = nz_shape((m, n), x.dtype)
    if tuple(x.shape[-3:]) != expected:
        raise ValueError(
            f"nz_to_nd: x has NZ tail shape {tuple(x.shape[-3:])}, but an ND "
            f"[{m}, {n}] {x.dtype} matrix packs to {expected} (C0 = {cols})"
        )


@torch.library.custom_op("ascend_fa::nd_to_nz", mutates_args=())
def _nd_to_nz_op(x: torch.Tensor) -> torch.Tensor:
    return _nd_to_nz_impl(x)


@_nd_to_nz_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(nz_shape(x.shape, x.dtype))


@torch.library.custom_op("ascend_fa::nz_to_nd", mutates_args=())
def _nz_to_nd_op(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    return _nz_to_nd_impl(x, m, n)


@_nz_to_nd_op.register_fake
def _(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-3], m, n))


def nd_to_nz(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x`` ``[..., M, N]`` into NZ ``[..., ceil(N/C0), ceil(M/16)*16, C0]``.

    Same dtype; padding is zero; element ``(m, n)`` lands at ``[..., n//C0, m, n%C0]``.
    """
    _check_rank(x, "nd_to_nz: x", 2)
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"nd_to_nz: x must have M, N > 0, got shape {tuple(x.shape)}")
    return torch.ops.ascend_fa.nd_to_nz(x)


def nz_to_nd(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Unpack NZ ``x`` ``[..., ceil(n/C0), ceil(m/16)*16, C0]`` into ND ``[..., m, n]``,
    dropping the padding. Exact inverse of :func:`nd_to_nz`."""
    _validate_nz(x, m, n)
    return torch.ops.ascend_fa.nz_to_nd(x, m, n)


def nd_to_nz_ref(x: torch.Tensor) -> torch.Tensor:
    """Golden reference: one element at a time, straight from the definition."""
    *batch, m, n = x.shape
    cols = c0(x.dtype)
    out = torch.zeros(nz_shape(x.shape, x.dtype), dtype=x.dtype, device=x.device)
    for i in range(m):
        for j in range(n):
            out[..., j // cols, i, j % cols] = x[..., i, j]
    return out


def nz_to_nd_ref(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Golden reference of :func:`nz_to_nd`: one element at a time."""
    cols = c0(x.dtype)
    out = torch.empty(*x.shape[:-3], m, n, dtype=x.dtype, device=x.device)
    for i in range(m):
        for j in range(n):
            out[..., i, j] = x[..., j // cols, i, j % cols]
    return out
