"""W8A8 linear ops: activation quantizers and the quantized matmul, defined once.

========================  ==========================================================
op (``ascend_fa::``)      inputs -> output
========================  ==========================================================
``quantize_static``       ``x`` ``[M, K]`` float, ``scale``/``offset`` ``[1]`` float,
                          ``div_mode`` -> int8 ``[M, K]``
``dynamic_quant``         ``x`` ``[M, K]`` float -> int8 ``[M, K]``, fp32 ``[M]``
``quant_matmul``          ``x_q`` ``[M, K]`` int8, ``weight`` ``[N, K]`` int8,
                          ``deq_scale`` ``[N]`` fp32/int64, ``quant_bias`` ``[N]``
                          int32 or None -> ``[M, N]`` ``out_dtype``
``quant_matmul_dynamic``  ``x_q``, ``weight`` as above, ``weight_scale`` ``[N]`` fp32,
                          ``pertoken_scale`` ``[M]`` fp32, ``bias`` ``[N]`` or None
                          -> ``[M, N]`` ``out_dtype``
========================  ==========================================================

Numerics, each as the device documents it:

* ``quantize_static`` is ``torch_npu.npu_quantize(x, scale, offset, torch.qint8, -1,
  div_mode)``: ``clamp(round_half_even(x * scale + offset), -128, 127)`` in fp32
  (``x / scale`` when ``div_mode``); the offset is added **before** rounding, as in
  op-plugin's golden for AscendQuantV2 (Ascend/op-plugin
  ``test/test_custom_ops/test_npu_quantize.py`` @517f2e7,
  ``cpu_op_exec_ascend_quant_v2``: ``np.round(x * scale + zero_point)`` then
  ``np.clip(-128, 127)``) and in
  msModelSlim 26.1's quantizer (``msmodelslim/ir/api/impl/int_quantization.py``,
  ``(x / scale + offset).round_()``). vllm-ascend calls it with ``div_mode=False`` and
  the reciprocal of ``input_scale`` computed in the model dtype
  (vllm-project/vllm-ascend ``vllm_ascend/ops/register_custom_ops.py`` @182b75e,
  ``_quantize_impl``; ``methods/w8a8_static.py``, ``process_weights_after_loading``).
* ``dynamic_quant`` is ``torch_npu.npu_dynamic_quant(x)``: per row ``scale = max|x| /
  127`` and ``y = round_half_even(x / scale)`` in fp32 (Ascend/op-plugin
  ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_dynamic_quant.md`` and its test's
  ``supported_op_exec`` @517f2e7). The device leaves an all-zero row undefined
  (``0 / 0``); here it gets codes 0 and scale 0, so its output is exactly 0 (the
  documented safe value).
* ``quant_matmul`` is ``torch_npu.npu_quant_matmul(x_q, weight.t(), deq_scale,
  bias=quant_bias, output_dtype=...)``: ``(x_q @ weight^T + quant_bias) * deq_scale``
  (op-plugin ``torch_npu-npu_quant_matmul.md``: "bias 为 int32: out = (x1 @ x2 + bias) *
  scale"). The product is accumulated exactly in integers (int32 on the device;
  here :func:`int_gemm`: an int8 GEMM with int32 accumulation on a CPU with int8
  dot-product instructions, else fp32 GEMMs over K chunks of 1024 whose partial
  sums are exact; :func:`int_gemm_path` says which and why),
  the bias is added in
  float64 (exact), the int32 sum is converted to fp32
  (round to nearest even), multiplied by the fp32 scale and rounded once to
  ``out_dtype``. An int64
  ``deq_scale`` (fp16 models, msModelSlim's ``deqscale2int64``) holds the fp32 bit
  pattern in its low 32 bits; the device keeps the top 19 bits of it (op-plugin
  ``torch_npu-npu_trans_quant_param.md``: "scale 按bit位取高19位截断"), so it is
  decoded with the low 13 mantissa bits cleared.
* ``quant_matmul_dynamic`` is ``npu_quant_matmul(x_q, weight.t(), weight_scale,
  pertoken_scale=..., bias=..., output_dtype=...)``: ``x_q @ weight^T * weight_scale
  * pertoken_scale + bias`` in fp32, rounded once to ``out_dtype``
  (op-plugin ``torch_npu-npu_quant_matmul.md``, float bias row of the formula).

Each op has a fake kernel, and a ``*_ref`` golden reference that loops over elements
in plain Python (tests compare the ops with it bit for bit).
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import settings
from .constants import INT8_MAX, INT8_MIN
from .native import native_kernels

__all__ = [
    "FP19_MASK",
    "INT_GEMM_ENV",
    "NATIVE_GEMM_MAX_M",
    "OUT_DTYPES",
    "IntGemmPath",
    "decode_deq_scale",
    "encode_deq_scale_int64",
    "dynamic_codes",
    "dynamic_dequant",
    "dynamic_quant",
    "dynamic_quant_ref",
    "int8_dot_instructions",
    "int_gemm",
    "int_gemm_float",
    "int_gemm_path",
    "int_gemm_report",
    "quant_matmul",
    "quant_matmul_dynamic",
    "quant_matmul_dynamic_ref",
    "quant_matmul_ref",
    "quantize_static",
    "quantize_static_ref",
    "static_codes",
    "static_dequant",
]

logger = logging.getLogger(__name__)

#: ``deq_scale`` bits the device keeps of an int64 (fp32 pattern) scale: sign,
#: exponent and the top 10 mantissa bits ("FP19").
FP19_MASK = 0xFFFFE000

#: ``out_dtype`` names the matmul ops accept (op signatures carry strings).
OUT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _out_dtype(name: str) -> torch.dtype:
    if name not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {sorted(OUT_DTYPES)}, got {name!r}")
    return OUT_DTYPES[name]


def encode_deq_scale_int64(deq: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N]`` -> int64 ``[N]`` holding each value's fp32 bit pattern (the
    form fp16 models store, msModelSlim ``save/utils/deqscale.py``
    ``deqscale2int64``: ``frombuffer(fp32 bytes, int32).astype(int64)``)."""
    bits = deq.detach().to("cpu", torch.float32).contiguous().view(torch.int32)
    return bits.to(torch.int64)


def decode_deq_scale(deq: torch.Tensor) -> torch.Tensor:
    """The fp32 ``[N]`` scale the device multiplies by: a float32 ``deq_scale`` as
    is; an int64 one decoded from its low 32 bits with the low 13 mantissa bits
    cleared (the device keeps FP19, see the module doc)."""
    if deq.dtype == torch.int64:
        low = (deq & 0xFFFFFFFF) & FP19_MASK
        # Back to a signed int32 pattern, then reinterpret as fp32.
        low = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
        return low.view(torch.float32)
    return deq.to(torch.float32)


def _check_2d(fn: str, name: str, t: torch.Tensor, dtype: torch.dtype | None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a 2-D tensor, got {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{fn}: {name} must be {dtype}, got {t.dtype}")


def _check_vec(
    fn: str, name: str, t: torch.Tensor, n: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != n:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must have shape [{n}], got {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{fn}: {name} must be one of {dtypes}, got {t.dtype}")


# --------------------------------------------------------------------------- quantize


@torch.library.custom_op("ascend_fa::quantize_static", mutates_args=())
def _quantize_static_op(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, div_mode: bool
) -> torch.Tensor:
    s = scale.to(device=x.device, dtype=torch.float32)
    o = offset.to(device=x.device, dtype=torch.float32)
    return static_codes(x, s, o, div_mode)


def static_codes(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, div_mode: bool
) -> torch.Tensor:
    """The arithmetic of ``quantize_static`` on checked operands: ``x`` ``[M, K]``
    float, ``scale`` / ``offset`` fp32 ``[1]`` on its device. The op runs it; a
    caller whose operands are already checked (a quantized linear's own buffers)
    calls it directly and skips the op's checks and dispatch."""
    native = _native_static_codes(x, scale, offset, div_mode)
    if native is not None:
        return native
    # fp16 / bf16 x: the product is formed in fp32 (type promotion with the [1]
    # fp32 scale widens x exactly); an fp64 x is rounded to fp32 first, as the
    # device takes fp32 at most.
    xf = x.float() if x.dtype == torch.float64 else x
    # Two fp32 roundings (scale, then offset) and ties to even, as the golden does.
    y = torch.div(xf, scale) if div_mode else torch.mul(xf, scale)
    return y.add_(offset).round_().clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


_NATIVE_IN = (torch.float16, torch.bfloat16, torch.float32)


def _native_static_codes(x, scale, offset, div_mode) -> torch.Tensor | None:
    """:func:`static_codes` by the native kernel (the same codes, bit for bit:
    ``atb_ops/csrc/linear.c``) for contiguous CPU operands, else
    None."""
    if x.device.type != "cpu" or x.dtype not in _NATIVE_IN or not x.is_contiguous():
        return None
    if scale.device.type != "cpu" or offset.device.type != "cpu":
        return None
    if scale.numel() != 1 or offset.numel() != 1:
        return None
    kernels = native_kernels()
    if kernels is None:
        return None
    s, o = scale.item(), offset.item()
    return kernels.static_codes(x, s, o, div_mode)


@_quantize_static_op.register_fake
def _(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, div_mode: bool
) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.int8)


def quantize_static(
    x: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    *,
    div_mode: bool = False,
) -> torch.Tensor:
    """Per-tensor static INT8 codes of ``x`` ``[M, K]``:
    ``clamp(round(x * scale + offset), -128, 127)`` (``x / scale`` with
    ``div_mode``), ``scale`` and ``offset`` ``[1]`` floating (the offset is an
    integer value in any float dtype, as the device takes it)."""
    fn = "quantize_static"
    _check_2d(fn, "x", x, None)
    if not x.is_floating_point():
        raise ValueError(f"{fn}: x must be floating, got {x.dtype}")
    for name, t in (("scale", scale), ("offset", offset)):
        if not isinstance(t, torch.Tensor) or t.shape != (1,):
            raise ValueError(f"{fn}: {name} must have shape [1]")
    s = float(scale.float())
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"{fn}: scale must be finite and > 0, got {s}")
    return torch.ops.ascend_fa.quantize_static(x, scale, offset, bool(div_mode))


def quantize_static_ref(
    x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, div_mode: bool = False
) -> torch.Tensor:
    """Golden reference of :func:`quantize_static`, one element at a time (fp32
    arithmetic through numpy-free scalar tensors, ties to even by hand)."""
    s = torch.tensor(float(scale.float()), dtype=torch.float32)
    o = torch.tensor(float(offset.float()), dtype=torch.float32)
    out = torch.empty(x.shape, dtype=torch.int8)
    xf = x.float()
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            v = xf[i, j] / s if div_mode else xf[i, j] * s
            out[i, j] = _clamp_int8(_round_half_even(float(v + o)))
    return out


def _round_half_even(v: float) -> int:
    low = math.floor(v)
    frac = v - low
    return low + 1 if frac > 0.5 or (frac == 0.5 and low % 2 == 1) else low


def _clamp_int8(v: int) -> int:
    return min(max(v, INT8_MIN), INT8_MAX)


@torch.library.custom_op("ascend_fa::dynamic_quant", mutates_args=())
def _dynamic_quant_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dynamic_codes(x)


def dynamic_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic of ``dynamic_quant`` on a checked ``x`` ``[M, K]`` float (see
    :func:`static_codes` for why it is callable directly)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    # An all-zero row: codes 0 and scale 0 (0 / 0 is undefined on the device).
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / safe[:, None]), INT8_MIN, INT8_MAX)
    return q.to(torch.int8), scale


@_dynamic_quant_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(x, dtype=torch.int8),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    )


def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT8: ``x`` ``[M, K]`` float -> codes int8 ``[M, K]`` and
    scales fp32 ``[M]`` (``max|x_m| / 127``; see the module doc)."""
    _check_2d("dynamic_quant", "x", x, None)
    if not x.is_floating_point():
        raise ValueError(f"dynamic_quant: x must be floating, got {x.dtype}")
    return torch.ops.ascend_fa.dynamic_quant(x)


def dynamic_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Golden reference of :func:`dynamic_quant`, one row and element at a time."""
    xf = x.float()
    q = torch.zeros(x.shape, dtype=torch.int8)
    scales = torch.zeros(x.shape[0], dtype=torch.float32)
    for i in range(x.shape[0]):
        amax = max((abs(float(v)) for v in xf[i]), default=0.0)
        s = torch.tensor(amax, dtype=torch.float32) / torch.tensor(
            float(INT8_MAX), dtype=torch.float32
        )
        scales[i] = s
        if amax == 0.0:
            continue
        for j in range(x.shape[1]):
            q[i, j] = _clamp_int8(_round_half_even(float(xf[i, j] / s)))
    return q, scales


# ----------------------------------------------------------------------------- matmul


#: K per fp32 GEMM chunk: |product| <= 128 * 128 = 2**14, so every partial sum of
#: a 1024-wide chunk is an integer of magnitude <= 2**24, exact in fp32.
_EXACT_FP32_K = 1024


def _chunked_gemm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x_q @ weight^T`` as int32 from fp32 GEMMs over K chunks whose partial
    sums are exact integers (see ``_EXACT_FP32_K``), converted to int32 (exact) and
    added in int32 (no sum leaves it, see :func:`int_gemm`)."""
    k = x_q.shape[1]
    acc = None
    for k0 in range(0, max(k, 1), _EXACT_FP32_K):
        part = x_q[:, k0 : k0 + _EXACT_FP32_K].float()
        part = (part @ weight[:, k0 : k0 + _EXACT_FP32_K].float().t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    assert acc is not None
    return acc


#: The setting that picks the CPU's exact integer product: ``auto`` (the CPU's
#: instructions, then a timing of each product shape), ``int_mm`` or ``fp32``.
INT_GEMM_ENV = "ASCEND_FA_INT_GEMM"

#: Linux ``/proc/cpuinfo`` flags of int8 dot-product instructions, with the name
#: the reports use. oneDNN's int8 GEMM (``torch._int_mm``) is fast only with one
#: of them; without them it is a slow fallback: with torch 2.13 on an AMD EPYC
#: with AVX2 and no VNNI one 512 x 576 x 1536 product took 1,213 ms against 38 ms
#: for the fp32 chunks (1088 x 576 x 3072: 10.3 s against 0.62 s).
_INT8_DOT_FLAGS = {
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "amx_int8": "AMX-INT8",
}

#: Test hook: a bool forces the CPU product in-process (``True``: ``_int_mm``);
#: None (the default) lets :func:`int_gemm_path` decide.
_CPU_INT_MM: bool | None = None
#: The decision of ``auto`` from the CPU's instructions, made once per process
#: (what the CPU is does not change; no timing is involved).
_CPU_PATH: IntGemmPath | None = None
#: Per product shape (M rounded up to a power of two, K, N): the measured
#: comparison that confirmed or reversed ``auto``'s ``int_mm`` (see
#: :func:`_measured_int_mm`).
_SHAPES: dict[tuple[int, int, int], ShapeTiming] = {}
_SHAPES_LOCK = threading.Lock()
_LOGGED: set[IntGemmPath] = set()
#: ``int_mm`` is kept for a shape unless its best time measured more than this
#: many times the fp32 chunks' best (over interleaved pairs: a busy machine
#: delays both alike, and a stall only ever adds time); a small loss is not worth
#: a reversal.
_LOSS_MARGIN = 1.25
#: Timed pairs per shape (after one untimed call of each: oneDNN builds its
#: primitive for a new shape on the first call).
_TIMED_PAIRS = 3
#: Products below this many multiply-adds are not timed (their times are too
#: short to compare; either path costs microseconds): the CPU's choice stands.
_MEASURE_MIN_MACS = 1 << 22
#: At most this many shapes are timed per process; later new shapes take the
#: CPU's choice.
_MEASURE_MAX_SHAPES = 64


@dataclass(frozen=True)
class IntGemmPath:
    """Which exact integer product :func:`int_gemm` runs on the CPU, and why.

    ``path``: ``"int_mm"`` (``torch._int_mm``) or ``"fp32"`` (fp32 GEMM chunks);
    ``source``: ``"setting"`` (``ASCEND_FA_INT_GEMM``), ``"cpu"`` (the CPU's
    instructions, ``auto``) or ``"test"`` (the in-process hook); ``timed``: each
    product shape's first use is timed against the other path (``auto`` with
    ``int_mm``), so a measured loss can reverse the choice for that shape."""

    path: str
    reason: str
    source: str
    timed: bool = False

    @property
    def int_mm(self) -> bool:
        return self.path == "int_mm"

    def describe(self) -> str:
        name = "torch._int_mm (int8 GEMM)" if self.int_mm else "fp32 GEMM chunks"
        return f"{name}: {self.reason}"


@dataclass(frozen=True)
class ShapeTiming:
    """A timed product shape: ``ratio`` is ``_int_mm``'s best time over the fp32
    chunks' best (interleaved pairs); ``int_mm`` whether it stays."""

    ratio: float
    int_mm: bool


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def int8_dot_instructions() -> tuple[str, ...]:
    """The CPU's int8 dot-product instructions (``AVX512-VNNI``, ``AVX-VNNI``,
    ``AMX-INT8``), from torch's CPU checks and the kernel's CPU flags."""
    found: list[str] = []
    vnni = getattr(getattr(torch, "cpu", None), "_is_vnni_supported", None)
    try:
        if vnni is not None and vnni():
            found.append("AVX512-VNNI")
    except RuntimeError:
        pass
    flags = _cpu_flags()
    for flag, name in _INT8_DOT_FLAGS.items():
        if flag in flags and name not in found:
            found.append(name)
    return tuple(found)


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def _detect_path() -> IntGemmPath:
    cap = _cpu_capability()
    if not hasattr(torch, "_int_mm"):
        return IntGemmPath("fp32", f"torch {torch.__version__} has no _int_mm", "cpu")
    found = int8_dot_instructions()
    if found:
        return IntGemmPath(
            "int_mm",
            f"the CPU has {', '.join(found)} (torch CPU capability {cap}); each "
            f"product shape's first use is timed against the fp32 chunks, and a "
            f"loss beyond {_LOSS_MARGIN}x reverses it for that shape",
            "cpu",
            timed=True,
        )
    return IntGemmPath(
        "fp32",
        f"no int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8) on "
        f"this CPU (torch CPU capability {cap}), where torch._int_mm is a slow "
        f"fallback (16-32x the fp32 GEMM's time on an AVX2 AMD EPYC)",
        "cpu",
    )


def int_gemm_path() -> IntGemmPath:
    """The CPU product of :func:`int_gemm` (see :class:`IntGemmPath`): forced by
    ``ASCEND_FA_INT_GEMM=int_mm|fp32`` (read on every call), else (``auto``)
    decided from the CPU's int8 dot-product instructions, once per process."""
    global _CPU_PATH
    if _CPU_INT_MM is not None:
        path = IntGemmPath("int_mm" if _CPU_INT_MM else "fp32", "forced", "test")
    else:
        forced = settings.get(INT_GEMM_ENV)
        if forced != "auto":
            path = IntGemmPath(
                str(forced), f"set by {INT_GEMM_ENV}={forced}", "setting"
            )
        else:
            if _CPU_PATH is None:
                _CPU_PATH = _detect_path()
            path = _CPU_PATH
    if path not in _LOGGED:
        _LOGGED.add(path)
        logger.debug("integer products on the CPU: %s", path.describe())
    return path


def int_gemm_report() -> dict[str, object]:
    """What :func:`int_gemm` runs on this CPU, for reports and benchmark records:
    ``path``, ``reason``, ``source``, and each timed shape
    (``"MxKxN": {"ratio", "path"}``, M rounded up to a power of two)."""
    path = int_gemm_path()
    with _SHAPES_LOCK:
        shapes = {
            f"{m}x{k}x{n}": {
                "ratio": round(t.ratio, 3),
                "path": "int_mm" if t.int_mm else "fp32",
            }
            for (m, k, n), t in sorted(_SHAPES.items())
        }
    return {
        "path": path.path,
        "reason": path.reason,
        "source": path.source,
        "timed_shapes": shapes,
    }


def _measured_int_mm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``int_gemm`` where ``auto`` chose ``_int_mm`` from the CPU: the first
    product of each shape is run on both paths, interleaved (``_TIMED_PAIRS``
    pairs, alternating which goes first, after one untimed call of each), and
    ``_int_mm`` stays for the shape unless its best time exceeds the fp32
    chunks' best by more than ``_LOSS_MARGIN``. The shapes are the run's own, so
    the choice is measured where it matters, and both paths see the same load."""
    m, k = x_q.shape
    n = weight.shape[0]
    if m * k * n < _MEASURE_MIN_MACS:
        return torch._int_mm(x_q, weight.t())
    key = (1 << max(m - 1, 0).bit_length(), k, n)
    timing = _SHAPES.get(key)
    if timing is None and len(_SHAPES) < _MEASURE_MAX_SHAPES:
        out = torch._int_mm(x_q, weight.t())
        _chunked_gemm(x_q, weight)
        t_int, t_fp = [], []
        for i in range(_TIMED_PAIRS):
            for fp in (i % 2, 1 - i % 2):  # alternate which path goes first
                t0 = time.perf_counter()
                if fp:
                    _chunked_gemm(x_q, weight)
                else:
                    torch._int_mm(x_q, weight.t())
                (t_fp if fp else t_int).append(time.perf_counter() - t0)
        ratio = min(t_int) / max(min(t_fp), 1e-9)
        timing = ShapeTiming(ratio, ratio <= _LOSS_MARGIN)
        with _SHAPES_LOCK:
            _SHAPES.setdefault(key, timing)
        logger.debug(
            "integer product %dx%dx%d: torch._int_mm took %.2fx the fp32 chunks' "
            "time (best of %d interleaved pairs): %s",
            m, k, n, ratio, _TIMED_PAIRS,
            "keeping _int_mm" if timing.int_mm else "fp32 chunks for this shape",
        )  # fmt: skip
        return out
    if timing is None or timing.int_mm:
        return torch._int_mm(x_q, weight.t())
    return _chunked_gemm(x_q, weight)


#: The native kernel takes products of at most this many rows (a decode step's
#: tokens) on a CPU without int8 dot-product instructions; larger ones (a
#: prefill) take the fp32 GEMM chunks, whose blocked GEMM amortizes the weight's
#: conversion over the rows.
NATIVE_GEMM_MAX_M = 16
#: Products of at least this many multiply-adds are split over torch's threads
#: (below it a thread hand-off costs more than it saves).
_NATIVE_GEMM_SPLIT_MACS = 1 << 19


def _native_gemm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """:func:`int_gemm` by the native kernel (``atb_ops/csrc/int_gemm.c``: the same
    int32, the weight read as int8) for contiguous CPU int8 operands of at most
    :data:`NATIVE_GEMM_MAX_M` rows, else None. The output columns are split over
    up to ``torch.get_num_threads()`` threads (the call releases the GIL)."""
    m, k = x_q.shape
    n = weight.shape[0]
    if m > NATIVE_GEMM_MAX_M or x_q.dtype != torch.int8 or weight.dtype != torch.int8:
        return None
    if not (x_q.is_contiguous() and weight.is_contiguous()):
        return None
    kernels = native_kernels()
    if kernels is None:
        return None
    out = torch.empty(m, n, dtype=torch.int32)
    parts = 1
    if m * k * n >= _NATIVE_GEMM_SPLIT_MACS:
        parts = max(1, min(torch.get_num_threads(), n // 64))
    if parts == 1:
        rc = kernels.int_gemm(x_q, weight, out, (0, n))
    else:
        # column ranges in multiples of 8 rows of the weight
        bounds = [min(n, (n * i // parts + 7) // 8 * 8) for i in range(parts + 1)]
        bounds[-1] = n
        pool = _gemm_pool(parts - 1)
        futures = [
            pool.submit(kernels.int_gemm, x_q, weight, out, (bounds[i], bounds[i + 1]))
            for i in range(1, parts)
        ]
        rcs = [kernels.int_gemm(x_q, weight, out, (bounds[0], bounds[1]))]
        rc = next((r for r in rcs + [f.result() for f in futures] if r != 0), 0)
    return out if rc == 0 else None


_POOL: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _gemm_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads for :func:`_native_gemm`, one per process (a
    forked child makes its own: the parent's threads are not in it)."""
    key = (os.getpid(), workers)
    with _POOL_LOCK:
        pool = _POOL.get(key)
        if pool is None:
            pool = _POOL[key] = ThreadPoolExecutor(
                workers, thread_name_prefix="ascend-fa-gemm"
            )
        return pool


def int_gemm(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x_q @ weight^T`` of int8 operands ``[M, K]``, ``[N, K]``: the int32
    accumulator of the device, exact, as int32 ``[M, N]``. Any summation order gives
    the same integer (no partial sum leaves int32: ``K <= 65535`` keeps
    ``|sum| <= 65535 * 2**14 < 2**30``). On the CPU an int8 GEMM
    (``torch._int_mm``, int32 accumulation) where the CPU has int8 dot-product
    instructions (:func:`int_gemm_path`); elsewhere the native kernel for up to
    :data:`NATIVE_GEMM_MAX_M` rows (a decode step: it reads the int8 weight as
    stored, AVX2 ``vpmaddwd`` into int32), and fp32 GEMMs over exact K chunks for
    more rows, where a torch build lacks ``_int_mm`` for these operands, or
    without the native kernels. ``K == 1`` never takes ``_int_mm``: torch 2.13's
    returns garbage for it on AMX CPUs (measured on Intel Xeon with AMX: every
    ``[M > 1, 1] x [1, N]`` product of 3000 random shapes wrong, every K >= 2
    right)."""
    if x_q.device.type == "cpu":
        path = int_gemm_path()
        if path.int_mm and x_q.shape[1] > 1 and hasattr(torch, "_int_mm"):
            try:
                if path.timed:
                    return _measured_int_mm(x_q, weight)
                return torch._int_mm(x_q, weight.t())
            except (RuntimeError, NotImplementedError):
                pass
        elif not path.int_mm:
            native = _native_gemm(x_q, weight)
            if native is not None:
                return native
    return _chunked_gemm(x_q, weight)


def int_gemm_float(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``int_gemm(x_q, weight).float()`` (the same values, fp32 ``[M, N]``) for
    operands holding integers in ``[-128, 127]``: int8, or float tensors of such
    integers (a search that scores many candidates keeps its codes in float and
    skips the int8 round trip). Where the fp32 chunks are the product, up to two
    chunks are added in fp32: each chunk's sum is an exact integer and one
    correctly rounded addition of two exact values rounds as the int32 sum's
    conversion does; more chunks add in int32."""
    cpu_int = (
        x_q.device.type == "cpu"
        and hasattr(torch, "_int_mm")
        and int_gemm_path().int_mm
    )
    if cpu_int or x_q.shape[1] > 2 * _EXACT_FP32_K:
        return int_gemm(x_q.to(torch.int8), weight.to(torch.int8)).float()
    xf, wf = x_q.float(), weight.float()
    k = xf.shape[1]
    acc = xf[:, :_EXACT_FP32_K] @ wf[:, :_EXACT_FP32_K].t()
    if k > _EXACT_FP32_K:
        acc.add_(xf[:, _EXACT_FP32_K:] @ wf[:, _EXACT_FP32_K:].t())
    return acc


@torch.library.custom_op("ascend_fa::quant_matmul", mutates_args=())
def _quant_matmul_op(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    acc = int_gemm(x_q, weight)
    bias = None
    if quant_bias is not None:
        bias = quant_bias.to(acc.device, torch.int32)
    deq = decode_deq_scale(deq_scale).to(acc.device)
    return static_dequant(acc, deq, bias, _out_dtype(out_dtype))


def static_dequant(
    acc: torch.Tensor,
    deq: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The epilogue of ``quant_matmul`` on checked operands: ``acc`` int32
    ``[M, N]`` (:func:`int_gemm`), ``deq`` fp32 ``[N]`` (decoded), ``bias``
    (``quant_bias``: int32, or its fp64 values) ``[N]`` or None -> ``(acc +
    bias) * deq`` in ``out_dtype`` (see :func:`static_codes` for why it is
    callable directly)."""
    native = _native_static_dequant(acc, deq, bias, out_dtype)
    if native is not None:
        return native
    if bias is not None and bias.dtype == torch.int32:
        bias = bias.double()
    # int32 + int32 added in fp64 (exact), the sum -> fp32 (one rounding; an
    # int32 alone converts with the same single rounding), times the fp32 scale,
    # one rounding to out.
    y = acc.float() if bias is None else torch.add(acc, bias).float()
    return y.mul_(deq).to(out_dtype)


def _native_static_dequant(acc, deq, bias, out_dtype) -> torch.Tensor | None:
    """:func:`static_dequant` by the native kernel (bit for bit) for contiguous
    CPU operands, an int32 bias (``quant_bias`` itself) or none, and bf16 / fp32
    output, else None."""
    if out_dtype not in (torch.bfloat16, torch.float32) or acc.device.type != "cpu":
        return None
    if acc.dtype != torch.int32 or acc.dim() != 2 or not acc.is_contiguous():
        return None
    if deq.dtype != torch.float32 or not deq.is_contiguous():
        return None
    if bias is not None and (bias.dtype != torch.int32 or not bias.is_contiguous()):
        return None
    kernels = native_kernels()
    if kernels is None:
        return None
    return kernels.static_dequant(acc, bias, deq, out_dtype)


@_quant_matmul_op.register_fake
def _(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=_out_dtype(out_dtype))


def quant_matmul(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W8A8 static matmul ``(x_q @ weight^T + quant_bias) * deq_scale``.

    ``x_q`` int8 ``[M, K]``, ``weight`` int8 ``[N, K]`` (checkpoint layout),
    ``deq_scale`` ``[N]`` float32 or int64 (fp32 bits), ``quant_bias`` int32 ``[N]``
    or None -> ``[M, N]`` in ``out_dtype``.
    """
    fn = "quant_matmul"
    _check_2d(fn, "x_q", x_q, torch.int8)
    _check_2d(fn, "weight", weight, torch.int8)
    if x_q.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: x_q has K = {x_q.shape[1]} but weight [N, K] has K = "
            f"{weight.shape[1]}"
        )
    n = weight.shape[0]
    _check_vec(fn, "deq_scale", deq_scale, n, (torch.float32, torch.int64))
    if quant_bias is not None:
        _check_vec(fn, "quant_bias", quant_bias, n, (torch.int32,))
    name = str(out_dtype).removeprefix("torch.")
    _out_dtype(name)
    return torch.ops.ascend_fa.quant_matmul(x_q, weight, deq_scale, quant_bias, name)


def _fp32(v: float) -> float:
    """``v`` rounded to fp32 (round to nearest even), as a Python float."""
    return struct.unpack("f", struct.pack("f", v))[0]


def quant_matmul_ref(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Golden reference of :func:`quant_matmul`: Python integer dot products, then
    fp32 conversion, fp32 multiply and one rounding to ``out_dtype``, per element."""
    deq = [float(v) for v in decode_deq_scale(deq_scale)]
    xs = x_q.tolist()
    ws = weight.tolist()
    qb = quant_bias.tolist() if quant_bias is not None else [0] * len(ws)
    out = torch.empty((len(xs), len(ws)), dtype=torch.float32)
    for m, row in enumerate(xs):
        for n, wrow in enumerate(ws):
            acc = sum(a * b for a, b in zip(row, wrow, strict=True)) + qb[n]
            out[m, n] = _fp32(_fp32(float(acc)) * deq[n])
    return out.to(out_dtype)


@torch.library.custom_op("ascend_fa::quant_matmul_dynamic", mutates_args=())
def _quant_matmul_dynamic_op(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    acc = int_gemm(x_q, weight)
    return dynamic_dequant(
        acc,
        weight_scale.to(acc.device, torch.float32),
        pertoken_scale.to(acc.device, torch.float32),
        None if bias is None else bias.to(acc.device),
        _out_dtype(out_dtype),
    )


def dynamic_dequant(
    acc: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The epilogue of ``quant_matmul_dynamic`` on checked operands: ``acc`` int32
    ``[M, N]``, ``weight_scale`` fp32 ``[N]``, ``pertoken_scale`` fp32 ``[M]``,
    ``bias`` float ``[N]`` or None (see :func:`static_codes`)."""
    # each product and the bias sum rounded to fp32 in turn (a bf16 / fp16 bias
    # is widened exactly), one rounding to out
    y = acc.float().mul_(weight_scale).mul_(pertoken_scale[:, None])
    if bias is not None:
        y.add_(bias)
    return y.to(out_dtype)


@_quant_matmul_dynamic_op.register_fake
def _(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: str,
) -> torch.Tensor:
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=_out_dtype(out_dtype))


def quant_matmul_dynamic(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W8A8_DYNAMIC matmul ``x_q @ weight^T * weight_scale * pertoken_scale + bias``.

    ``x_q`` int8 ``[M, K]``, ``weight`` int8 ``[N, K]``, ``weight_scale`` fp32
    ``[N]``, ``pertoken_scale`` fp32 ``[M]``, ``bias`` float ``[N]`` or None ->
    ``[M, N]`` in ``out_dtype``.
    """
    fn = "quant_matmul_dynamic"
    _check_2d(fn, "x_q", x_q, torch.int8)
    _check_2d(fn, "weight", weight, torch.int8)
    if x_q.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: x_q has K = {x_q.shape[1]} but weight [N, K] has K = "
            f"{weight.shape[1]}"
        )
    n = weight.shape[0]
    _check_vec(fn, "weight_scale", weight_scale, n, (torch.float32,))
    _check_vec(fn, "pertoken_scale", pertoken_scale, x_q.shape[0], (torch.float32,))
    if bias is not None:
        _check_vec(fn, "bias", bias, n, (torch.float32, torch.float16, torch.bfloat16))
    name = str(out_dtype).removeprefix("torch.")
    _out_dtype(name)
    return torch.ops.ascend_fa.quant_matmul_dynamic(
        x_q, weight, weight_scale, pertoken_scale, bias, name
    )


def quant_matmul_dynamic_ref(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pertoken_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Golden reference of :func:`quant_matmul_dynamic`, element by element in fp32."""
    xs = x_q.tolist()
    ws = weight.tolist()
    wsc = [float(v) for v in weight_scale.float()]
    pts = [float(v) for v in pertoken_scale.float()]
    b = [float(v) for v in bias.float()] if bias is not None else None
    out = torch.empty((len(xs), len(ws)), dtype=torch.float32)
    for m, row in enumerate(xs):
        for n, wrow in enumerate(ws):
            acc = sum(a * c for a, c in zip(row, wrow, strict=True))
            v = _fp32(_fp32(_fp32(float(acc)) * wsc[n]) * pts[m])
            if b is not None:
                v = _fp32(v + b[n])
            out[m, n] = v
    return out.to(out_dtype)
