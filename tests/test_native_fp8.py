"""The native FP8 block dequantize: bit-equal to ``(codes.float() * scale_inv)
.to(dtype)`` and to the eager decode, with the same refusals."""

from __future__ import annotations

import contextlib

import pytest
import torch
from ascend_fa.atb_ops.native import native_disabled, native_kernels, native_status

from ascend_fa.fp8.blocks import BadBlock, Workspace, dequantize_chunk, e4m3_values

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
