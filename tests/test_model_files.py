"""An artifact's config.json is the source's, kept key for key, and the source's
other model files are copied as msModelSlim copies them; a config a
transformers-4 reader would take another RoPE from is reported by ``inspect``."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import (  # noqa: E402
    TF4_LLAMA3_CONFIG,
    TF4_QWEN3_CONFIG,
    TF4_SOURCE_FILES,
    transformers4_source,
)

from ascend_fa.artifact import (  # noqa: E402
    artifact_config,
    copy_model_files,
    rope_findings,
    with_transformers4_rope,
)
from ascend_fa.artifact import model_files as mf  # noqa: E402
from ascend_fa.cli import main  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b  # small helper",
    "Ascend NPUs run attention with int8 caches in fractal layouts.",
    "A lighthouse keeper climbed the stairs every evening at dusk.",
]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


# --- rope_findings: a pure function on the config dict ------------------------


def test_transformers4_config_has_nothing_to_disagree_with():
    assert rope_findings(TF4_LLAMA3_CONFIG) == []
    assert rope_findings(TF4_QWEN3_CONFIG) == []
    assert with_transformers4_rope(TF4_LLAMA3_CONFIG) == TF4_LLAMA3_CONFIG


def test_transformers5_llama3_config_is_reported_until_the_keys_are_added():
    tf5 = {"model_type": "llama", "rope_parameters": dict(LLAMA3_ROPE)}
    found = rope_findings(tf5)
    assert len(found) == 2
    assert "rope_theta missing" in found[0] and "500000.0" in found[0]
    assert "rope_scaling missing" in found[1] and "'llama3'" in found[1]
    fixed = with_transformers4_rope(tf5)
    assert fixed["rope_theta"] == 500000.0
    assert fixed["rope_scaling"] == {
        k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"
    }
    assert fixed["rope_parameters"] == LLAMA3_ROPE
    assert rope_findings(fixed) == []


@pytest.mark.parametrize(
    "config, problem",
    [
        # counter-examples: each a config transformers 4 reads differently
        ({"rope_theta": 10000.0}, "rope_theta 10000.0 but rope_parameters has"),
        ({"rope_theta": 500000.0, "rope_scaling": None}, "rope_scaling missing"),
        (
            {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 4.0}},
            "rope_scaling.factor is 4.0 but rope_parameters.factor is 8.0",
        ),
        (
            {
                "rope_theta": 500000.0,
                "rope_scaling": {"type": "linear", "factor": 8.0},
            },
            "rope_scaling is 'linear' but rope_parameters is 'llama3'",
        ),
    ],
)
def test_llama3_counter_examples(config, problem):
    found = rope_findings({"rope_parameters": dict(LLAMA3_ROPE), **config})
    assert any(problem in f for f in found), found


def test_default_rope():
    default = {"rope_theta": 1000000.0, "rope_type": "default"}
    # transformers 4 falls back to 10000: the same RoPE only when that is theta
    assert rope_findings({"rope_parameters": {**default, "rope_theta": 10000.0}}) == []
    assert "rope_theta missing" in rope_findings({"rope_parameters": default})[0]
    # an integer theta equals its float spelling
    assert rope_findings({"rope_parameters": default, "rope_theta": 1000000}) == []
    scaled = {
        "rope_parameters": default,
        "rope_theta": 1e6,
        "rope_scaling": LLAMA3_ROPE,
    }
    assert "scales it" in rope_findings(scaled)[0]
    nested = {"rope_parameters": {"full_attention": default, "sliding": default}}
    assert rope_findings(nested) == []  # per layer type: no transformers-4 spelling
    kept = with_transformers4_rope({"rope_parameters": default, "rope_theta": 5.0})
    assert kept["rope_theta"] == 5.0  # a present key is never changed


# --- artifact_config ------------------------------------------------------------


def test_artifact_config_keeps_the_source():
    source = {
        **TF4_QWEN3_CONFIG,
        "quantization_config": {"quant_method": "fp8"},
        "text_config": {"quantization_config": {}, "hidden_size": 64},
    }
    model = {"tie_word_embeddings": True, "rope_parameters": {}}
    for target in ("mindie", "vllm-ascend", None):
        cfg = artifact_config(model, target, torch.float16, source=source)
        assert cfg == {
            **TF4_QWEN3_CONFIG,
            "torch_dtype": "float16",
            "text_config": {"hidden_size": 64},
        }
    cfg = artifact_config(model, "vllm", torch.bfloat16, source=source)
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    # transformers 5's spelling is set too when the source has it
    tf5 = {"dtype": "float32", "tie_word_embeddings": True}
    cfg = artifact_config(model, "mindie", torch.bfloat16, source=tf5)
    assert cfg == {**tf5, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    # a calibration that untied the head (a residual rotation) says so
    untied = artifact_config(
        {"tie_word_embeddings": False}, "mindie", torch.bfloat16, source=source
    )
    assert untied["tie_word_embeddings"] is False


def test_gguf_config_gets_transformers4_rope_keys():
    loaded = {
        "model_type": "llama",
        "_name_or_path": "/somewhere",
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    }
    cfg = artifact_config(loaded, "mindie", torch.bfloat16)
    assert cfg["rope_theta"] == 100000.0 and "rope_scaling" not in cfg
    assert "_name_or_path" not in cfg and cfg["torch_dtype"] == "bfloat16"
    assert rope_findings(cfg) == []


# --- copy_model_files -----------------------------------------------------------


def test_copy_model_files_as_msmodelslim(tmp_path, monkeypatch, caplog):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    files = {
        "generation_config.json": "{}",
        "tokenizer.json": "{}",
        "tokenizer.model": "spm",
        "chat_template.jinja": "{{ x }}",
        "modeling_custom.py": "# remote code",
        "merges.txt": "#version: 0.2",
        # never copied: weights, indexes, the artifact's own files, hidden files
        "model.safetensors": "weights",
        "model.safetensors.index.json": "{}",
        "pytorch_model.bin": "pickle",
        "config.json": "{}",
        "quant_model_description.json": "{}",
        "calibration_report.json": "{}",
        ".hidden.json": "{}",
        "README.md": "readme",
        "big.json": "x" * 100,
    }
    for name, text in files.items():
        (src / name).write_text(text)
    (src / "sub").mkdir()
    (src / "sub" / "inner.json").write_text("{}")
    outside = tmp_path / "secret.json"
    outside.write_text("secret")
    os.symlink(outside, src / "linked_out.json")
    os.symlink(src / "merges.txt", src / "linked_in.txt")
    monkeypatch.setattr(mf, "MAX_COPIED_FILE_BYTES", 50)
    copied = copy_model_files(src, dest)
    want = [
        "chat_template.jinja",
        "generation_config.json",
        "linked_in.txt",
        "merges.txt",
        "modeling_custom.py",
        "tokenizer.json",
        "tokenizer.model",
    ]
    assert copied == want
    assert sorted(p.name for p in dest.iterdir()) == want
    for name in want:
        assert not (dest / name).is_symlink()
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    assert "linked_out.json" in caplog.text and "big.json" in caplog.text


# --- calibrate: the source's config.json and files kept ----------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf4")
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return data, {
        "llama3": transformers4_source(root / "llama3", TF4_LLAMA3_CONFIG),
        "qwen3": transformers4_source(root / "qwen3", TF4_QWEN3_CONFIG),
    }


def _calibrate(src, out, data, *extra):
    args = ["calibrate", "--model", str(src), "--calib-data", str(data)]
    args += ["--num-samples", "3", "--heldout", "1", "--max-length", "24"]
    return main([*args, "--output", str(out), "-q", *extra])


def _check_kept(src, out, target, release=()):
    source = json.loads((src / "config.json").read_text())
    got = json.loads((out / "config.json").read_text())
    assert got.pop("torch_dtype") == "bfloat16"
    qc = got.pop("quantization_config", None)
    assert (qc is not None) == (target == "vllm")
    source.pop("torch_dtype")
    rotation = json.loads((out / "calibration_report.json").read_text())
    rotation = (rotation.get("linears") or {}).get("rotation")
    if rotation is not None and rotation["untied"]:
        # static W8A8 rotates by default (--rotate auto): a tied head is untied,
        # the one key that changes
        assert source["tie_word_embeddings"] is True
        assert got["tie_word_embeddings"] is False
        got["tie_word_embeddings"] = True
    assert got == source  # every other key with its value, in the source's order
    assert list(got) == list(source)
    for name in TF4_SOURCE_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "model.safetensors").exists()
    assert main(["inspect", str(out), "--target", target, *release]) == 0


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("target", ["mindie", "vllm-ascend", "vllm"])
def test_calibrate_keeps_the_source_config(sources, tmp_path, name, target):
    data, models = sources
    out = tmp_path / "out"
    # vllm-ascend loads a Llama's C8 from 0.25.1rc1 on (Qwen3's in the default)
    release = ["--consumer-version", "0.25.1rc1"] if target == "vllm-ascend" else []
    assert _calibrate(models[name], out, data, "--target", target, *release) == 0
    _check_kept(models[name], out, target, release)
    if name == "llama3":  # what a transformers-4 reader takes
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["rope_theta"] == 500000.0
        assert cfg["rope_scaling"]["rope_type"] == "llama3"


def test_streaming_calibration_keeps_the_source_config(sources, tmp_path):
    data, models = sources
    out = tmp_path / "out"
    rc = _calibrate(models["llama3"], out, data, "--target", "mindie", "--streaming")
    assert rc == 0
    _check_kept(models["llama3"], out, "mindie")


def test_inspect_reports_a_config_read_with_another_rope(sources, tmp_path, capsys):
    data, models = sources
    out = tmp_path / "out"
    assert _calibrate(models["llama3"], out, data, "--target", "mindie") == 0
    cfg = json.loads((out / "config.json").read_text())
    # what a transformers-5 re-serialization writes: rope_parameters only
    cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": 500000.0}
    del cfg["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["inspect", str(out), "--target", "mindie"]) == 1
    text = capsys.readouterr().out
    assert "rope_theta missing at the top level" in text
    assert "rope_scaling missing" in text
