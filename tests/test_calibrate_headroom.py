"""``calibrate --linear-headroom``: the static ``down_proj`` ranges' headroom in the
artifact (each range times its fold growth to the given power), and the
refusals."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

from ascend_fa.cli import main  # noqa: E402

SMALL = ["--num-samples", "6", "--max-length", "24", "--batch-size", "2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("headroom") / "llama", "llama")


def _calibrate(model, out, *extra):
    return main(
        [
            "calibrate",
            "--target",
            "mindie",
            "--model",
            str(model),
            "--output",
            str(out),
            "--heldout",
            "1",
            "--no-report",
            "--quiet",
            *SMALL,
            *extra,
        ]
    )


def _groups(out):
    report = json.loads((out / "calibration_report.json").read_text())
    return {g["group"]: g for g in report["linears"]["groups"]}


def test_headroom_is_the_fold_growth_to_the_given_power(llama, tmp_path):
    """Layer 0 sees the same inputs whatever the headroom (later layers see its
    quantized outputs): its down_proj headroom with D doublings is the one-doubling
    headroom to the power D, the searched α and clip do not move, and the other
    groups get none. ``0`` switches it off."""
    runs = {}
    for d in ("0", "1", "2"):
        out = tmp_path / f"d{d}"
        assert _calibrate(llama, out, "--linear-headroom", d) == 0
        runs[d] = _groups(out)
    default = tmp_path / "default"
    assert _calibrate(llama, default) == 0
    assert _groups(default) == runs["2"]
    down = "model.layers.0.mlp.down"
    g = runs["1"][down]["headroom"]
    assert g > 1.0
    assert runs["2"][down]["headroom"] == pytest.approx(g**2, rel=1e-9)
    assert runs["0"][down]["headroom"] == 1.0
    for key in ("alpha", "clip"):
        assert runs["0"][down][key] == runs["2"][down][key]
    lo0, hi0 = runs["0"][down]["range"]
    lo2, hi2 = runs["2"][down]["range"]
    assert (lo2, hi2) == pytest.approx((lo0 * g**2, hi0 * g**2), rel=1e-6)
    for run in runs.values():
        for name, group in run.items():
            if not name.endswith(".mlp.down"):
                assert group["headroom"] == 1.0, name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--linear-headroom", "-1"], "--linear-headroom '-1': a number of doublings"),
        (["--linear-headroom", "lots"], "--linear-headroom 'lots': a number of"),
        (["--linear-headroom", "11"], "in [0, 10]"),
        (
            ["--linear-headroom", "1", "--linear", "w8a8_dynamic"],
            "--linear-headroom widens static W8A8 ranges; this run's linears are "
            "W8A8_DYNAMIC",
        ),
    ],
)
def test_bad_headroom_is_one_line_before_any_work(
    llama, tmp_path, capsys, extra, message
):
    out = tmp_path / "o"
    assert _calibrate(llama, out, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()
