"""The native FP8 block dequantize: bit-equal to ``(codes.float() * scale_inv)
.to(dtype)`` and to the eager decode, with the same refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from ascend_fa.atb_ops.native import native_disabled, native_kernels, native_status

from ascend_fa.fp8.blocks import (
    BadBlock,
    Workspace,
    dequantize_chunk,
    e4m3_values,
    quantize_chunk,
)

ALL_CODES = torch.arange(256, dtype=torch.int16).to(torch.uint8)


@pytest.fixture(params=["simd", "scalar"])
def path(request):
    status = native_status()
    if not status.available:
        if status.compiler is not None:  # a compiler that fails: a bug here
            pytest.fail(f"native kernels failed to build: {status.reason}")
        pytest.skip(f"native kernels unavailable: {status.reason}")
    kernels = native_kernels()
    on = kernels.set_simd(request.param == "simd")
    if request.param == "simd" and not on:
        pytest.skip("this CPU has no AVX2 + F16C")
    yield request.param
    kernels.set_simd(True)


def test_e4m3_values_equal_torch_cast_on_all_256_codes():
    """The project's exact bit-move decode equals torch's float8_e4m3fn -> float32
    cast on every code; 0x7F and 0xFF (the only NaNs) are NaN in both."""
    ours = e4m3_values()
    torchs = ALL_CODES.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(torchs)
    assert nan.nonzero().view(-1).tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan].view(torch.int32), torchs[~nan].view(torch.int32))


def _expand(scale, r, n, block):
    br, bc = block
    return scale.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,block", [((260, 254), (128, 128)), ((37, 45), (16, 8))])
def test_every_code_under_many_scales(path, rng, dtype, shape, block):
    """Every non-NaN code, in partial blocks and column tails that are not a
    multiple of 8, under scales from tiny to huge (bf16) or within range (fp16):
    the native result, the eager result and the fp32 product rounded by torch are
    the same bits."""
    r, n = shape
    finite = ALL_CODES[(ALL_CODES & 0x7F) != 0x7F]
    codes = finite[torch.randint(0, finite.numel(), (r, n), generator=rng)]
    codes[0, : finite.numel()] = finite[: min(n, finite.numel())]
    codes = codes.view(torch.float8_e4m3fn)
    nbr, nbc = -(-r // block[0]), -(-n // block[1])
    exps = torch.randint(-60, 60 if dtype == torch.bfloat16 else 6, (nbr, nbc))
    scale = torch.rand(nbr, nbc, generator=rng) * torch.pow(2.0, exps.float())
    scale = scale.clamp_min(2.0**-100)
    want = (codes.float() * _expand(scale, r, n, block)).to(dtype)
    got = torch.empty(r, n, dtype=dtype)
    dequantize_chunk(codes, scale, block, Workspace(), got)
    eager = torch.empty(r, n, dtype=dtype)
    with native_disabled():
        dequantize_chunk(codes, scale, block, Workspace(), eager)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), path
    assert torch.equal(eager.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_code_and_overflow_refused_like_eager(path, dtype):
    """A NaN code is refused with its block; with fp16 output a product beyond
    float16 is refused too; when a chunk has both, the NaN code is named (the
    eager decode checks for NaN codes first)."""
    block = (16, 16)
    codes = torch.full((40, 40), 0x38, dtype=torch.uint8)  # 1.0
    scale = torch.ones(3, 3)

    def run(c, s, native):
        out = torch.empty(40, 40, dtype=dtype)
        ctx = native_disabled() if not native else contextlib.nullcontext()
        with ctx, pytest.raises(BadBlock) as info:
            dequantize_chunk(c.view(torch.float8_e4m3fn), s, block, Workspace(), out)
        return (info.value.row, info.value.col, info.value.what)

    nan = codes.clone()
    nan[35, 20] = 0xFF
    assert run(nan, scale, True) == run(nan, scale, False)
    assert run(nan, scale, True)[:2] == (2, 1)
    if dtype == torch.float16:
        big = scale.clone()
        big[0, 2] = 1e5  # 1.0 * 1e5 > 65504
        assert run(codes, big, True) == run(codes, big, False)
        assert "float16" in run(codes, big, True)[2]
        assert run(nan, big, True) == run(nan, big, False)
        assert "NaN" in run(nan, big, True)[2]


# -- the native block quantize ---------------------------------------------------------


def naive_quantize(w: torch.Tensor, block):
    """One block at a time, straight from the rule, with torch's own cast."""
    br, bc = block
    r, n = w.shape
    nbr, nbc = -(-r // br), -(-n // bc)
    codes = torch.empty(r, n, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nbr, nbc)
    for i in range(nbr):
        for j in range(nbc):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            s = torch.clamp_min(
                blk.abs().amax() / 448.0, torch.finfo(torch.float32).tiny
            )
            scale[i, j] = s
            codes[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / s).to(
                torch.float8_e4m3fn
            )
    return codes, scale


def _quantize(w, block, native: bool):
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    ctx = contextlib.nullcontext() if native else native_disabled()
    with ctx:
        scale = quantize_chunk(w, block, Workspace(), out)
    return out.view(torch.uint8), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape,block", [((260, 254), (128, 128)), ((37, 45), (16, 8)), ((64, 96), (64, 32))]
)
def test_quantize_native_equals_eager_and_naive(path, rng, dtype, shape, block):
    """Codes and scales of the native kernel, the eager path and a per-block naive
    reference are the same bits: magnitudes from subnormal to large per block
    row, an all-zero block (scale floor), partial edge blocks and column tails
    that are not a multiple of 8 or 32."""
    r, n = shape
    top = 4.0 if dtype == torch.float16 else 30.0
    mag = torch.pow(10.0, torch.linspace(-top, top / 8, r))[:, None]
    w = (torch.randn(shape, generator=rng) * mag).to(dtype)
    w[: block[0], : block[1]] = 0
    if dtype != torch.float32:  # every 16-bit pattern but inf / NaN, in one row
        pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
        vals = pats.view(dtype)
        vals = vals[torch.isfinite(vals)][: r * n // 2]
        w.view(-1)[-vals.numel() :] = vals
    got = _quantize(w, block, True)
    eager = _quantize(w, block, False)
    codes, scale = naive_quantize(w, block)
    assert torch.equal(got[0], codes.view(torch.uint8)), path
    assert torch.equal(got[1].view(torch.int32), scale.view(torch.int32)), path
    assert torch.equal(eager[0], got[0]) and torch.equal(eager[1], got[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_native_refuses_nonfinite_like_eager(path, dtype, bad):
    """The first block (row-major) holding inf or NaN is named, as the eager
    path names it, also when a later block holds one too."""
    w = torch.ones(50, 70, dtype=dtype)
    w[33, 61] = bad
    w[45, 5] = bad
    found = []
    for native in (True, False):
        with pytest.raises(BadBlock) as info:
            _quantize(w, (16, 16), native)
        found.append((info.value.row, info.value.col, info.value.what))
    assert found[0] == found[1] == (2, 0, "non-finite values")


def test_e4m3_conversion_equals_torch_cast(path, rng):
    """The kernels' fp32 -> E4M3 rounding equals torch's cast on every bf16
    pattern (times factors that land between codes), on random fp32 patterns
    (subnormal codes, ties, carries into the exponent), and on NaN; beyond the
    format (|x| > 464, inf) it saturates to +-448 as torch 2.13 does."""
    kernels = native_kernels()
    pats = torch.arange(0, 1 << 16, dtype=torch.int32).mul(1 << 16).view(torch.float32)
    rand = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=rng)
    x = torch.cat(
        [
            pats,
            pats * 0.75,
            pats * 1.0625,
            pats * 2.0**-9,
            rand.int().view(torch.float32),
        ]
    )
    x = x.contiguous()
    ours = kernels.fp8_e4m3(x).view(torch.uint8)
    inside = ~(x.abs() > 464)  # NaN included
    torchs = x[inside].to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours[inside], torchs), path
    outside = x[~inside]
    want = torch.where(outside > 0, 0x7E, 0xFE).to(torch.uint8)
    assert torch.equal(ours[~inside], want)
    nan = torch.isnan(x)
    assert nan.any() and bool(((ours[nan] & 0x7F) == 0x7F).all())


def test_quantize_native_declines_another_rounding_mode():
    """Under a rounding mode other than to-nearest (MXCSR), the kernel writes
    nothing and says so; quantize_chunk then runs the eager path."""
    import ctypes
    import ctypes.util
    import platform

    status = native_status()
    if not status.available or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs the native kernels on x86-64")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    w = torch.ones(16, 16)
    codes = torch.full((16, 16), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 7.0)
    before = libm.fegetround()
    assert libm.fesetround(0x800) == 0  # FE_UPWARD (x86)
    try:
        rc = native_kernels().fp8_quantize(w, (16, 16), scale, codes)
    finally:
        libm.fesetround(before)
    assert rc == -1
    assert bool((codes.view(torch.uint8) == 0x11).all()) and scale.item() == 7.0
