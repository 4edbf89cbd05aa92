"""``bench attention --sweep``: the memory-bound limit, the points, the plot."""

from __future__ import annotations

import json

import pytest

from ascend_fa.benchmarks.attention_sweep import (
    FULL,
    QUICK,
    SweepPoint,
    bytes_ratio,
    plot_sweep,
    sweep_points,
)
from ascend_fa.benchmarks.results import Record


def test_limit_is_bytes_int8_over_bytes_float():
    p = SweepPoint("int8_kv", 8, 4096, 32, 8, 128, "nz")
    cache = 8 * 4096 * 8 * 128 * 2  # K and V elements
    qo = 8 * 32 * 128 * 2 * 2
    assert bytes_ratio(p) == pytest.approx((cache + 64 + qo) / (2 * cache + qo))
    assert 0.5 < bytes_ratio(p) < 0.502
    mla = SweepPoint("fakquant", 8, 4096, 16, 1, 128, "nz")
    assert bytes_ratio(mla) == pytest.approx((512 + 128) / (2 * 576), rel=1e-2)
    # short contexts: the query/output bytes weigh more, the limit rises
    assert bytes_ratio(SweepPoint("int8_kv", 1, 16, 32, 8, 128, "nz")) > bytes_ratio(p)


def test_points_cover_every_dimension():
    for grid in (QUICK, FULL):
        pts = sweep_points(grid)
        assert {p.mode for p in pts} == {"int8_kv", "faquant", "fakquant"}
        assert {p.layout for p in pts} == {"nd", "nz"}
        assert {p.context for p in pts} == set(grid["context"])
        assert len({(p.heads, p.kv_heads) for p in pts}) >= 2
    assert len(sweep_points(QUICK)) >= 4


def test_plot_is_a_real_picture(tmp_path):
    import matplotlib.image

    recs = [
        Record(
            "attention",
            "cpu",
            m,
            {"context": c, "B": 1},
            0.01,
            ratio=r,
            extra={"limit": 0.5},
        )
        for m, c, r in [
            ("int8_kv", 256, 0.9),
            ("int8_kv", 1024, 0.7),
            ("fakquant", 256, 1.0),
            ("fakquant", 1024, 0.8),
        ]
    ]
    path = tmp_path / "p.png"
    plot_sweep(recs, str(path), "t")
    img = matplotlib.image.imread(str(path))
    assert img.shape[1] >= 300 and img.shape[0] >= 200
    assert float(img[..., :3].std()) > 0.05


@pytest.mark.slow
def test_quick_sweep_cli(tmp_path, capsys):
    from ascend_fa.cli import main

    png, js = tmp_path / "s.png", tmp_path / "s.json"
    argv = [
        "bench",
        "attention",
        "--backend",
        "cpu",
        "--quick",
        "--sweep",
        "--plot",
        str(png),
        "--json",
        str(js),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "limit" in out and "\nbest: " in out
    doc = json.loads(js.read_text())
    assert len(doc["records"]) >= 4
    assert all(r["backend"] == "cpu" and r["mode"] for r in doc["records"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "compare", str(js), str(js)]) == 0
