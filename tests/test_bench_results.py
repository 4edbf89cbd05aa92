"""The benchmark result schema: timing, verdicts, strict JSON, comparison."""

from __future__ import annotations

import json
import math

import pytest

from ascend_fa.benchmarks.results import (
    SCHEMA,
    Record,
    Timing,
    compare_results,
    load_results,
    time_on,
    verdict,
    write_results,
)
from ascend_fa.cli import main
from ascend_fa.errors import FileFormatError


def test_timing_median_and_spread():
    t = Timing((0.2, 0.1, 0.3))
    assert t.median_s == 0.2 and math.isclose(t.spread, 1.0)
    assert Timing((0.5,)).spread == 0.0
    calls = []
    got = time_on(lambda: calls.append(1), "cpu", repeats=4, warmup=2)
    assert len(calls) == 6 and len(got.samples) == 4


@pytest.mark.parametrize(
    ("value", "goal", "want"),
    [(0.6, ">= 0.5", "ok"), (0.4, ">= 0.5", "miss"), (1.2, "<= 1.25", "ok"),
     (1.3, "<= 1.25", "miss"), (None, None, None), (float("nan"), ">= 1", "miss")],
)  # fmt: skip
def test_verdict(value, goal, want):
    assert verdict(value, goal) == want


def _doc(tmp_path, name, times, spread=0.01):
    recs = [
        Record("kvcache", "cpu", mode, {"T": 4096}, t, spread, 5, 0.5, "clone")
        for mode, t in times.items()
    ]
    path = tmp_path / name
    write_results(path, recs, backend="cpu", extra={"nan": float("nan")})
    return path


def test_strict_json_with_environment(tmp_path):
    path = _doc(tmp_path, "a.json", {"int8": 0.01})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["schema"] == SCHEMA and doc["extra"]["nan"] is None
    env = doc["environment"]
    assert {"ascend_fa", "torch", "python", "cpu", "cpu_count", "device"} <= set(env)
    assert doc["records"][0]["benchmark"] == "kvcache"
    assert load_results(path)["records"] == doc["records"]


def test_compare_flags_regressions_beyond_spread(tmp_path, capsys):
    a = _doc(tmp_path, "a.json", {"int8": 0.010, "fp16": 0.020, "bf16": 0.03})
    b = _doc(tmp_path, "b.json", {"int8": 0.01005, "fp16": 0.030, "bf16": 0.02})
    headers, rows, regressions = compare_results(load_results(a), load_results(b))
    flags = {r[2]: r[-1] for r in rows}
    assert flags == {"int8": "", "fp16": "REGRESSION", "bf16": "faster"}
    assert regressions == 1 and "change" in headers
    assert main(["bench", "compare", str(a), str(a)]) == 0
    out = capsys.readouterr().out
    assert "3 matching records, 0 regression(s)" in out and "+0.0%" in out


def test_compare_refuses_other_files(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(FileFormatError, match="x.json"):
        load_results(bad)
    assert main(["bench", "compare", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a benchmark result file" in err


def test_unusable_backend_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["bench", "layout", "--backend", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cuda" in err


def test_linear_accuracy_records_one_per_recipe_and_goal(tmp_path):
    from ascend_fa.benchmarks.linear_accuracy import MODES, accuracy_records
    from ascend_fa.evaluation import EvalResult

    # per recipe: (KL, top-1, perplexity against a float perplexity of 10)
    measured = {
        "faquant": (0.004, 0.96, 10.0),
        "w8a8_rtn": (0.6, 0.55, 18.0),
        "w8a8": (0.02, 0.91, 10.2),
        "w8a8_dynamic": (0.03, 0.92, 10.1),
    }
    names = {mode: name for name, mode in MODES.items()}
    results = {
        d: {
            names[m]: EvalResult(names[m], 100, 10.0, p, kl=kl, top1=t)
            for m, (kl, t, p) in measured.items()
        }
        for d in ("prose", "code")
    }
    info = {
        names[m]: {
            "seconds": 10.0 * (i + 1),
            "ratio": float(i + 1),
            "float": 3 if m == "w8a8" else 0,
            "linears": 0 if m == "faquant" else 30,
            "report": None,
            "phases": {} if m == "faquant" else {"observers": 2.0},
            "fa_seconds": 1.0,
        }
        for i, m in enumerate(measured)
    }
    records = accuracy_records(results, info, {"samples": 2})
    by_mode = {r.mode: r for r in records}
    assert by_mode["faquant"].goal is None and by_mode["w8a8"].goal is None
    assert by_mode["w8a8"].ratio == 3.0  # the whole calibration, no verdict
    assert by_mode["w8a8"].extra["phases"] == {"observers": 2.0}
    assert by_mode["w8a8 prose KL"].verdict == "ok"
    assert by_mode["w8a8 code top-1"].verdict == "ok"
    assert by_mode["w8a8 prose RTN KL / default KL"].ratio == pytest.approx(30.0)
    assert by_mode["w8a8_dynamic code KL"].verdict == "miss"
    assert by_mode["w8a8 linears float fraction"].verdict == "ok"
    assert by_mode["w8a8"].extra["accuracy"]["code"]["kl"] == 0.02
    doc = write_results(tmp_path / "r.json", records, backend="cpu")
    assert load_results(tmp_path / "r.json")["schema"] == SCHEMA == doc["schema"]
    assert len(doc["records"]) == 4 + 2 * 6 + 1


def test_linear_accuracy_cross_domain_goals_and_recipe_subsets():
    from ascend_fa.benchmarks.linear_accuracy import MODES, accuracy_records, selected
    from ascend_fa.evaluation import EvalResult

    names = {mode: name for name, mode in MODES.items()}
    # calibrated on prose: code is held to KL <= 0.035, ppl <= +4 %, top-1 >= 0.90
    results = {
        "prose": {
            names["w8a8"]: EvalResult("x", 100, 10.0, 10.25, kl=0.029, top1=0.95)
        },
        "code": {names["w8a8"]: EvalResult("x", 100, 10.0, 10.35, kl=0.034, top1=0.91)},
    }
    info = {
        names["w8a8"]: dict(
            seconds=1.0,
            ratio=1.0,
            float=2,
            linears=30,
            report=None,
            phases={},
            fa_seconds=0.0,
        )
    }
    records = accuracy_records(results, info, {"calib_domain": "prose"})
    by_mode = {r.mode: r for r in records}
    assert by_mode["w8a8 code KL"].goal == "<= 0.035"
    assert by_mode["w8a8 code KL"].verdict == "ok"
    assert by_mode["w8a8 code ppl delta %"].goal == "<= 4"
    assert by_mode["w8a8 prose KL"].goal == "<= 0.03"
    assert by_mode["w8a8 prose ppl delta %"].verdict == "ok"
    assert "w8a8_dynamic prose KL" not in by_mode  # not a row of this run
    variants = dict.fromkeys(MODES)
    assert list(selected(variants, "w8a8, faquant")) == [
        names["faquant"],
        names["w8a8"],
    ]
    assert list(selected(variants, "")) == list(MODES)
    with pytest.raises(SystemExit, match="--recipes 'w4a8'"):
        selected(variants, "w8a8,w4a8")


def test_the_packaged_calibration_set_labels_its_domains():
    from ascend_fa.calibration.data import calib_domain_texts, load_calib_texts

    texts = load_calib_texts()
    by = {d: calib_domain_texts(d) for d in ("prose", "code", "numbers")}
    assert sum(len(v) for v in by.values()) == len(texts)
    assert sorted(t for v in by.values() for t in v) == sorted(texts)
    assert len(by["code"]) == 10 and len(by["prose"]) == 23
    assert all(
        t.lstrip().startswith(
            ("def ", "import", "#", "SELECT", "class", "function", "fn ")
        )
        for t in by["code"]
    )
    with pytest.raises(ValueError, match="calibration domain 'poetry'"):
        calib_domain_texts("poetry")


def test_check_results_accepts_written_files_and_names_bad_fields(tmp_path):
    from ascend_fa.benchmarks.results import check_results

    path = _doc(tmp_path, "a.json", {"int8": 0.01, "fp16": 0.02})
    assert len(check_results(path, "kvcache")["records"]) == 2
    with pytest.raises(FileFormatError, match="from benchmark 'kvcache'"):
        check_results(path, "layout")
    doc = json.loads(path.read_text())
    for field, value, message in [
        ("median_s", "fast", "record 1: 'median_s' is 'fast'"),
        ("params", None, "record 1: 'params' is None"),
        ("verdict", "PASS", "record 1: verdict 'PASS'"),
        ("repeats", True, "record 1: 'repeats' is True"),
    ]:
        bad = json.loads(json.dumps(doc))
        bad["records"][1][field] = value
        broken = tmp_path / f"bad_{field}.json"
        broken.write_text(json.dumps(bad))
        with pytest.raises(FileFormatError, match=message) as err:
            check_results(broken)
        assert broken.name in str(err.value)
    empty = json.loads(json.dumps(doc))
    empty["records"] = []
    (tmp_path / "empty.json").write_text(json.dumps(empty))
    with pytest.raises(FileFormatError, match="no records"):
        check_results(tmp_path / "empty.json")


@pytest.mark.slow
def test_bench_targets_quick_json_in_the_one_schema(tmp_path):
    """bench targets writes the schema: one record per target and text, the float
    row with ratio 1, KL and top-1 beside the perplexity ratio."""
    from ascend_fa.benchmarks.results import check_results

    # (every benchmark's --quick JSON, calibration-overhead's included, is checked
    # against the schema by ci/bench_smoke.sh; this checks the targets rows.)
    path = tmp_path / "targets.json"
    main(["bench", "targets", "--quick", "--json", str(path)])
    doc = check_results(path, "targets")
    modes = {r["mode"] for r in doc["records"]}
    assert modes == {
        "float", "mindie_faquant", "vllm_ascend_c8", "vllm_fp8_tensor",
        "vllm_fp8_head", "mindie_w8a8_faquant",
    }  # fmt: skip
    evals = {r["params"]["eval"] for r in doc["records"]}
    assert evals == {"prose", "code", "prose-long", "code-long"}
    assert all("kl" in r["extra"] and "top1" in r["extra"] for r in doc["records"])
    base = [r for r in doc["records"] if r["mode"] == "float"]
    assert base and all(r["ratio"] == 1.0 for r in base)
    # long context: each mode at the short and the long window of each long set;
    # the long window's record carries its KL ratio and the goal
    long = [r for r in doc["records"] if r["params"]["eval"].endswith("-long")]
    assert {r["params"]["window"] for r in long} == {64, 256}
    assert len(long) == 2 * 2 * 5
    for r in long:
        at_long = r["params"]["window"] == 256
        assert (r["extra"]["kl_vs_short_window"] is not None) == at_long
        assert (r["goal"] == "<= 1.25") == at_long


def test_bench_targets_w8a8_row_runs_on_its_quantized_copy():
    """The W8A8 + FAQuant row is evaluated on its own model (the quantized copy)
    against the float model's reference: float placeholders on the same model
    give KL 0 and top-1 1; on the copy with W8A8 linears the KL is positive; the
    float model is left as it was."""
    import copy

    import torch

    from ascend_fa.benchmarks import targets
    from ascend_fa.calibration.pipeline import calibrate_linears
    from ascend_fa.linear import LinearConfig
    from ascend_fa.linear.modules import QuantizedLinear

    model, tok, _name = targets._model(quick=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    texts = ["a quick brown fox jumps over the lazy dog " * 4] * 4
    quantized = copy.deepcopy(model)
    calibrate_linears(
        quantized, tok, texts, LinearConfig(), max_length=32, progress=False
    )
    assert any(isinstance(m, QuantizedLinear) for m in quantized.modules())
    windows = [torch.arange(40) % 200, torch.arange(40) % 97]
    specs = {"same": None, "copy": targets.OnModel(quantized, None)}
    _ppl, _n, rows, _s = targets._evaluate(model, windows, specs)
    assert rows["same"]["kl"] == 0.0 and rows["same"]["top1"] == 1.0
    assert rows["copy"]["kl"] > 0.0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_streaming_workdir_that_is_not_a_directory_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["bench", "streaming", "--quick", "--workdir", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workdir" in err[0] and "not a directory" in err[0]
    assert not missing.exists()
