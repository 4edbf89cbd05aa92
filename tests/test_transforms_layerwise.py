"""Attention transforms folded inside the layer-major FA pass
(:class:`ascend_fa.transforms.attention.LayerwiseTransforms`).

Tiny real transformers models (Llama with outlier K / V channels, Qwen3 with
q_norm / k_norm, DeepSeek-V3 MLA): the in-pass route reaches the decisions of the
separate statistics forward (:func:`apply_attention_transforms`) on the same
samples, folds the same weights, keeps the float model's function, and its FA
scales are those of calibrating the pre-folded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import DEEPSEEK_TINY, byte_tokenizer, tiny_causal_lm

from ascend_fa.calibration.job import default_recipe_path
from ascend_fa.calibration.pipeline import calibrate_model, calibration_batches
from ascend_fa.calibration.recipe import FA3QuantConfig, Recipe, load_recipe
from ascend_fa.transforms.attention import (
    ATTENTION_TRANSFORMS,
    LayerwiseTransforms,
    apply_attention_transforms,
)

TEXTS = [
    f"text {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 3) + str(i * 13)
    for i in range(7)
]
STATS_ROWS = 4  # the first two batches of two


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=260, max_position_embeddings=128)
    if kind == "deepseek_v3":
        return tiny_causal_lm(
            kind, seed=2, **common, **{**DEEPSEEK_TINY, "num_hidden_layers": 3}
        )
    m = tiny_causal_lm(
        kind,
        seed=2,
        **common,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            # Outlier channels, so that every layer's search has something to move.
            attn.k_proj.weight[1] *= 10.0
            attn.k_proj.weight[1 + 4] *= 10.0
            attn.v_proj.weight[3] *= 15.0
            if getattr(attn, "k_norm", None) is not None:
                attn.k_norm.weight[2] = 8.0
    return m


def _names(kind: str) -> tuple[str, ...]:
    return ("qk-smoothing",) if kind == "deepseek_v3" else ATTENTION_TRANSFORMS


def _calibrate(model, tok, recipe=None, before_layer=None):
    result = calibrate_model(
        model,
        tok,
        TEXTS,
        recipe=recipe or load_recipe(default_recipe_path()),
        max_length=40,
        batch_size=2,
        progress=False,
        before_layer=before_layer,
    )
    scales = result.export_scales(model)
    result.remove(model)
    return scales


@torch.no_grad()
def _logprobs(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(m(input_ids=ids, use_cache=False).logits.float(), -1)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_in_pass_matches_the_statistics_forward(kind: str) -> None:
    tok = byte_tokenizer()
    ref = _model(kind)
    pre = copy.deepcopy(ref)
    stats = calibration_batches(tok, TEXTS[:STATS_ROWS], max_length=40, batch_size=2)
    want = apply_attention_transforms(pre, stats, _names(kind), seed=4)
    want_scales = _calibrate(pre, tok)

    got_model = copy.deepcopy(ref)
    in_pass = LayerwiseTransforms(
        got_model, _names(kind), seed=4, stats_rows=STATS_ROWS
    )
    got_scales = _calibrate(got_model, tok, before_layer=in_pass)
    got = in_pass.result()

    assert got.transforms == want.transforms and got.mla == want.mla
    assert any(layer.qk_exponent for layer in got.layers)
    for g, w in zip(got.layers, want.layers, strict=True):
        assert g.name == w.name
        assert g.qk_exponent == w.qk_exponent, g.name
        assert g.v_rotation_seeds == w.v_rotation_seeds
        assert g.qk_errors.keys() == w.qk_errors.keys()
        for beta, err in w.qk_errors.items():
            assert g.qk_errors[beta] == pytest.approx(err, rel=1e-4, abs=1e-7)
        if w.qk_factors is None:
            assert g.qk_factors is None
        else:
            torch.testing.assert_close(g.qk_factors, w.qk_factors, rtol=1e-5, atol=0)
    # The same folded weights (up to the float rounding of the layer inputs).
    after = got_model.state_dict()
    for key, value in pre.state_dict().items():
        torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6)
    # The FA scales of calibrating the pre-folded model.
    assert got_scales.keys() == want_scales.keys()
    for key, value in want_scales.items():
        torch.testing.assert_close(got_scales[key], value, rtol=1e-4, atol=1e-7)
    # And the float model computes what the original computes.
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(9))
    p, q = _logprobs(ref, ids), _logprobs(got_model, ids)
    assert float((p.exp() * (p - q)).sum(-1).max()) <= 1e-5


def test_a_layer_the_recipe_leaves_float_is_not_smoothed() -> None:
    tok = byte_tokenizer()
    model = _model("llama")
    before = copy.deepcopy(model.model.layers[0].self_attn.state_dict())
    recipe = Recipe(processors=[FA3QuantConfig(exclude=["model.layers.0.self_attn"])])
    in_pass = LayerwiseTransforms(model, ["qk-smoothing"], stats_rows=STATS_ROWS)
    scales = _calibrate(model, tok, recipe=recipe, before_layer=in_pass)
    got = in_pass.result()
    assert got.layers[0].qk_exponent is None
    assert all(layer.qk_exponent is not None for layer in got.layers[1:])
    assert not any(k.startswith("model.layers.0.") for k in scales)
    after = model.model.layers[0].self_attn.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_v_rotation_alone_folds_at_construction_and_needs_no_statistics() -> None:
    model = _model("llama")
    ref = copy.deepcopy(model)
    in_pass = LayerwiseTransforms(model, ["v-rotation"])
    attn, ref_attn = model.model.layers[2].self_attn, ref.model.layers[2].self_attn
    assert not torch.equal(attn.v_proj.weight, ref_attn.v_proj.weight)
    weights = copy.deepcopy(model.state_dict())
    _calibrate(model, byte_tokenizer(), before_layer=in_pass)
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert all(layer.v_rotation_seeds for layer in in_pass.result().layers)


def test_a_model_without_a_layer_major_pass_is_refused() -> None:
    model = _model("llama")
    model.config.layer_types = ["sliding_attention", "full_attention", "full_attention"]
    in_pass = LayerwiseTransforms(model, ["qk-smoothing"])
    with pytest.raises(ValueError, match="layer-major"):
        _calibrate(model, byte_tokenizer(), before_layer=in_pass)
