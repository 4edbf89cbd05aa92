"""Per-head INT8 primitives against naive references, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import dequantize_per_head_ref, quantize_per_head_ref
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ascend_fa import dequantize_per_head, per_head_qparams, quantize_per_head


def _qparams_ref(lo: list[float], hi: list[float]) -> list[float]:
    """The scale formula evaluated in fp32 one head at a time."""
    out = []
    for a, b in zip(lo, hi):
        a32 = torch.tensor(min(a, 0.0), dtype=torch.float32)
        b32 = torch.tensor(max(b, 0.0), dtype=torch.float32)
        amax = torch.maximum(-a32, b32)
        out.append(float(torch.maximum(amax / 127, torch.tensor(2.0**-23))))
    return out


def test_per_head_qparams_formula():
    lo = torch.tensor([-1.0, 0.5, -3.0, 0.0, -1e-30])
    hi = torch.tensor([2.0, 4.0, -1.0, 0.0, 1e-30])
    scale, offset = per_head_qparams(lo, hi)
    assert scale.dtype == torch.float32 and offset.dtype == torch.int8
    assert scale.shape == offset.shape == (5,)
    assert torch.count_nonzero(offset) == 0
    assert scale.tolist() == _qparams_ref(lo.tolist(), hi.tolist())
    # range forced to include zero: an all-positive head uses hi only
    assert scale[1] == torch.tensor(4.0) / 127
    # all-zero head gets the 2**-23 floor instead of zero
    assert scale[3] == 2.0**-23 and scale[4] == 2.0**-23


def test_per_head_qparams_bf16_inputs_use_fp32():
    lo = torch.tensor([-1.3, -0.7], dtype=torch.bfloat16)
    hi = torch.tensor([0.9, 5.1], dtype=torch.bfloat16)
    scale, _ = per_head_qparams(lo, hi)
    assert scale.dtype == torch.float32
    assert scale.tolist() == _qparams_ref(lo.float().tolist(), hi.float().tolist())


@pytest.mark.parametrize(
    "lo, hi, match",
    [
        (
            torch.tensor([0.0, float("nan")]),
            torch.tensor([1.0, 1.0]),
            r"lo must be finite.*head 1",
        ),
        (
            torch.tensor([0.0, 0.0]),
            torch.tensor([float("inf"), 1.0]),
            r"hi must be finite.*head 0",
        ),
        (
            torch.zeros(2, 1),
            torch.zeros(2, 1),
            r"lo must be 1-D \[H\], got shape \(2, 1\)",
        ),
        (torch.zeros(2), torch.zeros(3), r"same shape, got \(2,\) and \(3,\)"),
        (torch.zeros(2, dtype=torch.int32), torch.zeros(2), r"lo must be floating"),
    ],
)
def test_per_head_qparams_bad_input(lo, hi, match):
    with pytest.raises(ValueError, match=match):
        per_head_qparams(lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("axis", [1, -2, 0])
def test_quantize_matches_reference(dtype, axis, rng):
    x = (torch.randn(3, 4, 5, generator=rng) * 3).to(dtype)
    h = x.shape[axis]
    scale = torch.rand(h, generator=rng) * 0.05 + 0.01
    q = quantize_per_head(x, scale, axis=axis)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert torch.equal(q, quantize_per_head_ref(x, scale, axis))
    d = dequantize_per_head(q, scale, axis=axis, dtype=dtype)
    assert d.dtype == dtype
    assert torch.equal(d, dequantize_per_head_ref(q, scale, axis, dtype))


def test_saturation_at_minus_128_and_127():
    scale = torch.tensor([1.0])
    x = torch.tensor([[-1000.0, -128.4, -128.6, 126.6, 127.4, 1000.0]]).T.contiguous().T
    q = quantize_per_head(x, scale, axis=0)
    assert q.tolist() == [[-128, -128, -128, 127, 127, 127]]


def test_ties_round_half_to_even():
    scale = torch.tensor([0.5])
    # x / 0.5 = -2.5, -1.5, -0.5, 0.5, 1.5, 2.5 -> -2, -2, 0, 0, 2, 2
    x = torch.tensor([[-1.25, -0.75, -0.25, 0.25, 0.75, 1.25]])
    assert quantize_per_head(x, scale, axis=0).tolist() == [[-2, -2, 0, 0, 2, 2]]


def test_bf16_input_uses_fp32_math():
    # the quotient is formed in fp32, not in bf16
    x = torch.tensor([[0.3984375, 1.0078125]], dtype=torch.bfloat16)
    scale = torch.tensor([0.0078125 * 1.0001])
    expected = torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)
    assert torch.equal(quantize_per_head(x, scale, axis=0), expected)
    dq = dequantize_per_head(expected, scale, axis=0, dtype=torch.bfloat16)
    assert torch.equal(dq, (expected.float() * scale).to(torch.bfloat16))


@settings(max_examples=30, deadline=None)
@given(
    h=st.integers(1, 4),
    n=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    spread=st.floats(1e-3, 1e3),
)
@example(h=3, n=7, dtype=torch.bfloat16, seed=7, spread=167.0)  # a rounding tie
def test_quantize_property(h, n, dtype, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, h, n, generator=gen) * spread).to(dtype)
    lo = x.float().amin(dim=(0, 2))
    hi = x.float().amax(dim=(0, 2))
    scale, _ = per_head_qparams(lo, hi)
    q = quantize_per_head(x, scale, axis=1)
    assert torch.equal(q, quantize_per_head_ref(x, scale, 1))
    # with the full range, nothing saturates beyond one step and error <= scale/2,
    # up to the fp32 rounding of the dequantized product q * scale (half an ulp of
    # a value near |x|: a tie x / scale = k + 0.5 lands a hair above scale/2)
    err = (dequantize_per_head(q, scale) - x.float()).abs()
    bound = scale.view(1, h, 1) * 0.5 * (1 + 1e-6) + x.float().abs() * 2.0**-23
    assert bool((err <= bound).all())
    assert math.isfinite(float(err.max()))


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: quantize_per_head(
                torch.zeros(2, 3, dtype=torch.int32), torch.ones(3)
            ),
            r"x must be a floating tensor, got torch.int32",
        ),
        (
            lambda: quantize_per_head(torch.zeros(2, 3), torch.ones(3, 1)),
            r"scale must be 1-D floating \[H\], got shape \(3, 1\)",
        ),
        (
            lambda: quantize_per_head(
                torch.zeros(2, 3), torch.ones(3, dtype=torch.int64)
            ),
            r"scale must be 1-D floating",
        ),
        (
            lambda: quantize_per_head(torch.zeros(2, 3), torch.ones(4)),
            r"scale has 4 entries but x.shape\[1\] = 3",
        ),
        (
            lambda: quantize_per_head(torch.zeros(2, 3), torch.tensor([1.0, 0.0, 1.0])),
            r"scale must be finite and > 0, got 0.0 at head 1",
        ),
        (
            lambda: quantize_per_head(
                torch.zeros(2, 3), torch.tensor([1.0, 1.0, float("nan")])
            ),
            r"finite and > 0, got nan at head 2",
        ),
        (
            lambda: quantize_per_head(torch.zeros(2, 3), torch.ones(3), axis=5),
            r"axis 5 out of range for shape \(2, 3\)",
        ),
        (
            lambda: dequantize_per_head(torch.zeros(2, 3), torch.ones(3)),
            r"q must be an int8 tensor, got torch.float32",
        ),
        (
            lambda: dequantize_per_head(
                torch.zeros(2, 3, dtype=torch.int8), -torch.ones(3)
            ),
            r"finite and > 0, got -1.0 at head 0",
        ),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_opcheck(rng):
    x = torch.randn(2, 3, 4, generator=rng)
    scale = torch.rand(3, generator=rng) + 0.01
    torch.library.opcheck(torch.ops.ascend_fa.quantize_per_head.default, (x, scale, 1))
    q = quantize_per_head(x, scale)
    torch.library.opcheck(
        torch.ops.ascend_fa.dequantize_per_head.default, (q, scale, 1)
    )
