"""``calibrate --error-budget``: layers ranked by measured error, the fewest kept
float to meet a token-KL budget, the choice in the report and the artifact."""

from __future__ import annotations

import json

import pytest
import torch
from builders import byte_tokenizer, save_tiny, tiny_llama

from ascend_fa.artifact import read_fa_scales
from ascend_fa.calibration.budget import check_error_budget, fit_error_budget
from ascend_fa.calibration.job import default_recipe_path
from ascend_fa.calibration.pipeline import calibrate_model, calibration_batches
from ascend_fa.calibration.recipe import load_recipe
from ascend_fa.cli import main
from ascend_fa.errors import InputError

TEXTS = [f"sample {i}: " + "the quick brown fox jumps over it. " * 3 for i in range(4)]


@pytest.fixture(scope="module")
def calibrated():
    m = tiny_llama(seed=3, num_hidden_layers=3)
    with torch.no_grad():
        # A wide V outlier: static per-head INT8 has a measurable error.
        m.model.layers[1].self_attn.v_proj.weight[2] *= 60.0
    tok = byte_tokenizer()
    res = calibrate_model(
        m,
        tok,
        TEXTS,
        recipe=load_recipe(default_recipe_path()),
        max_length=48,
        batch_size=2,
        progress=False,
    )
    batches = list(calibration_batches(tok, TEXTS, max_length=48, batch_size=2))
    yield m, batches
    res.remove(m)


def test_ranking_and_greedy_choice(calibrated):
    m, batches = calibrated
    before = {k: v.clone() for k, v in m.state_dict().items()}
    full = fit_error_budget(m, batches, budget=0.0)
    names = [r["name"] for r in full.ranking]
    assert sorted(names) == [f"model.layers.{i}.self_attn" for i in range(3)]
    cos = [r["attention_output_cosine"] for r in full.ranking]
    assert cos == sorted(cos) and cos[0] < 1.0
    # Budget 0: every layer float at the end, KL 0 (the float model itself).
    assert full.kept_float == names and full.kl_steps[-1] == pytest.approx(0, abs=1e-9)
    assert len(full.kl_steps) == 4 and full.met
    # A budget between the steps keeps exactly the prefix that meets it.
    mid = (full.kl_steps[0] + full.kl_steps[1]) / 2
    if full.kl_steps[1] < full.kl_steps[0]:
        part = fit_error_budget(m, batches, budget=mid)
        assert part.kept_float == names[:1] and part.met
    loose = fit_error_budget(m, batches, budget=1.0)
    assert loose.kept_float == [] and loose.kl_steps == full.kl_steps[:1]
    assert all(r["kept_float"] is False for r in loose.ranking)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_check_error_budget():
    assert check_error_budget(None) is None
    assert check_error_budget("0.003") == 0.003
    for bad in ("-1", "x", float("nan"), True):
        with pytest.raises(InputError, match="--error-budget"):
            check_error_budget(bad)


def _common(model) -> list[str]:
    return [
        "calibrate",
        "--model",
        str(model),
        "--num-samples",
        "4",
        "--max-length",
        "32",
        "--batch-size",
        "2",
        "--heldout",
        "1",
        "--no-report",
    ]


def test_cli_budget_refused_for_kv_cache_targets(tmp_path, capsys):
    model = save_tiny(tmp_path / "llama", "llama")
    rc = main(
        [
            *_common(model),
            "--target",
            "vllm",
            "--linear",
            "none",
            "--error-budget",
            "0.1",
            "--output",
            str(tmp_path / "v"),
        ]
    )
    assert rc == 2 and "use --target mindie" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


@pytest.mark.slow
def test_cli_budget_keeps_layers_float_and_reports(tmp_path, capsys):
    model = save_tiny(tmp_path / "llama", "llama", num_hidden_layers=3)
    first, out = tmp_path / "first", tmp_path / "art"
    args = [*_common(model), "--target", "mindie", "--transforms", "v-rotation"]
    assert main([*args, "--error-budget", "10", "--output", str(first)]) == 0
    eb = json.loads((first / "calibration_report.json").read_text())["error_budget"]
    assert eb["kept_float"] == [] and len(eb["ranking"]) == 3
    assert len(set(read_fa_scales(first))) == 3
    budget = eb["kl_steps"][0] * 0.99
    assert main([*args, "--error-budget", repr(budget), "--output", str(out)]) == 0
    assert "attention layers kept float" in capsys.readouterr().out
    eb = json.loads((out / "calibration_report.json").read_text())["error_budget"]
    kept = eb["kept_float"]
    assert 1 <= len(kept) < 3 and eb["met"] and eb["kl_steps"][-1] <= budget
    assert kept == [r["name"] for r in eb["ranking"]][: len(kept)]
    assert set(read_fa_scales(out)) == {r["name"] for r in eb["ranking"]} - set(kept)
