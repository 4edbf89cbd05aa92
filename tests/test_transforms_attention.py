"""Folded attention transforms (V rotation, Q/K smoothing): exact on real tiny
transformers models, layer-local and deterministic, refusals named."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import tiny_causal_lm, tiny_deepseek, tiny_llama

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.transforms.attention import (
    ATTENTION_TRANSFORMS,
    apply_attention_transforms,
    fold_v_rotation,
    parse_transforms,
    smoothing_factors,
    v_rotation_matrix,
)

_BASE = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _model(kind: str, tied: bool) -> torch.nn.Module:
    if kind == "llama":
        m = tiny_llama(seed=1, tie_word_embeddings=tied)
    elif kind == "qwen2":
        m = tiny_causal_lm("qwen2", seed=1, tie_word_embeddings=tied, **_BASE)
    else:
        m = tiny_causal_lm(
            "qwen3", seed=1, tie_word_embeddings=tied, head_dim=16, **_BASE
        )
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            # Outlier channels (as trained models have) so that smoothing and
            # rotation have something to move; biases exercise the bias folds.
            attn.k_proj.weight[3] *= 12.0
            attn.k_proj.weight[3 + 8] *= 12.0
            attn.v_proj.weight[5] *= 20.0
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                if lin.bias is not None:
                    lin.bias.normal_(0.0, 0.5)
            if getattr(attn, "k_norm", None) is not None:
                attn.k_norm.weight[2] = 9.0
    return m


def _batches(n: int = 2, s: int = 48, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, s), generator=g)
    mask = torch.ones(n, s, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row: padding is not observed
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return [{"input_ids": ids, "attention_mask": mask, "position_ids": pos}]


@torch.no_grad()
def _logprobs(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(m(input_ids=ids, use_cache=False).logits.float(), -1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_folding_is_exact_per_token_kl(kind: str, tied: bool) -> None:
    ref = _model(kind, tied)
    folded = copy.deepcopy(ref)
    result = apply_attention_transforms(
        folded, _batches(), ATTENTION_TRANSFORMS, seed=3
    )
    assert result.transforms == ATTENTION_TRANSFORMS
    # Smoothing did something on at least one layer and weights changed.
    assert any(layer.qk_exponent for layer in result.layers)
    attn0, ref0 = folded.model.layers[0].self_attn, ref.model.layers[0].self_attn
    assert not torch.equal(attn0.v_proj.weight, ref0.v_proj.weight)
    assert not torch.equal(attn0.o_proj.weight, ref0.o_proj.weight)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))
    p, q = _logprobs(ref, ids), _logprobs(folded, ids)
    kl = (p.exp() * (p - q)).sum(-1)  # [B, S] per-token KL(original || folded)
    assert float(kl.max()) <= 1e-5, float(kl.max())


def test_v_rotation_fold_matches_naive_per_head_reference() -> None:
    m = _model("qwen2", tied=False)
    attn = m.model.layers[1].self_attn
    wv, bv = attn.v_proj.weight.double().clone(), attn.v_proj.bias.double().clone()
    wo = attn.o_proj.weight.double().clone()
    fold_v_rotation(attn, 1, seed=11)
    d, group = 16, 2
    for h in range(2):
        r = v_rotation_matrix(11, 1, h, d)
        assert torch.allclose(r @ r.t(), torch.eye(d, dtype=torch.float64))
        rows = slice(h * d, (h + 1) * d)
        for c in range(d):  # new V channel c = sum_j R[j, c] * old channel j
            want = sum(r[j, c] * wv[h * d + j] for j in range(d))
            assert torch.allclose(
                attn.v_proj.weight[h * d + c].double(), want, atol=1e-5
            )
            want_b = sum(r[j, c] * bv[h * d + j] for j in range(d))
            got_b = float(attn.v_proj.bias[h * d + c].detach())
            assert abs(got_b - float(want_b.detach())) < 1e-5
        for i in range(h * group, (h + 1) * group):
            cols = slice(i * d, (i + 1) * d)
            assert torch.allclose(
                attn.o_proj.weight[:, cols].double(), wo[:, cols] @ r, atol=1e-5
            )
        assert rows.stop <= wv.shape[0]


def test_v_rotation_spreads_an_outlier_channel() -> None:
    m = _model("llama", tied=True)
    folded = copy.deepcopy(m)
    apply_attention_transforms(folded, [], ["v-rotation"], seed=0)
    w0 = m.model.layers[0].self_attn.v_proj.weight[:16].detach()
    w1 = folded.model.layers[0].self_attn.v_proj.weight[:16].detach()
    # Row norms of head 0: one row 20x the others before, flat after.
    n0, n1 = w0.norm(dim=1), w1.norm(dim=1)
    assert float(n0.max() / n0.median()) > 5.0
    assert float(n1.max() / n1.median()) < 2.0


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = (_model("qwen3", tied=False) for _ in range(3))
    for m, seed in ((a, 4), (b, 4), (c, 5)):
        apply_attention_transforms(m, _batches(), ATTENTION_TRANSFORMS, seed=seed)
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name
    assert not torch.equal(
        a.model.layers[0].self_attn.v_proj.weight,
        c.model.layers[0].self_attn.v_proj.weight,
    )


def test_layer_decision_depends_only_on_its_own_statistics() -> None:
    """Changing layer 1's weights leaves layer 0's folded weights bit-equal."""
    a, b = _model("llama", tied=False), _model("llama", tied=False)
    with torch.no_grad():
        b.model.layers[1].self_attn.k_proj.weight.mul_(3.0)
    for m in (a, b):
        apply_attention_transforms(m, _batches(), ATTENTION_TRANSFORMS, seed=2)
    sa, sb = a.model.layers[0].state_dict(), b.model.layers[0].state_dict()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_smoothing_search_prefers_balance_and_keeps_identity_when_balanced() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 32, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 32, 8, generator=g, dtype=torch.float64)
    k[:, :, 1] *= 40.0
    k[:, :, 5] *= 40.0  # one RoPE pair (1, 5) carries K's range
    qmax = torch.sqrt(q[..., :4] ** 2 + q[..., 4:] ** 2).amax(1)
    kmax = torch.sqrt(k[..., :4] ** 2 + k[..., 4:] ** 2).amax(1)
    beta, s, errors = smoothing_factors(qmax, kmax, q, k, shared=False)
    assert beta > 0 and errors[beta] < errors[0.0]
    assert s.shape == (2, 4) and float(s[:, 1].min()) < float(s[:, 0].max())
    # Equal ranges: every factor is 1 for any beta, the tie keeps beta = 0.
    beta, s, _ = smoothing_factors(qmax, qmax[::2], q, q[::2], shared=True)
    assert beta == 0.0 and s.shape == (1, 4)


def test_parse_transforms() -> None:
    assert parse_transforms(None) == ()
    assert parse_transforms("none") == ()
    assert parse_transforms("qk-smoothing, v-rotation") == ATTENTION_TRANSFORMS
    assert parse_transforms(["v-rotation"]) == ("v-rotation",)
    with pytest.raises(InputError, match="unknown transform 'hadamard'"):
        parse_transforms("v-rotation,hadamard")


def test_refusals_name_the_problem() -> None:
    with pytest.raises(UnsupportedError, match="deepseek_v3"):
        apply_attention_transforms(tiny_deepseek(), [], ["v-rotation"])
    m = tiny_llama()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.model.layers[1].self_attn.set_submodule("o_proj", torch.nn.Identity())
    with pytest.raises(UnsupportedError, match="o_proj is Identity"):
        apply_attention_transforms(m, [], ["v-rotation"])
    # Nothing half-folded: layer 0 is untouched.
    for key, value in m.model.layers[0].state_dict().items():
        assert torch.equal(value, before[f"model.layers.0.{key}"]), key
    with pytest.raises(InputError, match="no calibration token"):
        apply_attention_transforms(tiny_llama(), [], ["qk-smoothing"])
