"""The vLLM plugin's reading of ``quant_model_description.json`` (no vLLM here):
each layer's type, fused shards, and the one-line refusals. The plugin's packaging:
the entry point vLLM loads, the overlay CI builds, nothing of vLLM imported by
``import ascend_fa.serving``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_fa.errors import FileFormatError, UnsupportedError
from ascend_fa.serving.description import ServingDescription, check_tensors
from ascend_fa.serving.overlay import ENTRY_POINTS

ROOT = Path(__file__).resolve().parent.parent
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj",
          "up_proj"]}  # fmt: skip
ATTN = "model.layers.0.self_attn"


def _desc(**types: str) -> dict:
    d = {"model_quant_type": "W8A8", "version": "1.0.0", "group_size": 0,
         "metadata": {}, "fa_quant_type": "FAQuant", f"{ATTN}.quant_type": "INT8",
         "lm_head.weight": "FLOAT"}  # fmt: skip
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        d[f"{ATTN}.{p}.weight"] = "W8A8"
        d[f"{ATTN}.{p}.deq_scale"] = "W8A8"
    d[f"{ATTN}.fa_q.scale"] = "FAQuant"
    d.update({k.replace("__", "."): v for k, v in types.items()})
    return d


def test_layer_types():
    desc = ServingDescription(_desc())
    assert desc.linear_type(f"{ATTN}.qkv_proj", PACKED) == "W8A8"
    assert desc.linear_type(f"{ATTN}.o_proj", PACKED) == "W8A8"
    assert desc.linear_type("lm_head", PACKED) == "FLOAT"
    # a layer the description does not name is float (vllm-ascend's default)
    assert desc.linear_type("model.layers.0.mlp.gate_up_proj", PACKED) == "FLOAT"
    assert desc.fa_quant_type == "FAQuant" and desc.kv_cache_type is None


def test_fused_shards_of_different_types_refused():
    d = _desc()
    d[f"{ATTN}.k_proj.weight"] = "W8A8_DYNAMIC"
    desc = ServingDescription(d)
    with pytest.raises(UnsupportedError) as e:
        desc.linear_type(f"{ATTN}.qkv_proj", PACKED)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{ATTN}.qkv_proj" in msg and f"{ATTN}.k_proj.weight W8A8_DYNAMIC" in msg


@pytest.mark.parametrize(
    "key, value, needle",
    [
        (f"{ATTN}.o_proj.weight", "W4A8_DYNAMIC", f"{ATTN}.o_proj.weight"),
        ("fa_quant_type", "FA8", "fa_quant_type 'FA8'"),
        ("kv_cache_type", "C4", "kv_cache_type 'C4'"),
    ],
)
def test_unknown_types_refused_in_one_line(key, value, needle):
    d = _desc()
    d[key] = value
    with pytest.raises(UnsupportedError) as e:
        ServingDescription(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fakquant_accepted():
    """FAKQuant (MLA) is served (``ascend_fa.serving.mla``); whether the model's
    attention is MLA is checked when vLLM builds the layers."""
    d = _desc()
    d["fa_quant_type"] = "FAKQuant"
    assert ServingDescription(d).fa_quant_type == "FAKQuant"


def test_recorded_target():
    """The MLA query mode follows the recorded target (vllm-ascend: dynamic)."""
    d = _desc()
    assert ServingDescription(d).target is None
    d["metadata"] = {"ascend_fa_target": "vllm-ascend"}
    assert ServingDescription(d).target == "vllm-ascend"


def test_malformed_description_refused():
    d = _desc()
    d[f"{ATTN}.o_proj.weight"] = ["W8A8"]
    with pytest.raises(FileFormatError) as e:
        ServingDescription(d)
    assert f"'{ATTN}.o_proj.weight' maps to a JSON list" in str(e.value)


def test_expert_types():
    d = _desc()
    for e in range(2):
        for p in ("gate_proj", "up_proj", "down_proj"):
            d[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = "W8A8_DYNAMIC"
    desc = ServingDescription(d)
    assert desc.expert_type("model.layers.0.mlp.experts") == "W8A8_DYNAMIC"
    d["model.layers.0.mlp.experts.1.up_proj.weight"] = "FLOAT"
    with pytest.raises(UnsupportedError, match="experts have types"):
        ServingDescription(d).expert_type("model.layers.0.mlp.experts")


def test_import_does_not_import_vllm():
    code = (
        "import sys, ascend_fa, ascend_fa.serving, ascend_fa.serving.description; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'vllm_ascend')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_entry_point_and_overlay(tmp_path):
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    eps = project["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"ascend_fa": "ascend_fa.serving:register"}
    assert ENTRY_POINTS == {"vllm.general_plugins": eps}
    assert "ascend_fa.serving" in project["tool"]["setuptools"]["packages"]
    out = tmp_path / "overlay"
    script = ROOT / "ci" / "vllm_plugin_overlay.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(script), str(out)], capture_output=True,
                          text=True, check=True, env=env)  # fmt: skip
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    (meta,) = out.glob("ascend_fa-*.dist-info")
    text = (meta / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]\nascend_fa = ascend_fa.serving:register" in text
    # the overlay's ascend_fa resolves the package-dir mapping
    for sub in ("serving", "backends", "atb_ops", "linear"):
        assert (out / "ascend_fa" / sub / "__init__.py").is_file()


def _dtypes(desc: dict) -> dict:
    """The weight files' dtypes matching ``_desc()``: int8 weights, fp32 rest."""
    out = {}
    for name in ServingDescription(desc).types:
        out[name] = "I8" if name.endswith("_proj.weight") else "F32"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for t in ("input_scale", "input_offset", "quant_bias"):
            out[f"{ATTN}.{p}.{t}"] = "F32"
    return out


def _full_desc() -> dict:
    d = _desc()
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for t in ("input_scale", "input_offset", "quant_bias"):
            d[f"{ATTN}.{p}.{t}"] = "W8A8"
    return d


def test_check_tensors_accepts_agreeing_files():
    d = _full_desc()
    check_tensors(ServingDescription(d), _dtypes(d))
    # a tied head: described FLOAT, not stored (the embedding is)
    t = _dtypes(d)
    del t["lm_head.weight"]
    check_tensors(ServingDescription(d), t)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d, t: t.pop(f"{ATTN}.o_proj.deq_scale"),
         f"{ATTN}.o_proj.deq_scale: missing from the weights"),
        (lambda d, t: t.update({f"{ATTN}.extra": "F32"}),
         f"{ATTN}.extra: in the weight files, not in"),
        (lambda d, t: t.update({f"{ATTN}.o_proj.weight": "BF16"}),
         f"{ATTN}.o_proj.weight: BF16 in the weights, quant_model_description.json "
         "says W8A8"),
        (lambda d, t: d.update({f"{ATTN}.o_proj.weight": "FLOAT"}),
         f"{ATTN}.o_proj.weight: int8 in the weights"),
        (lambda d, t: (d.pop(f"{ATTN}.o_proj.quant_bias"),
                       t.pop(f"{ATTN}.o_proj.quant_bias")),
         f"{ATTN}.o_proj.quant_bias: missing from the weights"),
    ],
)  # fmt: skip
def test_check_tensors_names_the_disagreeing_tensor(edit, needle):
    d = _full_desc()
    t = _dtypes(d)
    edit(d, t)
    with pytest.raises(FileFormatError) as e:
        check_tensors(ServingDescription(d), t)
    assert needle in str(e.value) and "\n" not in str(e.value)
