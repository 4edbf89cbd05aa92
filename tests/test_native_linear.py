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


def _naive_product(x, w):
    """``x @ w^T`` by Python integers, one dot product at a time."""
    xs, ws = x.tolist(), w.tolist()
    return torch.tensor(
        [[sum(a * b for a, b in zip(r, c, strict=True)) for c in ws] for r in xs],
        dtype=torch.int32,
    )


@pytest.mark.parametrize("simd", [True, False])
def test_int_gemm_kernel_equals_naive_product(simd):
    """The native int8 product (AVX2 and portable paths) equals Python's integer
    dot products: rows 1-9 (the 4-row blocks and every remainder), K below,
    at and off multiples of 16, extreme codes (-128 * -128 everywhere in a row),
    column ranges that split the output."""
    gen = torch.Generator().manual_seed(3)
    kernels = native_kernels()
    try:
        kernels.set_simd(simd)
        for m, k, n in [(1, 1, 3), (2, 15, 5), (3, 16, 7), (4, 31, 9), (5, 48, 4),
                        (7, 100, 11), (8, 64, 6), (9, 17, 13)]:  # fmt: skip
            x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
            w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
            x[0], w[0] = -128, -128
            ref = _naive_product(x, w)
            out = torch.full((m, n), 7, dtype=torch.int32)
            cut = n // 2
            assert kernels.int_gemm(x, w, out, (0, cut)) == 0
            assert torch.equal(out[:, :cut], ref[:, :cut])
            assert bool((out[:, cut:] == 7).all())  # only its own columns
            assert kernels.int_gemm(x, w, out, (cut, n)) == 0
            assert torch.equal(out, ref), (m, k, n)
    finally:
        kernels.set_simd(True)


def test_int_gemm_kernel_refuses_a_bad_column_range():
    x = torch.zeros(1, 16, dtype=torch.int8)
    w = torch.zeros(4, 16, dtype=torch.int8)
    out = torch.zeros(1, 4, dtype=torch.int32)
    assert native_kernels().int_gemm(x, w, out, (2, 5)) == -1
    assert native_kernels().int_gemm(x, w, out, (3, 2)) == -1


def test_int_gemm_decode_rows_take_the_kernel_bit_equal(monkeypatch):
    """``int_gemm`` on the fp32 path: up to NATIVE_GEMM_MAX_M rows go to the
    kernel (split over threads for large products), more rows to the fp32
    chunks; both equal the chunks' int32 bit for bit, K up to the int32 limit."""
    from ascend_fa.atb_ops import linear as lin

    monkeypatch.setattr(lin, "_CPU_INT_MM", False)
    gen = torch.Generator().manual_seed(5)
    calls = []
    real = native_kernels().int_gemm
    monkeypatch.setattr(
        type(native_kernels()), "int_gemm",
        lambda self, *a: calls.append(a[3]) or real(*a),
    )  # fmt: skip
    for m, k, n in [(1, 576, 960), (8, 1536, 576), (16, 2048, 1024), (17, 64, 8)]:
        x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        calls.clear()
        got = lin.int_gemm(x, w)
        assert torch.equal(got, lin._chunked_gemm(x, w)), (m, k, n)
        assert bool(calls) == (m <= lin.NATIVE_GEMM_MAX_M)
        if calls:
            covered = sorted(calls)
            assert covered[0][0] == 0 and covered[-1][1] == n
    # the largest |sum| K allows: every product 2**14
    k = 65535
    x = torch.full((2, k), -128, dtype=torch.int8)
    w = torch.full((3, k), -128, dtype=torch.int8)
    assert bool((lin.int_gemm(x, w) == k * 2**14).all())
