"""Quantized linears: W8A8 (static per-tensor activations) and W8A8_DYNAMIC.

Each module replaces an ``nn.Linear`` at the same dotted name and runs the exact
integer path of the device (:mod:`ascend_fa.atb_ops.linear`). ``export_tensors``
returns every tensor under the name and in the dtype and shape the consumers read:

====================  ========================  ============  =========================
tensor                W8A8                      W8A8_DYNAMIC  dtype
====================  ========================  ============  =========================
``<p>.weight``        ``[N, K]``                ``[N, K]``    int8, symmetric per row
``<p>.weight_scale``  ``[N, 1]``                ``[N, 1]``    model dtype
``<p>.weight_offset`` ``[N, 1]`` zeros          ``[N, 1]``    model dtype
``<p>.input_scale``   ``[1]``                   -             model dtype
``<p>.input_offset``  ``[1]``                   -             int8
``<p>.deq_scale``     ``[N]``                   -             fp32 (bf16/fp32 models),
                                                              int64 fp32 bits (fp16)
``<p>.quant_bias``    ``[N]``                   -             int32
``<p>.bias``          ``[N]`` (if the linear    ``[N]``       model dtype
                      has one)
====================  ========================  ============  =========================

Sources (cited where each rule is applied below): vllm-project/vllm-ascend
``vllm_ascend/quantization/methods/w8a8_static.py`` and ``w8a8_dynamic.py`` @182b75e
(parameter names, shapes, dtypes); Ascend/MindIE-LLM
``examples/atb_models/atb_llm/utils/quantize/w8a8.py``, ``w8a8_dynamic.py`` and
``atb_llm/utils/weights.py`` @8b4871a (int64 ``deq_scale`` for fp16, per-tensor
``input_scale`` shared by fused linears); msModelSlim 26.1
``core/quant_service/modelslim_v1/save/ascendv1.py`` (``quant_bias`` =
``round(bias / deq_scale - input_offset * rowsum(W_q))``, ``.bias`` written beside
it) and ``pytorch/llm_ptq/llm_ptq_tools/save/complex_quantifier.py`` (``weight_scale``
/ ``weight_offset`` also for W8A8).

Every scale is chosen representable in the model dtype (rounded **up**, so no
weight code clips), because both consumers cast the scales to the model dtype when
loading (vllm-ascend declares them ``params_dtype``; MindIE's
``Weights.correct_tensor_dtype`` casts every float tensor but ``deq_scale``): the
value written is the value the device uses. Scales are floored at
``max(2**-23, finfo(dtype).tiny)`` so an all-zero weight row or activation gives
finite, normal scales (codes 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ascend_fa.atb_ops.cache import direct_cpu_call
from ascend_fa.atb_ops.constants import INT8_MAX, INT8_MIN, SCALE_EPS
from ascend_fa.atb_ops.linear import (
    FP19_MASK,
    OUT_DTYPES,
    decode_deq_scale,
    dynamic_codes,
    dynamic_dequant,
    dynamic_quant,
    encode_deq_scale_int64,
    int_gemm,
    quant_matmul,
    quant_matmul_dynamic,
    quantize_static,
    static_codes,
    static_dequant,
)
from ascend_fa.errors import FileFormatError, UnsupportedError

__all__ = [
    "ARTIFACT_DTYPES",
    "QUANT_TYPES",
    "QuantizedLinear",
    "W8A8DynamicLinear",
    "W8A8Linear",
    "activation_qparams",
    "check_linear_shape",
    "dtype_round_up",
    "quantize_weight",
    "scale_floor",
]

#: Linear quantization types (description values) built here.
QUANT_TYPES = ("W8A8", "W8A8_DYNAMIC")
#: Model dtypes an artifact may have (fp32 only for research artifacts).
ARTIFACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: ``torch_npu.npu_quant_matmul``: "x1与x2最后一维的shape大小不能超过65535"
#: (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_quant_matmul.md``
#: @517f2e7): K and N of a quantized linear are at most 65535.
MAX_MATMUL_DIM = 65535
_INT32 = torch.iinfo(torch.int32)
#: Activation dtypes the matmul ops return in (``forward``'s output dtype).
_OUT = frozenset(OUT_DTYPES.values())


def check_linear_shape(name: str, in_features: int, out_features: int) -> None:
    """Raise :class:`UnsupportedError` for a linear no consumer's W8A8 kernel takes:
    ``npu_quant_matmul`` needs K, N <= 65535 (vllm-ascend splits larger weights only
    for one DeepSeek-V3.2 projection, ``w8a8_dynamic.py``)."""
    for what, n in (("in_features", in_features), ("out_features", out_features)):
        if n < 1 or n > MAX_MATMUL_DIM:
            raise UnsupportedError(
                f"{name}: {what} = {n}; torch_npu.npu_quant_matmul takes 1 to "
                f"{MAX_MATMUL_DIM} (op-plugin npu_quant_matmul docs), so no consumer "
                "can run this linear quantized; exclude it or keep --linear none"
            )


def scale_floor(dtype: torch.dtype) -> float:
    """Smallest scale handed out: ``2**-23``, or the dtype's smallest normal value
    when larger (fp16: ``2**-14``), so no scale is subnormal in the model dtype."""
    return max(SCALE_EPS, float(torch.finfo(dtype).tiny))


def dtype_round_up(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive fp32 values -> the nearest values representable in ``dtype`` that
    are ``>= v``, returned as fp32."""
    v = v.float()
    if dtype == torch.float32:
        return v.clone()
    r = v.to(dtype)
    low = r.float() < v
    if bool(low.any()):
        # The next representable positive value is the next bit pattern.
        bumped = (r.view(torch.int16) + 1).view(dtype)
        r = torch.where(low, bumped, r)
    return r.float()


def quantize_weight(
    weight: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: ``weight`` ``[N, K]`` -> ``(codes int8
    [N, K], scale fp32 [N])`` with ``scale = max|W_n| / 127`` rounded up to
    ``dtype`` and floored (:func:`scale_floor`)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = dtype_round_up(torch.clamp(amax / INT8_MAX, min=scale_floor(dtype)), dtype)
    codes = torch.clamp(torch.round(w / scale[:, None]), INT8_MIN, INT8_MAX)
    return codes.to(torch.int8), scale


def activation_qparams(lo: float, hi: float, dtype: torch.dtype) -> tuple[float, int]:
    """Asymmetric per-tensor INT8 parameters of the range ``[lo, hi]`` (widened to
    hold 0): ``scale = (hi - lo) / 255`` rounded up to ``dtype`` and floored, and
    ``offset = -128 - round(lo / scale)`` in ``[-128, 127]``, so that ``lo`` maps
    to about -128 and ``hi`` to about 127 with ``code = round(x / scale + offset)``.
    """
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    raw = torch.tensor([max((hi - lo) / 255.0, scale_floor(dtype))])
    scale = float(dtype_round_up(raw, dtype)[0])
    offset = INT8_MIN - round(lo / scale)
    return scale, int(min(max(offset, INT8_MIN), INT8_MAX))


def _finite(name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UnsupportedError(f"{name}{key}: not finite")


class QuantizedLinear(nn.Module):
    """Common part of the quantized linears (see the module doc).

    ``dtype`` is the model (artifact) dtype the scales are representable in;
    computation follows the input's dtype.
    """

    quant_type: str = ""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        if dtype not in ARTIFACT_DTYPES:
            raise UnsupportedError(
                f"model dtype must be one of bfloat16, float16, float32, got {dtype}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features)

    def _direct(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` may run the ops' CPU arithmetic directly (the
        buffers were checked when the module was built; ``x`` is a plain CPU
        tensor of a dtype the ops take): the same integers and roundings as the
        ops, without their per-call checks and dispatch, which cost more than the
        arithmetic of a one-token decode step."""
        return x.dtype in _OUT and direct_cpu_call((x, self.weight))

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quant_type={self.quant_type}, dtype={dtype}"
        )

    def dequantized_weight(self) -> torch.Tensor:
        """``codes * weight_scale`` fp32 ``[N, K]`` (the fake-quant weight)."""
        return self.weight.float() * self.weight_scale[:, None]

    #: buffer names, in registration order (``bias`` may be None)
    BUFFERS: tuple[str, ...] = ()

    @classmethod
    def from_state(
        cls, state: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> QuantizedLinear:
        """The module whose buffers are ``state`` (its own ``state_dict()``, e.g.
        meta tensors of a spilled layer), nothing recomputed: a resumed run puts
        back the modules it had placed. ``bias`` absent means no bias."""
        missing = [n for n in cls.BUFFERS if n != "bias" and n not in state]
        if missing:
            raise ValueError(f"{cls.__name__}.from_state: no {missing[0]!r}")
        out_features, in_features = state["weight"].shape
        module = cls.__new__(cls)
        QuantizedLinear.__init__(module, int(in_features), int(out_features), dtype)
        for name in cls.BUFFERS:
            module.register_buffer(name, state.get(name))
        return module


class W8A8Linear(QuantizedLinear):
    """W8A8 static: per-tensor asymmetric activations, symmetric per-channel weights.

    Buffers: ``weight`` int8 ``[N, K]``, ``weight_scale`` fp32 ``[N]``,
    ``input_scale`` fp32 ``[1]``, ``input_offset`` int8 ``[1]``, ``deq_scale`` fp32
    ``[N]`` (the value the device multiplies by), ``quant_bias`` int32 ``[N]``,
    ``bias`` fp32 ``[N]`` or None (exported as ``.bias``; the forward uses
    ``quant_bias``). Values are representable in ``dtype``.
    """

    quant_type = "W8A8"
    BUFFERS = (
        "weight",
        "weight_scale",
        "input_scale",
        "input_offset",
        "bias",
        "deq_scale",
        "quant_bias",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: float,
        input_offset: int,
        *,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        deq_scale: torch.Tensor | None = None,
        quant_bias: torch.Tensor | None = None,
        name: str = "",
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, dtype)
        self.register_buffer("weight", weight.to(torch.int8).contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        self.register_buffer("input_scale", torch.tensor([float(input_scale)]))
        self.register_buffer(
            "input_offset", torch.tensor([input_offset], dtype=torch.int8)
        )
        b = None if bias is None else bias.detach().to(dtype).float().reshape(-1)
        self.register_buffer("bias", b)
        if deq_scale is None:
            # deq_scale = input_scale * weight_scale in fp32 (msModelSlim
            # ``deqscale_process``); exact, both factors have <= 11 mantissa bits.
            deq = self.input_scale * self.weight_scale
            if dtype == torch.float16:
                # fp16 models store int64 and the device keeps FP19 of it
                # (op-plugin npu_trans_quant_param docs): round down to FP19 here
                # so the stored value is the value used whichever way it is read.
                bits = deq.view(torch.int32).to(torch.int64) & FP19_MASK
                deq = bits.to(torch.int32).view(torch.float32)
        else:
            deq = decode_deq_scale(deq_scale)
        self.register_buffer("deq_scale", deq.float().contiguous())
        if quant_bias is None:
            quant_bias = self._fold_bias(name)
        self.register_buffer("quant_bias", quant_bias.to(torch.int32).reshape(-1))

    def _fold_bias(self, name: str) -> torch.Tensor:
        # quant_bias = round(bias / deq_scale - input_offset * rowsum(W_q))
        # (msModelSlim ascendv1.py on_w8a8_static), in float64: the offset term
        # reaches 128 * 127 * K and must stay exact.
        rowsum = self.weight.double().sum(dim=1)
        qb = -float(self.input_offset[0]) * rowsum
        if self.bias is not None:
            qb = qb + self.bias.double() / self.deq_scale.double()
        qb = torch.round(qb)
        if bool((qb.abs() > _INT32.max).any()):
            n = int((qb.abs() > _INT32.max).nonzero()[0, 0])
            raise UnsupportedError(
                f"{name or 'linear'}: quant_bias overflows int32 at output channel "
                f"{n} ({float(qb[n]):.4g}: bias / deq_scale too large); keep this "
                "linear float"
            )
        return qb.to(torch.int32)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lo: float,
        hi: float,
        *,
        dtype: torch.dtype,
        name: str = "",
    ) -> W8A8Linear:
        """Quantize a float ``weight`` ``[N, K]`` (+ ``bias``) for activations in
        ``[lo, hi]``."""
        check_linear_shape(name, weight.shape[1], weight.shape[0])
        codes, wscale = quantize_weight(weight, dtype)
        scale, offset = activation_qparams(lo, hi, dtype)
        return cls(codes, wscale, scale, offset, dtype=dtype, bias=bias, name=name)

    @classmethod
    def from_tensors(
        cls, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> W8A8Linear:
        """Rebuild from artifact tensors (keys ``weight``, ``deq_scale``, ...)."""
        need = ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias")
        missing = [k for k in need if k not in tensors]
        if missing:
            raise FileFormatError(f"{name}: W8A8 linear without {', '.join(missing)}")
        w = tensors["weight"]
        if w.dtype != torch.int8 or w.dim() != 2:
            raise FileFormatError(f"{name}.weight: expected int8 [N, K], got {w.dtype}")
        n = w.shape[0]
        ws = tensors.get("weight_scale")
        ws = torch.ones(n) if ws is None else ws.float().reshape(-1)
        offset = tensors["input_offset"].float().reshape(-1)
        if offset.numel() != 1 or float(offset[0]) != round(float(offset[0])):
            raise FileFormatError(f"{name}.input_offset: expected one integer value")
        scale = tensors["input_scale"].float().reshape(-1)
        if scale.numel() != 1 or not float(scale[0]) > 0:
            raise FileFormatError(f"{name}.input_scale: expected one value > 0")
        deq = tensors["deq_scale"].reshape(-1)
        qb = tensors["quant_bias"].reshape(-1)
        if deq.shape[0] != n or qb.shape[0] != n or qb.dtype != torch.int32:
            raise FileFormatError(
                f"{name}: deq_scale and quant_bias (int32) must have {n} entries"
            )
        return cls(
            w,
            ws,
            float(scale[0]),
            int(offset[0]),
            dtype=dtype,
            bias=tensors.get("bias"),
            deq_scale=deq,
            quant_bias=qb,
            name=name,
        )

    def activation_reciprocal(self) -> torch.Tensor:
        """``1 / input_scale`` computed in the model dtype (vllm-ascend
        ``w8a8_static.py``: ``aclnn_input_scale_reciprocal = 1 / input_scale``
        with ``params_dtype`` parameters), as fp32 ``[1]``."""
        return torch.reciprocal(self.input_scale.to(self.dtype)).float()

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """int8 codes ``[M, K]`` of ``x`` as the device makes them:
        ``npu_quantize(x, 1 / input_scale, input_offset, qint8, -1, False)``."""
        return quantize_static(
            self._flat(x),
            self.activation_reciprocal(),
            self.input_offset.float(),
            div_mode=False,
        )

    def _direct_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1 / input_scale, input_offset)`` as the direct path takes them (fp32
        ``[1]`` each), derived once per state of the buffers (their storage and
        version: a load or an in-place change derives them again) instead of
        three conversions per call."""
        bufs = (self.input_scale, self.input_offset)
        key = tuple((b.data_ptr(), b._version, b.device) for b in bufs)
        cached = self.__dict__.get("_derived")
        if cached is None or cached[0] != key:
            ops = (self.activation_reciprocal(), self.input_offset.float())
            cached = self.__dict__["_derived"] = (key, ops)
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct(x):
            recip, offset = self._direct_operands()
            q = static_codes(self._flat(x), recip, offset, False)
            acc = int_gemm(q, self.weight)
            y = static_dequant(acc, self.deq_scale, self.quant_bias, x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        q = self.quantize_input(x)
        y = quant_matmul(
            q, self.weight, self.deq_scale, self.quant_bias, out_dtype=x.dtype
        )
        return y.view(*x.shape[:-1], self.out_features)

    def fake_quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The float-domain model of the same quantization: ``(q - offset) *
        input_scale @ (W_q * weight_scale)^T + bias`` in fp32."""
        q = self.quantize_input(x).float() - self.input_offset.float()
        y = (q * self.input_scale) @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def export_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = self.dtype
        n = self.out_features
        deq = (
            encode_deq_scale_int64(self.deq_scale)
            if d == torch.float16
            else self.deq_scale.clone()
        )
        out = {
            ".weight": self.weight.cpu().clone(),
            ".weight_scale": self.weight_scale.to(d).reshape(n, 1).cpu(),
            ".weight_offset": torch.zeros(n, 1, dtype=d),
            ".input_scale": self.input_scale.to(d).cpu(),
            ".input_offset": self.input_offset.cpu().clone(),
            ".deq_scale": deq.cpu(),
            ".quant_bias": self.quant_bias.cpu().clone(),
        }
        if self.bias is not None:
            out[".bias"] = self.bias.to(d).cpu()
        _finite(prefix, out)
        return {prefix + k: v.contiguous() for k, v in out.items()}


class W8A8DynamicLinear(QuantizedLinear):
    """W8A8_DYNAMIC: per-token symmetric activations at run time, symmetric
    per-channel weights. Buffers ``weight`` int8 ``[N, K]``, ``weight_scale`` fp32
    ``[N]``, ``bias`` fp32 ``[N]`` or None (values representable in ``dtype``)."""

    quant_type = "W8A8_DYNAMIC"
    BUFFERS = ("weight", "weight_scale", "bias")

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        *,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, dtype)
        self.register_buffer("weight", weight.to(torch.int8).contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        b = None if bias is None else bias.detach().to(dtype).float().reshape(-1)
        self.register_buffer("bias", b)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype,
        name: str = "",
    ) -> W8A8DynamicLinear:
        check_linear_shape(name, weight.shape[1], weight.shape[0])
        codes, wscale = quantize_weight(weight, dtype)
        return cls(codes, wscale, dtype=dtype, bias=bias)

    @classmethod
    def from_tensors(
        cls, name: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> W8A8DynamicLinear:
        w = tensors.get("weight")
        ws = tensors.get("weight_scale")
        if w is None or ws is None:
            raise FileFormatError(f"{name}: W8A8_DYNAMIC linear needs weight_scale")
        if w.dtype != torch.int8 or w.dim() != 2 or ws.numel() != w.shape[0]:
            raise FileFormatError(
                f"{name}: expected int8 weight [N, K] and weight_scale [N, 1]"
            )
        return cls(w, ws.float(), dtype=dtype, bias=tensors.get("bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct(x):
            q, pts = dynamic_codes(self._flat(x))
            acc = int_gemm(q, self.weight)
            y = dynamic_dequant(acc, self.weight_scale, pts, self.bias, x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        q, pts = dynamic_quant(self._flat(x))
        y = quant_matmul_dynamic(
            q, self.weight, self.weight_scale, pts, self.bias, out_dtype=x.dtype
        )
        return y.view(*x.shape[:-1], self.out_features)

    def fake_quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(q * per-token scale) @ (W_q * weight_scale)^T + bias`` in fp32."""
        q, pts = dynamic_quant(self._flat(x))
        y = (q.float() * pts[:, None]) @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def export_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        d = self.dtype
        n = self.out_features
        out = {
            ".weight": self.weight.cpu().clone(),
            ".weight_scale": self.weight_scale.to(d).reshape(n, 1).cpu(),
            # Symmetric weights: offsets are zeros (msModelSlim writes zeros_like).
            ".weight_offset": torch.zeros(n, 1, dtype=d),
        }
        if self.bias is not None:
            out[".bias"] = self.bias.to(d).cpu()
        _finite(prefix, out)
        return {prefix + k: v.contiguous() for k, v in out.items()}
