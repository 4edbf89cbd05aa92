"""The native static W8A8 quantizer and dequantize epilogue against the eager
torch path, bit for bit: every 16-bit input pattern, fp32 inputs with specials,
int32 accumulators to the limits, bf16 ties; and the eager fallback outside the
default float environment."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
from ascend_fa.atb_ops.linear import static_codes, static_dequant
from ascend_fa.atb_ops.native import native_disabled, native_kernels

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="no native kernels (no C compiler)"
)

SCALES = [(1 / 0.0173, 0.0), (37.25, -3.0), (0.5, 127.0), (1 / 3.1e-5, -128.0)]


def _eager_codes(x, s, o, div):
    with native_disabled():
        return static_codes(x, s, o, div)


def _all_patterns(dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    return x[~torch.isnan(x.float())].contiguous()


@pytest.mark.parametrize("div", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codes_every_16bit_input_equal_eager(dtype, div):
    x = _all_patterns(dtype)
    for s, o in SCALES:
        sc, off = torch.tensor([s]), torch.tensor([o])
        got = native_kernels().static_codes(x, s, o, div)
        assert got is not None
        assert torch.equal(got, _eager_codes(x, sc, off, div)), (s, o)


def test_codes_fp32_specials_ties_and_tails_equal_eager():
    gen = torch.Generator().manual_seed(0)
    s = 1 / 0.0173
    half = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) / s  # near ties
    x = torch.cat([
        torch.randn(10_007, generator=gen) * 3,
        half, torch.nextafter(half, torch.tensor(1e9)),
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e38, -3e38, 1e-45]),
    ])  # fmt: skip
    for n in (x.numel(), 31, 33, 1):
        part = x[:n].contiguous()
        for o in (0.0, -7.0, 100.0):
            sc, off = torch.tensor([s]), torch.tensor([o])
            want = _eager_codes(part, sc, off, False)
            assert torch.equal(static_codes(part, sc, off, False), want)


def test_codes_nan_input_gives_code_zero():
    x = torch.tensor([float("nan")] * 40 + [1.0])
    got = native_kernels().static_codes(x, 2.0, 0.0, False)
    assert got[:40].eq(0).all() and int(got[40]) == 2


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dequant_equals_eager_fp64_path(out, with_bias):
    gen = torch.Generator().manual_seed(1)
    m, n = 37, 203
    lim = 2**31 - 1
    acc = torch.randint(-(2**26), 2**26, (m, n), generator=gen, dtype=torch.int32)
    acc[0, :4] = torch.tensor([lim, -lim - 1, 2**24 + 1, -(2**24) - 3])
    qb = torch.randint(-(2**30), 2**30, (n,), generator=gen, dtype=torch.int32)
    qb[:4] = torch.tensor([lim, -lim - 1, 1, 0])
    deq = torch.rand(n, generator=gen) * 1e-4 + 1e-7
    # bf16 ties: values whose fp32 product is exactly halfway between two bf16
    deq[5], qb[5] = 1.0, 0
    acc[1, 5], acc[2, 5] = 257, 259  # 9 significant bits, the last one set: ties
    bias = qb if with_bias else None
    got = static_dequant(acc, deq, bias, out)
    with native_disabled():
        want = static_dequant(acc, deq, None if bias is None else bias.double(), out)
    assert got.dtype == out and torch.equal(got, want)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="fesetround from the C library on x86-64 Linux",
)
def test_other_rounding_mode_takes_the_eager_path():
    """Under another rounding mode the kernels decline (their exactness argument
    needs round to nearest) and the eager path runs under that mode."""
    libc = ctypes.CDLL(None)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    sc, off = torch.tensor([1 / 0.0173]), torch.tensor([1.0])
    fe_downward = 0x400
    old = libc.fegetround()
    assert libc.fesetround(fe_downward) == 0
    try:
        assert native_kernels().static_codes(x, sc.item(), 1.0, False) is None
        got = static_codes(x, sc, off, False)
        want = _eager_codes(x, sc, off, False)
    finally:
        libc.fesetround(old)
    assert torch.equal(got, want)
