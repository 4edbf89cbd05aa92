"""C8 (per-channel int8) and FP8 E4M3 KV caches through the paged ops.

Cache codes are compared bit for bit with the naive per-token references (and
with the eval fake-quant :class:`C8FakeQuant`); attention outputs with the fp64
references within the budget of ``tests/test_paged_attention.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape
from ascend_fa.atb_ops.attention import paged_attention_ref, prefill_attention_ref
from ascend_fa.atb_ops.cache import reshape_and_cache_ref, token_rows_ref

from ascend_fa import paged_attention, prefill_attention, reshape_and_cache
from ascend_fa.calibration.kv import C8FakeQuant, FP8FakeQuant

FP8 = torch.float8_e4m3fn
FLOOR = 1e-3
KINDS = ["c8", "fp8_head", "fp8_tensor", "c8_k_head_v"]


def _scales(kind, key, value, rng):
    """Scales fitted to the data (what calibration produces), shrunk a little so
    some values saturate on purpose."""

    def per_channel(x):
        return (x.float().abs().amax(dim=0) / 127 * 0.8).clamp(min=1e-6)

    def per_head(x, fmax):
        return (x.float().abs().amax(dim=(0, 2)) / fmax * 0.8).clamp(min=1e-6)

    if kind == "c8":
        return per_channel(key), per_channel(value)
    if kind == "c8_k_head_v":  # K per channel, V per head: each side on its own
        return per_channel(key), per_head(value, 127)
    if kind == "fp8_head":
        return per_head(key, 448), per_head(value, 448)
    return per_head(key, 448).amax().reshape(1), per_head(value, 448).amax().reshape(1)


def _cache_dtype(kind):
    return FP8 if kind.startswith("fp8") else torch.int8


def _alloc(kind, layout, nb, bs, hkv, d):
    cd = _cache_dtype(kind)
    shape = nz_cache_shape(nb, bs, hkv, d, cd) if layout == "nz" else (nb, bs, hkv, d)
    return torch.zeros(shape, dtype=cd), torch.zeros(shape, dtype=cd)


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_cache_write_bit_equal_to_naive_loop(rng, kind, dtype, layout):
    t, hkv, d, nb, bs = 150, 2, 64, 8, 32
    chan = 1 + 4 * (torch.rand(hkv, d, generator=rng) > 0.9).float()
    key = (torch.randn(t, hkv, d, generator=rng) * chan).to(dtype)
    value = torch.randn(t, hkv, d, generator=rng).to(dtype)
    ks, vs = _scales(kind, key, value, rng)
    slots = torch.randperm(nb * bs, generator=rng)[:t].to(torch.int32)
    slots[::17] = -1  # padding
    kc, vc = _alloc(kind, layout, nb, bs, hkv, d)
    kr, vr = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, layout=layout)
    reshape_and_cache_ref(key, value, kr, vr, slots, ks, vs, layout)
    assert torch.equal(_bytes(kc), _bytes(kr))
    assert torch.equal(_bytes(vc), _bytes(vr))
    # the block-granular (prefill) write path: whole blocks in order
    kc, vc = _alloc(kind, layout, nb, bs, hkv, d)
    kr, vr = kc.clone(), vc.clone()
    whole = torch.arange(128, dtype=torch.int32) + bs
    args = (key[:128], value[:128])
    reshape_and_cache(*args, kc, vc, whole, k_scale=ks, v_scale=vs, layout=layout)
    reshape_and_cache_ref(*args, kr, vr, whole, ks, vs, layout)
    assert torch.equal(_bytes(kc), _bytes(kr))
    assert torch.equal(_bytes(vc), _bytes(vr))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_c8_codes_equal_the_eval_fake_quant(rng, dtype):
    """The runtime's cache codes are C8FakeQuant's codes bit for bit, and the
    fake-quant output is those codes times the held scale."""
    b, hkv, t, d, bs = 2, 2, 40, 32, 32
    x = (torch.randn(b, hkv, t, d, generator=rng) * 3).to(dtype)
    scale = torch.rand(hkv * d, generator=rng) * 0.03 + 0.005  # [Hkv*D] on disk
    fq = C8FakeQuant("fa_k", scale, hkv, d, dtype)
    want = fq.codes(x)  # [B, Hkv, T, D]
    held = fq.held_scale(dtype)
    assert torch.equal(fq(x), (want.float() * held).to(dtype))
    # the runtime: the artifact's [Hkv*D] scale as [Hkv, D], tokens [B*T, Hkv, D]
    k = x.permute(0, 2, 1, 3).reshape(b * t, hkv, d)
    kc, vc = _alloc("c8", "nz", 4, bs, hkv, d)
    slots = torch.arange(b * t, dtype=torch.int32)
    s2 = scale.view(hkv, d)
    reshape_and_cache(k, k, kc, vc, slots, k_scale=s2, v_scale=s2)
    got = torch.stack([token_rows_ref(kc, i, "nz") for i in range(b * t)])
    assert torch.equal(got, want.permute(0, 2, 1, 3).reshape(b * t, hkv * d))


def test_c8_rounding_follows_the_reciprocal_multiply():
    """A bf16 value whose reciprocal product rounds across a tie gets vllm-ascend's
    code, not the fp32 quotient's (the rule the two would disagree on)."""
    scale = torch.tensor([[0.1]])
    held = scale.view(1).to(torch.bfloat16)
    inv = 1.0 / held
    xs = (torch.arange(1, 20000, dtype=torch.float32) * 0.001).to(torch.bfloat16)
    prod = (xs * inv).float()  # bf16 product
    quot = xs.float() / held.float()
    differ = torch.round(prod).clamp(-128, 127) != torch.round(quot).clamp(-128, 127)
    x = xs[differ][:8].view(-1, 1, 1)
    assert x.numel() > 0
    kc, vc = _alloc("c8", "nd", 1, 32, 1, 1)
    slots = torch.arange(x.shape[0], dtype=torch.int32)
    reshape_and_cache(x, x, kc, vc, slots, k_scale=scale, v_scale=scale, layout="nd")
    want = torch.round((x.view(-1) * inv.view(1)).float()).clamp(-128, 127)
    assert torch.equal(kc.view(-1)[: x.shape[0]].float(), want)


def test_fp8_codes_equal_the_eval_fake_quant(rng):
    b, hkv, t, d = 1, 4, 33, 32
    x = torch.randn(b, hkv, t, d, generator=rng).bfloat16() * 50
    scale = torch.tensor([0.05, 0.1, 0.02, 0.3])  # some values saturate at 448
    fq = FP8FakeQuant("fa_v", scale, hkv)
    k = x.permute(0, 2, 1, 3).reshape(t, hkv, d)
    kc, vc = _alloc("fp8_head", "nz", 2, 32, hkv, d)
    slots = torch.arange(t, dtype=torch.int32)
    reshape_and_cache(k, k, kc, vc, slots, k_scale=scale, v_scale=scale)
    codes = torch.stack([token_rows_ref(vc, i, "nz") for i in range(t)])
    deq = (codes.float().view(t, hkv, d) * scale.view(1, hkv, 1)).bfloat16()
    assert torch.equal(deq, fq(x).permute(0, 2, 1, 3).reshape(t, hkv, d))
    assert float(codes.float().abs().max()) == 448.0  # saturated, never NaN


def _env(rng, kind, dtype, layout, lens, h=8, hkv=2, d=32, bs=32):
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + 1
    order = torch.randperm(nb, generator=rng).tolist()
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per_seq[b]]
        pos += per_seq[b]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    chan = 1 + 3 * (torch.rand(hkv, d, generator=rng) > 0.9).float()
    key = (torch.randn(sum(lens), hkv, d, generator=rng) * chan).to(dtype)
    value = torch.randn(sum(lens), hkv, d, generator=rng).to(dtype)
    ks, vs = _scales(kind, key, value, rng)
    kc, vc = _alloc(kind, layout, nb, bs, hkv, d)
    reshape_and_cache(key, value, kc, vc, torch.tensor(slots, dtype=torch.int32),
                      k_scale=ks, v_scale=vs, layout=layout)  # fmt: skip
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (kc, vc, table, seq_lens), dict(
        num_kv_heads=hkv, scale=1 / math.sqrt(d), k_scale=ks, v_scale=vs, layout=layout
    )


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_and_prefill_within_budget(rng, kind, dtype, layout):
    """Error vs the fp64 reference (which dequantizes the cache) at most twice
    the error of the same computation in the activation dtype, plus a floor."""
    cache, kw = _env(rng, kind, dtype, layout, [1, 37, 70])
    q = torch.randn(3, 8, 32, generator=rng).to(dtype)
    out = paged_attention(q, *cache, **kw)
    ref = paged_attention_ref(q, *cache, **kw)
    plain = paged_attention_ref(q, *cache, **kw, compute_dtype=dtype)
    budget = 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert float((out.double() - ref).abs().max()) <= budget
    qp = torch.randn(3, 5, 8, 32, generator=rng).to(dtype)
    ql = torch.tensor([1, 5, 3], dtype=torch.int32)
    out = prefill_attention(qp, *cache, query_lens=ql, **kw)
    ref = prefill_attention_ref(qp, *cache, query_lens=ql, **kw)
    plain = prefill_attention_ref(qp, *cache, query_lens=ql, **kw, compute_dtype=dtype)
    budget = 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert float((out.double() - ref).abs().max()) <= budget
    # each sequence's last prefill row is the decode of the same (newest) token
    last = ql.long() - 1
    rows = torch.arange(3)
    dec = paged_attention(qp[rows, last].contiguous(), *cache, **kw)
    assert float((dec.double() - out[rows, last].double()).abs().max()) <= budget


def test_per_channel_scales_are_really_per_channel(rng):
    """Doubling one channel's K scale (and halving its codes' meaning) changes the
    output exactly as dequantizing that channel with the new scale would."""
    cache, kw = _env(rng, "c8", torch.float32, "nz", [40])
    q = torch.randn(1, 8, 32, generator=rng)
    ks = kw["k_scale"].clone()
    ks[1, 5] *= 2
    kw2 = dict(kw, k_scale=ks)
    out = paged_attention(q, *cache, **kw2)
    ref = paged_attention_ref(q, *cache, **kw2)
    assert float((out.double() - ref).abs().max()) < 1e-5
    assert float((out - paged_attention(q, *cache, **kw)).abs().max()) > 1e-4


def _partial_opcheck(utils):
    def run(op, args):
        torch.library.opcheck(op, args, test_utils=utils)

    return run


def test_opcheck_with_per_channel_and_fp8_scales(rng):
    for kind in ("c8", "fp8_tensor"):
        # opcheck's schema test compares tensors with arithmetic that CPU torch does
        # not implement for float8 ("mul_cpu_reduced_float"); the other checks run
        utils = ("test_autograd_registration", "test_faketensor")
        if kind == "c8":
            utils = (*utils, "test_schema")
        opcheck = _partial_opcheck(utils)
        cache, kw = _env(rng, kind, torch.bfloat16, "nz", [3, 33])
        q = torch.randn(2, 8, 32, generator=rng).bfloat16()
        ks, vs = kw["k_scale"], kw["v_scale"]
        opcheck(
            torch.ops.ascend_fa.paged_attention.default,
            (q, *cache, 2, 0.2, ks, vs, None, "nz"),
        )
        qp = torch.randn(2, 3, 8, 32, generator=rng).bfloat16()
        opcheck(
            torch.ops.ascend_fa.prefill_attention.default,
            (qp, *cache, None, 2, 0.2, ks, vs, None, "nz"),
        )
        key = torch.randn(5, 2, 32, generator=rng).bfloat16()
        kc, vc = cache[0].clone(), cache[1].clone()
        opcheck(
            torch.ops.ascend_fa.reshape_and_cache.default,
            (key, key, kc, vc, torch.arange(5, dtype=torch.int32), ks, vs, "nz"),
        )


BAD = [
    ("c8", "k_scale", torch.ones(2, 33), r"k_scale must have shape \[2\] or \[2, 32\]"),
    ("c8", "k_scale", torch.ones(32, 2), r"\[Hkv, D\] per channel.*got \(32, 2\)"),
    ("c8", "v_scale", torch.ones(2, 32, dtype=torch.float16), "must be float32"),
    ("c8", "v_scale", torch.full((2, 32), -1.0), "finite and > 0"),
    ("fp8_head", "k_scale", torch.ones(2, 32), r"shape \[1\] or \[2\] \(FP8"),
    ("fp8_head", "v_scale", torch.ones(3), r"shape \[1\] or \[2\] \(FP8"),
    ("fp8_head", "v_scale", torch.tensor([1.0, float("nan")]), "finite and > 0"),
]


@pytest.mark.parametrize("kind,name,bad,match", BAD)
def test_bad_scales_refused_before_anything_is_written(rng, kind, name, bad, match):
    cache, kw = _env(rng, kind, torch.bfloat16, "nz", [40])
    kc, vc = cache[0], cache[1]
    before = (kc.clone(), vc.clone())
    key = torch.randn(3, 2, 32, generator=rng).bfloat16()
    scales = {"k_scale": kw["k_scale"], "v_scale": kw["v_scale"], name: bad}
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(key, key, kc, vc, torch.arange(3, dtype=torch.int32),
                          **scales)  # fmt: skip
    assert torch.equal(_bytes(kc), _bytes(before[0]))
    assert torch.equal(_bytes(vc), _bytes(before[1]))
    q = torch.randn(1, 8, 32, generator=rng).bfloat16()
    with pytest.raises(ValueError, match=match):
        paged_attention(q, *cache, **dict(kw, **scales))


def test_bad_combinations(rng):
    cache, kw = _env(rng, "c8", torch.bfloat16, "nz", [40])
    q = torch.randn(1, 8, 32, generator=rng).bfloat16()
    with pytest.raises(ValueError, match="q_scale .FAQuant. takes per-head"):
        paged_attention(q, *cache, **kw, q_scale=torch.ones(8))
    fcache, fkw = _env(rng, "fp8_head", torch.bfloat16, "nz", [40])
    with pytest.raises(ValueError, match="FP8 KV cache is read with a float query"):
        paged_attention(q, *fcache, **fkw, q_scale=torch.ones(8))
    with pytest.raises(ValueError, match="float8_e4m3fn caches need k_scale"):
        paged_attention(q, *fcache, **dict(fkw, k_scale=None, v_scale=None))
    key = torch.randn(3, 2, 32, generator=rng).bfloat16()
    slots = torch.arange(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="differs from key dtype"):
        reshape_and_cache(key, key, fcache[0], fcache[1], slots)
    f16 = torch.zeros(
        nz_cache_shape(2, 32, 2, 32, torch.bfloat16), dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="must be int8 or float8_e4m3fn"):
        reshape_and_cache(key, key, f16, f16.clone(), slots,
                          k_scale=torch.ones(2), v_scale=torch.ones(2))  # fmt: skip


def test_mla_refuses_fp8_caches(rng):
    from ascend_fa import mla_paged_attention

    lat = torch.zeros(2, 1, 32, 32, dtype=FP8)
    rope = torch.zeros(2, 1, 32, 16, dtype=torch.bfloat16)
    qn = torch.randn(1, 4, 32, generator=rng).bfloat16()
    qr = torch.randn(1, 4, 16, generator=rng).bfloat16()
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="MLA caches are float or int8"):
        mla_paged_attention(qn, qr, lat, rope, table, lens, scale=0.1)
