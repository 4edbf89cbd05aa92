"""``bench serving``'s peer: the compressed-tensors W8A8 twin of a float model
(what vLLM's own int8 path loads). The decoder linears' codes and scales equal a
naive per-row symmetric quantization, everything else is the source's bytes, the
config says compressed-tensors int8 channel / dynamic token; bad sources are
refused with one line and nothing written. (vLLM itself loads the twin in the
``bench serving --quick`` smoke run of CI.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_fa.benchmarks.int8_twin import (
    TWIN_QUANTIZATION_CONFIG,
    is_twin_linear,
    write_int8_twin,
)
from ascend_fa.errors import InputError


def _source(tmp_path, extra=None):
    gen = torch.Generator().manual_seed(0)
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "model.embed_tokens.weight": torch.randn(11, 8, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.rand(8, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 5, generator=gen),
        "model.layers.0.mlp.down_proj.bias": torch.randn(8, generator=gen),
        "lm_head.weight": torch.randn(11, 8, generator=gen),
    }
    tensors["model.layers.0.mlp.down_proj.weight"][3] = 0.0  # all-zero row
    tensors.update(extra or {})
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    return src, tensors


def _naive(w):
    rows, scales = [], []
    for row in w.tolist():
        s = max(max(abs(v) for v in row) / 127, 2**-23)
        s = torch.tensor(s, dtype=torch.float32).item()
        rows.append([max(-128, min(127, round(v / s))) for v in row])
        scales.append(s)
    return torch.tensor(rows, dtype=torch.int8), torch.tensor(scales)[:, None]


def test_twin_quantizes_decoder_linears_and_keeps_the_rest(tmp_path):
    src, tensors = _source(tmp_path)
    out = tmp_path / "twin"
    assert write_int8_twin(src, out) == 2
    got = load_file(str(out / "model.safetensors"))
    for name in ("q_proj", "down_proj"):
        key = next(k for k in tensors if f"{name}.weight" in k)
        codes, scale = _naive(tensors[key].float())
        assert got[key].dtype == torch.int8
        assert torch.equal(got[key], codes)
        ws = got[key.replace(".weight", ".weight_scale")]
        assert ws.dtype == torch.float32 and ws.shape == (codes.shape[0], 1)
        assert torch.equal(ws, scale)
    for key in ("model.embed_tokens.weight", "lm_head.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.mlp.down_proj.bias"):  # fmt: skip
        assert torch.equal(got[key], tensors[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    q = config["quantization_config"]
    assert q == TWIN_QUANTIZATION_CONFIG
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel"
    assert group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True
    assert (out / "tokenizer.json").read_text() == "{}"


def test_twin_linear_names():
    assert is_twin_linear("model.layers.3.self_attn.qkv_proj.weight", (4, 4))
    assert is_twin_linear("model.language_model.layers.0.mlp.up_proj.weight", (4, 4))
    assert not is_twin_linear("model.layers.3.self_attn.q_proj.bias", (4,))
    assert not is_twin_linear("lm_head.weight", (4, 4))
    assert not is_twin_linear("model.layers.0.input_layernorm.weight", (4,))


def test_twin_refuses_a_quantized_source(tmp_path):
    src, _ = _source(tmp_path)
    (src / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8"}})
    )
    with pytest.raises(InputError, match="already has a quantization_config"):
        write_int8_twin(src, tmp_path / "twin")
    assert not (tmp_path / "twin").exists()


def test_twin_refuses_routed_experts(tmp_path):
    extra = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(4, 4)}
    src, _ = _source(tmp_path, extra)
    with pytest.raises(InputError, match="routed experts"):
        write_int8_twin(src, tmp_path / "twin")
    assert not (tmp_path / "twin").exists()
