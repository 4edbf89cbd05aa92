"""GQA FAQuant adapter on tiny random llama / qwen2 / qwen3 / mistral models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from builders import tiny_causal_lm  # noqa: E402

from ascend_fa.adapters import GQAAdapter, get_adapter, supported_model_types  # noqa: E402
from ascend_fa.adapters.base import WRAPPED_PREFIX  # noqa: E402
from ascend_fa.adapters.hf import set_point  # noqa: E402
from ascend_fa.calibration import (  # noqa: E402
    FA3FakeQuant,
    FA3Processor,
    FA3QuantConfig,
    FA3QuantPlaceHolder,
)
from ascend_fa.families import FAMILIES  # noqa: E402
from ascend_fa.hf_compat import cache_kwargs, output_cache  # noqa: E402

# Also run under transformers 4.57 (ci/unit_transformers4.sh).
pytestmark = pytest.mark.transformers4

VOCAB = 101
TYPES = ["llama", "qwen2", "qwen3", "mistral"]


def tiny_model(model_type: str, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    return tiny_causal_lm(
        model_type,
        seed=seed,
        attn=attn,
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )


class Recorder(nn.Module):
    """Stand-in observer: records inputs and per-head min/max over real tokens."""

    def __init__(self, out=None) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.out = out

    def forward(self, x, token_mask=None):
        self.calls.append((x.detach().clone(), token_mask))
        m = (
            torch.ones(x.shape[0], x.shape[2], dtype=torch.bool)
            if token_mask is None
            else token_mask
        )
        sel = x.transpose(1, 2)[m]  # [N, H, D] real tokens only
        lo, hi = sel.amin(dim=(0, 2)), sel.amax(dim=(0, 2))
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)
        return x if self.out is None else self.out(x)


def attach_recorders(model, out=None):
    recs = {}
    for name, mod in GQAAdapter().attention_modules(model):
        for b in ("fa_q", "fa_k", "fa_v"):
            set_point(mod, b, Recorder(out))
            recs[(name, b)] = getattr(mod, b)
    return recs


def ids(b=2, s=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, s), generator=g)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", TYPES)
def test_injection_bit_equal_idempotent_removable(model_type, attn):
    model = tiny_model(model_type, attn)
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    assert isinstance(adapter, GQAAdapter) and adapter.fa_quant_type == "FAQuant"
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    assert model.config._attn_implementation == WRAPPED_PREFIX + attn
    attn0 = model.model.layers[0].self_attn
    assert isinstance(attn0.fa_q, FA3QuantPlaceHolder)
    heads = (attn0.fa_q.num_heads, attn0.fa_k.num_heads, attn0.fa_v.num_heads)
    assert heads == (6, 2, 2)
    assert torch.equal(model(x).logits, ref)
    modules_before = [n for n, _ in model.named_modules()]
    fa_q = attn0.fa_q
    adapter.inject_fa3_placeholders("", model, lambda n: True)  # twice: no change
    assert [n for n, _ in model.named_modules()] == modules_before
    assert attn0.fa_q is fa_q
    assert model.config._attn_implementation == WRAPPED_PREFIX + attn
    assert torch.equal(model(x).logits, ref)
    adapter.remove_fa3_placeholders(model)
    assert model.config._attn_implementation == attn
    names = [n for n, _ in model.named_modules()]
    assert not any(n.endswith(("fa_q", "fa_k", "fa_v")) for n in names)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.equal(model(x).logits, ref)


@pytest.mark.parametrize("model_type", TYPES)
def test_captures_q_after_rope_and_kv_before_repeat(model_type):
    model = tiny_model(model_type)
    GQAAdapter().inject_fa3_placeholders("", model, lambda n: True)
    recs = attach_recorders(model)
    attn0 = model.model.layers[0].self_attn
    seen = {}

    def grab(_m, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["pe"] = kwargs["position_embeddings"]

    h = attn0.register_forward_pre_hook(grab, with_kwargs=True)
    x = ids(2, 7)
    model(x, use_cache=False)
    h.remove()
    q, _ = recs[("model.layers.0.self_attn", "fa_q")].calls[0]
    k, _ = recs[("model.layers.0.self_attn", "fa_k")].calls[0]
    v, _ = recs[("model.layers.0.self_attn", "fa_v")].calls[0]
    assert q.shape == (2, 6, 7, 8)
    assert k.shape == (2, 2, 7, 8) and v.shape == (2, 2, 7, 8)
    # Independent reference: projections (+ qwen3's q/k norms), then RoPE.
    hs, (cos, sin) = seen["h"], seen["pe"]
    mod = __import__(type(attn0).__module__, fromlist=["apply_rotary_pos_emb"])
    with torch.no_grad():
        rq = attn0.q_proj(hs).view(2, 7, -1, 8)
        rk = attn0.k_proj(hs).view(2, 7, -1, 8)
        if hasattr(attn0, "q_norm"):
            rq, rk = attn0.q_norm(rq), attn0.k_norm(rk)
        rq, rk = mod.apply_rotary_pos_emb(
            rq.transpose(1, 2), rk.transpose(1, 2), cos, sin
        )
        rv = attn0.v_proj(hs).view(2, 7, -1, 8).transpose(1, 2)
    assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)
    # every layer fired once
    assert all(len(r.calls) == 1 for r in recs.values())


def test_kv_after_cache_update():
    model = tiny_model("llama")
    GQAAdapter().inject_fa3_placeholders("", model, lambda n: True)
    recs = attach_recorders(model)
    x = ids(1, 5)
    out = model(x, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    model(
        nxt,
        **cache_kwargs(output_cache(out)),
        use_cache=True,
        attention_mask=torch.ones(1, 6, dtype=torch.long),
    )
    q, qm = recs[("model.layers.1.self_attn", "fa_q")].calls[1]
    k, km = recs[("model.layers.1.self_attn", "fa_k")].calls[1]
    assert q.shape[2] == 1 and k.shape[2] == 6  # T = cached 5 + current 1
    assert qm.shape == (1, 1) and km.shape == (1, 6)
    # the cached part of K is exactly what the first forward saw
    k0, _ = recs[("model.layers.1.self_attn", "fa_k")].calls[0]
    assert torch.equal(k[:, :, :5], k0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_excluded_same_ranges_as_single_samples(side):
    model = tiny_model("qwen2")
    GQAAdapter().inject_fa3_placeholders("", model, lambda n: True)
    lengths = [9, 4, 6]
    seqs = [ids(1, n, seed=10 + n)[0] for n in lengths]
    singles = attach_recorders(model)
    for s in seqs:
        model(s[None], use_cache=False)
    batched = attach_recorders(model)
    S = max(lengths)
    input_ids = torch.zeros(3, S, dtype=torch.long)
    mask = torch.zeros(3, S, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(S - len(s), S)
        input_ids[i, sl], mask[i, sl] = s, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False)
    for key, rec in batched.items():
        # Same values, different batching: matmul blocking may change last bits.
        torch.testing.assert_close(rec.lo, singles[key].lo, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec.hi, singles[key].hi, rtol=1e-5, atol=1e-6)
        _, tm = rec.calls[0]
        assert torch.equal(tm, mask.bool())
    # Without the mask the pad tokens would widen at least one range.
    nomask = attach_recorders(model)
    model(input_ids=input_ids, position_ids=pos, use_cache=False)
    assert any(
        not torch.allclose(nomask[k].lo, batched[k].lo)
        or not torch.allclose(nomask[k].hi, batched[k].hi)
        for k in batched
    )


def test_processor_minmax_batch_invariant():
    """Through the real processor: B = 3 padded equals three B = 1 runs."""
    seqs = [ids(1, n, seed=n)[0] for n in (8, 3, 5)]
    results = []
    for batched in (False, True):
        model = tiny_model("llama")
        proc = FA3Processor(FA3QuantConfig(method="minmax"))
        proc.preprocess(model, get_adapter(model))
        proc.process(model)
        with torch.no_grad():
            if batched:
                mask = torch.zeros(3, 8, dtype=torch.long)
                inp = torch.zeros(3, 8, dtype=torch.long)
                for i, s in enumerate(seqs):
                    inp[i, : len(s)], mask[i, : len(s)] = s, 1
                model(input_ids=inp, attention_mask=mask, use_cache=False)
            else:
                for s in seqs:
                    model(s[None], use_cache=False)
        proc.postprocess(model)
        results.append(proc.export_scales(model))
    for attn, branches in results[0].items():
        for b, (scale, _) in branches.items():
            torch.testing.assert_close(results[1][attn][b][0], scale, rtol=1e-5, atol=0)


def test_outputs_of_fa_points_feed_attention():
    model = tiny_model("llama")
    x = ids()
    ref = model(x).logits
    adapter = get_adapter(model)
    adapter.inject_fa3_placeholders("", model, lambda n: True)
    # V replaced by zeros -> attention output is exactly o_proj(0) = 0 in each layer,
    # so logits change.
    for _, mod in adapter.attention_modules(model):
        mod.fa_v = Recorder(out=torch.zeros_like)
    assert not torch.allclose(model(x).logits, ref)
    # int8 fake-quant with per-head max scales: close to float, not equal.
    for _, mod in adapter.attention_modules(model):
        for b, h in (("fa_q", 6), ("fa_k", 2), ("fa_v", 2)):
            set_point(mod, b, FA3FakeQuant(b, torch.full((h,), 0.05)))
    out = model(x).logits
    assert not torch.equal(out, ref)
    # Error budget: int8 with step 0.05 on O(1) activations of a random tiny model.
    assert (out - ref).abs().max() < 0.05


def test_should_inject_selects_modules():
    model = tiny_model("mistral")
    x = ids()
    ref = model(x).logits
    names = []
    GQAAdapter().inject_fa3_placeholders(
        "root", model, lambda n: names.append(n) or n.endswith("layers.1.self_attn")
    )
    assert names == ["root.model.layers.0.self_attn", "root.model.layers.1.self_attn"]
    assert not hasattr(model.model.layers[0].self_attn, "fa_q")
    assert hasattr(model.model.layers[1].self_attn, "fa_q")
    assert torch.equal(model(x).logits, ref)


def test_unsupported_model_type_lists_supported():
    cfg = transformers.AutoConfig.for_model(
        "gpt2", vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    listed = ", ".join(supported_model_types())
    with pytest.raises(ValueError, match=rf"model type 'gpt2'.*{listed}$"):
        get_adapter(model)
    with pytest.raises(ValueError, match="has no config.model_type"):
        get_adapter(nn.Linear(2, 2))
    assert supported_model_types() == sorted(FAMILIES)
    assert {"deepseek_v3", "llama", "mistral", "qwen2", "qwen3"} <= set(FAMILIES)
    expected = {"deepseek_v3", "deepseek_v32", "glm_moe_dsa", "llama", "mistral"}
    assert expected | {"qwen2", "qwen3"} <= set(supported_model_types())
    assert supported_model_types() == sorted(supported_model_types())
