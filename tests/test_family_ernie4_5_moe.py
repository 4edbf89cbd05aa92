"""ERNIE-4.5-MoE (``ernie4_5_moe``): GQA attention with interleaved RoPE, a dense
first layer, then routed experts beside shared experts.

A tiny random model is calibrated for ``--target vllm`` (FP8 KV-cache scales,
loaded by the real vLLM 0.32 in ``tests/test_vllm_families.py``). vllm-ascend has
no ernie mapping at any release here (rule ``quant.ernie-no-mapping``); MindIE's
atb ``ernie_moe`` builds no FA3 and serves quantized linears only, which ascend-fa
does not write for this family: both refuse in one line and ``inspect`` agrees.
The tiny model shows only that the path runs, not accuracy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import byte_tokenizer, tiny_causal_lm
from safetensors.torch import load_file

from ascend_fa.artifact import inspect_artifact
from ascend_fa.artifact.mindie_models import mindie_model
from ascend_fa.cli import main
from ascend_fa.families import ERNIE4_5_MOE, attention_kind

CONFIG = dict(
    vocab_size=260, max_position_embeddings=256, hidden_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, tie_word_embeddings=False, intermediate_size=32,
    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    moe_num_shared_experts=1, moe_layer_start_index=1,
)  # fmt: skip
ARGS = ["--num-samples", "2", "--max-length", "12", "--batch-size", "2"]
ARGS += ["--heldout", "0", "--no-report", "-q"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ernie4_5_moe") / "src"
    tiny_causal_lm("ernie4_5_moe", attn=None, **CONFIG).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_family_is_data():
    assert attention_kind("ernie4_5_moe") is ERNIE4_5_MOE
    assert ERNIE4_5_MOE.fa_targets == () and ERNIE4_5_MOE.kv_cache_targets
    m = mindie_model("ernie4_5_moe")
    assert m.model == "ernie_moe" and m.fa3 is None and m.refusal


def test_vllm_artifact_and_refusals(src, tmp_path, capsys):
    out = tmp_path / "vllm"
    argv = ["calibrate", "--model", str(src), *ARGS]
    assert main([*argv, "--target", "vllm", "--output", str(out)]) == 0
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    scales = sorted(n for n in tensors if n.endswith(("k_scale", "v_scale")))
    assert scales == [
        f"model.layers.{i}.self_attn.{s}_scale" for i in range(2) for s in "kv"
    ]
    assert all(tensors[n].shape == (1,) and tensors[n].item() > 0 for n in scales)
    assert inspect_artifact(out, target="vllm")["findings"] == []
    capsys.readouterr()
    for release in ("0.13.0", "0.18.0", "0.23.0.post1", "main"):
        bad = tmp_path / release
        rc = main([*argv, "--target", "vllm-ascend", "--consumer-version", release,
                   "--output", str(bad)])  # fmt: skip
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and not bad.exists(), line
        assert release in line and "Ernie4_5_MoeForCausalLM" in line
        assert "quant.ernie-no-mapping" in line and "--target vllm" in line
    bad = tmp_path / "mindie"
    rc = main([*argv, "--target", "mindie", "--linear", "w8a8", "--output", str(bad)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not bad.exists(), line
    assert "MindIE 3.0.0" in line and "ernie4_5_moe" in line and "ernie_moe" in line
    report = inspect_artifact(out, target="vllm-ascend", consumer_version="0.18.0")
    assert any("quant.ernie-no-mapping" in f for f in report["findings"]), report
