"""Quantized linear modules: exported tensors as the consumers read them, the
integer path against the fake-quant path, safe values and refusals."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops.linear import decode_deq_scale

from ascend_fa.errors import UnsupportedError
from ascend_fa.linear import W8A8DynamicLinear, W8A8Linear
from ascend_fa.linear.modules import (
    activation_qparams,
    check_linear_shape,
    dtype_round_up,
    quantize_weight,
)


def _layer(n=12, k=20, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.2
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    x = torch.randn(5, 3, k, generator=g)
    return w, b, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w8a8_export_dtypes_and_shapes(dtype):
    w, b, x = _layer()
    lo, hi = float(x.min()), float(x.max())
    m = W8A8Linear.from_float(w, b, lo, hi, dtype=dtype, name="p")
    t = m.export_tensors("p")
    deq_dtype = torch.int64 if dtype == torch.float16 else torch.float32
    want = {
        "p.weight": (torch.int8, (12, 20)),
        "p.weight_scale": (dtype, (12, 1)),
        "p.weight_offset": (dtype, (12, 1)),
        "p.input_scale": (dtype, (1,)),
        "p.input_offset": (torch.int8, (1,)),
        "p.deq_scale": (deq_dtype, (12,)),
        "p.quant_bias": (torch.int32, (12,)),
        "p.bias": (dtype, (12,)),
    }
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == want
    assert bool((t["p.weight_offset"] == 0).all())
    # Values written are the values used: the scales are representable in dtype.
    assert torch.equal(t["p.weight_scale"].float().flatten(), m.weight_scale)
    assert float(t["p.input_scale"].float()) == float(m.input_scale)
    # deq_scale = input_scale * weight_scale (fp16: FP19 of it, read as int64 bits)
    deq = decode_deq_scale(t["p.deq_scale"])
    assert torch.equal(deq, m.deq_scale)
    exact = m.input_scale * m.weight_scale
    if dtype == torch.float16:
        assert bool((deq <= exact).all()) and bool((deq > exact * (1 - 2**-10)).all())
    else:
        assert torch.equal(deq, exact)
    # quant_bias = round(bias / deq - offset * rowsum(W_q)) (msModelSlim's rule)
    rowsum = t["p.weight"].double().sum(1)
    qb = torch.round(
        m.bias.double() / deq.double() - float(t["p.input_offset"]) * rowsum
    )
    assert torch.equal(t["p.quant_bias"], qb.to(torch.int32))


def test_w8a8_dynamic_export():
    w, b, _ = _layer()
    m = W8A8DynamicLinear.from_float(w, b, dtype=torch.bfloat16)
    t = m.export_tensors("q")
    assert set(t) == {"q.weight", "q.weight_scale", "q.weight_offset", "q.bias"}
    assert t["q.weight_scale"].shape == (12, 1) and t["q.weight_scale"].dtype == (
        torch.bfloat16
    )


@pytest.mark.parametrize("cls", [W8A8Linear, W8A8DynamicLinear])
def test_integer_path_matches_fake_quant_path(cls):
    """The exact integer forward equals the float-domain model of the same
    quantization within fp32 rounding (the integer path rounds the sum once)."""
    for seed in range(4):
        w, b, x = _layer(seed=seed)
        if cls is W8A8Linear:
            m = cls.from_float(
                w, b, float(x.min()), float(x.max()), dtype=torch.bfloat16
            )
        else:
            m = cls.from_float(w, b, dtype=torch.bfloat16)
        y_int = m(x)
        y_fq = m.fake_quant_forward(x)
        ref = x @ w.t() + b
        scale = float(ref.abs().max())
        # quant_bias rounds bias / deq to an integer: <= deq / 2 per output
        tol = 1e-5 * scale + (float(m.deq_scale.max()) if cls is W8A8Linear else 0)
        assert float((y_int - y_fq).abs().max()) <= tol
        # and both are close to float (8-bit quantization error)
        assert float((y_int - ref).abs().max()) < 0.1 * scale


def test_scales_representable_and_rounded_up():
    v = torch.tensor([1.0 + 2**-12, 3.3e-3, 7.0])
    for dtype in (torch.bfloat16, torch.float16):
        r = dtype_round_up(v, dtype)
        assert torch.equal(r.to(dtype).float(), r) and bool((r >= v).all())
    codes, scale = quantize_weight(torch.tensor([[1.0, -2.54, 0.3]]), torch.bfloat16)
    assert int(codes.abs().max()) <= 127  # rounding the scale up never clips


def test_zero_rows_and_channels_get_safe_finite_values():
    w = torch.zeros(4, 8)
    w[1, 3] = 0.5
    m = W8A8Linear.from_float(w, None, 0.0, 0.0, dtype=torch.float16, name="z")
    t = m.export_tensors("z")
    for k, v in t.items():
        if v.is_floating_point():
            assert bool(torch.isfinite(v).all()), k
    # fp16: no scale below the smallest normal fp16 value
    assert float(t["z.weight_scale"].float().min()) >= torch.finfo(torch.float16).tiny
    assert bool((m(torch.zeros(2, 8)) == 0).all())
    d = W8A8DynamicLinear.from_float(w, None, dtype=torch.bfloat16)
    assert bool((d(torch.zeros(3, 8)) == 0).all())  # all-zero token -> 0


def test_activation_offset_and_range():
    scale, offset = activation_qparams(-1.0, 3.0, torch.float32)
    assert abs(scale - 4.0 / 255) < 1e-7 and -128 <= offset <= 127
    assert round(-1.0 / scale + offset) == -128
    scale, offset = activation_qparams(0.5, 2.0, torch.float32)  # widened to 0
    assert offset == -128


def test_bias_overflow_is_a_clear_error():
    w = torch.full((2, 4), 1e-3)
    b = torch.tensor([1e9, 0.0])
    with pytest.raises(UnsupportedError, match="p.x: quant_bias overflows int32"):
        W8A8Linear.from_float(w, b, -1e-3, 1e-3, dtype=torch.bfloat16, name="p.x")


def test_shapes_no_consumer_takes_are_refused():
    with pytest.raises(UnsupportedError, match="big: in_features = 70000"):
        check_linear_shape("big", 70000, 16)
    with pytest.raises(UnsupportedError, match="out_features = 65536"):
        W8A8DynamicLinear.from_float(torch.zeros(65536, 2), None, dtype=torch.bfloat16)


def test_from_tensors_round_trip_is_bit_equal():
    w, b, x = _layer(seed=3)
    for dtype in (torch.bfloat16, torch.float16):
        m = W8A8Linear.from_float(w, b, float(x.min()), float(x.max()), dtype=dtype)
        t = m.export_tensors("p")
        parts = {k.removeprefix("p."): v for k, v in t.items()}
        back = W8A8Linear.from_tensors("p", parts, dtype)
        assert torch.equal(back(x), m(x))
        d = W8A8DynamicLinear.from_float(w, b, dtype=dtype)
        parts = {k.removeprefix("p."): v for k, v in d.export_tensors("p").items()}
        assert torch.equal(W8A8DynamicLinear.from_tensors("p", parts, dtype)(x), d(x))


def test_direct_path_follows_buffer_changes():
    """The direct path derives 1 / input_scale, the offset and fp64 quant_bias
    once per state of the buffers: an in-place change or a new buffer (a load)
    is seen on the next call, as the op path (through torch.ops) sees it."""
    w, b, x = _layer(seed=5)
    m = W8A8Linear.from_float(
        w, b, float(x.min()), float(x.max()), dtype=torch.bfloat16
    )
    first = m(x)
    assert torch.equal(m(x), first)
    m.input_scale.mul_(2)
    m.quant_bias.add_(7)
    changed = m(x)
    assert not torch.equal(changed, first)
    other = W8A8Linear.from_tensors(
        "p", {k.removeprefix("p."): v for k, v in m.export_tensors("p").items()},
        torch.bfloat16,
    )  # fmt: skip
    assert torch.equal(other(x), changed)
    m.load_state_dict({**m.state_dict(), "input_offset": m.input_offset + 3})
    assert torch.equal(m(x), quantized_through_op(m, x))


def quantized_through_op(m, x):
    """``m(x)`` through torch.ops (a dispatch mode active: no direct call)."""

    class _Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Mode():
        return m(x)


def test_smooth_factors_zero_channels_and_tied_heads():
    from ascend_fa.linear.search import smooth_factors

    a = torch.tensor([0.0, 2.0, 8.0, 1.0])
    w = torch.tensor([1.0, 0.0, 2.0, 1.0])
    s = smooth_factors(a, w, 0.5)
    assert s[0] == 1 and s[1] == 1  # an all-zero side keeps 1 (safe value)
    assert float(s[2]) == pytest.approx(2.0)
    # o_proj: 2 KV heads x 2 query heads x D=2 -> one factor per KV-head channel
    a = torch.arange(1.0, 9.0)
    s = smooth_factors(a, torch.ones(8), 1.0, tie=2, head_dim=2)
    assert s.view(2, 2, 2)[:, 0].equal(s.view(2, 2, 2)[:, 1])
    assert s.tolist() == [3.0, 4.0, 3.0, 4.0, 7.0, 8.0, 7.0, 8.0]
