"""GQA paged attention (decode and prefill) against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape, per_head_qparams
from ascend_fa.atb_ops.attention import paged_attention_ref, prefill_attention_ref

from ascend_fa import paged_attention, prefill_attention, reshape_and_cache

FLOOR = 1e-3


def _amax_scale(x, axis):
    """Per-head scale from the data itself (what calibration would produce)."""
    dims = [i for i in range(x.dim()) if i != axis]
    amax = x.float().abs().amax(dim=dims)
    return per_head_qparams(-amax, amax)[0]


def build(rng, *, mode, dtype, layout, lens, h=8, hkv=2, d=32, bs=32, spare=2):
    """Write K/V of ``len(lens)`` sequences into freshly allocated paged caches (blocks
    handed out in shuffled order) and return everything a call needs."""
    b_sz = len(lens)
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + spare
    order = torch.randperm(nb, generator=rng).tolist()
    table = torch.zeros(b_sz, max(per_seq), dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per_seq[b]]
        pos += per_seq[b]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    t_all = sum(lens)
    # realistic activations: unit-variance heads with a few larger channels
    chan = 1 + 3 * (torch.rand(hkv, d, generator=rng) > 0.9).float()
    key = (torch.randn(t_all, hkv, d, generator=rng) * chan).to(dtype)
    value = torch.randn(t_all, hkv, d, generator=rng).to(dtype)
    quant = mode != "float"
    cache_dtype = torch.int8 if quant else dtype
    shape = (
        nz_cache_shape(nb, bs, hkv, d, cache_dtype)
        if layout == "nz"
        else (nb, bs, hkv, d)
    )
    kc = torch.zeros(shape, dtype=cache_dtype)
    vc = torch.zeros(shape, dtype=cache_dtype)
    ks = _amax_scale(key, 1) if quant else None
    vs = _amax_scale(value, 1) if quant else None
    reshape_and_cache(
        key,
        value,
        kc,
        vc,
        torch.tensor(slots, dtype=torch.int32),
        k_scale=ks,
        v_scale=vs,
        layout=layout,
    )
    return dict(
        kc=kc,
        vc=vc,
        table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        ks=ks,
        vs=vs,
        key=key,
        value=value,
        h=h,
        hkv=hkv,
        d=d,
        bs=bs,
    )


def dense_attention(query, env, query_lens=None):
    """Unquantized attention from the float K/V (fp64), ``query`` ``[B, S, H, D]``."""
    b_sz, s_len, h, d = query.shape
    g = h // env["hkv"]
    out = torch.zeros(b_sz, s_len, h, d, dtype=torch.float64)
    start = 0
    for b, n in enumerate(env["seq_lens"].tolist()):
        k = env["key"][start : start + n].double().repeat_interleave(g, dim=1)
        v = env["value"][start : start + n].double().repeat_interleave(g, dim=1)
        start += n
        nq = s_len if query_lens is None else int(query_lens[b])
        for i in range(nq):
            p = n - nq + i
            s = torch.einsum("hd,lhd->hl", query[b, i].double(), k[: p + 1])
            out[b, i] = torch.einsum(
                "hl,lhd->hd", torch.softmax(s / math.sqrt(d), -1), v[: p + 1]
            )
    return out


def _cos(a, b):
    return float(
        torch.nn.functional.cosine_similarity(
            a.double().flatten(), b.double().flatten(), dim=0
        )
    )


MODES = ["float", "int8_kv", "faquant"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_decode_error_budget_and_cosine(rng, mode, dtype, layout):
    env = build(rng, mode=mode, dtype=dtype, layout=layout, lens=[1, 37, 70])
    h, d = env["h"], env["d"]
    query = torch.randn(3, h, d, generator=rng).to(dtype)
    qs = _amax_scale(query, 1) if mode == "faquant" else None
    kw = dict(
        num_kv_heads=env["hkv"],
        scale=1 / math.sqrt(d),
        k_scale=env["ks"],
        v_scale=env["vs"],
        q_scale=qs,
        layout=layout,
    )
    args = (query, env["kc"], env["vc"], env["table"], env["seq_lens"])
    out = paged_attention(*args, **kw)
    assert out.dtype == dtype and out.shape == query.shape
    ref = paged_attention_ref(*args, **kw)
    plain = paged_attention_ref(*args, **kw, compute_dtype=dtype)
    err = float((out.double() - ref).abs().max())
    budget = 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert err <= budget, (err, budget)
    # against unquantized fp32 attention on the original activations
    dense = dense_attention(query.unsqueeze(1), env).squeeze(1)
    assert _cos(out, dense) >= 0.999


@pytest.mark.parametrize("mode", MODES)
def test_prefill_causal_matches_reference_and_decode(rng, mode):
    dtype = torch.bfloat16
    env = build(rng, mode=mode, dtype=dtype, layout="nz", lens=[9, 40], h=4, hkv=1)
    h, d = env["h"], env["d"]
    query = torch.randn(2, 6, h, d, generator=rng).to(dtype)
    qlens = torch.tensor([6, 4], dtype=torch.int32)
    qs = _amax_scale(query, 2) if mode == "faquant" else None
    kw = dict(
        num_kv_heads=env["hkv"],
        scale=1 / math.sqrt(d),
        k_scale=env["ks"],
        v_scale=env["vs"],
        q_scale=qs,
        layout="nz",
    )
    args = (query, env["kc"], env["vc"], env["table"], env["seq_lens"])
    out = prefill_attention(*args, **kw, query_lens=qlens)
    ref = prefill_attention_ref(*args, **kw, query_lens=qlens)
    plain = prefill_attention_ref(*args, **kw, query_lens=qlens, compute_dtype=dtype)
    err = float((out.double() - ref).abs().max())
    assert err <= 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert bool((out[1, 4:] == 0).all())  # padded query rows
    assert _cos(out, dense_attention(query, env, qlens)) >= 0.999
    # the last query row of each sequence is exactly a decode step
    last = torch.stack([query[0, 5], query[1, 3]])
    dec = paged_attention(last, *args[1:], **kw)
    assert torch.allclose(
        dec.float(), torch.stack([out[0, 5], out[1, 3]]).float(), atol=1e-2, rtol=0
    )


def test_causality_future_tokens_do_not_matter(rng):
    env = build(rng, mode="int8_kv", dtype=torch.float32, layout="nz", lens=[64])
    query = torch.randn(1, 3, env["h"], env["d"], generator=rng)
    kw = dict(num_kv_heads=env["hkv"], scale=0.2, k_scale=env["ks"], v_scale=env["vs"])
    table = env["table"]
    full = prefill_attention(query, env["kc"], env["vc"], table, env["seq_lens"], **kw)
    # the same three rows as the last tokens of a 50-token prefix
    short = prefill_attention(
        query, env["kc"], env["vc"], table, torch.tensor([50], dtype=torch.int32), **kw
    )
    assert not torch.allclose(full, short)
    env["kc"].view(-1)[:] = env["kc"].view(-1).flip(0)  # scramble; rerun is different
    again = prefill_attention(query, env["kc"], env["vc"], table, env["seq_lens"], **kw)
    assert not torch.allclose(full, again)


def test_faquant_scores_are_int8_dot_products(rng):
    """FAQuant: scores = (q_codes . k_codes) * q_scale[h] * k_scale[h // g] * scale."""
    env = build(
        rng,
        mode="faquant",
        dtype=torch.float32,
        layout="nd",
        lens=[5],
        h=2,
        hkv=1,
        d=16,
        bs=32,
    )
    query = torch.randn(1, 2, 16, generator=rng)
    qs = torch.tensor([0.02, 0.05])
    out = paged_attention(
        query,
        env["kc"],
        env["vc"],
        env["table"],
        env["seq_lens"],
        num_kv_heads=1,
        scale=0.25,
        k_scale=env["ks"],
        v_scale=env["vs"],
        q_scale=qs,
        layout="nd",
    )
    kcodes = env["kc"][env["table"][0, 0], :5, 0].double()
    vcodes = env["vc"][env["table"][0, 0], :5, 0].double()
    for hh in range(2):
        qc = torch.clamp(torch.round(query[0, hh] / qs[hh]), -128, 127).double()
        s = (kcodes @ qc) * float(qs[hh]) * float(env["ks"][0]) * 0.25
        want = torch.softmax(s, 0) @ vcodes * float(env["vs"][0])
        assert torch.allclose(out[0, hh].double(), want, atol=1e-5, rtol=1e-5)


def test_opcheck_attention_ops(rng):
    env = build(rng, mode="faquant", dtype=torch.bfloat16, layout="nz", lens=[3, 33])
    h, d = env["h"], env["d"]
    q = torch.randn(2, h, d, generator=rng).bfloat16()
    qs = _amax_scale(q, 1)
    common = (env["kc"], env["vc"], env["table"], env["seq_lens"])
    torch.library.opcheck(
        torch.ops.ascend_fa.paged_attention.default,
        (q, *common, env["hkv"], 0.2, env["ks"], env["vs"], qs, "nz"),
    )
    qp = torch.randn(2, 3, h, d, generator=rng).bfloat16()
    torch.library.opcheck(
        torch.ops.ascend_fa.prefill_attention.default,
        (
            qp,
            *common,
            torch.tensor([3, 2], dtype=torch.int32),
            env["hkv"],
            0.2,
            env["ks"],
            env["vs"],
            None,
            "nz",
        ),
    )
    fenv = build(rng, mode="float", dtype=torch.float16, layout="nd", lens=[4])
    torch.library.opcheck(
        torch.ops.ascend_fa.paged_attention.default,
        (
            torch.randn(1, h, d, generator=rng).half(),
            fenv["kc"],
            fenv["vc"],
            fenv["table"],
            fenv["seq_lens"],
            fenv["hkv"],
            0.2,
            None,
            None,
            None,
            "nd",
        ),
    )


def test_decode_groups_and_prefill_row_chunks_do_not_change_results(rng, monkeypatch):
    """Decode batches sequences into groups and prefill splits query rows into
    chunks to bound memory; forcing the smallest groups/chunks must not change the
    result (fp32 query, so only summation order could differ). The eager decode
    (the native kernel, where it runs, has no groups)."""
    from ascend_fa.atb_ops import attention as att
    from ascend_fa.atb_ops.native import NATIVE_ENV

    monkeypatch.setenv(NATIVE_ENV, "0")

    env = build(rng, mode="int8_kv", dtype=torch.float32, layout="nz", lens=[3, 70, 41])
    kw = dict(num_kv_heads=env["hkv"], scale=0.2, k_scale=env["ks"], v_scale=env["vs"])
    common = (env["kc"], env["vc"], env["table"], env["seq_lens"])
    qd = torch.randn(3, env["h"], env["d"], generator=rng)
    qp = torch.randn(3, 3, env["h"], env["d"], generator=rng)
    dec, pre = paged_attention(qd, *common, **kw), prefill_attention(qp, *common, **kw)
    monkeypatch.setattr(att, "_DECODE_GROUP_BYTES", 1)
    monkeypatch.setattr(att, "_SCORE_CHUNK", 1)
    assert torch.allclose(paged_attention(qd, *common, **kw), dec, atol=1e-6, rtol=0)
    assert torch.allclose(prefill_attention(qp, *common, **kw), pre, atol=1e-6, rtol=0)


def test_cpu_workspace_is_reused_and_releasable(rng):
    from ascend_fa.atb_ops import attention as att
    from ascend_fa.atb_ops.native import native_disabled

    from ascend_fa.attention import release_workspace

    # the eager decode's buffers (the native kernel, where it runs, keeps none)
    with native_disabled():
        _workspace_reused(rng, att, release_workspace)


def _workspace_reused(rng, att, release_workspace):
    env = build(rng, mode="int8_kv", dtype=torch.bfloat16, layout="nz", lens=[40, 9])
    q = torch.randn(2, env["h"], env["d"], generator=rng).bfloat16()
    kw = dict(num_kv_heads=env["hkv"], scale=0.2, k_scale=env["ks"], v_scale=env["vs"])
    args = (q, env["kc"], env["vc"], env["table"], env["seq_lens"])
    release_workspace()
    first = paged_attention(*args, **kw)
    bufs = att._workspace(q.device)
    ptrs = {k: v.data_ptr() for k, v in bufs.items()}
    assert {"kraw", "kf32", "vraw", "vf32"} <= set(ptrs)
    second = paged_attention(*args, **kw)
    assert {k: v.data_ptr() for k, v in att._workspace(q.device).items()} == ptrs
    assert torch.equal(first, second)  # reused buffers never leak into results
    release_workspace()
    assert att._workspace(q.device) == {}


def test_decode_full_blocks_without_padding(rng):
    """Sequences that end exactly on a block boundary skip the padding mask."""
    env = build(rng, mode="int8_kv", dtype=torch.float32, layout="nz", lens=[64, 64])
    q = torch.randn(2, env["h"], env["d"], generator=rng)
    kw = dict(num_kv_heads=env["hkv"], scale=0.2, k_scale=env["ks"], v_scale=env["vs"])
    args = (q, env["kc"], env["vc"], env["table"], env["seq_lens"])
    out = paged_attention(*args, **kw)
    ref = paged_attention_ref(*args, **kw)
    assert float((out.double() - ref).abs().max()) <= FLOOR


class _Dispatched(torch.overrides.TorchFunctionMode):
    """Changes nothing, but with it active every call goes through ``torch.ops``
    (no direct CPU call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("scales", ["faquant", "c8"])
@pytest.mark.parametrize("lens", [[45], [70, 90], [1, 37, 70]])
def test_decode_fast_path(rng, scales, lens, native, monkeypatch):
    """The decode path of a serving step: the op's CPU implementation called
    directly, ``check=False`` (a step's later layers), one gather group whose
    result is returned as is, the block table's columns taken as they are when
    every sequence uses the same number of blocks ([45]: one sequence, a table
    wider than it needs; [70, 90]: both three blocks) and rewritten otherwise.
    The same bits as the op through ``torch.ops``, within the error budget of the
    float64 reference; per-channel (C8) K / V scales with a float query too; on
    the native kernel and on the eager path."""
    from ascend_fa.atb_ops.native import NATIVE_ENV

    if not native:
        monkeypatch.setenv(NATIVE_ENV, "0")
    env = build(rng, mode="faquant", dtype=torch.bfloat16, layout="nd", lens=lens)
    h, d, hkv = env["h"], env["d"], env["hkv"]
    wide = torch.cat([env["table"], env["table"][:, :1]], dim=1)  # unused column
    query = torch.randn(len(lens), h, d, generator=rng).bfloat16()
    if scales == "faquant":
        sc = dict(k_scale=env["ks"], v_scale=env["vs"], q_scale=_amax_scale(query, 1))
    else:
        k_s, v_s = (env[n + "s"].view(hkv, 1).expand(hkv, d).contiguous() for n in "kv")
        sc = dict(k_scale=k_s, v_scale=v_s)
    kw = dict(num_kv_heads=hkv, scale=1 / math.sqrt(d), layout="nd", **sc)
    args = (query, env["kc"], env["vc"], wide, env["seq_lens"])
    out = paged_attention(*args, **kw)
    assert torch.equal(paged_attention(*args, **kw, check=False), out)
    with _Dispatched():
        assert torch.equal(paged_attention(*args, **kw), out)
    ref = paged_attention_ref(*args, **kw)
    plain = paged_attention_ref(*args, **kw, compute_dtype=torch.bfloat16)
    err = float((out.double() - ref).abs().max())
    assert err <= 2 * float((plain.double() - ref).abs().max()) + FLOOR, err
    bad = wide.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(query, env["kc"], env["vc"], bad, env["seq_lens"], **kw)
