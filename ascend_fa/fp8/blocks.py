"""The FP8 E4M3 block format and its scale math, one tensor at a time.

====================  =================  ===============================
tensor                dtype              shape
====================  =================  ===============================
``<name>`` (``W``)    ``float8_e4m3fn``  ``[out, in]``
``<name>_scale_inv``  ``float32``        ``[ceil(out/BR), ceil(in/BC)]``
====================  =================  ===============================

Per ``[BR, BC]`` block (DeepSeek-V3: 128 x 128; edge blocks are partial), in fp32:
``scale_inv = max(amax(|W_block|) / 448, tiny)``, ``W_fp8 = (W / scale_inv)
.to(float8_e4m3fn)`` (round to nearest even); dequantization is ``W = W_fp8.float()
* scale_inv`` cast to bf16 or fp16. That is the rule DeepSeek's own
``inference/kernel.py`` (``weight_dequant``) and vLLM's block-FP8 loader apply.

The chunk functions (:func:`quantize_chunk`, :func:`dequantize_chunk`) take whole
block rows and write their result into a caller-given ``out`` tensor, so the
conversion driver computes straight into its write buffers.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import torch

from ..atb_ops.constants import FP8_BLOCK, FP8_E4M3_MAX
from ..atb_ops.native import native_kernels
from .errors import FP8FormatError, FP8InputError

__all__ = [
    "CHUNK_ELEMS",
    "NATIVE_CHUNK_ELEMS",
    "OUT_DTYPES",
    "SCALE_SUFFIX",
    "TINY",
    "BadBlock",
    "Workspace",
    "check_block",
    "check_scale_inv",
    "chunk_rows",
    "dequantize_blockwise",
    "dequantize_chunk",
    "e4m3_values",
    "quantize_blockwise",
    "quantize_chunk",
    "scale_shape",
]

#: Suffix of the per-block inverse scales: ``<weight name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"

#: Smallest scale: an all-zero (or vanishingly small) block divides by this instead
#: of by 0, so its codes are 0, never NaN.
TINY = torch.finfo(torch.float32).tiny

#: Elements per working chunk (~2 MiB as fp32), whole block rows at a time: small
#: enough to stay in cache between the passes of one chunk and to bound memory per
#: worker; large enough that per-op overhead is small (narrower column slabs of a
#: 7168-wide block row measured slower, not faster).
CHUNK_ELEMS = 1 << 19
#: Elements per chunk when the native one-pass kernels run: no intermediate has to
#: stay in cache between passes, so chunks are larger, fewer (about 4 MiB of bf16)
#: and the per-chunk Python and object overhead (5-10% of the conversion with
#: :data:`CHUNK_ELEMS`, garbage collection included) shrinks; the output of one
#: chunk still fits one staging buffer of the writer
#: (:data:`~ascend_fa.fp8.safetensors_io.WRITE_BYTES`).
NATIVE_CHUNK_ELEMS = 1 << 21

#: Output dtypes of dequantization, by the name the CLI and config.json use.
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

#: Bits of |x| compared as integers: for IEEE floats, ordering of the non-negative
#: bit patterns equals ordering of the values, and every pattern at or above +inf's
#: is inf or NaN. amax over int16 is ~2x faster than over bf16 and exact.
_INT_VIEW = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}
#: A 1-element int16 tensor, not a Python scalar: it makes ``int8 * 2**7`` compute
#: in int16 (type promotion), sign-extending the code in the same pass.
_TIMES_128 = torch.tensor([128], dtype=torch.int16)


class BadBlock(Exception):
    """A block holds values the format forbids; ``row``/``col`` are block indices
    relative to the chunk (the caller adds its offset and names the tensor)."""

    def __init__(self, row: int, col: int, what: str = "non-finite values") -> None:
        super().__init__(row, col, what)
        self.row, self.col, self.what = row, col, what


class Workspace:
    """Reusable flat buffers: fresh large allocations page-fault on every use, which
    costs more than the arithmetic, so each chunk reuses the same memory."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        #: the write staging buffers, lent to one shard writer at a time
        self.staging: list[torch.Tensor] = []

    def get(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 1), dtype=dtype)
            self._bufs[(key, dtype)] = buf
        return buf[:n].view(*shape)


def check_block(block_size: Sequence[int]) -> tuple[int, int]:
    """``block_size`` as ``(BR, BC)``; refuses anything but two positive ints."""
    try:
        br, bc = (operator.index(b) for b in block_size)
    except (TypeError, ValueError):
        br = bc = 0
    if isinstance(block_size, str | bytes) or br < 1 or bc < 1:
        shown = list(block_size) if isinstance(block_size, list | tuple) else block_size
        raise FP8InputError(f"block size must be two positive integers, got {shown}")
    return br, bc


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, int]:
    """``[ceil(out/BR), ceil(in/BC)]`` for a weight ``[out, in]``."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def chunk_rows(cols: int, br: int) -> int:
    """Rows per chunk: whole block rows, about :data:`CHUNK_ELEMS` elements
    (:data:`NATIVE_CHUNK_ELEMS` when the native kernels are in use)."""
    elems = CHUNK_ELEMS if native_kernels() is None else NATIVE_CHUNK_ELEMS
    return max(1, elems // max(cols, 1) // br) * br


def _first_bad_block(mask: torch.Tensor) -> tuple[int, int]:
    idx = torch.nonzero(mask)[0]
    return int(idx[0]), int(idx[1])


def check_scale_inv(scale_inv: torch.Tensor) -> None:
    """Raise :class:`BadBlock` for the first ``scale_inv [nbr, nbc]`` entry that is
    zero, negative or not finite: each would turn a whole block into 0, a flipped
    sign, inf or NaN, and no quantizer writes one (its floor is :data:`TINY`)."""
    s = scale_inv.float()
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        row, col = _first_bad_block(bad)
        v = float(s[row, col])
        kind = (
            "non-finite" if not math.isfinite(v) else "zero" if v == 0 else "negative"
        )
        raise BadBlock(row, col, f"a {kind} scale_inv")


def _quantize_native(
    w: torch.Tensor, block: tuple[int, int], out: torch.Tensor
) -> torch.Tensor | None:
    """``scale_inv`` from the native one-pass kernel (:mod:`ascend_fa.atb_ops.
    native`) with the codes in ``out``, or None when it does not apply (nothing
    written: the eager path runs)."""
    kernels = native_kernels() if w.device.type == "cpu" else None
    if (
        kernels is None
        or w.dtype not in _INT_VIEW
        or not (w.is_contiguous() and out.is_contiguous())
        or out.dtype != torch.float8_e4m3fn
        or out.device.type != "cpu"
        or tuple(out.shape) != tuple(w.shape)
    ):
        return None
    scale_inv = torch.empty(scale_shape(w.shape, block))
    bad = kernels.fp8_quantize(w, block, scale_inv, out)
    if bad is None:
        return scale_inv
    if bad < 0:  # a changed float environment (MXCSR)
        return None
    raise BadBlock(*divmod(bad, scale_inv.shape[1]))


def quantize_chunk(
    w: torch.Tensor, block: tuple[int, int], ws: Workspace, out: torch.Tensor
) -> torch.Tensor:
    """``w [r, n]`` (r a multiple of BR unless it is the tensor's last chunk) ->
    codes in ``out [r, n] float8_e4m3fn``; returns ``scale_inv [ceil(r/BR),
    ceil(n/BC)] float32``.

    Raises :class:`BadBlock` (chunk-relative) on inf/NaN.
    """
    br, bc = block
    r, n = w.shape
    nbr, nbc = -(-r // br), -(-n // bc)
    if r * n == 0:
        return torch.empty((nbr, nbc))
    # on CPU, one native pass per block: the same scales, codes and refusals
    scale_inv = _quantize_native(w, block, out)
    if scale_inv is not None:
        return scale_inv
    rows, cols = nbr * br, nbc * bc
    idt, mask, inf_bits = _INT_VIEW[w.dtype]
    # amax(|W|) per block on the integer view of |W| (sign bit cleared). Padding
    # of partial edge blocks is 0, the neutral element of max over |W|.
    bits = ws.get("bits", (rows, cols), idt)
    if cols > n:
        bits[:, n:].zero_()
    if rows > r:
        bits[r:].zero_()
    torch.bitwise_and(w.view(idt), mask, out=bits[:r, :n])
    amax_bits = bits.view(nbr, br, nbc, bc).amax(dim=(1, 3))
    bad = amax_bits >= inf_bits
    if bool(bad.any()):
        raise BadBlock(*_first_bad_block(bad))
    amax = amax_bits.view(w.dtype).float()
    # fp32 throughout: amax / 448 is the spec's scale; the floor keeps an all-zero
    # block finite (0 / tiny = 0) instead of 0 / 0 = NaN.
    scale_inv = torch.clamp_min(amax / FP8_E4M3_MAX, TINY)
    x = ws.get("f32", (rows, cols), torch.float32)
    x[:r, :n].copy_(w)
    # Exactly W / scale_inv with the block-broadcast scale (IEEE division is the same
    # in place or not), then round-to-nearest-even into E4M3.
    x.view(nbr, br, nbc, bc).div_(scale_inv.view(nbr, 1, nbc, 1))
    out.copy_(x[:r, :n])
    return scale_inv


def _e4m3_half_bits(codes_i8: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as fp16 bits of ``value / 2**8`` (see :func:`dequantize_chunk`)."""
    # code (sign-extended) * 2**7: bit 15 = sign, bit 14 = sign too, 13..7 = code
    torch.mul(codes_i8, _TIMES_128, out=out)
    return out.bitwise_and_(-16385)  # clear bit 14 (~0x4000 as int16)


@functools.cache
def e4m3_values() -> torch.Tensor:
    """The fp32 value of each of the 256 float8_e4m3fn codes ``[256]`` (NaN at
    0x7F and 0xFF, the format's only NaNs; it has no infinities), decoded by the
    exact bit move of :func:`dequantize_chunk`, not by torch's cast."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8)
    half = _e4m3_half_bits(codes, torch.empty(256, dtype=torch.int16))
    values = half.view(torch.float16).float() * 256.0
    values[(codes.view(torch.uint8) & 0x7F) == 0x7F] = float("nan")
    return values


def _dequantize_native(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor,
) -> bool:
    """The one-pass native kernel (:mod:`ascend_fa.atb_ops.native`) when it
    applies; False (nothing written) when it does not."""
    kernels = native_kernels() if codes.device.type == "cpu" else None
    r, n = codes.shape
    nbr, nbc = -(-r // block[0]), -(-n // block[1])
    if (
        kernels is None
        or not (codes.is_contiguous() and out.is_contiguous())
        or scale_inv.dtype != torch.float32
        or tuple(scale_inv.shape) != (nbr, nbc)
        or tuple(out.shape) != (r, n)
        or out.dtype not in (torch.bfloat16, torch.float16)
        or out.device.type != "cpu"
        or scale_inv.device.type != "cpu"
    ):
        return False
    bad = kernels.fp8_dequantize(
        codes, scale_inv.contiguous(), block, e4m3_values(), out
    )
    if bad is None:
        return True
    what, pos = bad
    if what == "unsupported":
        return False
    if what == "overflow":
        # the eager path looks for NaN codes in the whole chunk first
        nan = ((codes.view(torch.uint8) & 0x7F) == 0x7F).view(-1).nonzero()
        if nan.numel():
            what, pos = "nan", int(nan[0, 0])
    br, bc = block
    why = "an FP8 NaN code" if what == "nan" else "a value beyond float16"
    raise BadBlock(pos // n // br, pos % n // bc, why)


def dequantize_chunk(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    ws: Workspace,
    out: torch.Tensor,
) -> None:
    """``codes [r, n] float8_e4m3fn``, ``scale_inv [ceil(r/BR), ceil(n/BC)]``
    float32 -> ``out [r, n]`` (bf16 or fp16), equal to ``(codes.float() *
    scale_inv).to(out.dtype)`` bit for bit.

    The caller checks the whole tensor's scales once (:func:`check_scale_inv`).
    Raises :class:`BadBlock` on an FP8 NaN code or (fp16) a result out of range.
    """
    br, bc = block
    r, n = codes.shape
    if r * n == 0:
        return
    # on CPU, one native pass: same values and the same refusals
    if _dequantize_native(codes, scale_inv, block, out):
        return
    nbr, nbc = -(-r // br), -(-n // bc)
    rows, cols = nbr * br, nbc * bc
    # E4M3FN has no inf; 0x7F / 0xFF are its NaNs.
    low = ws.get("nan", (r, n), torch.uint8)
    torch.bitwise_and(codes.view(torch.uint8), 0x7F, out=low)
    if int(low.amax()) == 0x7F:
        pos = int(torch.nonzero((low == 0x7F).view(-1))[0])
        raise BadBlock(pos // n // br, pos % n // bc, "an FP8 NaN code")
    # torch's scalar fp8 -> fp32 conversion is slow on CPU; E4M3 bits shifted into
    # fp16 are exact instead: sign stays in bit 15, exponent+mantissa (7 bits) move
    # to bits 13..7, which is fp16 with exponent bias 15 instead of 7, i.e. the
    # value / 2**8 (subnormals included). The 2**8 is folded into the scale, exact
    # because multiplying by a power of two only changes the exponent.
    half = ws.get("half", (rows, cols), torch.int16)
    if cols > n:
        half[:, n:].zero_()
    if rows > r:
        half[r:].zero_()
    _e4m3_half_bits(codes.view(torch.int8), half[:r, :n])
    x = ws.get("f32", (rows, cols), torch.float32)
    x.copy_(half.view(torch.float16))
    scale = scale_inv * 256.0
    xb = x.view(nbr, br, nbc, bc)
    if bool(torch.isfinite(scale).all()):
        xb.mul_(scale.view(nbr, 1, nbc, 1))
    else:  # scale_inv * 2**8 overflows fp32: apply the two factors one by one
        xb.mul_(256.0).mul_(scale_inv.view(nbr, 1, nbc, 1))
    out.copy_(x[:r, :n])
    if out.dtype == torch.float16:
        finite = torch.isfinite(out)
        if not bool(finite.all()):
            pos = int(torch.nonzero(~finite.view(-1))[0])
            raise BadBlock(pos // n // br, pos % n // bc, "a value beyond float16")


def quantize_blockwise(
    weight: torch.Tensor, block_size: Sequence[int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [out, in]`` (bf16, fp16 or fp32) to FP8 E4M3 block-wise.

    Returns ``(codes [out, in] float8_e4m3fn, scale_inv [ceil(out/BR), ceil(in/BC)]
    float32)`` with, per block, ``scale_inv = max(amax(|W|) / 448, tiny)`` and
    ``codes = (W / scale_inv).to(float8_e4m3fn)`` in fp32. Vectorized over blocks,
    processed in chunks of whole block rows. Raises :class:`FP8FormatError`
    naming the block on inf/NaN.
    """
    block = check_block(block_size)
    if weight.dim() != 2 or weight.dtype not in _INT_VIEW:
        raise FP8InputError(
            "quantize_blockwise expects a 2-D bf16/fp16/fp32 tensor, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    w = weight.detach().to("cpu").contiguous()
    rows, cols = w.shape
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty(scale_shape(w.shape, block))
    ws = Workspace()
    step = chunk_rows(cols, block[0])
    for r0 in range(0, rows, step):
        b0 = r0 // block[0]
        try:
            s = quantize_chunk(w[r0 : r0 + step], block, ws, codes[r0 : r0 + step])
        except BadBlock as e:
            raise FP8FormatError(
                f"tensor has {e.what} in block ({b0 + e.row}, {e.col})"
            ) from None
        scales[b0 : b0 + s.shape[0]] = s
    return codes, scales


def dequantize_blockwise(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block_size: Sequence[int] = FP8_BLOCK,
) -> torch.Tensor:
    """``codes [out, in] float8_e4m3fn`` x ``scale_inv [ceil(out/BR), ceil(in/BC)]``
    -> ``[out, in] dtype`` (bf16 or fp16), equal to ``(codes.float() *
    scale_inv_broadcast).to(dtype)``. Raises :class:`FP8FormatError` naming the
    block on a scale_inv that is zero, negative or not finite, an FP8 NaN code, or
    fp16 overflow.
    """
    block = check_block(block_size)
    if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn:
        raise FP8InputError(
            f"expected 2-D float8_e4m3fn codes, got {tuple(codes.shape)} {codes.dtype}"
        )
    if dtype not in OUT_DTYPES.values():
        raise FP8InputError(f"dtype must be bfloat16 or float16, got {dtype}")
    rows, cols = codes.shape
    expect = scale_shape(codes.shape, block)
    if tuple(scale_inv.shape) != expect or not scale_inv.is_floating_point():
        raise FP8InputError(
            f"scale_inv shape {tuple(scale_inv.shape)} ({scale_inv.dtype}) does not "
            f"match codes {(rows, cols)} with block {list(block)}: expected a float "
            f"tensor of shape {expect}"
        )
    q = codes.detach().to("cpu").contiguous()
    s = scale_inv.detach().to("cpu", torch.float32).contiguous()
    try:
        check_scale_inv(s)
    except BadBlock as e:
        raise FP8FormatError(
            f"tensor has {e.what} in block ({e.row}, {e.col})"
        ) from None
    result = torch.empty((rows, cols), dtype=dtype)
    ws = Workspace()
    step = chunk_rows(cols, block[0])
    for r0 in range(0, rows, step):
        b0 = r0 // block[0]
        sc = s[b0 : b0 + -(-min(step, rows - r0) // block[0])]
        try:
            dequantize_chunk(q[r0 : r0 + step], sc, block, ws, result[r0 : r0 + step])
        except BadBlock as e:
            raise FP8FormatError(
                f"tensor has {e.what} in block ({b0 + e.row}, {e.col})"
            ) from None
    return result
