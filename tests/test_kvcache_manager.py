"""PagedKVCache: allocation per backend, slot mapping, block tables, freeing."""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape
from ascend_fa.atb_ops.attention import paged_attention_ref

from ascend_fa import (
    PagedKVCache,
    paged_attention,
    prefill_attention,
    reshape_and_cache,
)


def test_allocates_per_layer_nz_caches():
    cache = PagedKVCache(3, 2, 64, num_blocks=5, block_size=32, mode="int8_kv")
    assert cache.layout == "nz" and cache.backend.name == "cpu"
    assert len(cache.key_caches) == len(cache.value_caches) == 3
    for k, v in (cache.layer(i) for i in range(3)):
        assert k.shape == nz_cache_shape(5, 32, 2, 64, torch.int8) == v.shape
        assert k.dtype == torch.int8
    assert cache.key_caches[0].data_ptr() != cache.key_caches[1].data_ptr()
    f = PagedKVCache(1, 2, 64, num_blocks=5, block_size=32, dtype=torch.float16)
    assert f.key_caches[0].dtype == torch.float16
    nd = PagedKVCache(1, 2, 64, num_blocks=5, block_size=32, layout="nd")
    assert nd.key_caches[0].shape == (5, 32, 2, 64)
    with pytest.raises(IndexError, match="index 3 out of range"):
        cache.layer(3)


def test_slot_mapping_block_table_seq_lens():
    cache = PagedKVCache(1, 1, 32, num_blocks=6, block_size=16)
    step = cache.append([7, 9], [20, 3])
    # seq 7 gets blocks 0, 1; seq 9 gets block 2
    assert cache.blocks_of(7) == [0, 1] and cache.blocks_of(9) == [2]
    want = list(range(0, 20)) + [32, 33, 34]
    assert step.slot_mapping.tolist() == want and step.slot_mapping.dtype == torch.int32
    assert step.block_table.tolist() == [[0, 1], [2, 0]]
    assert step.seq_lens.tolist() == [20, 3] and step.query_lens.tolist() == [20, 3]
    step = cache.append([9, 7], 1)  # decode: one token each, order as given
    assert step.slot_mapping.tolist() == [35, 20]
    assert step.seq_lens.tolist() == [4, 21]
    assert cache.num_free_blocks == 3
    # filling block 1 of seq 7 exactly, then one more token opens a new block
    cache.append([7], 11)
    assert cache.seq_len(7) == 32 and cache.blocks_of(7) == [0, 1]
    cache.append([7], 1)
    assert cache.blocks_of(7) == [0, 1, 3]


def test_out_of_blocks_changes_nothing_and_free_recycles():
    cache = PagedKVCache(1, 1, 32, num_blocks=3, block_size=16)
    cache.append([1], 30)
    with pytest.raises(ValueError, match="out of blocks: need 2, 1 free of 3"):
        cache.append([1, 2], [5, 16])
    assert cache.seq_len(1) == 30 and cache.seq_len(2) == 0
    assert cache.num_free_blocks == 1
    cache.free(1)
    assert cache.num_free_blocks == 3 and cache.sequences == []
    step = cache.append([2], 1)
    assert step.slot_mapping.tolist() == [0]  # lowest block first again
    with pytest.raises(ValueError, match="seq_ids has duplicates"):
        cache.append([2, 2], 1)
    with pytest.raises(ValueError, match="num_tokens has 1 entries for 2 sequences"):
        cache.append([2, 3], [1])


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        PagedKVCache(1, 1, 32, num_blocks=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        PagedKVCache(1, 1, 32, num_blocks=2, mode="int4")
    with pytest.raises(ValueError, match="'fakquant' is for MLA caches"):
        PagedKVCache(1, 1, 32, num_blocks=2, mode="fakquant")
    with pytest.raises(ValueError, match="MLA caches have one latent head"):
        PagedKVCache(1, 2, 64, num_blocks=2, mla=True)
    with pytest.raises(ValueError, match="layout must be one of"):
        PagedKVCache(1, 1, 32, num_blocks=2, layout="zz")


def test_mla_caches_and_bytes_per_token():
    mla = PagedKVCache(
        2, 1, 512, num_blocks=4, block_size=128, mla=True, rope_dim=64, mode="fakquant"
    )
    lat, rope = mla.layer(0)
    assert lat.shape == (4, 16, 128, 32) and lat.dtype == torch.int8
    assert rope.shape == (4, 4, 128, 16) and rope.dtype == torch.bfloat16
    assert mla.bytes_per_token() == 2 * (512 + 64 * 2)
    bf = PagedKVCache(1, 8, 128, num_blocks=4, block_size=128)
    i8 = PagedKVCache(1, 8, 128, num_blocks=4, block_size=128, mode="int8_kv")
    assert bf.bytes_per_token() == 2 * 8 * 128 * 2
    assert i8.bytes_per_token(scale_bytes=2 * 8 * 4) / bf.bytes_per_token() <= 0.51


def test_end_to_end_prefill_then_decode_through_the_manager(rng):
    hkv, h, d = 2, 4, 32
    cache = PagedKVCache(1, hkv, d, num_blocks=8, block_size=32, mode="int8_kv")
    ks = torch.full((hkv,), 0.03)
    vs = torch.full((hkv,), 0.02)
    step = cache.append([0, 1], [37, 5])
    key = torch.randn(42, hkv, d, generator=rng).bfloat16()
    value = torch.randn(42, hkv, d, generator=rng).bfloat16()
    kc, vc = cache.layer(0)
    reshape_and_cache(key, value, kc, vc, step.slot_mapping, k_scale=ks, v_scale=vs)
    q = torch.randn(2, 37, h, d, generator=rng).bfloat16()
    out = prefill_attention(
        q,
        kc,
        vc,
        step.block_table,
        step.seq_lens,
        num_kv_heads=hkv,
        scale=1 / math.sqrt(d),
        k_scale=ks,
        v_scale=vs,
        query_lens=step.query_lens,
    )
    assert bool((out[1, 5:] == 0).all())
    step = cache.append([0, 1], 1)
    key = torch.randn(2, hkv, d, generator=rng).bfloat16()
    reshape_and_cache(key, key, kc, vc, step.slot_mapping, k_scale=ks, v_scale=vs)
    qd = torch.randn(2, h, d, generator=rng).bfloat16()
    kw = dict(num_kv_heads=hkv, scale=1 / math.sqrt(d), k_scale=ks, v_scale=vs)
    dec = paged_attention(qd, kc, vc, step.block_table, step.seq_lens, **kw)
    ref = paged_attention_ref(qd, kc, vc, step.block_table, step.seq_lens, **kw)
    assert float((dec.double() - ref).abs().max()) < 1e-2
