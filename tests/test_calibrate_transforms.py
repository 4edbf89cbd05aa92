"""``calibrate --transforms``: folded weights in every target's artifact, the
description and report say what was folded, evaluation reads the stored weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from builders import save_tiny

from ascend_fa.cli import main
from ascend_fa.linear import artifact_model, read_artifact_tensors

ALL = "v-rotation,qk-smoothing"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("m") / "qwen2", "qwen2")


def _calibrate(model_dir, out, *extra, target="vllm-ascend", linear="none"):
    # Qwen2 C8 loads from vllm-ascend 0.25.1rc1 on (ascend_fa.artifact.releases)
    release = ["--consumer-version", "0.25.1rc1"] if target == "vllm-ascend" else []
    return main(
        [
            "calibrate",
            "--target",
            target,
            *release,
            "--model",
            str(model_dir),
            "--num-samples",
            "4",
            "--max-length",
            "32",
            "--batch-size",
            "2",
            "--heldout",
            "2",
            "--linear",
            linear,
            "--no-report",
            "--output",
            str(out),
            *extra,
        ]
    )


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@torch.no_grad()
def _kl(ref: torch.nn.Module, other: torch.nn.Module) -> float:
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    p = torch.log_softmax(ref(input_ids=ids).logits.float(), -1)
    q = torch.log_softmax(other(input_ids=ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).max())


@pytest.mark.parametrize("target", ["vllm-ascend", "vllm"])
def test_folded_weights_in_float_linear_artifacts(qwen2, tmp_path, target):
    plain, folded = tmp_path / "plain", tmp_path / "folded"
    assert _calibrate(qwen2, plain, target=target) == 0
    assert _calibrate(qwen2, folded, "--transforms", ALL, target=target) == 0
    a, b = read_artifact_tensors(plain), read_artifact_tensors(folded)
    for name in ("v_proj.weight", "o_proj.weight"):
        key = f"model.layers.0.self_attn.{name}"
        assert a[key].dtype == b[key].dtype == torch.bfloat16
        assert not torch.equal(a[key], b[key]), key
    report = json.loads((folded / "calibration_report.json").read_text())
    assert report["transforms"]["folded"] == ["v-rotation", "qk-smoothing"]
    assert len(report["transforms"]["layers"]) == 2
    assert "qk_smoothing_exponent" in report["transforms"]["layers"][0]
    # The stored folded weights over the source model compute its function (up
    # to the bf16 rounding every artifact has).
    src = transformers.AutoModelForCausalLM.from_pretrained(qwen2).eval()
    assert artifact_model(src, plain) is None  # unfolded: the source's weights
    over = artifact_model(src, folded)
    assert over is not None
    assert _kl(src, over) <= 1e-3


def test_mindie_w8a8_description_names_the_folds(qwen2, tmp_path, capsys):
    out = tmp_path / "art"
    assert (
        _calibrate(qwen2, out, "--transforms", ALL, target="mindie", linear="w8a8") == 0
    )
    assert "folded v-rotation, qk-smoothing" in capsys.readouterr().out
    desc = json.loads((out / "quant_model_description.json").read_text())
    meta = desc["metadata"]
    assert set(meta["ascend_fa_transforms"]) == {"v-rotation", "qk-smoothing"}
    assert meta["ascend_fa_transforms_seed"] == 0
    assert desc["model.layers.0.self_attn.v_proj.weight"] == "W8A8"


def test_refusals(qwen2, tmp_path, capsys):
    assert _calibrate(qwen2, tmp_path / "a", "--transforms", "rotate") == 2
    assert "unknown transform 'rotate'" in _error(capsys)
    assert not (tmp_path / "a").exists()
    rc = main(
        ["calibrate", "--model", str(qwen2), "--merge-into", str(tmp_path / "x")]
        + ["--output", str(tmp_path / "c"), "--transforms", "v-rotation"]
    )
    assert rc == 2
    assert "--merge-into keeps the export's weights" in _error(capsys)
    ds = save_tiny(tmp_path / "ds", "deepseek_v3")
    capsys.readouterr()  # the builder's own output
    rc = _calibrate(
        ds, tmp_path / "b", "--transforms", "v-rotation", linear="w8a8_dynamic"
    )
    assert rc == 2
    assert "v-rotation has no MLA form" in _error(capsys)
    assert not (tmp_path / "b").exists()


def test_deepseek_latent_smoothing_in_the_artifact(tmp_path, capsys):
    """MLA ``qk-smoothing`` (the latent fold) goes into a FAKQuant artifact: the
    stored kv_a_layernorm / kv_b_proj differ from the plain run's, everything the
    fold does not touch is the same, the description says where it went."""
    ds = save_tiny(tmp_path / "ds", "deepseek_v3")
    plain, folded = tmp_path / "plain", tmp_path / "folded"
    for out, extra in ((plain, ()), (folded, ("--transforms", "qk-smoothing"))):
        rc = _calibrate(ds, out, *extra, linear="w8a8_dynamic")
        assert rc == 0, capsys.readouterr().err
    a, b = read_artifact_tensors(plain), read_artifact_tensors(folded)
    report = json.loads((folded / "calibration_report.json").read_text())
    layers = report["transforms"]["layers"]
    smoothed = [
        f"model.layers.{x['index']}"
        for x in layers
        if x.get("qk_smoothing_factor_range")
    ]
    assert smoothed, layers
    for layer in smoothed:
        key = f"{layer}.self_attn.kv_a_layernorm.weight"
        assert not torch.equal(a[key], b[key]), key
    for key in a:
        if "self_attn" not in key and "mlp" in key and key.endswith("norm.weight"):
            assert torch.equal(a[key], b[key]), key
    desc = json.loads((folded / "quant_model_description.json").read_text())
    where = desc["metadata"]["ascend_fa_transforms"]["qk-smoothing"]
    assert "kv_a_layernorm" in where and "kv_b_proj" in where


def test_bench_attention_accuracy_reads_artifacts_back(qwen2, tmp_path, capsys):
    out = tmp_path / "acc.json"
    args = ["bench", "attention-accuracy", "--model", str(qwen2), "--quick"]
    args += ["--num-samples", "2", "--max-length", "32"]
    assert main([*args, "--max-eval-tokens", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "artifact dtype bf16, read back" in text
    assert "calibration with transforms" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ascend-fa-bench/1"
    modes = {(r["mode"], r["params"]["domain"]) for r in doc["records"]}
    for mode in (
        "default",
        "msModelSlim-style recall_window/union",
        "v-rotation + qk-smoothing",
        "dynamic per-token-head (bound)",
        "dynamic + transforms (bound)",
    ):
        assert {(mode, "prose"), (mode, "code")} <= modes
    both = [r for r in doc["records"] if r["mode"] == "v-rotation + qk-smoothing"]
    assert set(both[0]["extra"]["verdicts"]) == {
        "cosine",
        "rel_l1",
        "kl",
        "ppl_delta_pct",
    }
    # The float control of each row is the source model: dynamic is the best.
    by = {(r["mode"], r["params"]["domain"]): r["extra"] for r in doc["records"]}
    assert by[("dynamic per-token-head (bound)", "prose")]["kl"] >= 0.0
