"""reshape_and_cache / reshape_and_cache_mla: bit-exact against per-token loops."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape, quantize_per_head
from ascend_fa.atb_ops.cache import (
    direct_cpu_write,
    reshape_and_cache_mla_ref,
    reshape_and_cache_ref,
    token_rows_ref,
)

from ascend_fa import reshape_and_cache, reshape_and_cache_mla


def _slots(gen, n_tokens, num_slots, n_pad):
    """Distinct random slots with ``n_pad`` entries replaced by -1."""
    slots = torch.randperm(num_slots, generator=gen)[:n_tokens].to(torch.int32)
    pad = torch.randperm(n_tokens, generator=gen)[:n_pad]
    slots[pad] = -1
    return slots


def _caches(layout, nb, bs, hkv, d, dtype, sentinel):
    if layout == "nz":
        shape = nz_cache_shape(nb, bs, hkv, d, dtype)
    else:
        shape = (nb, bs, hkv, d)
    fill = torch.full(shape, sentinel, dtype=dtype)
    return fill.clone(), fill.clone()


CASES = [
    # dtype, quantized, layout, T, Hkv, D, NB, BS
    (torch.float16, False, "nz", 37, 2, 24, 5, 16),
    (torch.bfloat16, False, "nz", 50, 1, 48, 4, 32),
    (torch.float32, False, "nz", 21, 3, 16, 3, 16),
    (torch.float16, True, "nz", 45, 2, 48, 3, 32),
    (torch.bfloat16, True, "nz", 29, 1, 64, 2, 64),
    (torch.bfloat16, False, "nd", 33, 2, 20, 4, 16),
    (torch.float32, True, "nd", 40, 3, 8, 2, 32),
]


@pytest.mark.parametrize("dtype,quantized,layout,t,hkv,d,nb,bs", CASES)
def test_cache_write_matches_per_token_loop(
    rng, dtype, quantized, layout, t, hkv, d, nb, bs
):
    key = (torch.randn(t, hkv, d, generator=rng) * 3).to(dtype)
    value = (torch.randn(t, hkv, d, generator=rng) * 2).to(dtype)
    cache_dtype = torch.int8 if quantized else dtype
    ks = vs = None
    if quantized:
        ks = (
            torch.rand(hkv, generator=rng) * 0.02 + 0.01
        )  # clips some outliers at +-128
        vs = torch.rand(hkv, generator=rng) * 0.02 + 0.01
    slots = _slots(rng, t, nb * bs - 3, n_pad=5)  # partly filled last block
    kc, vc = _caches(layout, nb, bs, hkv, d, cache_dtype, 7)
    kr, vr = _caches(layout, nb, bs, hkv, d, cache_dtype, 7)
    reshape_and_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, layout=layout)
    reshape_and_cache_ref(key, value, kr, vr, slots, ks, vs, layout)
    assert torch.equal(kc, kr)
    assert torch.equal(vc, vr)
    # untouched slots keep the sentinel; a padded token wrote nothing
    written = set(slots[slots >= 0].tolist())
    free = next(s for s in range(nb * bs) if s not in written)
    assert bool((token_rows_ref(kc, free, layout) == 7).all())
    if quantized:
        # the stored codes are exactly quantize_per_head of the token
        t0 = int((slots >= 0).nonzero()[0, 0])
        want = quantize_per_head(key[t0 : t0 + 1], ks, axis=1).reshape(-1)
        assert torch.equal(token_rows_ref(kc, int(slots[t0]), layout), want)


def test_int64_slots_and_all_padding(rng):
    key = torch.randn(6, 2, 16, generator=rng, dtype=torch.float32).half()
    kc, vc = _caches("nz", 2, 16, 2, 16, torch.float16, 0)
    before = kc.clone()
    reshape_and_cache(key, key, kc, vc, torch.full((6,), -1, dtype=torch.int64))
    assert torch.equal(kc, before)
    slots = torch.tensor([5, -1, 31, 0, -7, 16], dtype=torch.int64)
    kr, vr = _caches("nz", 2, 16, 2, 16, torch.float16, 0)
    reshape_and_cache(key, key, kc, vc, slots)
    reshape_and_cache_ref(key, key, kr, vr, slots)
    assert torch.equal(kc, kr)


def test_nz_element_position_from_definition():
    """Token at slot s, feature c -> [s // BS, c // C0, s % BS, c % C0]."""
    hkv, d, bs = 2, 16, 16
    key = torch.arange(3 * hkv * d, dtype=torch.float32).view(3, hkv, d).half()
    kc, vc = _caches("nz", 3, bs, hkv, d, torch.float16, 0)
    slots = torch.tensor([17, 2, 40], dtype=torch.int32)
    reshape_and_cache(key, key, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        for c in range(hkv * d):
            assert kc[s // bs, c // 16, s % bs, c % 16] == key[t].reshape(-1)[c]


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("layout", ["nz", "nd"])
def test_mla_cache_write_matches_loop(rng, quantized, layout):
    t, r, dr, nb, bs = 23, 64, 32, 3, 32
    latent = torch.randn(t, r, generator=rng).bfloat16()
    rope = torch.randn(t, dr, generator=rng).bfloat16()
    ks = torch.tensor([0.02]) if quantized else None
    ldt = torch.int8 if quantized else torch.bfloat16
    if layout == "nz":
        lshape = nz_cache_shape(nb, bs, 1, r, ldt)
        rshape = nz_cache_shape(nb, bs, 1, dr, torch.bfloat16)
    else:
        lshape, rshape = (nb, bs, 1, r), (nb, bs, 1, dr)
    lc, rc = torch.zeros(lshape, dtype=ldt), torch.zeros(rshape, dtype=torch.bfloat16)
    lr, rr = lc.clone(), rc.clone()
    slots = _slots(rng, t, nb * bs, n_pad=4)
    reshape_and_cache_mla(latent, rope, lc, rc, slots, k_scale=ks, layout=layout)
    reshape_and_cache_mla_ref(latent, rope, lr, rr, slots, ks, layout)
    assert torch.equal(lc, lr)
    assert torch.equal(rc.view(torch.int16), rr.view(torch.int16))
    assert rc.dtype == torch.bfloat16  # the RoPE part is never quantized


def test_opcheck_cache_ops(rng):
    key = torch.randn(9, 2, 16, generator=rng).half()
    kc, vc = _caches("nz", 2, 32, 2, 16, torch.int8, 0)
    ks = torch.tensor([0.01, 0.02])
    slots = torch.tensor([0, 3, -1, 40, 7, 8, 9, 63, 12], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.ascend_fa.reshape_and_cache.default,
        (key, key, kc, vc, slots, ks, ks, "nz"),
    )
    fc, gc = _caches("nd", 2, 16, 2, 16, torch.float16, 0)
    torch.library.opcheck(
        torch.ops.ascend_fa.reshape_and_cache.default,
        (key, key, fc, gc, slots % 32, None, None, "nd"),
    )
    lat = torch.randn(9, 64, generator=rng).bfloat16()
    rope = torch.randn(9, 32, generator=rng).bfloat16()
    lc = torch.zeros(nz_cache_shape(2, 32, 1, 64, torch.int8), dtype=torch.int8)
    rc = torch.zeros(nz_cache_shape(2, 32, 1, 32, torch.bfloat16), dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.ascend_fa.reshape_and_cache_mla.default,
        (lat, rope, lc, rc, slots, torch.tensor([0.03]), "nz"),
    )


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize(
    "dtype,quantized",
    [(torch.float16, False), (torch.float32, False), (torch.bfloat16, True)],
)
def test_prefill_block_path_matches_loop(rng, layout, dtype, quantized):
    """Prefill-like writes (whole blocks in shuffled order, a partly filled last
    block whose other rows already hold data, tokens out of order) take the
    block-staging path; it must equal the per-token loop bit for bit."""
    hkv, d, bs, nb = 2, 32, 32, 8
    cache_dtype = torch.int8 if quantized else dtype
    kc, vc = _caches(layout, nb, bs, hkv, d, cache_dtype, 0)
    old = torch.randn(kc.shape, generator=rng)
    kc.copy_(old.to(cache_dtype) if not quantized else (old * 50).to(torch.int8))
    vc.copy_(kc)
    kr, vr = kc.clone(), vc.clone()
    blocks = torch.randperm(nb, generator=rng)[:4].tolist()
    slots = [b * bs + r for b in blocks[:3] for r in range(bs)]
    slots += [blocks[3] * bs + r for r in range(5, 17)]  # rows 0-4, 17+ keep old data
    perm = torch.randperm(len(slots), generator=rng)
    slots_t = torch.tensor(slots, dtype=torch.int64)[perm]
    slots_t[7] = -1
    t = slots_t.numel()
    key = torch.randn(t, hkv, d, generator=rng).to(dtype)
    value = torch.randn(t, hkv, d, generator=rng).to(dtype)
    ks = torch.tensor([0.02, 0.03]) if quantized else None
    reshape_and_cache(
        key, value, kc, vc, slots_t, k_scale=ks, v_scale=ks, layout=layout
    )
    reshape_and_cache_ref(key, value, kr, vr, slots_t, ks, ks, layout)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    # in-order full blocks (no staging copy at all)
    in_order = torch.tensor([b * bs + r for b in sorted(blocks[:2]) for r in range(bs)])
    key2 = torch.randn(in_order.numel(), hkv, d, generator=rng).to(dtype)
    reshape_and_cache(
        key2, key2, kc, vc, in_order, k_scale=ks, v_scale=ks, layout=layout
    )
    reshape_and_cache_ref(key2, key2, kr, vr, in_order, ks, ks, layout)
    assert torch.equal(kc, kr)


def test_chunked_quantization_equals_quantize_per_head(rng):
    """The write path quantizes in cache-sized chunks; across chunk boundaries the
    codes must equal ``quantize_per_head`` (itself tested against a scalar loop)."""
    from ascend_fa.atb_ops.cache import _QUANT_CHUNK, _quantize_rows

    hkv, d = 4, 128
    t = 2 * _QUANT_CHUNK // (hkv * d) + 37  # three chunks, the last one partial
    x = (torch.randn(t, hkv, d, generator=rng) * 4).bfloat16()
    scale = torch.tensor([0.01, 0.02, 0.03, 0.04])
    assert torch.equal(_quantize_rows(x, scale), quantize_per_head(x, scale, axis=1))
    assert torch.equal(
        _quantize_rows(x[:0], scale), torch.empty(0, hkv, d, dtype=torch.int8)
    )


@pytest.mark.parametrize("layout", ["nz", "nd"])
def test_block_path_index_copy_branch(rng, monkeypatch, layout):
    """Many touched blocks: the block path copies them with one index_copy_."""
    from ascend_fa.atb_ops import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_BLOCK_LOOP_MAX", 0)
    hkv, d, bs, nb = 1, 16, 16, 12
    kc, vc = _caches(layout, nb, bs, hkv, d, torch.float16, 3)
    kr, vr = kc.clone(), vc.clone()
    blocks = torch.randperm(nb, generator=rng)[:9]
    slots = (blocks.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:-4]  # last partial
    key = torch.randn(slots.numel(), hkv, d, generator=rng).half()
    reshape_and_cache(key, key, kc, vc, slots, layout=layout)
    reshape_and_cache_ref(key, key, kr, vr, slots, None, None, layout)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_golden_write_codes_equal_the_per_element_quantization_reference(rng):
    """The golden cache write quantizes with its own half-to-even rule; its codes
    equal the per-element loop of quantize_per_head_ref, ties and saturation
    included."""
    from ascend_fa.atb_ops.quant import quantize_per_head_ref

    scale = torch.tensor([0.5, 0.25])
    ties = torch.tensor([0.25, 0.75, -0.25, -1.25, 1.25, 63.75, -64.25, 70.0])
    key = torch.cat([ties, torch.randn(24, generator=rng) * 30]).view(1, 2, 16)
    key = key.repeat(3, 1, 1) * torch.tensor([1.0, -1.0, 0.5]).view(3, 1, 1)
    kc, vc = _caches("nd", 1, 32, 2, 16, torch.int8, 0)
    slots = torch.tensor([0, 5, 9], dtype=torch.int32)
    reshape_and_cache_ref(key, key, kc, vc, slots, scale, scale, "nd")
    want = quantize_per_head_ref(key, scale, axis=1)
    assert torch.equal(kc[0, [0, 5, 9]], want)


def _all_16bit(dtype):
    """Every non-NaN value of a 16-bit float dtype (the infinities included)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[~torch.isnan(x)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_quantization_every_16bit_value(dtype):
    """The write path's fused quantizer (magic-number rounding, narrowing cast) gives
    the golden codes (floor-based half-to-even, no torch.round) for every 16-bit
    input, with scales that make ties, saturate, or underflow to inf quotients."""
    from ascend_fa.atb_ops.cache import _quantize_ref, _quantize_rows

    x = _all_16bit(dtype)
    scales = torch.tensor([1.0, 0.5, 0.02, 3.0e-4, 2.0**-23, 1e-38, 7.0, 1.0e6])
    h = scales.numel()
    d = 64
    n = x.numel() // d * d
    rows = x[:n].view(-1, 1, d).expand(-1, h, d).contiguous()
    got = _quantize_rows(rows, scales)
    assert torch.equal(got, _quantize_ref(rows, scales))
    assert torch.equal(got, quantize_per_head(rows, scales, axis=1))


def test_fused_quantization_fp32_ties_and_bounds(rng):
    """fp32 input: exact half-integer quotients round to even, the int8 bounds and
    one past them saturate, +-inf saturate, large finite values saturate."""
    from ascend_fa.atb_ops.cache import _quantize_ref, _quantize_rows

    halves = torch.arange(-130, 130, dtype=torch.float32) + 0.5
    edges = torch.tensor(
        [127.0, 127.49999, 127.5, 128.0, -128.0, -128.5, -128.50002, -129.0, 0.0,
         -0.0, 3.0e38, -3.0e38, float("inf"), float("-inf"), 4194303.5, 2.0**22,
         2.0**23, -(2.0**23) - 1.0, 1e-45]
    )  # fmt: skip
    noise = torch.randn(4000, generator=rng) * 200
    x = torch.cat([halves, edges, noise])
    x = x[: x.numel() // 2 * 2].view(-1, 2, 1).expand(-1, 2, 8).contiguous()
    scale = torch.tensor([1.0, 0.5])
    got = _quantize_rows(x, scale)
    assert torch.equal(got, _quantize_ref(x, scale))
    assert torch.equal(got, quantize_per_head(x, scale, axis=1))


@pytest.mark.parametrize("pattern", ["whole_blocks", "scattered", "padded"])
def test_repeated_slot_found_in_every_slot_pattern(rng, pattern):
    """Duplicate slots are refused whether the call writes whole blocks in order
    (checked on block starts), scattered slots, or slots with padding."""
    from ascend_fa.atb_ops.cache import repeated_slot

    bs, nb = 16, 8
    if pattern == "whole_blocks":
        blocks = torch.tensor([5, 2, 7, 2])  # block 2 handed out twice
        slots = (blocks.view(-1, 1) * bs + torch.arange(bs)).view(-1)
        want = 32
    else:
        slots = torch.randperm(nb * bs, generator=rng)[:40]
        slots[31] = slots[3]
        want = int(slots[3])
        if pattern == "padded":
            slots[[0, 9]] = -1
    assert repeated_slot(slots[slots >= 0], bs) == want
    clean = torch.unique(slots[slots >= 0])
    assert repeated_slot(clean, bs) is None
    key = torch.randn(slots.numel(), 1, 16, generator=rng).half()
    kc, vc = _caches("nz", nb, bs, 1, 16, torch.float16, 3)
    before = kc.clone()
    with pytest.raises(ValueError, match=f"writes slot {want} more than once"):
        reshape_and_cache(key, key, kc, vc, slots.to(torch.int32))
    assert torch.equal(kc, before)
    # whole blocks in order but not aligned to a block start: still sorted per slot
    shifted = (torch.tensor([1, 3]).view(-1, 1) * bs + 3 + torch.arange(bs)).view(-1)
    assert repeated_slot(shifted, bs) is None
    assert repeated_slot(torch.cat([shifted, shifted[:bs]]), bs) == int(shifted[0])


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mla", [False, True])
def test_direct_cpu_write_equals_the_op_and_bumps_versions(rng, mla):
    """The public wrappers run the CPU implementation without the op's Python
    dispatch for plain CPU tensors: same bytes as the op, the caches' version
    counters bumped as the op bumps them (the input's not), and inference tensors
    written without one. A dispatch mode, or an input autograd would record, still
    goes through the op (the mode sees it; the predicate refuses the latter)."""
    t, bs, nb = 40, 32, 3
    slots = torch.randperm(nb * bs, generator=rng)[:t].to(torch.int32)
    if mla:
        x = torch.randn(t, 64, generator=rng).half()
        rope = torch.randn(t, 32, generator=rng).half()
        s = torch.tensor([0.02])

        def caches():
            return (
                torch.zeros(nb, bs, 1, 64, dtype=torch.int8),
                torch.zeros(nb, bs, 1, 32, dtype=torch.float16),
            )

        def public(c, inp=x):
            reshape_and_cache_mla(inp, rope, *c, slots, k_scale=s, layout="nd")

        def op(c):
            torch.ops.ascend_fa.reshape_and_cache_mla(x, rope, *c, slots, s, "nd")

        name = "ascend_fa.reshape_and_cache_mla"
    else:
        x = torch.randn(t, 2, 32, generator=rng).half()
        s = torch.tensor([0.02, 0.03])

        def caches():
            c = torch.zeros(nb, bs, 2, 32, dtype=torch.int8)
            return c, c.clone()

        def public(c, inp=x):
            reshape_and_cache(inp, inp, *c, slots, k_scale=s, v_scale=s, layout="nd")

        def op(c):
            torch.ops.ascend_fa.reshape_and_cache(x, x, *c, slots, s, s, "nd")

        name = "ascend_fa.reshape_and_cache"
    direct, via_op = caches(), caches()
    public(direct)
    op(via_op)
    for a, b in zip(direct, via_op):
        assert torch.equal(a, b)
        assert a._version == b._version == 1
    assert x._version == 0
    with torch.inference_mode():
        frozen = caches()
        public(frozen)
    assert all(torch.equal(a, b) for a, b in zip(frozen, via_op))
    log = _OpLog()
    with log:
        public(caches())
    assert any(name in o for o in log.ops), log.ops
    leaf = x.clone().requires_grad_()
    assert not direct_cpu_write((leaf, None))
    with torch.no_grad():
        assert direct_cpu_write((leaf, None))
    assert not direct_cpu_write((torch.nn.Parameter(x.float()),))
    assert direct_cpu_write((x, None, *caches()))
