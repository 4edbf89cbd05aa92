"""NZ layout: nd_to_nz / nz_to_nd against the per-element golden loops."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import nd_to_nz_ref, nz_shape, nz_to_nd_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_fa import c0, nd_to_nz, nz_cache_shape, nz_to_nd

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


def _rand(shape, dtype, gen):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def test_c0_values():
    assert c0(torch.float16) == 16
    assert c0(torch.bfloat16) == 16
    assert c0(torch.float32) == 16
    assert c0(torch.int8) == 32
    assert c0(torch.float8_e4m3fn) == 32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(16, 32), (17, 33), (1, 1), (5, 70), (40, 64), (2, 3, 33, 48), (3, 31, 16)],
)
def test_nd_to_nz_matches_naive_loop(dtype, shape, rng):
    x = _rand(shape, dtype, rng)
    z = nd_to_nz(x)
    ref = nd_to_nz_ref(x)
    assert z.dtype == dtype
    assert z.shape == ref.shape == nz_shape(shape, dtype)
    assert torch.equal(
        z.view(torch.uint8) if dtype != torch.int8 else z,
        ref.view(torch.uint8) if dtype != torch.int8 else ref,
    )
    back = nz_to_nd(z, shape[-2], shape[-1])
    assert torch.equal(back, x)
    assert torch.equal(nz_to_nd_ref(z, shape[-2], shape[-1]), x)


def test_nz_element_placement_and_zero_padding():
    m, n = 18, 35
    x = (torch.arange(m * n, dtype=torch.float32) + 1).view(m, n)
    z = nd_to_nz(x)
    assert z.shape == (3, 32, 16)
    for i, j in [(0, 0), (17, 34), (5, 16), (16, 15)]:
        assert z[j // 16, i, j % 16] == x[i, j]
    # Rows 18..31 and columns 35..47 are padding: exactly zero.
    assert torch.count_nonzero(z[:, m:, :]) == 0
    assert torch.count_nonzero(z[2, :, 3:]) == 0
    assert torch.count_nonzero(z) == m * n


def test_non_contiguous_input_matches_reference(rng):
    base = torch.randn(40, 70, generator=rng).to(torch.float16)
    x = base.t()  # [70, 40], non-contiguous
    assert torch.equal(nd_to_nz(x), nd_to_nz_ref(x.contiguous()))


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 80),
    batch=st.lists(st.integers(1, 3), max_size=2),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(m, n, batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rand((*batch, m, n), dtype, gen)
    z = nd_to_nz(x)
    assert z.shape == nz_shape(x.shape, dtype)
    assert torch.equal(nz_to_nd(z, m, n), x)
    assert torch.equal(z, nd_to_nz_ref(x))


def test_nz_cache_shape():
    assert nz_cache_shape(10, 128, 8, 128, torch.float16) == (10, 64, 128, 16)
    assert nz_cache_shape(10, 128, 8, 128, torch.int8) == (10, 32, 128, 32)
    # head_dim alone need not be a multiple of C0: 3 heads x 48 = 144 = 9 x 16.
    assert nz_cache_shape(2, 16, 3, 48, torch.bfloat16) == (2, 9, 16, 16)
    assert nz_cache_shape(1, 32, 1, 512, torch.int8) == (1, 16, 32, 32)


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 128, 3, 10, torch.float16), r"num_heads\*head_dim = 3\*10 = 30 .*C0 = 16"),
        ((4, 128, 1, 48, torch.int8), r"48 is not a multiple of C0 = 32"),
        ((4, 24, 8, 128, torch.float16), r"block_size = 24 is not a multiple of 16"),
        ((4, 48, 8, 128, torch.int8), r"block_size = 48 is not a multiple of 32"),
        ((0, 128, 8, 128, torch.float16), r"num_blocks must be a positive int"),
    ],
)
def test_nz_cache_shape_errors(args, match):
    with pytest.raises(ValueError, match=match):
        nz_cache_shape(*args)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"rank >= 2"):
        nd_to_nz(torch.zeros(5))
    with pytest.raises(ValueError, match=r"M, N > 0"):
        nd_to_nz(torch.zeros(0, 4))
    z = nd_to_nz(torch.zeros(17, 20))
    with pytest.raises(
        ValueError, match=r"tail shape \(2, 32, 16\).*packs to \(3, 32, 16\)"
    ):
        nz_to_nd(z, 17, 40)
    with pytest.raises(ValueError, match=r"m must be a positive int"):
        nz_to_nd(z, 0, 20)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_opcheck(dtype, rng):
    x = _rand((2, 33, 70), dtype, rng)
    torch.library.opcheck(torch.ops.ascend_fa.nd_to_nz.default, (x,))
    z = nd_to_nz(x)
    torch.library.opcheck(torch.ops.ascend_fa.nz_to_nd.default, (z, 33, 70))
