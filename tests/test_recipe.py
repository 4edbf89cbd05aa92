"""YAML recipes: matching table, defaults, per-branch settings, every bad config."""

from __future__ import annotations

import logging
import textwrap
import warnings

import pytest

from ascend_fa.calibration import (
    FA3QuantConfig,
    Recipe,
    RecipeError,
    check_patterns,
    default_recipe,
    expand_braces,
    load_recipe,
    match_pattern,
)

NAMES = [f"model.layers.{i}.self_attn" for i in range(12)]


def recipe_text(item: str) -> str:
    body = textwrap.indent(textwrap.dedent(item).strip(), " " * 6)
    return "spec:\n  process:\n    - " + body.lstrip() + "\n"


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        (["*"], [], list(range(12))),
        (["*"], ["model.layers.0.self_attn"], list(range(1, 12))),
        # '*' also crosses dots
        (["model.*.self_attn"], [], list(range(12))),
        (["*.1.*"], [], [1]),
        # character class and '?'
        (["model.layers.[7-8].self_attn"], [], [7, 8]),
        (["model.layers.?.self_attn"], [], list(range(10))),
        (["model.layers.1?.self_attn"], [], [10, 11]),
        # brace expansion, nested
        (["model.layers.{3,5}.self_attn"], [], [3, 5]),
        (["model.layers.{1{0,1},2}.self_attn"], [], [2, 10, 11]),
        # exclude wins over include
        (["model.layers.{3,5}.self_attn"], ["*.5.*"], [3]),
        (["*"], ["*"], []),
        # case-sensitive
        (["MODEL.*"], [], []),
        (["model.layers.1"], [], []),  # full-name match, not prefix
    ],
)
def test_matching_table(include, exclude, expected):
    cfg = FA3QuantConfig(include=include, exclude=exclude)
    assert [i for i, n in enumerate(NAMES) if cfg.matches(n)] == expected


def test_brace_expansion_details():
    assert expand_braces("a.{3,5}.b") == ("a.3.b", "a.5.b")
    assert expand_braces("{a,b}{1,2}") == ("a1", "a2", "b1", "b2")
    assert expand_braces("x{y}z") == ("x{y}z",)  # no comma: literal, like bash
    assert expand_braces("x{y,z") == ("x{y,z",)  # unbalanced: literal
    assert match_pattern("x{y}z", "x{y}z")
    assert not match_pattern("x{y}z", "xyz")


def test_seed_example_and_extensions():
    r = load_recipe(
        recipe_text("""
        type: "fa3_quant"
        include: [ "*" ]
        exclude: [ "model.layers.0.self_attn" ]
        ratio: {q: 0.999, k: 1, v: 1.0}
        method: abs_quantile
        fa_v: {method: minmax, ratio: 0.5}
        fa_k: {accumulate: pooled, max_samples: 1000}
    """)
    )
    assert isinstance(r, Recipe) and len(r.processors) == 1
    cfg = r.processors[0]
    assert not cfg.matches("model.layers.0.self_attn") and cfg.matches(NAMES[1])
    q, k, v = (cfg.branch_settings(b) for b in ("fa_q", "fa_k", "fa_v"))
    assert (q.method, q.ratio, q.accumulate, q.max_samples) == (
        "abs_quantile",
        0.999,
        "union",
        None,
    )
    assert (k.method, k.ratio, k.accumulate, k.max_samples) == (
        "abs_quantile",
        1.0,
        "pooled",
        1000,
    )
    assert (v.method, v.ratio) == ("minmax", 0.5)


def test_defaults():
    cfg = default_recipe().processors[0]
    assert cfg.include == ["*"] and cfg.exclude == []
    assert all(cfg.matches(n) for n in NAMES)
    assert [cfg.branch_settings(b).ratio for b in ("fa_q", "fa_k", "fa_v")] == [
        0.9999,
        0.9999,
        1.0,
    ]
    assert cfg.branch_settings("fa_q").method == "recall_window"
    assert cfg.branch_settings("fa_q").accumulate == "union"
    cfg2 = load_recipe(recipe_text("type: fa3_quant")).processors[0]
    assert cfg2 == cfg


def test_scalar_ratio_and_msmodelslim_keys(tmp_path):
    text = textwrap.dedent("""
        apiversion: modelslim_v1
        metadata: {config_id: x, score: 1}
        spec:
          process:
            - type: fa3_quant
              ratio: 0.99
            - type: fa3_quant
              include: ["*.1.*"]
          save:
            - type: ascendv1_saver
    """)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    for source in (text, str(path), path):
        r = load_recipe(source)
        assert len(r.processors) == 2
        assert r.processors[0].branch_settings("fa_v").ratio == 0.99


def test_branch_settings_bad_branch():
    with pytest.raises(ValueError, match="branch must be one of"):
        FA3QuantConfig().branch_settings("fa_x")


def test_unmatched_pattern_warns(caplog):
    cfg = FA3QuantConfig(
        include=["model.layers.{3,99}.self_attn", "decoder.*"],
        exclude=["*.self_attention"],
    )
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning) as rec:
        bad = check_patterns(cfg, NAMES)
    assert bad == ["decoder.*", "*.self_attention"]
    msgs = [str(w.message) for w in rec]
    assert any(
        "include pattern 'decoder.*' matches no attention module" in m for m in msgs
    )
    assert any("exclude pattern '*.self_attention'" in m for m in msgs)
    assert "decoder.*" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_patterns(FA3QuantConfig(), NAMES) == []
        assert check_patterns(cfg, NAMES, warn=False) == bad


@pytest.mark.parametrize(
    ("item", "match"),
    [
        # unknown keys, at every level
        (
            "type: fa3_quant\ninclde: ['*']",
            r"spec\.process\[0\]\.inclde \(line 4\): unknown key 'inclde'",
        ),
        (
            "type: fa3_quant\nratio: {q: 0.9, kk: 0.9}",
            r"spec\.process\[0\]\.ratio\.kk \(line 4\): unknown key 'kk'",
        ),
        (
            "type: fa3_quant\nfa_q: {rate: 0.9}",
            r"spec\.process\[0\]\.fa_q\.rate \(line 4\): unknown key 'rate'",
        ),
        # wrong types
        (
            "type: fa3_quant\ninclude: '*'",
            r"spec\.process\[0\]\.include \(line 4\): Input should be a valid list",
        ),
        (
            "type: fa3_quant\ninclude: [1]",
            r"spec\.process\[0\]\.include\[0\] \(line 4\): "
            r"Input should be a valid string",
        ),
        (
            "type: fa3_quant\nratio: {q: 'high'}",
            r"spec\.process\[0\]\.ratio\.q \(line 4\): Input should be a valid number",
        ),
        (
            "type: fa3_quant\nratio: [0.9]",
            r"spec\.process\[0\]\.ratio \(line 4\): Input should be a valid dictionary",
        ),
        (
            "type: fa3_quant\nmax_samples: 1.5",
            r"spec\.process\[0\]\.max_samples \(line 4\): "
            r"Input should be a valid integer",
        ),
        (
            "type: fa3_quant\nmethod: mse",
            r"spec\.process\[0\]\.method \(line 4\): Input should be 'recall_window', "
            r"'minmax' or 'abs_quantile' \(got 'mse'\)",
        ),
        (
            "type: fa3_quant\naccumulate: sum",
            r"spec\.process\[0\]\.accumulate \(line 4\): Input should be 'union' or "
            r"'pooled'",
        ),
        (
            "type: 3",
            r"spec\.process\[0\]\.type \(line 3\): Input should be a valid string",
        ),
        # ratio outside (0, 1]
        (
            "type: fa3_quant\nratio: {k: 1.5}",
            r"spec\.process\[0\]\.ratio\.k \(line 4\): "
            r"ratio must be in \(0, 1\], got 1.5",
        ),
        (
            "type: fa3_quant\nratio: 0",
            r"spec\.process\[0\]\.ratio \(line 4\): ratio must be in \(0, 1\], got 0",
        ),
        (
            "type: fa3_quant\nfa_v:\n  ratio: -0.5",
            r"spec\.process\[0\]\.fa_v\.ratio \(line 5\): ratio must be in \(0, 1\]",
        ),
        (
            "type: fa3_quant\nratio: {v: .nan}",
            r"spec\.process\[0\]\.ratio\.v \(line 4\): "
            r"ratio must be in \(0, 1\], got nan",
        ),
        # unknown processor type
        (
            "type: w8a8_quant",
            r"spec\.process\[0\]\.type \(line 3\): "
            r"unknown processor type 'w8a8_quant'; "
            r"supported: 'fa3_quant'",
        ),
        # pooled without a bound
        (
            "type: fa3_quant\naccumulate: pooled",
            r"spec\.process\[0\] \(line 3\): "
            r"fa_q: accumulate 'pooled' needs max_samples",
        ),
        (
            "type: fa3_quant\nmax_samples: 0",
            r"max_samples \(line 4\): Input should be greater than 0",
        ),
    ],
)
def test_bad_item(item, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe_text(item))


def test_error_lists_every_problem_with_lines():
    text = recipe_text("type: fa3_quant\nmethod: mse\nratio: {q: 2.0}\nbogus: 1")
    with pytest.raises(RecipeError) as info:
        load_recipe(text)
    msg = str(info.value)
    assert "method (line 4)" in msg and "ratio.q (line 5)" in msg
    assert "bogus (line 6): unknown key 'bogus'" in msg


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("spec:\n  proces: []\n", r"spec\.proces \(line 2\): unknown key 'proces'"),
        (
            "spec:\n  save: []\n",
            r"spec\.process \(line 1\): missing required key 'process'",
        ),
        (
            "spec:\n  process: {type: fa3_quant}\n",
            r"spec\.process \(line 2\): Input should be a valid list",
        ),
        (
            "apiversion: v1\nextra: 1\nspec: {process: []}\n",
            r"extra \(line 2\): unknown key 'extra'",
        ),
        ("- a\n- b\n", "a recipe must be a mapping with a 'spec' key"),
        ("spec: [1\n", "not valid YAML"),
        ("", "a recipe must be a mapping"),
        ("no_such_recipe.yaml", "recipe file not found: no_such_recipe.yaml"),
    ],
)
def test_bad_document(text, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(text)


def test_error_names_file(tmp_path):
    path = tmp_path / "fa.yaml"
    path.write_text(recipe_text("type: fa3_quant\nratio: {q: 7}"))
    with pytest.raises(RecipeError, match=r"fa\.yaml: spec\.process\[0\]\.ratio\.q"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_python_construction_validates():
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        FA3QuantConfig(ratio={"q": 1.01})
    with pytest.raises(ValueError, match="unknown processor type"):
        FA3QuantConfig(type="other")
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        FA3QuantConfig(includes=["*"])


def test_scalar_ratio_error_reported_once():
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_text("type: fa3_quant\nratio: 2"))
    assert str(info.value).count("ratio must be in (0, 1]") == 1
