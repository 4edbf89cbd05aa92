"""Recipes that are the whole run: every ``calibrate`` choice in the YAML, flags
as overrides, the resolved recipe stored beside the weights, and a rerun of it
that writes the same artifact byte for byte (tiny models; SmolLM2, slow)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

transformers = pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

from ascend_fa import artifact  # noqa: E402
from ascend_fa.calibration.plan import plan_calibration  # noqa: E402
from ascend_fa.calibration.recipe import (  # noqa: E402
    RECIPE_FLAGS,
    Recipe,
    RecipeError,
    dump_recipe,
    load_recipe,
)
from ascend_fa.cli import build_parser, main  # noqa: E402

TEXTS = "\n\n".join(
    f"Sample {i}: the tide came in over sand {i * 7} times; def f{i}(x): return x"
    for i in range(12)
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_models")
    (root / "calib.txt").write_text(TEXTS)
    return save_tiny(root / "llama", "llama")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _assert_same_artifact(a: Path, b: Path) -> None:
    """Every file of ``a`` and ``b`` byte for byte (nothing excluded: the report
    holds no timing, the recipe no output path)."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name


def _rerun(art: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "calibrate",
            "--recipe",
            str(art / artifact.RECIPE_FILE),
            "--output",
            str(out),
            *extra,
        ]
    )


# A FAQuant + static W8A8 run (the mindie default) and a C8 run (vllm-ascend
# GQA), each given as flags the first time.
RUNS = {
    "faquant_w8a8": [
        "--target",
        "mindie",
        "--linear",
        "w8a8",
        "--linear-fallback",
        "0",
    ],
    "c8": ["--target", "vllm-ascend", "--consumer-version", "0.25.1rc1"],
}


@pytest.mark.transformers4
@pytest.mark.parametrize(
    "run",
    # the W8A8 run's linear pass takes minutes of wall time on a loaded machine
    [pytest.param("faquant_w8a8", marks=pytest.mark.slow), "c8"],
)
def test_stored_recipe_reruns_byte_for_byte(llama, tmp_path, run):
    calib = llama.parent / "calib.txt"
    first = tmp_path / "first"
    argv = [
        "calibrate",
        "--model",
        str(llama),
        "--calib-data",
        str(calib),
        "--num-samples",
        "4",
        "--max-length",
        "16",
        "--batch-size",
        "2",
        "--heldout",
        "1",
        "--seed",
        "5",
        *RUNS[run],
        "--output",
        str(first),
    ]
    assert main(argv) == 0
    stored = load_recipe(first / artifact.RECIPE_FILE)
    # fully resolved: the target's defaults decided, every flag recorded
    assert stored.source.model == str(llama) and stored.data.path == str(calib)
    assert (stored.data.num_samples, stored.data.seed) == (4, 5)
    assert stored.backend == "cpu" and stored.rotation in ("on", "off")
    if run == "c8":
        assert stored.target.consumer == "vllm-ascend"
        assert stored.target.release == "0.25.1rc1"
        assert stored.linears.scheme == "none" and stored.rotation == "off"
    else:
        assert stored.target.release == "3.0.0"  # the newest stable MindIE
        assert stored.linears.scheme == "w8a8" and stored.linears.fallback == 0
        assert stored.linears.headroom == 2.0 and stored.rotation == "on"
    assert artifact.inspect_artifact(first)["valid"]
    # the rerun, from the recipe alone, in another working directory
    second = tmp_path / "second"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert _rerun(first, second) == 0
    _assert_same_artifact(first, second)
    if run != "c8":
        return
    # a flag given explicitly wins over the recipe (and is recorded)
    third = tmp_path / "third"
    assert _rerun(first, third, "--seed", "6") == 0
    assert load_recipe(third / artifact.RECIPE_FILE).data.seed == 6
    assert (third / artifact.WEIGHTS_NAME).read_bytes() != (
        first / artifact.WEIGHTS_NAME
    ).read_bytes()


def test_recipe_values_win_over_defaults_flags_win_over_recipe(llama, tmp_path):
    """Defaults < recipe < flags given explicitly; a flag left out never
    clobbers the recipe with its default."""
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """
            spec:
              source: {model: llama}
              data: {path: calib.txt, num_samples: 5, max_length: 40, seed: 9}
              target: {consumer: vllm, dtype: fp16}
              linears: {scheme: none}
              process:
                - type: fa3_quant
            """
        )
    )
    (tmp_path / "llama").symlink_to(llama, target_is_directory=True)
    (tmp_path / "calib.txt").write_text(TEXTS)
    out = tmp_path / "out"
    plan = plan_calibration(recipe=path, output=out, max_length=33)
    # relative paths are relative to the recipe file
    assert plan.model == str(tmp_path / "llama")
    assert plan.calib_data == str(tmp_path / "calib.txt")
    assert (plan.num_samples, plan.seed) == (5, 9)  # the recipe's
    assert plan.max_length == 33  # the argument's
    assert plan.batch_size == 4 and plan.heldout == 4  # the defaults
    assert plan.target == "vllm" and plan.linear_type == "FLOAT"
    # the CLI: its defaults are "not given"
    args = build_parser().parse_args(
        ["calibrate", "--recipe", str(path), "--output", str(out)]
    )
    assert all(getattr(args, flag) is None for flag in RECIPE_FLAGS)
    args = build_parser().parse_args(
        ["calibrate", "--no-report", "--no-cache", "--no-clip-search", "--seed", "0"]
    )
    assert (args.picture_report, args.cache, args.clip_search, args.seed) == (
        False,
        False,
        False,
        0,
    )
    # an explicit value equal to the default still overrides the recipe
    assert plan_calibration(recipe=path, output=out, seed=0).seed == 0


def test_every_calibrate_flag_is_in_the_recipe_or_says_where_to_write():
    """Each ``calibrate`` option is a recipe key, or one of the options that only
    say where and how this run writes."""
    run_only = {"output", "overwrite", "force", "json", "dry_run", "recipe"}
    common = {"verbose", "quiet", "help"}
    parser = build_parser()
    sub = next(
        a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"
    ).choices["calibrate"]
    dests = {a.dest for a in sub._actions} - common
    assert dests == set(RECIPE_FLAGS) | run_only


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ("linears: {schem: w8a8}", r"spec\.linears\.schem \(line 2\): unknown key"),
        ("linears: {fallback: -1}", r"spec\.linears\.fallback"),
        ("linears: {headroom: 11}", r"spec\.linears\.headroom \(line 2\): headroom"),
        ("target: {consumer: trt}", r"spec\.target\.consumer \(line 2\): Input"),
        ("target: {dtype: int4}", r"spec\.target\.dtype \(line 2\)"),
        ("data: {num_samples: 0}", r"spec\.data\.num_samples \(line 2\): .*than 0"),
        ("data: {seed: 1.5}", r"spec\.data\.seed \(line 2\): .*valid integer"),
        ("rotation: maybe", r"spec\.rotation \(line 2\): Input should be 'auto'"),
        ("transforms: [v-rotation, v-rotation]", r"spec\.transforms .*twice"),
        ("transforms: [smooth]", r"spec\.transforms\[0\] \(line 2\)"),
        ("attention: {error_budget: -1}", r"spec\.attention\.error_budget"),
        ("export: {max_shard_size: lots}", r"spec\.export\.max_shard_size"),
        ("source: {streaming: 'yes'}", r"spec\.source\.streaming \(line 2\)"),
        ("backends: cpu", r"spec\.backends \(line 2\): unknown key 'backends'"),
    ],
)
def test_bad_run_settings_are_one_line_naming_file_and_key(tmp_path, section, match):
    path = tmp_path / "bad.yaml"
    path.write_text(f"spec:\n  {section}\n  process: [{{type: fa3_quant}}]\n")
    with pytest.raises(RecipeError, match=match) as info:
        load_recipe(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg


def test_cli_refuses_a_bad_recipe_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("spec:\n  data: {num_sample: 3}\n  process: []\n")
    assert main(["calibrate", "--recipe", str(path), "--output", "o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "spec.data.num_sample (line 2): unknown key" in err[0]
    assert str(path) in err[0] and not (tmp_path / "o").exists()


def test_yaml_on_off_and_release_numbers():
    text = (
        "spec:\n  rotation: on\n  target: {consumer: mindie, release: 3.0}\n"
        "  process: []\n"
    )
    r = load_recipe(text)
    assert r.rotation == "on" and r.target.release == "3.0"
    assert load_recipe(dump_recipe(r)) == r
    assert "rotation: 'on'" in dump_recipe(r)


def test_dump_is_canonical_and_round_trips():
    r = Recipe().with_values({"data.seed": 3, "transforms": ["qk-smoothing"]})
    text = dump_recipe(r, header="a\nb")
    assert text.startswith("# a\n# b\napiversion: v1\n")
    back = load_recipe(text)
    assert back == r and dump_recipe(back, header="a\nb") == text
    doc = yaml.safe_load(text)
    assert list(doc["spec"]) == [
        "source",
        "data",
        "target",
        "linears",
        "rotation",
        "transforms",
        "attention",
        "export",
        "backend",
        "process",
    ]
    with pytest.raises(ValueError, match=r"recipe key data\.seed"):
        r.with_values({"data.seed": "x"})


def test_packaged_default_states_every_default():
    """recipes/default.yaml writes every run setting out, each equal to the
    schema's default (so a recipe that leaves a key out runs as the default)."""
    from ascend_fa.calibration.plan import default_recipe_path

    doc = yaml.safe_load(default_recipe_path().read_text())
    assert set(doc["spec"]) >= set(Recipe.model_fields) - {
        "processors",
        "metadata",
    }
    r = load_recipe(default_recipe_path())
    assert r.model_copy(update={"processors": [], "metadata": None}) == Recipe()


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],  # the default: MindIE, FAQuant + static W8A8, the residual rotation
        ["--target", "vllm-ascend", "--consumer-version", "0.25.1rc1"],  # C8
    ],
    ids=["faquant_w8a8", "c8"],
)
def test_demo_model_rerun_byte_for_byte(tmp_path, extra):
    pytest.importorskip("gguf")
    try:
        from ascend_fa.models import default_model_location

        default_model_location()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    first, second = tmp_path / "first", tmp_path / "second"
    small = ["--num-samples", "4", "--max-length", "48", "--heldout", "1"]
    assert main(["calibrate", *small, *extra, "--output", str(first)]) == 0
    assert load_recipe(first / artifact.RECIPE_FILE).source.model is None
    assert _rerun(first, second) == 0
    _assert_same_artifact(first, second)


def test_recipes_page_matches_the_schema():
    """docs/guides/recipes.md's key tables are the ones generated from the
    schema; every meaning belongs to a key that exists."""
    from ascend_fa.cli import recipe_doc

    page = Path(__file__).resolve().parents[1] / "docs" / "guides" / "recipes.md"
    text = page.read_text(encoding="utf-8")
    block = text.split(recipe_doc.BEGIN, 1)[1].split(recipe_doc.END, 1)[0]
    assert block.strip() == recipe_doc.schema_markdown().strip(), (
        "regenerate: python -m ascend_fa.cli.recipe_doc docs/guides/recipes.md"
    )
    generated = recipe_doc.schema_markdown()
    for key in recipe_doc.MEANINGS:
        assert f"| `{key}` |" in generated, key
    for key in RECIPE_FLAGS.values():
        assert f"| `{key}` |" in generated, key
