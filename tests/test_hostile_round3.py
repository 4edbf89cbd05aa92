"""Hostile inputs, round 3: broken quantized linears, another model's export or
artifact, duplicate JSON keys, bad counts and long argument values.

Every case runs the real CLI on real files (tiny random checkpoints, an
msModelSlim-shaped export from :func:`builders.msmodelslim_export`, calibrated
artifacts), broken by hand. A refusal is one line naming the file and tensor or
key, exit 2 (``inspect``: 1 for an invalid artifact), and nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from builders import msmodelslim_export, save_tiny  # noqa: E402

from ascend_fa.artifact import DESCRIPTION_FILE, inspect_artifact  # noqa: E402
from ascend_fa.artifact.provenance import (  # noqa: E402
    RELEASE_METADATA_KEY,
    SOURCE_METADATA_KEY,
)
from ascend_fa.cli import main  # noqa: E402

FAST = ["--num-samples", "3", "--max-length", "16", "--batch-size", "3"]
FAST += ["--heldout", "1", "-q"]
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("round3")
    llama = save_tiny(root / "llama", "llama")
    qwen3 = save_tiny(root / "qwen3", "qwen3")
    export = root / "export"
    msmodelslim_export(export, llama)
    artifacts = {}
    for name, src in (("llama", llama), ("qwen3", qwen3)):
        out = root / f"art-{name}"
        assert (
            main(["calibrate", "--model", str(src), "--output", str(out), *FAST]) == 0
        )
        artifacts[name] = out
    arts = {f"art-{k}": v for k, v in artifacts.items()}
    return {"root": root, "llama": llama, "qwen3": qwen3, "export": export, **arts}


def one_line(capsys, rc: int, want_rc: int, verb: str, *names: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == want_rc, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ascend-fa {verb}: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
    }


def broken_copy(src: Path, dst: Path, name: str, how: str) -> Path:
    """``src`` copied to ``dst`` with tensor ``name`` broken as ``how`` says."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        if name not in tensors:
            continue
        x = tensors[name].clone()
        if how == "nan":
            x.view(-1)[0] = float("nan")
        elif how == "inf":
            x.view(-1)[0] = float("inf")
        elif how == "zero":
            x = torch.zeros_like(x)
        elif how == "negative":
            x = -x
        elif how == "f32":
            x = x.float()
        elif how == "f64":
            x = x.double()
        elif how == "cut":
            x = x[:, :10].contiguous()
        tensors[name] = x
        save_file(tensors, str(f))
        return dst
    raise AssertionError(f"{name} not in {src}")


LINEAR_CASES = [
    ("deq_scale", "nan", "non-finite"),
    ("input_scale", "inf", "non-finite"),
    ("input_scale", "zero", "values <= 0"),
    ("deq_scale", "negative", "values <= 0"),
    ("weight", "f32", "dtype F32, expected I8"),
    ("deq_scale", "f64", "dtype F64"),
    ("weight", "cut", "[48, 10]"),
]


@pytest.mark.parametrize("part, how, message", LINEAR_CASES)
def test_merge_refuses_broken_linears(setup, tmp_path, capsys, part, how, message):
    bad = broken_copy(setup["export"], tmp_path / "bad", f"{Q}.{part}", how)
    before = tree(tmp_path)
    out = tmp_path / "merged"
    rc = main(
        ["calibrate", "--model", str(setup["llama"]), "--merge-into", str(bad)]
        + ["--output", str(out), *FAST]
    )
    one_line(capsys, rc, 2, "calibrate", str(bad), f"{Q}.{part}", message)
    assert not out.exists() and tree(tmp_path) == before
    # inspect finds the same, with and without a target
    for extra in ([], ["--target", "mindie"]):
        assert main(["inspect", str(bad), *extra]) == 1
        assert f"{Q}.{part}" in capsys.readouterr().out


@pytest.mark.parametrize("part, how, message", LINEAR_CASES[:4])
def test_calibrated_artifact_with_broken_linear(
    setup, tmp_path, capsys, part, how, message
):
    assert main(["inspect", str(setup["art-llama"])]) == 0
    capsys.readouterr()
    bad = broken_copy(setup["art-llama"], tmp_path / "bad", f"{Q}.{part}", how)
    result = inspect_artifact(bad)
    assert not result["valid"]
    assert any(f"{Q}.{part}" in f and message in f for f in result["findings"])
    # eval and emulate judge the linears before the model loads
    rc = main(
        ["eval", "--model", str(setup["llama"]), "--artifact", str(bad)]
        + ["--max-tokens", "64", "-q"]
    )
    one_line(capsys, rc, 2, "eval", str(bad), f"{Q}.{part}")
    rc = main(
        ["emulate", "--model", str(setup["llama"]), "--artifact", str(bad)]
        + ["--max-new-tokens", "2", "-q"]
    )
    one_line(capsys, rc, 2, "emulate", str(bad), f"{Q}.{part}")


def test_another_models_calibration_is_not_merged(setup, tmp_path, capsys):
    """A Qwen3 (same tensor shapes as the tiny Llama) into a Llama export."""
    out = tmp_path / "merged"
    rc = main(
        ["calibrate", "--model", str(setup["qwen3"]), "--merge-into"]
        + [str(setup["export"]), "--output", str(out), *FAST]
    )
    one_line(capsys, rc, 2, "calibrate", "belongs to another model")
    assert not out.exists()


def test_another_models_artifact_is_not_evaluated(setup, capsys):
    for verb, extra in (
        ("eval", ["--max-tokens", "64"]),
        ("emulate", ["--max-new-tokens", "2"]),
    ):
        rc = main(
            [
                verb,
                "--model",
                str(setup["llama"]),
                "--artifact",
                str(setup["art-qwen3"]),
                *extra,
                "-q",
            ]
        )
        one_line(capsys, rc, 2, verb, str(setup["art-qwen3"]), "'qwen3'", "'llama'")


def test_the_artifact_records_its_provenance(setup):
    desc = json.loads((setup["art-llama"] / DESCRIPTION_FILE).read_text())
    record = desc["metadata"][SOURCE_METADATA_KEY]
    assert record["model_type"] == "llama"
    assert record["architectures"] == ["LlamaForCausalLM"]
    assert isinstance(record["shapes"], str) and len(record["shapes"]) == 16
    assert desc["metadata"][RELEASE_METADATA_KEY] == "3.0.0"
    # the kept source config.json is the source's
    cfg = json.loads((setup["art-llama"] / "config.json").read_text())
    assert SOURCE_METADATA_KEY not in json.dumps(cfg)


def test_inspect_uses_the_recorded_release(setup, tmp_path, capsys):
    """A Llama C8 artifact for vllm-ascend 0.25.1rc1 (0.23.0.post1, the default,
    maps C8 for Qwen3 only) inspects valid without flags."""
    out = tmp_path / "c8"
    rc = main(
        ["calibrate", "--model", str(setup["llama"]), "--output", str(out)]
        + ["--target", "vllm-ascend", "--consumer-version", "0.25.1rc1", *FAST]
    )
    assert rc == 0, capsys.readouterr().err
    desc = json.loads((out / DESCRIPTION_FILE).read_text())
    assert desc["metadata"][RELEASE_METADATA_KEY] == "0.25.1rc1"
    assert main(["inspect", str(out)]) == 0
    assert inspect_artifact(out)["consumer_version"] == "0.25.1rc1"
    # an explicit version still wins
    assert main(["inspect", str(out), "--consumer-version", "0.23.0.post1"]) == 1
    # a recorded release the table does not hold is a finding, not a crash
    desc["metadata"][RELEASE_METADATA_KEY] = "9.9.9"
    (out / DESCRIPTION_FILE).write_text(json.dumps(desc))
    result = inspect_artifact(out)
    assert not result["valid"]
    assert any("9.9.9" in f for f in result["findings"])
    for hostile in ("x" * 100_000, 5, ["0.25.1rc1"]):
        desc["metadata"][RELEASE_METADATA_KEY] = hostile
        (out / DESCRIPTION_FILE).write_text(json.dumps(desc))
        assert main(["inspect", str(out)]) == 1
        printed = capsys.readouterr().out
        assert "metadata records" in printed and len(printed) < 5000


def test_duplicate_description_key_is_refused(setup, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(setup["export"], bad)
    text = (bad / DESCRIPTION_FILE).read_text()
    norm = "model.layers.0.input_layernorm.weight"
    text = text.replace(f'"{norm}": "FLOAT"', f'"{norm}": "FLOAT", "{norm}": "W8A8"')
    (bad / DESCRIPTION_FILE).write_text(text)
    before = tree(tmp_path)
    out = tmp_path / "merged"
    rc = main(
        ["calibrate", "--model", str(setup["llama"]), "--merge-into", str(bad)]
        + ["--output", str(out), *FAST]
    )
    one_line(capsys, rc, 2, "calibrate", DESCRIPTION_FILE, norm, "twice")
    assert not out.exists() and tree(tmp_path) == before
    assert main(["inspect", str(bad)]) == 1
    assert "twice" in capsys.readouterr().out


def test_duplicate_key_in_model_config_is_refused(setup, tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(setup["llama"], src)
    text = (src / "config.json").read_text()
    text = text.replace(
        '"num_hidden_layers": 2', '"num_hidden_layers": 2, "num_hidden_layers": 1'
    )
    (src / "config.json").write_text(text)
    out = tmp_path / "out"
    rc = main(["calibrate", "--model", str(src), "--output", str(out), *FAST])
    one_line(capsys, rc, 2, "calibrate", "config.json", "num_hidden_layers", "twice")
    assert not out.exists()


@pytest.mark.parametrize(
    "verb, args, message",
    [
        ("eval", ["--max-tokens", "-5"], "--max-tokens must be > 0, got -5"),
        ("eval", ["--max-tokens", "0"], "--max-tokens must be > 0, got 0"),
        ("emulate", ["--max-eval-tokens", "-3"], "--max-eval-tokens must be >= 0"),
        ("emulate", ["--block-size", "0"], "--block-size must be > 0, got 0"),
    ],
)
def test_counts_are_checked(setup, capsys, verb, args, message):
    rc = main(
        [
            verb,
            "--model",
            str(setup["llama"]),
            "--artifact",
            str(setup["art-llama"]),
            *args,
            "-q",
        ]
    )
    one_line(capsys, rc, 2, verb, message)


def test_a_long_argument_is_cut(setup, capsys):
    long = "x" * 100_000
    rc = main(
        [
            "inspect",
            str(setup["art-llama"]),
            "--target",
            "mindie",
            "--consumer-version",
            long,
        ]
    )
    line = one_line(capsys, rc, 2, "inspect", "--consumer-version", "100002 characters")
    assert len(line) < 1000


# -- impossible configs: refused before the model is built -------------------------


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from builders import save_tiny_moe

    root = tmp_path_factory.mktemp("families")
    save_tiny_moe(root / "qwen3_moe", "qwen3_moe")
    save_tiny_moe(root / "glm4_moe", "glm4_moe")
    save_tiny(root / "gemma3", "gemma3_text")
    return root


CONFIG_CASES = [
    ("qwen3_moe", {"num_experts_per_tok": 8}, "num_experts_per_tok is 8"),
    ("qwen3_moe", {"num_hidden_layers": 0}, "num_hidden_layers is 0"),
    ("qwen3_moe", {"head_dim": 0}, "head_dim is 0"),
    ("qwen3_moe", {"rope_theta": -1.0}, "rope_theta is -1.0"),
    ("qwen3_moe", {"rope_theta": "big"}, "rope_theta is 'big'"),
    ("qwen3_moe", {"num_key_value_heads": 3}, "not a multiple"),
    ("glm4_moe", {"partial_rotary_factor": 1.5}, "partial_rotary_factor is 1.5"),
    ("glm4_moe", {"partial_rotary_factor": float("nan")}, "partial_rotary_factor"),
    ("glm4_moe", {"topk_group": 2}, "topk_group is 2"),
    ("gemma3", {"sliding_window": 0}, "sliding_window is 0"),
    ("gemma3", {"sliding_window": -1}, "sliding_window is -1"),
    ("gemma3", {"rope_theta": 5.0}, "rope_parameters.full_attention.rope_theta"),
    ("gemma3", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gemma3", {"layer_types": ["full_attention"] * 3000}, "chars), 3000 entries"),
]


@pytest.mark.parametrize("family, change, message", CONFIG_CASES)
def test_impossible_configs_are_refused(
    families, tmp_path, capsys, family, change, message
):
    src = tmp_path / "model"
    shutil.copytree(families / family, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    key = next(iter(change))
    out = tmp_path / "out"
    target = ["--target", "vllm-ascend"] if family == "glm4_moe" else []
    rc = main(["calibrate", "--model", str(src), "--output", str(out), *target, *FAST])
    line = one_line(capsys, rc, 2, "calibrate", "config.json", key, message)
    assert len(line) < 1000
    assert not out.exists()
    rc = main(["eval", "--model", str(src), "--compare-methods", "-q"])
    one_line(capsys, rc, 2, "eval", "config.json", key)


def test_transformers4_glm4_moe_rotary_fraction(tmp_path, capsys):
    """A transformers-4-style glm4_moe config (top-level ``rope_theta`` and
    ``partial_rotary_factor``) with a fraction above 1: a traceback before."""
    from builders import save_tiny_moe

    src = tmp_path / "glm"
    save_tiny_moe(src, "glm4_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=1.5)
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    rc = main(
        [
            "calibrate",
            "--model",
            str(src),
            "--output",
            str(out),
            "--target",
            "vllm-ascend",
            *FAST,
        ]
    )
    one_line(capsys, rc, 2, "calibrate", "config.json", "partial_rotary_factor")
    assert not out.exists()


# -- fp8: a finished output is verified, nothing stray lands in it -----------------


def _fp8_run(verb: str, inp: Path, out: Path, *extra: str) -> int:
    return main(["fp8", verb, "--input", str(inp), "--output", str(out), "-q", *extra])


def test_fp8_dequantize_verifies_a_finished_output(tmp_path, capsys):
    from test_fp8 import make_bf16_checkpoint

    make_bf16_checkpoint(tmp_path / "bf16")
    fp8 = tmp_path / "fp8"
    assert _fp8_run("quantize", tmp_path / "bf16", fp8) == 0
    shard = sorted(fp8.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the last tensor's data
    shard.write_bytes(bytes(data))
    out = tmp_path / "back"
    assert _fp8_run("dequantize", fp8, out) == 2
    one_line(capsys, 2, 2, "fp8", shard.name, "does not match")
    assert not out.exists() and not (tmp_path / "back.partial").exists()


def test_fp8_stray_file_in_partial_never_lands(tmp_path, capsys):
    from test_fp8 import make_bf16_checkpoint

    from ascend_fa.fp8 import quantize_checkpoint

    make_bf16_checkpoint(tmp_path / "bf16")
    out = tmp_path / "out"

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(tmp_path / "bf16", out, progress=False, on_shard_done=stop)
    partial = tmp_path / "out.partial"
    (partial / "stray.txt").write_text("not ours")
    assert _fp8_run("quantize", tmp_path / "bf16", out) == 2
    one_line(capsys, 2, 2, "fp8", "stray.txt")
    assert not out.exists()
    (partial / "stray.txt").unlink()
    assert _fp8_run("quantize", tmp_path / "bf16", out) == 0
    assert not (out / "stray.txt").exists()

    # a stray file added while the run goes on: refused before the rename
    out2 = tmp_path / "out2"

    def plant(name: str) -> None:
        (tmp_path / "out2.partial" / "planted.bin").write_bytes(b"x")

    with pytest.raises(Exception, match="planted.bin"):
        quantize_checkpoint(
            tmp_path / "bf16", out2, progress=False, on_shard_done=plant
        )
    assert not out2.exists()


def test_fp8_dequantize_sets_the_dtype_of_a_transformers5_config(tmp_path):
    from test_fp8 import make_fp8_checkpoint

    src = tmp_path / "fp8"
    make_fp8_checkpoint(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = cfg.pop("torch_dtype")  # transformers 5 writes dtype
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "bf16"
    assert _fp8_run("dequantize", src, out) == 0
    got = json.loads((out / "config.json").read_text())
    # its own spelling (README: no key added, the source's keys kept)
    assert got["dtype"] == "bfloat16" and "torch_dtype" not in got
    assert "quantization_config" not in got


# -- transformers' load report stays behind our one line ---------------------------


@pytest.mark.parametrize("how", ["missing", "mismatch"])
def test_load_report_is_not_printed_before_the_error(setup, tmp_path, how):
    src = tmp_path / "model"
    shutil.copytree(setup["llama"], src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    if how == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :10].contiguous()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    # a real process: its logging goes to stderr as a user sees it (in-process,
    # pytest's log capture would take transformers' report away from stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_fa", "calibrate", "--model", str(src)]
        + ["--output", str(out), *FAST],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("ascend-fa calibrate: error: "), proc.stderr
    assert str(src) in lines[0] and name in lines[0]
    assert "LOAD REPORT" not in proc.stderr
    assert not out.exists()


# -- the config rules one by one (the function the loader and calibrate call) ------


def _tf4_llama() -> dict:
    from builders import TF4_LLAMA3_CONFIG

    return json.loads(json.dumps(TF4_LLAMA3_CONFIG))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"indexer_types": ["full"]}, "indexer_types is ['full'], 1 entries"),
        ({"layer_types": "full_attention"}, "expected a list of strings"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers is [5]"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 0}}, "factor is 0"),
        ({"rope_scaling": "linear"}, "rope_scaling is 'linear'"),
        ({"n_shared_experts": -1}, "n_shared_experts is -1"),
        ({"num_hidden_layers": True}, "num_hidden_layers is True"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers is 2.0"),
        ({"rope_theta": float("inf")}, "rope_theta is inf"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            "rope_theta is 500000.0, but rope_parameters.rope_theta is 10000.0",
        ),
        ({"text_config": {"head_dim": -4}}, "text_config.head_dim is -4"),
        ({"num_experts": 2, "num_experts_per_tok": 3}, "more than the 2 routed"),
    ],
)
def test_config_rules(tmp_path, change, message):
    from ascend_fa.config_checks import check_model_config
    from ascend_fa.errors import FileFormatError

    cfg = {**_tf4_llama(), **change}
    with pytest.raises(FileFormatError) as info:
        check_model_config(cfg, tmp_path / "config.json")
    text = str(info.value)
    assert message in text and "config.json" in text and "\n" not in text


def test_config_rules_accept_real_configs(tmp_path):
    from builders import DEEPSEEK_TINY, TF4_QWEN3_CONFIG

    from ascend_fa.config_checks import check_model_config

    check_model_config(_tf4_llama(), tmp_path / "config.json")
    check_model_config(TF4_QWEN3_CONFIG, tmp_path / "config.json")
    check_model_config(DEEPSEEK_TINY, tmp_path / "config.json")
    # Qwen2-MoE: transformers writes sliding_window 0 with the window switched off
    check_model_config(
        {"sliding_window": 0, "use_sliding_window": False}, tmp_path / "config.json"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["attention", "--batch", "-1"], "--batch must be >= 1, got -1"),
        (["attention", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["kvcache", "--tokens", "-5"], "--tokens must be >= 1, got -5"),
        (["fp8", "--shards", "0"], "--shards must be >= 1, got 0"),
        (["linear-accuracy", "--num-samples", "-2"], "--num-samples must be >= 0"),
    ],
)
def test_bench_counts_are_checked(capsys, args, message):
    one_line(capsys, main(["bench", *args]), 2, "bench", message)
