"""This year's MLA families: ``kimi_k2`` (calibrated), ``longcat_flash`` and
``deepseek_v4`` (refused in one line).

Kimi-K2's config.json says ``model_type: kimi_k2`` on ``DeepseekV3ForCausalLM``
and transformers has no class of its own for it: ascend-fa builds it through the
DeepSeek-V3 classes (``families.BUILT_AS``) and leaves the file as the user gave
it, so the artifact keeps ``kimi_k2`` (what vllm-ascend's packed-module mapping
and MindIE's Kimi-K2 router key on). On a tiny random checkpoint: the model is
transformers' DeepSeek-V3 with the same logits, ``calibrate --target
vllm-ascend`` writes FAKQuant + W8A8_DYNAMIC under ``kimi_k2`` and ``inspect``
accepts it (the real loaders' verdicts are the slow suite's:
``test_vllm_ascend_loader.py``, ``test_mindie_own_code.py``). The tiny models
show only that the path runs, not accuracy.
"""

from __future__ import annotations

import json

import pytest
import torch
from builders import save_kimi_k2, save_tiny

from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact
from ascend_fa.cli import main
from ascend_fa.families import (
    MLA,
    attention_kind,
    built_as,
    family_refusal,
    moe_layout,
)
from ascend_fa.hf_compat import family_config
from ascend_fa.models import load_model

TEXTS = [
    f"Sample {i}: the quick brown fox jumps over {i * 7} lazy dogs" for i in range(6)
]


def _calib(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_kimi_k2_is_mla_built_through_deepseek_v3(tmp_path):
    assert attention_kind("kimi_k2") is MLA and built_as("kimi_k2") == "deepseek_v3"
    assert moe_layout("kimi_k2") == moe_layout("deepseek_v3")
    src = save_kimi_k2(tmp_path / "kimi")
    stated = json.loads((src / "config.json").read_text())
    assert stated["model_type"] == "kimi_k2" and "auto_map" in stated
    config = family_config(stated)
    assert type(config).__name__ == "DeepseekV3Config"
    assert not hasattr(config, "auto_map")  # the checkpoint's remote code never runs
    loaded = load_model(src, dtype=torch.float32)
    assert type(loaded.model).__name__ == "DeepseekV3ForCausalLM"
    # the same weights as a DeepSeek-V3 checkpoint: the same model
    ref_dir = save_tiny(
        tmp_path / "ds", "deepseek_v3", dtype=torch.bfloat16,
        topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
    )  # fmt: skip
    ref = load_model(ref_dir, dtype=torch.float32).model
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, ref(ids).logits)
    # the file is the user's, unchanged
    assert json.loads((src / "config.json").read_text()) == stated


def test_calibrate_kimi_k2_for_vllm_ascend_keeps_its_model_type(tmp_path, capsys):
    src = save_kimi_k2(tmp_path / "kimi", q_lora_rank=32)
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(src), "--calib-data", str(_calib(tmp_path))]
    argv += ["--num-samples", "2", "--max-length", "16", "--batch-size", "2"]
    argv += ["--heldout", "0", "--no-report", "-q", "--target", "vllm-ascend"]
    assert main([*argv, "--output", str(out)]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k2"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (out / "configuration_deepseek.py").is_file()  # the source's file
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["fa_quant_type"] == "FAKQuant"
    assert desc["metadata"]["ascend_fa_source"]["model_type"] == "kimi_k2"
    fa = sorted(k for k in desc if ".fa_" in k)
    assert fa and all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in fa)
    report = inspect_artifact(out, target="vllm-ascend")
    assert report["valid"], report["findings"]
    # vllm-ascend 0.13.0 drops FAKQuant for DeepseekV3ForCausalLM, as for DeepSeek-V3
    assert main(["inspect", str(out), "--consumer-version", "0.13.0"]) == 1
    capsys.readouterr()
    refused = tmp_path / "refused"
    rc = main([*argv, "--consumer-version", "0.13.0", "--output", str(refused)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not refused.exists() and "0.13.0" in line
    # the same artifact under a family no artifact is written for: inspect says so
    config["model_type"] = "deepseek_v4"
    (out / "config.json").write_text(json.dumps(config))
    report = inspect_artifact(out, target="vllm-ascend")
    assert any(f.startswith("config.json: deepseek_v4 (") for f in report["findings"])
    assert main(["inspect", str(out), "--target", "vllm-ascend"]) == 1


@pytest.mark.parametrize("model_type", ["longcat_flash", "deepseek_v4"])
@pytest.mark.parametrize("target", ["vllm-ascend", "mindie", "vllm"])
def test_the_other_mla_families_are_refused_in_one_line(
    model_type, target, tmp_path, capsys
):
    """Refused before anything loads (config.json is all it reads), in one line
    naming the family, the target and the reason; ``inspect`` reports an
    artifact of it (exit 1)."""
    import transformers

    src = tmp_path / "src"
    src.mkdir()
    transformers.AutoConfig.for_model(model_type).save_pretrained(src)
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(src), "--calib-data", str(_calib(tmp_path))]
    rc = main([*argv, "--target", target, "-q", "--output", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert f"{model_type} (--target {target})" in line
    assert target != "mindie" or "MindIE 3.0.0 has no model" in line
    assert family_refusal(model_type, target) in line
