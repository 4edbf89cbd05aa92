"""The stages of ``calibrate`` one at a time (:mod:`ascend_fa.calibration.plan`,
``.source``, ``.stages``, ``.export``) on tiny real checkpoints."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

from ascend_fa.calibration import plan as plan_mod  # noqa: E402
from ascend_fa.calibration.export import job_report, write_artifact  # noqa: E402
from ascend_fa.calibration.job import calibrate  # noqa: E402
from ascend_fa.calibration.plan import (  # noqa: E402
    PREFLIGHT_CHECKS,
    plan_calibration,
)
from ascend_fa.calibration.source import open_source  # noqa: E402
from ascend_fa.calibration.stages import (  # noqa: E402
    Folding,
    fold_transforms,
    keep_within_budget,
    measure_heldout,
    observe_attention,
    quantize_linears,
)
from ascend_fa.errors import InputError  # noqa: E402

SMALL = dict(num_samples=2, max_length=16, batch_size=2, heldout=1, progress=False)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-models")
    return {
        "llama": save_tiny(root / "llama", "llama"),
        "deepseek_v3": save_tiny(root / "ds", "deepseek_v3"),
    }


def test_plan_takes_calibrates_arguments_with_the_same_defaults():
    # calibrate passes its locals() to plan_calibration: the two must not drift.
    ours = inspect.signature(calibrate).parameters
    theirs = inspect.signature(plan_calibration).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


@pytest.mark.parametrize(
    ("kind", "target", "extra", "linear_type"),
    [
        ("llama", "mindie", {}, "W8A8"),
        # a Llama's C8 loads from vllm-ascend 0.25.1rc1 on
        ("llama", "vllm-ascend", {"consumer_version": "0.25.1rc1"}, "FLOAT"),
        ("llama", "vllm", {}, "FLOAT"),
        ("deepseek_v3", "vllm-ascend", {}, "W8A8_DYNAMIC"),
        ("llama", "mindie", {"linear": "none"}, "FLOAT"),
        (
            "llama",
            "vllm-ascend",
            {"linear": "w8a8_dynamic", "consumer_version": "main"},
            "W8A8_DYNAMIC",
        ),
    ],
)
def test_plan_resolves_the_linears_a_target_deploys(
    models, tmp_path, kind, target, extra, linear_type
):
    out = tmp_path / "out"
    plan = plan_calibration(
        models[kind], output=out, target=target, **{**SMALL, **extra}
    )
    assert plan.linear_type == linear_type
    assert plan.mla is (kind == "deepseek_v3")
    assert (len(plan.calib), len(plan.held)) == (2, 1)
    assert plan.recipe is not None and plan.dtype == torch.bfloat16
    assert not out.exists()  # a plan writes nothing
    lines = plan.lines()
    assert f"target: {target} (bfloat16 weights), linears {linear_type}" in lines[1]
    assert lines[-1] == f"output: write {out}"


def test_plan_lines_name_the_options(models, tmp_path):
    plan = plan_calibration(
        models["llama"],
        output=tmp_path / "out",
        target="mindie",
        linear="none",
        transforms="qk-smoothing",
        error_budget=0.5,
        dtype="fp32",
        **SMALL,
    )
    text = "\n".join(plan.lines())
    assert "transforms qk-smoothing" in text and "error budget KL 0.5" in text
    assert "float32 weights, research artifact" in text


def test_every_preflight_check_runs_before_any_work(models, tmp_path, monkeypatch):
    seen = []

    def stop(plan):
        seen.append(plan.target)
        raise InputError("stopped by a pre-flight check")

    monkeypatch.setattr(plan_mod, "PREFLIGHT_CHECKS", [*PREFLIGHT_CHECKS, stop])
    out = tmp_path / "out"
    with pytest.raises(InputError, match="stopped by a pre-flight check"):
        calibrate(models["llama"], output=out, target="vllm", **SMALL)
    assert seen == ["vllm"] and not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"target": "vllm", "clip_search": True}, "--clip-search tunes FAQuant"),
        ({"streaming": True, "transforms": "v-rotation"}, "--streaming does not"),
        ({"max_memory": "1GB"}, "--max-memory bounds a --streaming run"),
        ({"target": "vllm", "error_budget": 0.1}, "--error-budget keeps FAQuant"),
    ],
)
def test_preflight_refusals(models, tmp_path, extra, message):
    with pytest.raises(InputError, match=message):
        plan_calibration(models["llama"], output=tmp_path / "o", **{**SMALL, **extra})
    assert list(tmp_path.iterdir()) == []


def test_source_whole_and_streamed(models, tmp_path):
    plan = plan_calibration(
        models["llama"], output=tmp_path / "o", target="vllm", **SMALL
    )
    whole = open_source(plan, CPU)
    assert (whole.mla, whole.kv_mode("vllm"), whole.kv_mode("vllm-ascend")) == (
        False,
        "fp8",
        "c8",
    )
    assert whole.streamed is None and whole.resume is None
    assert whole.name == str(models["llama"])
    streamed_plan = plan_calibration(
        models["llama"], output=tmp_path / "o", target="vllm", streaming=True, **SMALL
    )
    streamed = open_source(streamed_plan, CPU)
    work = streamed.streamed.work_dir
    assert streamed.resume is not None and streamed.resume.linear_done == 0
    work.mkdir(parents=True, exist_ok=True)
    streamed.close()
    assert not work.exists()


def test_mla_source_writes_fa_scales_on_every_target(models, tmp_path):
    plan = plan_calibration(
        models["deepseek_v3"], output=tmp_path / "o", target="vllm-ascend", **SMALL
    )
    source = open_source(plan, CPU)
    assert source.mla and source.kv_mode("vllm-ascend") is None


def _stages(plan, source):
    folding = fold_transforms(plan, source)
    linears = quantize_linears(plan, source)
    attention = observe_attention(plan, source, folding)
    return folding, linears, attention


def test_attention_pass_fp8_kv_target(models, tmp_path):
    plan = plan_calibration(
        models["llama"], output=tmp_path / "o", target="vllm", **SMALL
    )
    source = open_source(plan, CPU)
    folding, linears, attention = _stages(plan, source)
    assert folding == Folding() and linears is None
    assert attention.kv_mode == "fp8" and attention.quant_kind == "FP8 KV"
    assert attention.fa_scales is None and set(attention.kv_scales) == set(
        attention.scales
    )
    same, budget = keep_within_budget(plan, source, attention)
    assert same is attention and budget is None
    heldout = measure_heldout(plan, source, attention, budget)
    assert heldout.stats["num_samples"] == 1
    attention.calibrated.remove(source.net)
    report = job_report(
        plan, source, attention, heldout, transforms=None, linears=None, budget=None
    )
    assert report["deployed"] == "FP8 KV" and report["kv_cache_scales"]
    dest = write_artifact(plan, source, attention, report, transforms=None)
    assert dest == tmp_path / "o" and (dest / "config.json").is_file()


def test_transforms_fold_in_the_pass_or_before_the_linears(models, tmp_path):
    float_plan = plan_calibration(
        models["llama"],
        output=tmp_path / "o",
        target="mindie",
        linear="none",
        transforms="qk-smoothing",
        **SMALL,
    )
    source = open_source(float_plan, CPU)
    folding = fold_transforms(float_plan, source)
    assert folding.in_pass is not None and folding.folded is None
    quant_plan = plan_calibration(
        models["llama"],
        output=tmp_path / "o",
        target="mindie",
        linear="w8a8",
        linear_fallback=0,
        transforms="qk-smoothing",
        **SMALL,
    )
    source = open_source(quant_plan, CPU)
    folding = fold_transforms(quant_plan, source)
    assert folding.in_pass is None and folding.outcome() is folding.folded
    assert folding.folded.to_report()["folded"] == ["qk-smoothing"]
    linears = quantize_linears(quant_plan, source)
    assert linears.to_report()["quant_type"] == "W8A8"


def test_an_error_budget_met_quantized_keeps_no_layer_float(models, tmp_path):
    plan = plan_calibration(
        models["llama"],
        output=tmp_path / "o",
        target="mindie",
        linear="none",
        error_budget=1e9,
        **SMALL,
    )
    source = open_source(plan, CPU)
    _, _, attention = _stages(plan, source)
    kept, budget = keep_within_budget(plan, source, attention)
    assert budget.kept_float == [] and budget.met
    assert kept.scales == attention.scales
