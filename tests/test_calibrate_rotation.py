"""``calibrate --rotate``: the residual-stream rotation before static W8A8 linears
(default for the families that take it), written as an artifact the consumers
load (its own ``lm_head``, ``tie_word_embeddings`` false), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402
from safetensors import safe_open  # noqa: E402

from ascend_fa.artifact.inspect import inspect_artifact  # noqa: E402
from ascend_fa.calibration.job import calibrate  # noqa: E402
from ascend_fa.calibration.plan import plan_calibration  # noqa: E402
from ascend_fa.errors import InputError, UnsupportedError  # noqa: E402

SMALL = dict(
    num_samples=4,
    max_length=24,
    batch_size=2,
    heldout=1,
    picture_report=False,
    progress=False,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotation-models")
    return {
        "tied": save_tiny(root / "tied", "llama", tie_word_embeddings=True),
        "deepseek_v3": save_tiny(root / "ds", "deepseek_v3"),
    }


def _weights(out):
    names = {}
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                names[k] = f.get_tensor(k)
    return names


def _report(out):
    return json.loads((out / "calibration_report.json").read_text())


def test_static_w8a8_rotates_by_default_and_the_artifact_loads(models, tmp_path):
    source = json.loads((models["tied"] / "config.json").read_text())
    assert source["tie_word_embeddings"] is True
    out = tmp_path / "rot"
    calibrate(models["tied"], output=out, target="mindie", **SMALL)
    rotation = _report(out)["linears"]["rotation"]
    assert rotation["untied"] is True and rotation["kind"] == "hadamard"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    # everything else of the source's config as it was
    for key, value in source.items():
        if key not in ("tie_word_embeddings", "dtype", "torch_dtype"):
            assert cfg[key] == value, key
    assert "ascend_fa_residual_rotation" not in cfg
    weights = _weights(out)
    assert "lm_head.weight" in weights
    # the embedding carries the rotation (the head is E diag(final norm) Q: the
    # tiny model's final norm is all ones, so the two are equal here)
    emb = _weights(models["tied"])["model.embed_tokens.weight"].bfloat16()
    assert not torch.equal(weights["model.embed_tokens.weight"], emb)
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    # the RMSNorm weights moved into the linears that read them
    norms = [k for k in weights if k.endswith("input_layernorm.weight")]
    assert norms
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["lm_head.weight"] == "FLOAT"
    assert inspect_artifact(out, target="mindie")["valid"]


def test_rotate_off_keeps_the_source_tied(models, tmp_path):
    out = tmp_path / "plain"
    calibrate(models["tied"], output=out, target="mindie", rotate="off", **SMALL)
    assert _report(out)["linears"]["rotation"] is None
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    # a tied head is written and described as msModelSlim writes it: the embedding
    weights = _weights(out)
    emb = _weights(models["tied"])["model.embed_tokens.weight"].bfloat16()
    assert torch.equal(weights["model.embed_tokens.weight"], emb)
    assert torch.equal(weights["lm_head.weight"], emb)
    assert inspect_artifact(out, target="mindie")["valid"]


def test_auto_leaves_per_token_linears_unrotated(models, tmp_path):
    out = tmp_path / "dyn"
    calibrate(
        models["tied"], output=out, target="mindie", linear="w8a8_dynamic", **SMALL
    )
    assert _report(out)["linears"]["rotation"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rotate": "sideways"}, "--rotate 'sideways'; choose one of auto, on, off"),
        (
            {"rotate": "on", "linear": "none"},
            "--rotate on rotates the residual stream for quantized linears",
        ),
        (
            {"rotate": "on", "streaming": True},
            "--rotate on does not apply with --streaming",
        ),
    ],
)
def test_refusals_before_any_work(models, tmp_path, extra, message):
    out = tmp_path / "o"
    with pytest.raises(InputError, match=message):
        plan_calibration(models["tied"], output=out, target="mindie", **SMALL, **extra)
    assert not out.exists()


def test_rotate_on_refuses_a_family_without_it(models, tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(UnsupportedError, match="residual rotation: model_type"):
        calibrate(
            models["deepseek_v3"],
            output=out,
            target="mindie",
            linear="w8a8",
            rotate="on",
            **SMALL,
        )
    assert not out.exists()
