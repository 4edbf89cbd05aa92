"""Every bad-input path of the public cache/attention API raises before any write,
and its message names the argument."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape

from ascend_fa import (
    mla_paged_attention,
    mla_prefill_attention,
    paged_attention,
    prefill_attention,
    reshape_and_cache,
    reshape_and_cache_mla,
)

T, HKV, H, D, NB, BS = 6, 2, 4, 16, 3, 32


def cache_args():
    key = torch.randn(T, HKV, D).half()
    kc = torch.zeros(nz_cache_shape(NB, BS, HKV, D, torch.int8), dtype=torch.int8)
    return dict(
        key=key,
        value=key.clone(),
        key_cache=kc,
        value_cache=kc.clone(),
        slot_mapping=torch.tensor([0, 1, -1, 40, 95, 3], dtype=torch.int32),
        k_scale=torch.full((HKV,), 0.01),
        v_scale=torch.full((HKV,), 0.01),
        layout="nz",
    )


def _i8(*shape):
    return torch.zeros(shape, dtype=torch.int8)


CACHE_BAD = [
    ("layout", "zn", r"layout must be one of"),
    ("key", torch.randn(T, HKV * D).half(), r"key must be \[T, Hkv, D\]"),
    ("key", torch.randn(T, HKV, D).to(torch.float64), r"key dtype must be"),
    ("key", [1, 2], r"key must be a tensor"),
    ("value", torch.randn(T, HKV, D).bfloat16(), r"key and value must have the same"),
    ("value", torch.randn(T + 1, HKV, D).half(), r"key and value must have the same"),
    ("key_cache", _i8(NB, HKV * D // 32, BS), r"key_cache must be a 4-D nz cache"),
    (
        "key_cache",
        _i8(NB, HKV * D // 16, BS, 16),
        r"key_cache last dim must be C0 = 32",
    ),
    ("caches", _i8(NB, 2, BS, 32), r"key_cache holds Hkv\*D = 64 features"),
    (
        "key_cache",
        _i8(NB, HKV * D // 32, 48, 32),
        r"key_cache block size 48 is not a "
        r"multiple of 32",
    ),
    ("key_cache", _i8(NB, 1, BS, 64)[..., :32], r"key_cache must be contiguous"),
    (
        "key_cache",
        torch.zeros(nz_cache_shape(NB, BS, HKV, D, torch.int16), dtype=torch.int16),
        r"key_cache dtype must be",
    ),
    (
        "value_cache",
        _i8(NB + 1, HKV * D // 32, BS, 32),
        r"key_cache and value_cache must have the same",
    ),
    ("k_scale", None, r"k_scale and v_scale must be given together"),
    (
        "k_scale",
        torch.full((HKV,), 0.01, dtype=torch.float64),
        r"k_scale must be float32",
    ),
    ("k_scale", torch.full((HKV + 1,), 0.01), r"k_scale must have shape \[2\]"),
    (
        "v_scale",
        torch.tensor([0.01, 0.0]),
        r"v_scale must be finite and > 0, got 0.0 at "
        r"index 1",
    ),
    ("v_scale", torch.tensor([float("nan"), 0.1]), r"v_scale must be finite"),
    (
        "slot_mapping",
        torch.tensor([0, 1, -1, 40, 96, 3], dtype=torch.int32),
        r"slot_mapping\[4\] = 96 is out of range: the cache has NB\*BS = 96 slots",
    ),
    (
        "slot_mapping",
        torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int16),
        r"slot_mapping must be int32 or int64",
    ),
    (
        "slot_mapping",
        torch.tensor([0, 1, 2], dtype=torch.int32),
        r"slot_mapping must have shape \[T\] = \[6\]",
    ),
    (
        "slot_mapping",
        torch.tensor([0, 1, 7, 40, 7, 3], dtype=torch.int32),
        r"slot_mapping writes slot 7 more than once",
    ),
]


@pytest.mark.parametrize(
    "arg,bad,match", CACHE_BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(CACHE_BAD)]
)
def test_reshape_and_cache_bad_input(arg, bad, match):
    kw = cache_args()
    if arg == "caches":
        kw["key_cache"], kw["value_cache"] = bad, bad.clone()
    else:
        kw[arg] = bad
    caches = [kw["key_cache"], kw["value_cache"]]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(
            kw.pop("key"),
            kw.pop("value"),
            kw.pop("key_cache"),
            kw.pop("value_cache"),
            kw.pop("slot_mapping"),
            **kw,
        )
    # nothing was written: the good slots of the same call were not applied either
    for c, b in zip(caches, before):
        if isinstance(c, torch.Tensor):
            assert torch.equal(c, b)


def test_float_cache_needs_matching_dtype():
    kw = cache_args()
    kw.update(k_scale=None, v_scale=None)
    kw["key_cache"] = torch.zeros(
        nz_cache_shape(NB, BS, HKV, D, torch.bfloat16), dtype=torch.bfloat16
    )
    kw["value_cache"] = kw["key_cache"].clone()
    with pytest.raises(
        ValueError,
        match=r"key_cache dtype torch.bfloat16 differs from "
        r"key dtype torch.float16",
    ):
        reshape_and_cache(**kw)
    kw = cache_args()
    kw["key_cache"] = torch.zeros(
        nz_cache_shape(NB, BS, HKV, D, torch.float16), dtype=torch.float16
    )
    kw["value_cache"] = kw["key_cache"].clone()
    with pytest.raises(ValueError, match=r"so key_cache must be int8"):
        reshape_and_cache(**kw)


def test_nd_cache_shape_mismatch():
    kw = cache_args()
    kw.update(
        layout="nd",
        key_cache=_i8(NB, BS, HKV, D * 2),
        value_cache=_i8(NB, BS, HKV, D * 2),
    )
    with pytest.raises(ValueError, match=r"key_cache is \[NB, BS, Hkv, D\]"):
        reshape_and_cache(**kw)


def mla_cache_args():
    return dict(
        latent=torch.randn(T, 64).bfloat16(),
        rope=torch.randn(T, 32).bfloat16(),
        latent_cache=_i8(*nz_cache_shape(NB, BS, 1, 64, torch.int8)),
        rope_cache=torch.zeros(
            nz_cache_shape(NB, BS, 1, 32, torch.bfloat16), dtype=torch.bfloat16
        ),
        slot_mapping=torch.arange(T, dtype=torch.int32),
        k_scale=torch.tensor([0.02]),
    )


MLA_CACHE_BAD = [
    ("latent", torch.randn(T, 1, 64).bfloat16(), r"latent must be \[T, R\]"),
    ("rope", torch.randn(T + 1, 32).bfloat16(), r"rope has 7 tokens but latent has 6"),
    (
        "rope",
        torch.randn(T, 32).half(),
        r"rope_cache dtype torch.bfloat16 must equal the "
        r"rope dtype",
    ),
    ("k_scale", torch.tensor([0.02, 0.03]), r"k_scale must have shape \[1\]"),
    ("k_scale", None, r"latent_cache dtype torch.int8 differs from latent dtype"),
    (
        "latent_cache",
        _i8(*nz_cache_shape(NB, BS, 1, 128, torch.int8)),
        r"latent_cache holds 128 features per token",
    ),
    (
        "rope_cache",
        torch.zeros(
            nz_cache_shape(NB + 1, BS, 1, 32, torch.bfloat16), dtype=torch.bfloat16
        ),
        r"latent_cache has 3 blocks of 32 but rope_cache has 4 blocks",
    ),
    (
        "slot_mapping",
        torch.tensor([0, 1, 2, 3, 4, 500], dtype=torch.int32),
        r"slot_mapping\[5\] = 500 is out of range",
    ),
]


@pytest.mark.parametrize("arg,bad,match", MLA_CACHE_BAD)
def test_reshape_and_cache_mla_bad_input(arg, bad, match):
    kw = mla_cache_args()
    kw[arg] = bad
    caches = [kw["latent_cache"], kw["rope_cache"]]
    with pytest.raises(ValueError, match=match):
        reshape_and_cache_mla(
            kw.pop("latent"),
            kw.pop("rope"),
            kw.pop("latent_cache"),
            kw.pop("rope_cache"),
            kw.pop("slot_mapping"),
            **kw,
        )
    assert not any(bool(c.any()) for c in caches)


def attn_args():
    kc = _i8(*nz_cache_shape(NB, BS, HKV, D, torch.int8))
    return dict(
        query=torch.randn(2, H, D).bfloat16(),
        key_cache=kc,
        value_cache=kc.clone(),
        block_table=torch.tensor([[0, 2], [1, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([40, 5], dtype=torch.int32),
        num_kv_heads=HKV,
        scale=0.25,
        k_scale=torch.full((HKV,), 0.01),
        v_scale=torch.full((HKV,), 0.01),
        q_scale=None,
        layout="nz",
    )


ATTN_BAD = [
    ("query", torch.randn(2, 1, H, D).bfloat16(), r"query must be \[B, H, D\]"),
    ("query", torch.randn(2, H, D).to(torch.float64), r"query dtype must be"),
    (
        "query",
        torch.randn(2, H, 2 * D).bfloat16(),
        r"key_cache holds 32 features per "
        r"token",
    ),
    ("num_kv_heads", 3, r"H = 4 heads are not a multiple of num_kv_heads = 3"),
    ("num_kv_heads", 0, r"num_kv_heads must be a positive int"),
    ("scale", float("inf"), r"scale must be finite and > 0"),
    ("scale", "0.1", r"scale must be a float"),
    ("layout", "NZ", r"layout must be one of"),
    ("k_scale", None, r"int8 caches need k_scale and v_scale"),
    ("v_scale", torch.full((HKV + 1,), 0.01), r"v_scale must have shape \[2\]"),
    ("q_scale", torch.full((HKV,), 0.01), r"q_scale must have shape \[4\]"),
    (
        "value_cache",
        _i8(NB, HKV * D // 32, 64, 32),
        r"key_cache and value_cache must "
        r"have the same",
    ),
    (
        "block_table",
        torch.tensor([[0, 2]], dtype=torch.int32),
        r"block_table must be \[B, max_blocks\] with B = 2",
    ),
    (
        "block_table",
        torch.tensor([[0, 2], [1, 0]], dtype=torch.float32),
        r"block_table must be int32 or int64",
    ),
    (
        "block_table",
        torch.tensor([[0, 3], [1, 0]], dtype=torch.int32),
        r"block_table\[0, 1\] = 3 is out of range \[0, 3\)",
    ),
    (
        "block_table",
        torch.tensor([[0, 2], [-1, 0]], dtype=torch.int32),
        r"block_table\[1, 0\] = -1 is out of range",
    ),
    (
        "seq_lens",
        torch.tensor([65, 5], dtype=torch.int32),
        r"seq_lens\[0\] = 65 needs more blocks than block_table holds",
    ),
    (
        "seq_lens",
        torch.tensor([40, 0], dtype=torch.int32),
        r"seq_lens\[1\] = 0 is shorter than its 1 query token",
    ),
    (
        "seq_lens",
        torch.tensor([40], dtype=torch.int32),
        r"seq_lens must be \[B\] = \[2\]",
    ),
]


@pytest.mark.parametrize(
    "arg,bad,match", ATTN_BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(ATTN_BAD)]
)
def test_paged_attention_bad_input(arg, bad, match):
    kw = attn_args()
    kw[arg] = bad
    with pytest.raises(ValueError, match=match):
        paged_attention(
            kw.pop("query"),
            kw.pop("key_cache"),
            kw.pop("value_cache"),
            kw.pop("block_table"),
            kw.pop("seq_lens"),
            **kw,
        )


def test_float_caches_reject_scales_and_prefill_checks():
    kw = attn_args()
    fc = torch.zeros(
        nz_cache_shape(NB, BS, HKV, D, torch.bfloat16), dtype=torch.bfloat16
    )
    kw.update(key_cache=fc, value_cache=fc.clone())
    with pytest.raises(
        ValueError,
        match=r"k_scale is given but the caches are "
        r"torch.bfloat16",
    ):
        paged_attention(**kw)
    kw = attn_args()
    kw["query"] = torch.randn(2, 3, H, D).bfloat16()
    kw["query_lens"] = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"query_lens\[1\] = 4 must be in \[0, S = 3\]"
    ):
        prefill_attention(**kw)
    kw["query_lens"] = torch.tensor([3, 3], dtype=torch.int32)
    kw["seq_lens"] = torch.tensor([40, 2], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"seq_lens\[1\] = 2 is shorter than its 3 query"
    ):
        prefill_attention(**kw)
    kw = attn_args()
    with pytest.raises(ValueError, match=r"query_lens is a prefill argument"):
        from ascend_fa.atb_ops.attention import check_paged_attention

        check_paged_attention(**kw, query_lens=torch.tensor([1, 1]))


def mla_args():
    return dict(
        q_nope=torch.randn(2, H, 64).bfloat16(),
        q_rope=torch.randn(2, H, 32).bfloat16(),
        latent_cache=_i8(*nz_cache_shape(NB, BS, 1, 64, torch.int8)),
        rope_cache=torch.zeros(
            nz_cache_shape(NB, BS, 1, 32, torch.bfloat16), dtype=torch.bfloat16
        ),
        block_table=torch.tensor([[0, 2], [1, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([40, 5], dtype=torch.int32),
        scale=0.1,
        k_scale=torch.tensor([0.02]),
        q_scale=None,
    )


MLA_BAD = [
    ("q_nope", torch.randn(2, H, 64, 1).bfloat16(), r"q_nope must be \[B, H, R\]"),
    (
        "q_rope",
        torch.randn(2, H + 1, 32).bfloat16(),
        r"q_rope .* must agree on all but "
        r"the last dim",
    ),
    ("q_rope", torch.randn(2, H, 32).half(), r"q_rope must have q_nope's dtype"),
    (
        "q_nope",
        torch.randn(2, H, 128).bfloat16(),
        r"latent_cache holds 64 features per "
        r"token .* but q_nope has R = 128",
    ),
    ("q_rope", torch.randn(2, H, 64).bfloat16(), r"rope_cache holds 32 features"),
    ("k_scale", None, r"an int8 latent_cache needs k_scale \[1\]"),
    ("q_scale", torch.full((H + 1,), 0.1), r"q_scale must have shape \[4\]"),
    (
        "rope_cache",
        _i8(*nz_cache_shape(NB, BS, 1, 32, torch.int8)),
        r"rope_cache must be a float cache",
    ),
    (
        "seq_lens",
        torch.tensor([40, 99], dtype=torch.int32),
        r"seq_lens\[1\] = 99 needs more blocks",
    ),
]


@pytest.mark.parametrize("arg,bad,match", MLA_BAD)
def test_mla_attention_bad_input(arg, bad, match):
    kw = mla_args()
    kw[arg] = bad
    with pytest.raises(ValueError, match=match):
        mla_paged_attention(**kw)


def test_mla_prefill_shape_and_float_latent_with_scale():
    kw = mla_args()
    with pytest.raises(ValueError, match=r"q_nope must be \[B, S, H, R\]"):
        mla_prefill_attention(**kw)
    kw = mla_args()
    kw["latent_cache"] = torch.zeros(
        nz_cache_shape(NB, BS, 1, 64, torch.bfloat16), dtype=torch.bfloat16
    )
    with pytest.raises(
        ValueError,
        match=r"k_scale is given but latent_cache is "
        r"torch.bfloat16",
    ):
        mla_paged_attention(**kw)


def test_unknown_backend_and_wrong_device_backend():
    kw = attn_args()
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'"):
        paged_attention(**kw, backend="tpu")
    from ascend_fa.backends.cpu import CPUBackend

    class OtherDevice(CPUBackend):
        name = "other"
        device_type = "meta"

    with pytest.raises(
        ValueError, match=r"tensors are on 'cpu', backend runs on 'meta'"
    ):
        paged_attention(**kw, backend=OtherDevice())
