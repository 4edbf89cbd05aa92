"""Residual-stream rotation: exact in float, streaming steps bit-equal to the whole
model, refusals that leave the model as it was, and the W8A8 calibration with it."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import byte_tokenizer, tiny_causal_lm, tiny_llama
from safetensors.torch import load_file, save_file

from ascend_fa.calibration.pipeline import calibration_batches
from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.linear import (
    LinearConfig,
    calibrate_linears,
    export_state,
    load_quantized_model,
)
from ascend_fa.transforms.residual import (
    is_rotated,
    rotate_decoder_layer,
    rotate_embeddings,
    rotate_head,
    rotate_residual,
    rotation_matrix,
    supports_rotation,
    untie_head,
)

TEXTS = [f"Row {i}: def f(x): return x * {i} + 1  # the fox {i * 3}" for i in range(6)]


def _model(model_type: str, tied: bool, hidden: int = 48):
    m = tiny_causal_lm(
        model_type,
        vocab_size=260,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    ).float()
    with torch.no_grad():  # non-trivial norm weights: the fold must carry them
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 2.0)
    return m


def _log_probs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), dim=-1)


def _kl(a, b):
    return (a.exp() * (a - b)).sum(-1)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_rotation_is_exact_in_float(model_type, tied):
    model = _model(model_type, tied)
    rotated = copy.deepcopy(model)
    rec = rotate_residual(rotated, seed=5)
    ids = torch.randint(0, 260, (2, 33), generator=torch.Generator().manual_seed(0))
    kl = _kl(_log_probs(model, ids), _log_probs(rotated, ids))
    # the brief's bound for the fold in fp32: per-token KL <= 1e-5
    assert float(kl.max()) <= 1e-5
    assert rec.size == 48 and rec.kind == "hadamard" and rec.untied == tied
    assert is_rotated(rotated) == rec and is_rotated(model) is None
    head, emb = rotated.lm_head.weight, rotated.get_input_embeddings().weight
    assert head.data_ptr() != emb.data_ptr()
    assert rotated.config.tie_word_embeddings is False
    assert "lm_head.weight" not in (getattr(rotated, "all_tied_weights_keys", {}) or {})
    for i in range(2):
        norm = rotated.model.layers[i].input_layernorm.weight
        assert torch.equal(norm, torch.ones_like(norm))


def test_rotation_is_orthogonal_and_seeded():
    q = rotation_matrix(48, 3)
    assert torch.allclose(q @ q.t(), torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, rotation_matrix(48, 3))
    assert not torch.equal(q, rotation_matrix(48, 4))


def test_streaming_steps_equal_the_whole_model_bit_for_bit():
    """What a one-layer-at-a-time calibration does: untie, rotate the embedding,
    each layer as it is loaded, the head at the end."""
    whole = _model("llama", True)
    steps = copy.deepcopy(whole)
    rotate_residual(whole, seed=2)
    q = rotation_matrix(48, 2)
    assert untie_head(steps)
    rotate_embeddings(steps, q)
    for i in range(2):
        rotate_decoder_layer(steps, i, q)
    rotate_head(steps, q)
    a, b = whole.state_dict(), steps.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_refusals_leave_the_model_unchanged():
    gpt2 = tiny_causal_lm(
        "gpt2", attn=None, n_embd=16, n_layer=1, n_head=2, vocab_size=260
    )
    assert not supports_rotation(gpt2)
    with pytest.raises(UnsupportedError, match="model_type 'gpt2'"):
        rotate_residual(gpt2)
    model = _model("llama", False)
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match="down_proj is Identity"):
        rotate_residual(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    ok = _model("llama", False)
    rotate_residual(ok)
    with pytest.raises(InputError, match="already rotated"):
        rotate_residual(ok)
    with pytest.raises(InputError, match=r"must be \[48, 48\]"):
        rotate_embeddings(_model("llama", False), torch.eye(4))
    tied = _model("llama", True)
    with pytest.raises(InputError, match="untie the head first"):
        rotate_head(tied, rotation_matrix(48, 0))


def _batches(tok):
    return list(calibration_batches(tok, TEXTS, max_length=40, batch_size=3))


def test_static_w8a8_rotates_and_exports_a_loadable_untied_artifact(tmp_path):
    tok = byte_tokenizer()
    model = tiny_llama(tie_word_embeddings=True)
    cfg = LinearConfig("W8A8", torch.bfloat16, fallback=0, rotate=True)
    result = calibrate_linears(model, _batches(tok), cfg)
    assert result.rotation == {
        "size": 64,
        "seed": 0,
        "kind": "hadamard",
        "untied": True,
    }
    assert result.to_report()["rotation"] == result.rotation
    enc = tok(TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model(**enc).logits
    state = export_state(model, {k: v.clone() for k, v in model.state_dict().items()})
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    fresh = tiny_llama(tie_word_embeddings=True)  # the source model: tied
    load_quantized_model(fresh, load_file(str(path)))
    assert fresh.lm_head.weight.data_ptr() != fresh.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(fresh(**enc).logits, want)


def test_rotation_is_opt_in_and_never_for_rtn():
    tok = byte_tokenizer()
    dyn = calibrate_linears(tiny_llama(), _batches(tok), LinearConfig(fallback=0))
    rtn = calibrate_linears(
        tiny_llama(),
        _batches(tok),
        LinearConfig.round_to_nearest("W8A8", torch.bfloat16),
    )
    assert dyn.rotation is None and rtn.rotation is None
    forced = tiny_causal_lm(
        "gpt2", attn=None, n_embd=16, n_layer=1, n_head=2, vocab_size=260
    )
    with pytest.raises(UnsupportedError, match="model_type 'gpt2'"):
        calibrate_linears(forced, _batches(tok), LinearConfig(rotate=True, fallback=0))


def test_the_artifact_writer_keeps_the_untied_head():
    from ascend_fa.artifact import checkpoint_state_dict

    model = _model("llama", True)
    assert "lm_head.weight" not in checkpoint_state_dict(model, torch.bfloat16)
    rotate_residual(model)
    state = checkpoint_state_dict(model, torch.bfloat16)
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight.bfloat16())
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
