"""MLA (absorbed, FAKQuant) paged attention against float64 references."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape, per_head_qparams
from ascend_fa.atb_ops.attention import (
    dynamic_query_scale,
    mla_paged_attention_ref,
    mla_prefill_attention_ref,
)

from ascend_fa import mla_paged_attention, mla_prefill_attention, reshape_and_cache_mla

FLOOR = 1e-3
R, DR = 128, 32  # small stand-ins for 512 / 64 (the emulation takes any width)


def build(rng, *, quantized, lens, bs=32, dtype=torch.bfloat16, layout="nz"):
    b_sz = len(lens)
    per_seq = [-(-n // bs) for n in lens]
    nb = sum(per_seq) + 1
    order = torch.randperm(nb, generator=rng).tolist()
    table = torch.zeros(b_sz, max(per_seq), dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per_seq[b]]
        pos += per_seq[b]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    t_all = sum(lens)
    latent = torch.randn(t_all, R, generator=rng).to(dtype)
    rope = torch.randn(t_all, DR, generator=rng).to(dtype)
    ldt = torch.int8 if quantized else dtype
    if layout == "nz":
        lc = torch.zeros(nz_cache_shape(nb, bs, 1, R, ldt), dtype=ldt)
        rc = torch.zeros(nz_cache_shape(nb, bs, 1, DR, dtype), dtype=dtype)
    else:
        lc = torch.zeros(nb, bs, 1, R, dtype=ldt)
        rc = torch.zeros(nb, bs, 1, DR, dtype=dtype)
    ks = None
    if quantized:
        amax = latent.float().abs().amax().view(1)
        ks = per_head_qparams(-amax, amax)[0]
    reshape_and_cache_mla(
        latent,
        rope,
        lc,
        rc,
        torch.tensor(slots, dtype=torch.int32),
        k_scale=ks,
        layout=layout,
    )
    return dict(
        lc=lc,
        rc=rc,
        table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        ks=ks,
        latent=latent,
        rope=rope,
    )


def dense_mla(q_nope, q_rope, env, scale):
    """Unquantized MLA from the float latent/rope (fp64), ``[B, S, H, R]`` queries."""
    b_sz, s_len = q_nope.shape[:2]
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    start = 0
    for b, n in enumerate(env["seq_lens"].tolist()):
        lat = env["latent"][start : start + n].double()
        rope = env["rope"][start : start + n].double()
        start += n
        for i in range(s_len):
            p = n - s_len + i + 1
            s = q_nope[b, i].double() @ lat[:p].T + q_rope[b, i].double() @ rope[:p].T
            out[b, i] = torch.softmax(s * scale, -1) @ lat[:p]
    return out


def _cos(a, b):
    return float(
        torch.nn.functional.cosine_similarity(
            a.double().flatten(), b.double().flatten(), dim=0
        )
    )


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("q_mode", ["dynamic", "static", "float"])
def test_mla_decode_budget_and_cosine(rng, q_mode, layout):
    env = build(rng, quantized=q_mode != "float", lens=[1, 45, 66], layout=layout)
    h = 4
    q_nope = torch.randn(3, h, R, generator=rng).bfloat16()
    q_rope = torch.randn(3, h, DR, generator=rng).bfloat16()
    qs = None
    if q_mode == "static":
        amax = q_nope.float().abs().amax(dim=(0, 2))
        qs = per_head_qparams(-amax, amax)[0]
    scale = (R + DR) ** -0.5
    args = (q_nope, q_rope, env["lc"], env["rc"], env["table"], env["seq_lens"])
    kw = dict(scale=scale, k_scale=env["ks"], q_scale=qs, layout=layout)
    out = mla_paged_attention(*args, **kw)
    assert out.shape == (3, h, R) and out.dtype == torch.bfloat16
    ref = mla_paged_attention_ref(*args, **kw)
    plain = mla_paged_attention_ref(*args, **kw, compute_dtype=torch.bfloat16)
    err = float((out.double() - ref).abs().max())
    assert err <= 2 * float((plain.double() - ref).abs().max()) + FLOOR
    dense = dense_mla(q_nope.unsqueeze(1), q_rope.unsqueeze(1), env, scale).squeeze(1)
    assert _cos(out, dense) >= 0.999


def test_dynamic_query_scale_is_rowmax_over_127():
    q = torch.tensor([[[1.0, -254.0, 3.0], [0.0, 0.0, 0.0]]])
    s = dynamic_query_scale(q)
    assert s.dtype == torch.float32 and s.shape == (1, 2)
    assert float(s[0, 0]) == 2.0
    assert float(s[0, 1]) == 2.0**-23  # an all-zero row stays finite


def test_mla_prefill_matches_reference(rng):
    env = build(rng, quantized=True, lens=[7, 40])
    h = 2
    q_nope = torch.randn(2, 5, h, R, generator=rng).bfloat16()
    q_rope = torch.randn(2, 5, h, DR, generator=rng).bfloat16()
    qlens = torch.tensor([5, 2], dtype=torch.int32)
    args = (q_nope, q_rope, env["lc"], env["rc"], env["table"], env["seq_lens"])
    kw = dict(scale=0.1, k_scale=env["ks"], query_lens=qlens)
    out = mla_prefill_attention(*args, **kw)
    ref = mla_prefill_attention_ref(*args, **kw)
    plain = mla_prefill_attention_ref(*args, **kw, compute_dtype=torch.bfloat16)
    err = float((out.double() - ref).abs().max())
    assert err <= 2 * float((plain.double() - ref).abs().max()) + FLOOR
    assert bool((out[1, 2:] == 0).all())
    dec = mla_paged_attention(
        q_nope[:, 1], q_rope[:, 1], *args[2:], scale=0.1, k_scale=env["ks"]
    )
    assert torch.allclose(dec[1].float(), out[1, 1].float(), atol=1e-2)


def test_opcheck_mla_ops(rng):
    env = build(rng, quantized=True, lens=[3, 20])
    qn = torch.randn(2, 2, R, generator=rng).bfloat16()
    qr = torch.randn(2, 2, DR, generator=rng).bfloat16()
    common = (env["lc"], env["rc"], env["table"], env["seq_lens"])
    torch.library.opcheck(
        torch.ops.ascend_fa.mla_paged_attention.default,
        (qn, qr, *common, 0.1, env["ks"], None, "nz"),
    )
    torch.library.opcheck(
        torch.ops.ascend_fa.mla_prefill_attention.default,
        (
            qn.unsqueeze(1),
            qr.unsqueeze(1),
            *common,
            None,
            0.1,
            env["ks"],
            torch.tensor([0.01, 0.02]),
            "nz",
        ),
    )


def test_mla_prefill_row_chunks_do_not_change_results(rng, monkeypatch):
    from ascend_fa.atb_ops import attention as att

    env = build(rng, quantized=True, lens=[9, 40], dtype=torch.float32)
    qn = torch.randn(2, 4, 2, R, generator=rng)
    qr = torch.randn(2, 4, 2, DR, generator=rng)
    args = (qn, qr, env["lc"], env["rc"], env["table"], env["seq_lens"])
    whole = mla_prefill_attention(*args, scale=0.1, k_scale=env["ks"])
    monkeypatch.setattr(att, "_SCORE_CHUNK", 1)
    chunked = mla_prefill_attention(*args, scale=0.1, k_scale=env["ks"])
    assert torch.allclose(whole, chunked, atol=1e-6, rtol=0)
