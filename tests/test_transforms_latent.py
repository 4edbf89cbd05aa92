"""MLA latent smoothing (``qk-smoothing`` on DeepSeek-V3): exact on a real tiny
transformers DeepSeek-V3, the folds match a naive reference, the search balances
a planted outlier channel and lowers the FAKQuant error, refusals named."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import tiny_deepseek

from ascend_fa.errors import UnsupportedError
from ascend_fa.transforms.attention import apply_attention_transforms
from ascend_fa.transforms.latent import (
    fold_latent_smoothing,
    latent_smoothing_factors,
)


def _model() -> torch.nn.Module:
    m = tiny_deepseek(seed=2).float()
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            # A latent outlier channel, as trained MLA latents have: channel 3 of
            # c is 40x larger, kv_b_proj's column 3 40x smaller (same function).
            attn.kv_a_layernorm.weight[3] = 40.0
            attn.kv_b_proj.weight[:, 3] /= 40.0
    return m


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :4] = 0  # left padding is not observed
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return [{"input_ids": ids, "attention_mask": mask, "position_ids": pos}]


@torch.no_grad()
def _logprobs(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(m(input_ids=ids, use_cache=False).logits.float(), -1)


def test_latent_smoothing_is_exact_per_token_kl() -> None:
    ref = _model()
    folded = copy.deepcopy(ref)
    result = apply_attention_transforms(folded, _batches(), ["qk-smoothing"])
    assert result.mla and result.transforms == ("qk-smoothing",)
    assert all(layer.qk_exponent for layer in result.layers)
    a0, r0 = folded.model.layers[0].self_attn, ref.model.layers[0].self_attn
    assert not torch.equal(a0.kv_a_layernorm.weight, r0.kv_a_layernorm.weight)
    assert not torch.equal(a0.kv_b_proj.weight, r0.kv_b_proj.weight)
    # nothing else changed
    after = folded.state_dict()
    for key, value in ref.state_dict().items():
        if "kv_a_layernorm" not in key and "kv_b_proj" not in key:
            assert torch.equal(value, after[key]), key
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5))
    p, q = _logprobs(ref, ids), _logprobs(folded, ids)
    kl = (p.exp() * (p - q)).sum(-1)
    assert float(kl.max()) <= 1e-5, float(kl.max())
    meta = result.description_metadata()["ascend_fa_transforms"]
    assert "kv_a_layernorm" in meta["qk-smoothing"]
    rep = result.to_report()["layers"][0]
    assert rep["qk_smoothing_exponent"] > 0
    assert rep["qk_smoothing_errors"]["0"] > min(rep["qk_smoothing_errors"].values())


def test_fold_matches_naive_reference() -> None:
    m = _model()
    attn = m.model.layers[0].self_attn
    g0 = attn.kv_a_layernorm.weight.detach().double().clone()
    w0 = attn.kv_b_proj.weight.detach().double().clone()
    r = g0.numel()
    s = torch.linspace(0.5, 3.0, r, dtype=torch.float64)
    fold_latent_smoothing(attn, s)
    g1 = attn.kv_a_layernorm.weight.detach().double()
    w1 = attn.kv_b_proj.weight.detach().double()
    for c in range(r):  # channel by channel: gamma[c] * s[c], column c / s[c]
        assert float(g1[c]) == pytest.approx(float(g0[c] * s[c]), rel=1e-6)
        torch.testing.assert_close(w1[:, c], w0[:, c] / s[c], rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="do not match kv_lora_rank"):
        fold_latent_smoothing(attn, torch.ones(r + 1))


def test_search_balances_the_outlier_and_lowers_the_error() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 48, 16, generator=g)
    c = torch.randn(1, 48, 16, generator=g)
    c[..., 5] *= 50.0  # one latent channel carries the whole range of c
    beta, s, errors = latent_smoothing_factors(
        q.abs().amax(1), c.abs().amax(1), q, c, scaling=0.25
    )
    assert beta > 0 and errors[beta] < errors[0.0]
    assert s.shape == (16,) and int(torch.argmax(s)) != 5 and int(torch.argmin(s)) == 5
    # balanced ranges: every factor is 1, the tie keeps beta = 0
    beta, s, _ = latent_smoothing_factors(
        c.abs().amax(1).expand(4, -1),
        c.abs().amax(1),
        c.expand(4, -1, -1),
        c,
        scaling=0.25,
    )
    assert beta == 0.0 and torch.equal(s, torch.ones(16))


def test_refusals_name_the_problem() -> None:
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(UnsupportedError, match="v-rotation has no MLA form"):
        apply_attention_transforms(m, _batches(), ["v-rotation", "qk-smoothing"])
    m.model.layers[1].self_attn.set_submodule("kv_b_proj", torch.nn.Identity())
    with pytest.raises(UnsupportedError, match="kv_b_proj is Identity"):
        apply_attention_transforms(m, _batches(), ["qk-smoothing"])
    for key, value in m.model.layers[0].state_dict().items():
        assert torch.equal(value, before[f"model.layers.0.{key}"]), key
