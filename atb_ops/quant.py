"""Per-head symmetric INT8 quantization, the numerics every FA path shares.

==================  =============================  ==============================
function            inputs                         output
==================  =============================  ==============================
per_head_qparams    ``lo``, ``hi`` ``[H]``         ``scale`` fp32 ``[H]``,
                                                   ``offset`` int8 zeros ``[H]``
quantize_per_head   ``x`` ``[..., H, ...]`` float,  int8 codes, shape of ``x``
                    ``scale`` ``[H]`` at ``axis``
dequantize_per_head ``q`` int8, ``scale`` ``[H]``  ``dtype``, shape of ``q``
==================  =============================  ==============================

Numerics, and why:

* Scales are fp32 even for bf16/fp16 activations: a bf16 scale carries 8 mantissa
  bits, which alone moves codes by up to half a step.
* ``scale = max(max(-lo, hi) / 127, 2**-23)``: symmetric about zero (offset 0, which
  is what the Ascend kernels take), and floored so an all-zero head never divides by
  zero.
* ``q = clamp(round_half_even(x / scale), -128, 127)``: division (not multiplication
  by a reciprocal) and ties-to-even match ``npu_quantize(div_mode=True)``; -128 stays a
  legal code because the device saturates to it.

This module is the one owner of that rule. Besides the validated ops it offers the
unvalidated fast forms that the calibration search, the evaluation and the reports
call many times per layer (same numerics, bit for bit):

=======================  ====================================================
function                 what
=======================  ====================================================
``int8_codes``           the fp32 codes ``clamp(round(x / s), -128, 127)``
``fake_quant_per_head``  ``int8_codes(x, scale[axis]) * scale`` in fp32
``saturated``            bool mask: ``round(x / s)`` outside ``[-128, 127]``
``absmax_scale``         ``max(amax / 127, 2**-23)`` from an absmax tensor
``dynamic_fake_quant``   per-slice (e.g. per token and head) quant -> dequant
``c8_codes``             C8 (per-channel KV) codes, vllm-ascend's write rule
``fp8_codes``            FP8 E4M3 KV codes, vLLM's write rule (CUDA or CPU
                         rounding)
=======================  ====================================================

The two KV-cache forms follow their consumers' cache writes, not the rule above:

* **C8** (vllm-ascend, per-channel ``[Hkv, D]`` scales): the scale is held in the
  activation dtype (its weight loader casts it to the parameter dtype), its
  reciprocal is taken in that dtype and the codes are
  ``clamp(round_half_even(x * (1 / s)), -128, 127)`` with the product rounded to
  the activation dtype (vllm-project/vllm-ascend@182b75ea
  ``vllm_ascend/attention/attention_v1.py`` ``_prepare_c8_scales`` /
  ``_quantize_kv_to_int8``; ``vllm_ascend/quantization/methods/kv_c8.py``
  ``_c8_kv_scale_weight_loader``). For a bf16 model the rounded product can land
  one code away from the fp32 quotient, so the fp32 rule would not reproduce the
  deployed cache.
* **FP8 E4M3** (vLLM, ``[1]`` or ``[Hkv]`` fp32 scales), read back as ``code * s``.
  The write rounds one of two ways (``rounding``, :data:`.constants.FP8_ROUNDINGS`):

  - ``"nearest"`` (vLLM on CUDA, the default): ``x / s`` in fp32, saturated at
    +-448, cast to ``float8_e4m3fn`` (round to nearest even)
    (vllm-project/vllm@2fed15b1 ``csrc/quantization/fp8/nvidia/quant_utils.cuh``
    ``scaled_vec_conversion``: ``__nv_cvt_float_to_fp8(float(x) / scale,
    __NV_SATFINITE, E4M3)``);
  - ``"trunc"`` (vLLM on CPU): ``y = x * (1 / s)``, the reciprocal and the product
    rounded to fp32, saturated at +-448, then the E4M3 code *toward zero* -- the
    kernel keeps the sign, exponent and top three mantissa bits of ``y * 2**-120``
    and drops the rest; ``y == 0`` gives the code +0 (vllm-project/vllm@0f25e050
    ``csrc/cpu/cpu_attn_fp8.hpp`` ``float_to_fp8e4m3_scalar``, called with the
    layer's ``1 / k_scale``). Round to nearest gives the same code for about half
    of the values only.
"""

from __future__ import annotations

import itertools
import math

import torch

from .constants import (
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    FP8_ROUNDINGS,
    INT8_MAX,
    INT8_MIN,
    SCALE_EPS,
)

__all__ = [
    "absmax_scale",
    "dynamic_fake_quant",
    "c8_codes",
    "c8_held_scale",
    "check_fp8_rounding",
    "fp8_codes",
    "fake_quant_per_head",
    "int8_codes",
    "saturated",
    "per_head_qparams",
    "quantize_per_head",
    "dequantize_per_head",
    "quantize_per_head_ref",
    "dequantize_per_head_ref",
]


def _check_finite_1d(t: torch.Tensor, fn: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{fn}: {name} must be 1-D [H], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{fn}: {name} must be floating, got {t.dtype}")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: {name} must be finite, got {float(t[idx])} at head {idx} "
            f"(shape {tuple(t.shape)})"
        )


def per_head_qparams(
    lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 parameters from a per-head range.

    ``lo``, ``hi`` ``[H]`` -> ``scale`` fp32 ``[H]`` =
    ``max(max(-lo, hi) / 127, 2**-23)`` with the range first widened to include 0,
    and ``offset`` int8 zeros ``[H]``.
    """
    _check_finite_1d(lo, "per_head_qparams", "lo")
    _check_finite_1d(hi, "per_head_qparams", "hi")
    if lo.shape != hi.shape:
        raise ValueError(
            f"per_head_qparams: lo and hi must have the same shape, got "
            f"{tuple(lo.shape)} and {tuple(hi.shape)}"
        )
    lo32 = torch.clamp(lo.float(), max=0.0)
    hi32 = torch.clamp(hi.float(), min=0.0)
    scale = absmax_scale(torch.maximum(-lo32, hi32))
    offset = torch.zeros(scale.shape, dtype=torch.int8, device=scale.device)
    return scale, offset


def absmax_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / 127, 2**-23)`` in fp32, any shape: the symmetric scale rule.

    The floor keeps ``x / scale`` finite for an all-zero head or token.
    """
    return torch.clamp(amax.float() / INT8_MAX, min=SCALE_EPS)


def int8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round_half_even(x.float() / scale), -128, 127)`` as fp32 codes.

    ``scale`` must already broadcast against ``x`` (fp32). No validation: this is the
    inner rule every quantizer here shares.
    """
    return torch.clamp(torch.round(x.float() / scale), INT8_MIN, INT8_MAX)


def fake_quant_per_head(
    x: torch.Tensor, scale: torch.Tensor, axis: int = 1
) -> torch.Tensor:
    """Quant -> dequant in fp32: ``int8_codes(x, s) * s`` with ``scale`` ``[H]``
    broadcast along ``axis``. Bit-equal to ``dequantize_per_head(quantize_per_head(x,
    scale, axis), scale, axis)``, without their validation (callers that loop over
    candidate scales call it hundreds of times)."""
    axis = axis % x.dim()
    s = scale.to(device=x.device, dtype=torch.float32).view(
        _bshape(x.dim(), axis, x.shape[axis])
    )
    return int8_codes(x, s) * s


def saturated(x: torch.Tensor, scale: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Bool mask of the values whose code ``round(x / s)`` falls outside
    ``[-128, 127]`` (they are clipped), ``scale`` ``[H]`` along ``axis``."""
    axis = axis % x.dim()
    s = scale.to(device=x.device, dtype=torch.float32).view(
        _bshape(x.dim(), axis, x.shape[axis])
    )
    q = torch.round(x.float() / s)
    return (q > INT8_MAX) | (q < INT8_MIN)


def c8_held_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The C8 scale as the device holds it: rounded to the activation ``dtype``,
    returned as fp32 values (exact) for the dequantization ``code * s``."""
    return scale.to(dtype).to(torch.float32)


def c8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """C8 codes of ``x`` (in ``x``'s dtype, integral values in ``[-128, 127]``).

    ``scale`` broadcasts against ``x`` (per channel ``[Hkv, D]`` viewed to fit).
    vllm-ascend's write: the scale cast to ``x``'s dtype, ``1.0 / s`` in that dtype,
    ``x * inv`` rounded to that dtype, then round half to even and saturate (see
    the module doc for the citation).
    """
    inv = 1.0 / scale.to(device=x.device, dtype=x.dtype)
    return torch.clamp(torch.round(x * inv), INT8_MIN, INT8_MAX)


def check_fp8_rounding(fn: str, rounding: object) -> str:
    """``rounding`` if it is one of :data:`.constants.FP8_ROUNDINGS`, else a
    ``ValueError`` naming ``fn`` and the choices."""
    if not isinstance(rounding, str) or rounding not in FP8_ROUNDINGS:
        raise ValueError(
            f"{fn}: fp8_rounding must be one of {', '.join(FP8_ROUNDINGS)}, got "
            f"{rounding!r}"
        )
    return rounding


def fp8_codes(
    x: torch.Tensor, scale: torch.Tensor, rounding: str = "nearest"
) -> torch.Tensor:
    """FP8 E4M3 codes of ``x`` as vLLM's cache write stores them (module doc).

    ``scale`` fp32 broadcasts against ``x``. ``rounding="nearest"``:
    ``float8_e4m3fn(clamp(x.float() / s, +-448))``; ``"trunc"``: the code toward
    zero of ``clamp(x.float() * (1 / s), +-448)``. Saturating first matters: the
    cast itself turns out-of-range values into NaN, where vLLM saturates.
    """
    s = scale.to(device=x.device, dtype=torch.float32)
    if rounding == "trunc":
        y = torch.clamp(x.float() * torch.reciprocal(s), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return _toward_zero(y)
    check_fp8_rounding("fp8_codes", rounding)
    y = torch.clamp(x.float() / s, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(FP8_KV_DTYPE)


def _toward_zero(y: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of fp32 ``y`` (within +-448) rounded toward zero.

    The nearest code is the truncated one or the next larger magnitude; the
    non-negative codes 0x00..0x7e grow with their bits, so one step down of the
    magnitude byte (the sign bit stays) corrects an overshoot. Below E4M3's
    smallest normal (2**-6) the CPU kernel's ``y * 2**-120`` is an fp32 subnormal,
    rounded to a multiple of 2**-149 before its bits are cut (a value below 2**-30
    becomes a signed zero); the same product here reproduces that. ``y == 0``
    (either sign) stores +0 as the kernel does.
    """
    cut = (y * 2.0**-120) * 2.0**120
    near = cut.to(FP8_KV_DTYPE)
    bits = near.view(torch.uint8)
    over = near.float().abs() > cut.abs()
    bits = torch.where(over, bits - 1, bits)
    bits = torch.where(y == 0, torch.zeros_like(bits), bits)
    return bits.view(FP8_KV_DTYPE)


def dynamic_fake_quant(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Quant -> dequant with one scale per slice along ``dim`` (e.g. per token and head
    for ``[B, H, S, D]`` and ``dim=-1``): ``s = absmax_scale(max |x| over dim)``.
    Returns ``x``'s dtype."""
    xf = x.float()
    s = absmax_scale(xf.abs().amax(dim=dim, keepdim=True))
    return (int8_codes(xf, s) * s).to(x.dtype)


def _norm_axis(fn: str, t: torch.Tensor, axis: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"{fn}: axis must be an int, got {axis!r}")
    if not -t.dim() <= axis < t.dim():
        raise ValueError(f"{fn}: axis {axis} out of range for shape {tuple(t.shape)}")
    return axis % t.dim()


def _check_scale(fn: str, t: torch.Tensor, scale: torch.Tensor, axis: int) -> int:
    axis = _norm_axis(fn, t, axis)
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{fn}: scale must be a tensor, got {type(scale).__name__}")
    if scale.dim() != 1 or not scale.is_floating_point():
        raise ValueError(
            f"{fn}: scale must be 1-D floating [H], got shape {tuple(scale.shape)} "
            f"dtype {scale.dtype}"
        )
    if scale.shape[0] != t.shape[axis]:
        raise ValueError(
            f"{fn}: scale has {scale.shape[0]} entries but x.shape[{axis}] = "
            f"{t.shape[axis]} (x shape {tuple(t.shape)})"
        )
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: scale must be finite and > 0, got {float(scale[idx])} at head {idx}"
        )
    return axis


def _bshape(ndim: int, axis: int, h: int) -> list[int]:
    shape = [1] * ndim
    shape[axis] = h
    return shape


@torch.library.custom_op("ascend_fa::quantize_per_head", mutates_args=())
def _quantize_op(x: torch.Tensor, scale: torch.Tensor, axis: int) -> torch.Tensor:
    s = scale.to(device=x.device, dtype=torch.float32).view(
        _bshape(x.dim(), axis, x.shape[axis])
    )
    return int8_codes(x, s).to(torch.int8)


@_quantize_op.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.int8)


@torch.library.custom_op("ascend_fa::dequantize_per_head", mutates_args=())
def _dequantize_op(q: torch.Tensor, scale: torch.Tensor, axis: int) -> torch.Tensor:
    # fp32 out; the public wrapper casts, so the op schema carries no dtype argument.
    s = scale.to(device=q.device, dtype=torch.float32).view(
        _bshape(q.dim(), axis, q.shape[axis])
    )
    return q.float() * s


@_dequantize_op.register_fake
def _(q: torch.Tensor, scale: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(q, dtype=torch.float32)


def quantize_per_head(
    x: torch.Tensor, scale: torch.Tensor, axis: int = 1
) -> torch.Tensor:
    """INT8 codes of ``x``: ``clamp(round_half_even(x.float() / scale), -128, 127)``.

    ``x`` any floating tensor, ``scale`` ``[x.shape[axis]]`` broadcast along ``axis``
    (the head axis: 1 for ``[B, H, S, D]``, -2 for ``[T, H, D]``).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_per_head: x must be a floating tensor, got {got}")
    axis = _check_scale("quantize_per_head", x, scale, axis)
    return torch.ops.ascend_fa.quantize_per_head(x, scale, axis)


def dequantize_per_head(
    q: torch.Tensor,
    scale: torch.Tensor,
    axis: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q.float() * scale).to(dtype)`` with ``scale`` ``[q.shape[axis]]`` broadcast
    along ``axis``. ``q`` must be int8."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"dequantize_per_head: q must be an int8 tensor, got {got}")
    axis = _check_scale("dequantize_per_head", q, scale, axis)
    return torch.ops.ascend_fa.dequantize_per_head(q, scale, axis).to(dtype)


def quantize_per_head_ref(
    x: torch.Tensor, scale: torch.Tensor, axis: int = 1
) -> torch.Tensor:
    """Golden reference: one element at a time. The quotient is formed in fp32 (as
    the contract says), then rounded half-to-even and saturated by hand."""
    axis = axis % x.dim()
    xf = x.float()
    sf = scale.float()
    out = torch.empty(x.shape, dtype=torch.int8)
    for idx in itertools.product(*(range(s) for s in x.shape)):
        quot = float(xf[idx] / sf[idx[axis]])
        low = math.floor(quot)
        frac = quot - low
        r = low + 1 if frac > 0.5 or (frac == 0.5 and low % 2 == 1) else low
        out[idx] = min(max(r, INT8_MIN), INT8_MAX)
    return out


def dequantize_per_head_ref(
    q: torch.Tensor,
    scale: torch.Tensor,
    axis: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Golden reference of :func:`dequantize_per_head`, one element at a time."""
    axis = axis % q.dim()
    sf = scale.float()
    out = torch.empty(q.shape, dtype=dtype)
    for idx in itertools.product(*(range(s) for s in q.shape)):
        out[idx] = (torch.tensor(int(q[idx]), dtype=torch.float32) * sf[idx[axis]]).to(
            dtype
        )
    return out
