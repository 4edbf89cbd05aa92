"""DeepSeek-V3 MLA FAKQuant adapter on a tiny random DeepseekV3 model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import builders  # noqa: E402

from ascend_fa.adapters import DeepseekV3Adapter, get_adapter  # noqa: E402
from ascend_fa.adapters.deepseek_v3 import absorbed_query, split_kv_b  # noqa: E402
from ascend_fa.adapters.hf import set_point  # noqa: E402
from ascend_fa.calibration import FA3FakeQuant, FA3QuantPlaceHolder  # noqa: E402

VOCAB, H, R, NOPE, ROPE, V = 97, 4, 32, 16, 8, 16


# Also run under transformers 4.57 (ci/unit_transformers4.sh).
pytestmark = pytest.mark.transformers4


def tiny_deepseek(attn: str = "sdpa", q_lora_rank: int | None = None) -> nn.Module:
    return builders.tiny_deepseek(
        attn=attn,
        vocab_size=VOCAB,
        num_attention_heads=H,
        num_key_value_heads=H,
        kv_lora_rank=R,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V,
        max_position_embeddings=64,
    )


class Recorder(nn.Module):
    def __init__(self, out=None) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.out = out

    def forward(self, x, token_mask=None):
        self.calls.append((x.detach().clone(), token_mask))
        return x if self.out is None else self.out(x)


def ids(b=2, s=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g)


def attach(model, out=None):
    recs = {}
    for name, mod in DeepseekV3Adapter().attention_modules(model):
        for b in ("fa_q", "fa_k", "fa_v"):
            set_point(mod, b, Recorder(out))
            recs[(name, b)] = getattr(mod, b)
    return recs


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_injection_bit_equal_idempotent_removable(attn, q_lora_rank):
    model = tiny_deepseek(attn, q_lora_rank)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "DeepseekV3MLP",
        "DeepseekV3MoE",
    ]
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    assert isinstance(adapter, DeepseekV3Adapter)
    assert adapter.fa_quant_type == "FAKQuant"
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    a0 = model.model.layers[0].self_attn
    assert isinstance(a0.fa_q, FA3QuantPlaceHolder)
    assert (a0.fa_q.num_heads, a0.fa_k.num_heads, a0.fa_v.num_heads) == (H, 1, 1)
    assert torch.equal(model(x).logits, ref)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    assert len(a0.kv_a_layernorm._forward_hooks) == 1  # not doubled
    assert torch.equal(model(x).logits, ref)
    adapter.remove_fa3_placeholders(model)
    assert model.config._attn_implementation == attn
    assert not a0.kv_a_layernorm._forward_hooks and not a0.kv_b_proj._forward_pre_hooks
    assert not hasattr(a0, "fa_q")
    assert torch.equal(model(x).logits, ref)


def test_observers_fire_per_layer_with_shapes_and_mask():
    model = tiny_deepseek()
    DeepseekV3Adapter().inject_fa3_placeholders("", model, lambda n: True)
    recs = attach(model)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    model(input_ids=ids(), attention_mask=mask, use_cache=False)
    for layer in range(2):  # dense layer 0 and MoE layer 1
        name = f"model.layers.{layer}.self_attn"
        ((q, qm),) = recs[(name, "fa_q")].calls
        ((k, km),) = recs[(name, "fa_k")].calls
        ((v, vm),) = recs[(name, "fa_v")].calls
        assert q.shape == (2, H, 7, R) and k.shape == (2, 1, 7, R)
        assert torch.equal(k, v)
        for m in (qm, km, vm):
            assert torch.equal(m, mask.bool())


def _rope(mod, attn, q, k, cos, sin):
    if attn.config.rope_interleave:
        return mod.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    return mod.apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_attention_matches_model_output(q_lora_rank):
    """From the captured latent and absorbed query, absorbed MLA reproduces the
    module's own (non-absorbed) output in fp32."""
    model = tiny_deepseek("eager", q_lora_rank)
    DeepseekV3Adapter().inject_fa3_placeholders("", model, lambda n: True)
    recs = attach(model)
    attn = model.model.layers[1].self_attn
    seen = {}

    def pre(_m, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["pe"] = kwargs["position_embeddings"]

    def post(_m, _a, out):
        seen["out"] = out[0]

    h1 = attn.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = attn.register_forward_hook(post)
    b, s = 2, 7
    with torch.no_grad():
        model(ids(b, s), use_cache=False)
        h1.remove()
        h2.remove()
        name = "model.layers.1.self_attn"
        q_abs = recs[(name, "fa_q")].calls[0][0]  # [B, H, S, R]
        c = recs[(name, "fa_k")].calls[0][0]  # [B, 1, S, R]
        # RoPE parts, recomputed from the layer input (never quantized).
        hs, (cos, sin) = seen["h"], seen["pe"]
        qs = (
            attn.q_proj(hs)
            if attn.q_lora_rank is None
            else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hs)))
        )
        q_pe = qs.view(b, s, H, NOPE + ROPE).transpose(1, 2)[..., NOPE:]
        k_pe = attn.kv_a_proj_with_mqa(hs)[..., R:].view(b, 1, s, ROPE)
        mod = __import__(type(attn).__module__, fromlist=["x"])
        q_pe, k_pe = _rope(mod, attn, q_pe, k_pe, cos, sin)
        w_uk, w_uv = split_kv_b(attn)
        assert w_uk.shape == (H, NOPE, R) and w_uv.shape == (H, V, R)
        scores = q_abs @ c.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)
        scores = scores * attn.scaling
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        p = scores.masked_fill(~causal, -math.inf).softmax(-1)  # [B, H, S, S]
        o_lat = p @ c  # [B, H, S, R]
        o = torch.einsum("bhsr,hvr->bshv", o_lat, w_uv).reshape(b, s, H * V)
        out = attn.o_proj(o)
    # fp32, 16-64 wide dot products: reassociation error ~1e-6.
    torch.testing.assert_close(out, seen["out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        q_abs,
        absorbed_query(
            attn,
            torch.cat([qs.view(b, s, H, -1).transpose(1, 2)[..., :NOPE], q_pe], -1),
        ),
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_absorbed_path_in_fake_quant_mode(attn):
    """A fa_q that returns a new tensor switches to absorbed attention: with an
    exact copy it reproduces the float logits; with int8 fake-quant they move."""
    model = tiny_deepseek(attn)
    x = ids()
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    ref = model(input_ids=x, attention_mask=mask).logits
    adapter = get_adapter(model)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    copies = attach(model, out=lambda t: t.clone())
    out = model(input_ids=x, attention_mask=mask).logits
    assert all(r.calls for r in copies.values())
    assert not torch.equal(out, ref)  # a different (absorbed) computation ran ...
    # ... that agrees with the model's own within fp32 reassociation error.
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-4)
    for _, m in adapter.attention_modules(model):
        for b, h in (("fa_q", H), ("fa_k", 1), ("fa_v", 1)):
            set_point(m, b, FA3FakeQuant(b, torch.full((h,), 0.02)))
    fq = model(input_ids=x, attention_mask=mask).logits
    assert not torch.allclose(fq, ref, atol=1e-4)
    assert (fq - ref)[mask.bool()].abs().max() < 0.1  # int8 error, not garbage


def test_latent_downstream_is_fa_k_output():
    """fa_k's output is the latent both K and V are built from (the Ascend kernel
    dequantizes the latent cache with fa_k.scale); fa_v's output is not used."""
    model = tiny_deepseek()
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    for _, m in adapter.attention_modules(model):
        m.fa_v = Recorder(out=torch.zeros_like)
    assert torch.equal(model(x).logits, ref)
    for _, m in adapter.attention_modules(model):
        m.fa_k = Recorder(out=torch.zeros_like)
        m.fa_v = Recorder()
    zero_latent = model(x).logits
    assert not torch.allclose(zero_latent, ref)
    # Zero latent: k_nope = 0 and V = 0, so each attention output is o_proj(0) = 0;
    # compare with a model whose kv_b_proj is zero (same effect, no adapter).
    adapter.remove_fa3_placeholders(model)
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.weight.data.zero_()
    torch.testing.assert_close(model(x).logits, zero_latent, rtol=1e-5, atol=1e-5)
