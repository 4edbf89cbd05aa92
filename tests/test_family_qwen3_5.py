"""This year's GQA families: Qwen3.5 / Qwen3.5-MoE as their multimodal wrappers,
gpt-oss and Llama 4 (text).

Qwen3.5's released checkpoints are ``Qwen3_5(Moe)ForConditionalGeneration``: the
language model under ``model.language_model.*``, a vision tower under
``model.visual.*``. A tiny random wrapper (:func:`builders.save_tiny_wrapper`: 4
layers, the last one full attention) is calibrated through its language model;
the artifact keeps the checkpoint's own names, the vision tower byte for byte (its
dtype too) and config.json as the source has it; the Gated DeltaNet projections
vllm-ascend packs (``in_proj_qkvz`` = qkv + z, ``in_proj_ba`` = b + a) share one
type per pair. The release verdicts are the real loader's
(``tests/test_vllm_ascend_loader.py``): 0.18.0 / 0.23.0.post1 drop the C8 scales
silently, so ``calibrate`` refuses them in one line and ``inspect`` agrees.

gpt-oss and Llama 4 have no quantization mapping in vllm-ascend and no MindIE
model: both Ascend targets refuse in one line before anything loads; ``--target
vllm`` (FP8 KV scales, loaded by the real vLLM in ``tests/test_vllm_families.py``)
runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import save_tiny_wrapper, tiny_causal_lm
from safetensors import safe_open

from ascend_fa.adapters import get_adapter
from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.cli import main
from ascend_fa.families import QWEN3_5, VLLM_ONLY, attention_kind, wrapper
from ascend_fa.linear.io import spec_in_memory

ARGS = ["--num-samples", "2", "--max-length", "12", "--batch-size", "2"]
ARGS += ["--heldout", "0", "--no-report", "-q"]
FULL = "model.language_model.layers.3.self_attn"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save_tiny_wrapper(
        tmp_path_factory.mktemp("qwen3_5_moe") / "src", "qwen3_5_moe"
    )


@pytest.fixture(scope="module")
def artifact(src, tmp_path_factory) -> Path:
    """W8A8_DYNAMIC linears + C8, for the release whose loader maps Qwen3.5's C8
    (vllm-ascend main: get_cache_scale_mapper)."""
    out = tmp_path_factory.mktemp("art") / "out"
    argv = ["calibrate", "--model", str(src), *ARGS, "--target", "vllm-ascend"]
    argv += ["--consumer-version", "main", "--linear", "w8a8_dynamic"]
    assert main([*argv, "--output", str(out)]) == 0
    return out


def _tensors(directory: Path, pattern: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob(pattern)):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def test_families_are_data():
    for t in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        assert attention_kind(t) is QWEN3_5
    assert QWEN3_5.kv_cache_targets and not QWEN3_5.paged_emulation
    assert wrapper("qwen3_5_moe").checkpoint_name("model.layers.3.self_attn") == FULL
    assert wrapper("qwen3_5_moe").checkpoint_name("lm_head.weight") == "lm_head.weight"
    assert wrapper("qwen3_5_moe_text") is None
    for t in ("gpt_oss", "llama4_text"):
        assert attention_kind(t) is VLLM_ONLY and VLLM_ONLY.fa_targets == ()


def test_wrapper_artifact_keeps_the_checkpoints_names_and_vision(src, artifact):
    source = _tensors(src, "model*.safetensors")
    written = _tensors(artifact, "quant_model_weights*.safetensors")
    desc = json.loads((artifact / DESCRIPTION_FILE).read_text())
    # every tensor under a name of the checkpoint's (no text-model names)
    assert not [n for n in written if n.startswith("model.layers.")]
    # every source tensor but the routed experts (split per expert, quantized)
    # is written under its own name
    assert {n for n in source if ".mlp.experts." not in n} <= set(written)
    # the vision tower as the source holds it: names, dtype, bytes; FLOAT
    visual = [n for n in source if n.startswith("model.visual.")]
    assert visual
    for n in visual:
        assert written[n].dtype == source[n].dtype and torch.equal(
            written[n], source[n]
        )
        assert desc[n] == "FLOAT"
    # config.json: the source's (the wrapper's), key for key; the artifact
    # states its dtype as torch_dtype too (what the transformers-4 readers read)
    config = json.loads((artifact / "config.json").read_text())
    assert config.pop("torch_dtype") == "bfloat16"
    assert config == json.loads((src / "config.json").read_text())
    # packed pairs share one type; C8 on the full-attention layer only
    a = "model.language_model.layers.0.linear_attn"
    assert desc[f"{a}.in_proj_qkv.weight"] == desc[f"{a}.in_proj_z.weight"]
    assert desc[f"{a}.in_proj_qkv.weight"] == "W8A8_DYNAMIC"
    assert desc[f"{a}.in_proj_b.weight"] == desc[f"{a}.in_proj_a.weight"] == "FLOAT"
    c8 = sorted(n for n in written if n.endswith(".kv_cache_scale"))
    assert c8 == [f"{FULL}.k_proj.kv_cache_scale", f"{FULL}.v_proj.kv_cache_scale"]
    meta = desc["metadata"]["ascend_fa_source"]
    assert meta["model_type"] == "qwen3_5_moe"
    assert meta["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]


def test_wrapper_release_verdicts(src, artifact, tmp_path, capsys):
    assert main(["inspect", str(artifact), "--target", "vllm-ascend"]) == 0
    capsys.readouterr()
    for release in ("0.23.0.post1", "0.18.0"):
        report = inspect_artifact(
            artifact, target="vllm-ascend", consumer_version=release
        )
        assert any("c8.qwen3-5-dropped" in f for f in report["findings"]), report
        out = tmp_path / release
        argv = ["calibrate", "--model", str(src), *ARGS, "--target", "vllm-ascend"]
        rc = main([*argv, "--consumer-version", release, "--output", str(out)])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and not out.exists()
        assert release in line and "silently" in line and "c8.qwen3-5-dropped" in line
    out = tmp_path / "mindie"
    rc = main(["calibrate", "--model", str(src), *ARGS, "--target", "mindie",
               "--output", str(out)])  # fmt: skip
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "qwen3_5" in line and "no model" in line and not out.exists()


def test_adapter_covers_the_full_attention_layers_only(src):
    import transformers

    net = transformers.AutoModelForCausalLM.from_pretrained(src)
    names = [n for n, _ in get_adapter(net).attention_modules(net)]
    assert names == ["model.layers.3.self_attn"]
    # eval / emulate read the artifact's scales under the loaded model's names
    assert list(spec_in_memory(net, {FULL: {}})) == names


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_ascend_targets_refuse_in_one_line(model_type, tmp_path, capsys):
    src = tmp_path / "src"
    tiny_causal_lm(model_type, attn=None, vocab_size=260, hidden_size=32,
                   intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16,
                   num_local_experts=2, num_experts_per_tok=1,
                   ).save_pretrained(src)  # fmt: skip
    arch = {"gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM"}
    for target, release in (("vllm-ascend", "0.23.0.post1"), ("mindie", "3.0.0")):
        out = tmp_path / target
        rc = main(["calibrate", "--model", str(src), *ARGS, "--target", target,
                   "--output", str(out)])  # fmt: skip
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and not out.exists(), line
        if target == "vllm-ascend":
            assert release in line and arch[model_type] in line
            assert "quant.no-mapping" in line and "--target vllm" in line
        else:
            assert "MindIE 3.0.0" in line and model_type in line
