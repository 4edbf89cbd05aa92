"""``calibrate --merge-into`` a genuine msModelSlim 26.1 export: written by
msModelSlim's own ``AscendV1Saver`` (:mod:`msmodelslim_saver`), its description
carries ``metadata``, ``optional`` and ``group_size``; the merge keeps them and
loads in mindie and vllm-ascend, and wrong descriptions are still refused."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from builders import TF4_LLAMA3_CONFIG, transformers4_source  # noqa: E402
from msmodelslim_saver import genuine_export, saver_available  # noqa: E402

from ascend_fa.artifact import DESCRIPTION_FILE, description_problem  # noqa: E402
from ascend_fa.artifact.reader import read_description  # noqa: E402
from ascend_fa.cli import main  # noqa: E402

_WHY = saver_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b  # small helper",
    "Ascend NPUs run attention with int8 caches in fractal layouts.",
    "A lighthouse keeper climbed the stairs every evening at dusk.",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("msmodelslim")
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    src = transformers4_source(root / "llama3", TF4_LLAMA3_CONFIG)
    exports = {
        q: (root / q, genuine_export(root / q, src, quant_type=q))
        for q in ("W8A8", "W8A8_DYNAMIC")
    }
    return data, src, exports


#: The source is a Llama: vllm-ascend loads its C8 from 0.25.1rc1 on
#: (ascend_fa.artifact.releases; 0.23.0.post1, the default, maps Qwen3 C8 only).
RELEASE = {"vllm-ascend": ["--consumer-version", "0.25.1rc1"]}


def _merge(src, export, out, data, target):
    return main(
        [
            "calibrate",
            "--model",
            str(src),
            "--calib-data",
            str(data),
            "--num-samples",
            "3",
            "--heldout",
            "1",
            "--max-length",
            "24",
            "--target",
            target,
            "--merge-into",
            str(export),
            "--output",
            str(out),
            "-q",
            *RELEASE.get(target, []),
        ]
    )


def test_the_saver_writes_what_msmodelslim_writes(setup):
    _, src, exports = setup
    export, desc = exports["W8A8"]
    # AscendV1Saver.post_run's top-level keys, besides the tensor entries
    assert desc["metadata"] == {} and desc["optional"] == {}
    assert desc["group_size"] == 0 and desc["version"] == "1.0.0"
    assert desc["model_quant_type"] == "W8A8"
    assert desc["model.layers.0.self_attn.q_proj.deq_scale"] == "W8A8"
    assert desc["lm_head.weight"] == "FLOAT"
    assert description_problem(desc) is None
    assert read_description(export) == desc  # what inspect and eval read
    # copy_files + remove_quantization_config: the source's config.json content
    assert json.loads((export / "config.json").read_text()) == TF4_LLAMA3_CONFIG
    assert (export / "generation_config.json").is_file()


@pytest.mark.parametrize(
    "quant, target",
    [("W8A8", "mindie"), ("W8A8", "vllm-ascend"), ("W8A8_DYNAMIC", "vllm-ascend")],
)
def test_merge_into_genuine_export(setup, tmp_path, quant, target):
    data, src, exports = setup
    export, desc = exports[quant]
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    out = tmp_path / "merged"
    assert _merge(src, export, out, data, target) == 0
    assert (
        main(["inspect", str(out), "--target", target, *RELEASE.get(target, [])]) == 0
    )
    merged = json.loads((out / DESCRIPTION_FILE).read_text())
    for key, value in desc.items():
        if key != "metadata":
            assert merged[key] == value  # optional, group_size, every tensor kept
    source = merged["metadata"].pop("ascend_fa_source")  # provenance, recorded
    assert source["model_type"] == "llama" and len(source["shapes"]) == 16
    release = merged["metadata"].pop("ascend_fa_consumer_version")
    assert release == (RELEASE.get(target) or [None, "3.0.0"])[1]
    assert merged["metadata"] == {**desc["metadata"], "ascend_fa_target": target}
    # inspect judges against the recorded release: no flag needed
    assert main(["inspect", str(out)]) == 0
    for name, blob in before.items():
        if name.endswith(".safetensors") or name == "generation_config.json":
            assert (out / name).read_bytes() == blob
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == TF4_LLAMA3_CONFIG  # kept: only quantization_config would go
    assert {p.name for p in export.iterdir()} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"model.layers.0.self_attn.q_proj.weight": 3},
            "'model.layers.0.self_attn.q_proj.weight' maps to a JSON integer, "
            "expected a JSON string",
        ),
        ({"optional": "none"}, "'optional' maps to a JSON string, expected a JSON"),
        ({"group_size": "0"}, "'group_size' maps to a JSON string, expected a JSON"),
        ({"group_size": -1}, "'group_size' is -1, expected >= 0"),
        ({"metadata": [1]}, "'metadata' maps to a JSON list, expected a JSON object"),
        (
            {"model.layers.0.self_attn.q_proj.weight": "W9A9"},
            "has type 'W9A9' in quant_model_description.json, which msModelSlim's "
            "saver never writes",
        ),
    ],
)
def test_wrong_descriptions_are_refused(setup, tmp_path, capsys, change, message):
    data, src, exports = setup
    export, desc = exports["W8A8"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in export.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / DESCRIPTION_FILE).write_text(json.dumps({**desc, **change}))
    out = tmp_path / "merged"
    capsys.readouterr()
    assert _merge(src, bad, out, data, "mindie") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert main(["inspect", str(bad)]) == 1  # inspect finds it too


def test_merged_export_recipe_reruns_byte_for_byte(setup, tmp_path):
    """The merge stores its resolved recipe (the export merged into, the linears
    kept); a rerun of it writes the same files byte for byte."""
    from ascend_fa.artifact import RECIPE_FILE
    from ascend_fa.calibration.recipe import load_recipe

    data, src, exports = setup
    export, _ = exports["W8A8"]
    out, again = tmp_path / "merged", tmp_path / "again"
    assert _merge(src, export, out, data, "mindie") == 0
    recipe = load_recipe(out / RECIPE_FILE)
    assert recipe.source.merge_into == str(export)
    assert recipe.linears.scheme == "none"  # the export's own linears are kept
    rerun = ["calibrate", "--recipe", str(out / RECIPE_FILE), "--output", str(again)]
    assert main([*rerun, "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in again.iterdir()
    )
    for p in out.iterdir():
        assert p.read_bytes() == (again / p.name).read_bytes(), p.name
