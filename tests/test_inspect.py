"""``ascend-fa inspect``: valid artifacts pass, each corruption is a named finding."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_fa.artifact import (
    DESCRIPTION_FILE,
    WEIGHTS_NAME,
    export_artifact,
    inspect_artifact,
)
from ascend_fa.cli import main

ATTN = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def artifact(tmp_path, heads=(4, 2, 2), fa_quant_type="FAQuant", name="art"):
    scales = {
        a: {
            b: (torch.full((h,), 0.01 * (i + 1)), torch.zeros(h, dtype=torch.int8))
            for b, h in zip(("fa_q", "fa_k", "fa_v"), heads)
        }
        for i, a in enumerate(ATTN)
    }
    sd = {
        "model.embed_tokens.weight": torch.randn(10, 8),
        "model.norm.weight": torch.ones(8),
    }
    return export_artifact(
        tmp_path / name,
        state_dict=sd,
        scales=scales,
        fa_quant_type=fa_quant_type,
        config={"model_type": "x"},
    )


def edit_tensors(path, fn):
    t = load_file(str(path / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(path / WEIGHTS_NAME))


def edit_json(path, name, fn):
    d = json.loads((path / name).read_text())
    fn(d)
    (path / name).write_text(json.dumps(d))


def findings(path):
    r = inspect_artifact(path)
    assert not r["valid"]
    return "\n".join(r["findings"])


def test_valid_artifact_cli_text_and_json(tmp_path, capsys):
    path = artifact(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fa_quant_type FAQuant" in out and out.strip().endswith("valid")
    assert "model.layers.1.self_attn" in out
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] and data["findings"] == []
    assert data["summary"]["fa_modules"] == 2 and data["summary"]["tensors"] == 14
    row = data["layers"][1]
    assert row["module"] == ATTN[1] and row["fa_q"]["heads"] == 4
    assert row["fa_k"]["min"] == pytest.approx(0.02)


def test_fakquant_valid(tmp_path):
    r = inspect_artifact(artifact(tmp_path, heads=(4, 1, 1), fa_quant_type="FAKQuant"))
    assert r["valid"], r["findings"]


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (
            lambda t: t.update(
                {"model.layers.0.self_attn.fa_q.scale": -torch.ones(4, 1)}
            ),
            r"fa_q.scale: values <= 0",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.fa_k.scale": torch.tensor(
                        [[float("nan")], [1.0]]
                    )
                }
            ),
            r"fa_k.scale: non-finite values",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.1.self_attn.fa_v.offset": torch.ones(
                        2, 1, dtype=torch.int8
                    )
                }
            ),
            r"layers.1.self_attn.fa_v.offset: nonzero values",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.fa_q.scale": torch.ones(
                        4, 1, dtype=torch.int8
                    )
                }
            ),
            r"fa_q.scale: dtype torch.int8, expected floating",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.fa_q.scale": torch.ones(4)}),
            r"fa_q.scale: shape \(4,\), expected \[H, 1\]",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.fa_v.scale": torch.ones(3, 1),
                    "model.layers.0.self_attn.fa_v.offset": torch.zeros(
                        3, 1, dtype=torch.int8
                    ),
                }
            ),
            r"fa_k has 2 heads but fa_v has 3",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.fa_q.offset": torch.zeros(
                        4, 2, dtype=torch.int8
                    )
                }
            ),
            r"fa_q.offset: shape \(4, 2\) != scale shape \(4, 1\)",
        ),
        (
            lambda t: t.pop("model.norm.weight"),
            r"model.norm.weight: in the description but no such tensor",
        ),
        (
            lambda t: t.update({"extra.weight": torch.ones(2)}),
            r"extra.weight: tensor has no description entry",
        ),
    ],
)
def test_tensor_corruptions(tmp_path, corrupt, message):
    path = artifact(tmp_path)
    edit_tensors(path, corrupt)
    assert re.search(message, findings(path))


def test_missing_offset_and_quant_type(tmp_path):
    path = artifact(tmp_path)
    edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.fa_k.offset"))
    edit_json(
        path, DESCRIPTION_FILE, lambda d: d.pop("model.layers.0.self_attn.quant_type")
    )
    text = findings(path)
    assert "model.layers.1.self_attn.fa_k: missing offset tensor" in text
    assert "model.layers.0.self_attn.quant_type: None in the description" in text


def test_fa_quant_type_consistency(tmp_path):
    path = artifact(tmp_path)
    # an older export whose config.json still carries the FA entries
    edit_json(
        path,
        "config.json",
        lambda d: d.update(quantization_config={"fa_quant_type": "FAQuant"}),
    )
    edit_json(path, DESCRIPTION_FILE, lambda d: d.update(fa_quant_type="FAKQuant"))
    text = findings(path)
    assert "FAKQuant expects one latent head for fa_k/fa_v, found 2" in text
    assert (
        "config.json: quantization_config.fa_quant_type 'FAQuant' != "
        "description 'FAKQuant'" in text
    )
    edit_json(path, DESCRIPTION_FILE, lambda d: d.update(fa_quant_type="Int8"))
    assert "fa_quant_type: 'Int8', expected 'FAQuant' or 'FAKQuant'" in findings(path)
    edit_json(path, DESCRIPTION_FILE, lambda d: d.pop("fa_quant_type"))
    assert "fa_quant_type: missing from the description" in findings(path)


def test_fa_type_without_tensors(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "quant_model_weight_w8a8.safetensors"))
    (d / DESCRIPTION_FILE).write_text(
        json.dumps({"w": "W8A8", "fa_quant_type": "FAQuant"})
    )
    assert "fa_quant_type: 'FAQuant' but no FA tensors" in findings(d)


def test_unreadable_files(tmp_path, capsys):
    path = artifact(tmp_path)
    (path / DESCRIPTION_FILE).write_text("{not json")
    assert "quant_model_description.json: invalid JSON" in findings(path)
    (path / DESCRIPTION_FILE).unlink()
    assert "quant_model_description.json: missing" in findings(path)
    (path / WEIGHTS_NAME).write_bytes(b"garbage")
    assert "weights:" in findings(path)
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "- quant_model_description.json: missing" in out
    assert "not a directory" in findings(tmp_path / "nope")
