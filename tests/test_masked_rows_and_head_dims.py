"""Masked means masked, and every head dim the layout can express works.

Caches start full of NaN (never-written slots) with a stale block of +inf that no
sequence owns; the tails of the last blocks stay NaN. Attention over the written
context must be finite and within the usual budget of a float64 reference, for
decode and prefill, float / int8-KV / FAQuant GQA and MLA, ND and NZ, and head dims
8, 16, 48, 64, 128 and the odd 72 / 40. A head dim the NZ layout cannot express
(``Hkv*D`` not a multiple of ``C0``) is refused before anything is written.
"""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import c0, nz_cache_shape, per_head_qparams
from ascend_fa.atb_ops.attention import (
    mla_paged_attention_ref,
    mla_prefill_attention_ref,
    paged_attention_ref,
    prefill_attention_ref,
)

from ascend_fa import (
    mla_paged_attention,
    mla_prefill_attention,
    paged_attention,
    prefill_attention,
    reshape_and_cache,
    reshape_and_cache_mla,
)

FLOOR = 1e-3
HEAD_DIMS = [8, 16, 48, 64, 128, 72, 40]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


def _scale(x: torch.Tensor, axis: int) -> torch.Tensor:
    dims = [i for i in range(x.dim()) if i != axis]
    amax = x.float().abs().amax(dim=dims)
    return per_head_qparams(-amax, amax)[0]


def _kv_heads(d: int, cache_dtype: torch.dtype) -> int:
    """The fewest KV heads whose ``Hkv*D`` fills whole NZ fractal columns."""
    return next(h for h in range(1, 33) if (h * d) % c0(cache_dtype) == 0)


def _paging(rng, lens, bs):
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 2  # one spare, one stale block nobody owns
    order = torch.randperm(nb, generator=rng).tolist()
    table = torch.zeros(len(lens), max(per) + 1, dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per[b]]
        pos += per[b]
        table[b, : per[b]] = torch.tensor(blocks, dtype=torch.int32)
        # an unused table entry pointing at the stale block
        table[b, per[b]] = order[-1]
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    return table, torch.tensor(slots, dtype=torch.int32), nb, order[-1]


def _poisoned(shape, dtype, stale: int):
    """A cache whose never-written slots hold NaN and whose stale block holds inf
    (int8 caches cannot hold either; they start at the extreme code instead)."""
    if dtype == torch.int8:
        cache = torch.full(shape, -128, dtype=dtype)
        cache[stale] = 127
        return cache
    cache = torch.full(shape, float("nan"), dtype=dtype)
    cache[stale] = float("inf")
    return cache


def _check_budget(out, ref_fn, args, kw, dtype):
    ref = ref_fn(*args, **kw)
    plain = ref_fn(*args, **kw, compute_dtype=dtype)
    assert torch.isfinite(out).all()
    err = float((out.double() - ref).abs().max())
    budget = 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert err <= budget, (err, budget)


def _gqa_env(rng, *, d, cache_dtype, layout, mode, lens=(5, 37), bs=32):
    act = torch.bfloat16 if cache_dtype == torch.int8 else cache_dtype
    hkv = _kv_heads(d, cache_dtype)
    table, slots, nb, stale = _paging(rng, list(lens), bs)
    shape = (
        nz_cache_shape(nb, bs, hkv, d, cache_dtype)
        if layout == "nz"
        else (nb, bs, hkv, d)
    )
    kc = _poisoned(shape, cache_dtype, stale)
    vc = _poisoned(shape, cache_dtype, stale)
    key = torch.randn(slots.numel(), hkv, d, generator=rng).to(act)
    value = torch.randn(slots.numel(), hkv, d, generator=rng).to(act)
    quant = cache_dtype == torch.int8
    ks, vs = (_scale(key, 1), _scale(value, 1)) if quant else (None, None)
    reshape_and_cache(key, value, kc, vc, slots, k_scale=ks, v_scale=vs, layout=layout)
    return dict(
        act=act, hkv=hkv, h=2 * hkv, kc=kc, vc=vc, table=table, ks=ks, vs=vs,
        seq_lens=torch.tensor(lens, dtype=torch.int32), mode=mode, layout=layout,
    )  # fmt: skip


CASES = [
    (d, dt, layout, mode)
    for d in HEAD_DIMS
    for dt in DTYPES
    for layout in ("nz", "nd")
    for mode in (("int8_kv", "faquant") if dt == torch.int8 else ("float",))
]


@pytest.mark.parametrize("d,cache_dtype,layout,mode", CASES)
def test_decode_and_prefill_ignore_poisoned_rows(rng, d, cache_dtype, layout, mode):
    env = _gqa_env(rng, d=d, cache_dtype=cache_dtype, layout=layout, mode=mode)
    act, h = env["act"], env["h"]
    q_dec = torch.randn(2, h, d, generator=rng).to(act)
    q_pre = torch.randn(2, 3, h, d, generator=rng).to(act)
    for prefill, query in ((False, q_dec), (True, q_pre)):
        kw = dict(
            num_kv_heads=env["hkv"],
            scale=1 / math.sqrt(d),
            k_scale=env["ks"],
            v_scale=env["vs"],
            q_scale=_scale(query, query.dim() - 2) if mode == "faquant" else None,
            layout=layout,
        )
        args = (query, env["kc"], env["vc"], env["table"], env["seq_lens"])
        fn = prefill_attention if prefill else paged_attention
        ref_fn = prefill_attention_ref if prefill else paged_attention_ref
        out = fn(*args, **kw)
        assert out.shape == query.shape and out.dtype == act
        _check_budget(out, ref_fn, args, kw, act)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("r,dr", [(64, 32), (512, 64)])
def test_mla_ignores_poisoned_rows(rng, quantized, layout, r, dr):
    bs, lens, h = 32, [7, 45], 4
    table, slots, nb, stale = _paging(rng, lens, bs)
    ldt = torch.int8 if quantized else torch.bfloat16
    if layout == "nz":
        lshape = nz_cache_shape(nb, bs, 1, r, ldt)
        rshape = nz_cache_shape(nb, bs, 1, dr, torch.bfloat16)
    else:
        lshape, rshape = (nb, bs, 1, r), (nb, bs, 1, dr)
    lc, rc = _poisoned(lshape, ldt, stale), _poisoned(rshape, torch.bfloat16, stale)
    latent = torch.randn(slots.numel(), r, generator=rng).bfloat16()
    rope = torch.randn(slots.numel(), dr, generator=rng).bfloat16()
    ks = _scale(latent.unsqueeze(1), 1) if quantized else None
    reshape_and_cache_mla(latent, rope, lc, rc, slots, k_scale=ks, layout=layout)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(scale=1 / math.sqrt(r + dr), k_scale=ks, layout=layout)
    qn = torch.randn(2, h, r, generator=rng).bfloat16()
    qr = torch.randn(2, h, dr, generator=rng).bfloat16()
    args = (qn, qr, lc, rc, table, seq_lens)
    out = mla_paged_attention(*args, **kw)
    _check_budget(out, mla_paged_attention_ref, args, kw, torch.bfloat16)
    pargs = (qn.unsqueeze(1).repeat(1, 2, 1, 1), qr.unsqueeze(1).repeat(1, 2, 1, 1))
    pargs = (*pargs, lc, rc, table, seq_lens)
    out = mla_prefill_attention(*pargs, **kw)
    _check_budget(out, mla_prefill_attention_ref, pargs, kw, torch.bfloat16)


@pytest.mark.parametrize(
    "d,hkv,dtype", [(8, 1, torch.int8), (16, 1, torch.int8), (8, 1, torch.float16)]
)
def test_inexpressible_nz_head_dim_refused_before_any_write(d, hkv, dtype):
    cols = c0(dtype)
    with pytest.raises(ValueError, match=rf"multiple of C0 = {cols}"):
        nz_cache_shape(4, 32, hkv, d, dtype)
    # a hand-made cache one fractal wide: the write names the NZ rule, writes nothing
    cache = torch.zeros(4, 1, 32, cols, dtype=dtype)
    before = cache.clone()
    key = torch.randn(3, hkv, d).half()
    kw = {}
    if dtype == torch.int8:
        kw = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
    with pytest.raises(ValueError, match=rf"Hkv\*D = {hkv * d} .*multiple of C0"):
        reshape_and_cache(
            key, key, cache, cache.clone(), torch.arange(3, dtype=torch.int32), **kw
        )
    assert torch.equal(cache, before)
