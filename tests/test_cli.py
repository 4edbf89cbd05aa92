"""The ``ascend-fa`` console script: discovery, doctor, bench dispatch."""

from __future__ import annotations

import json
import subprocess
import sys

from ascend_fa.cli import main


def test_doctor_text(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ascend-fa 0.1.0" in out and "torch " in out
    assert "cpu      available" in out
    assert "npu      unavailable: torch_npu is not installed" in out
    assert "selected backend: cpu" in out or "selected backend: cuda" in out
    assert "torch_npu installed: False" in out


def test_doctor_json_env_forced(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_BACKEND", "cpu")
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selected"] == "cpu"
    assert info["env"]["ASCEND_FA_BACKEND"] == "cpu"
    assert {b["name"] for b in info["backends"]} >= {"cpu", "cuda", "npu"}


def test_doctor_reports_bad_forced_backend(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_BACKEND", "npu")
    assert main(["doctor"]) == 1
    assert "selected backend: none (backend 'npu'" in capsys.readouterr().out


def test_console_script_runs_in_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "ascend_fa", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for cmd in ("doctor", "bench"):
        assert cmd in out


def test_bench_layout_quick_prints_ratios(capsys, tmp_path):
    path = tmp_path / "layout.json"
    assert (
        main(["bench", "layout", "--sizes", "1", "--repeats", "1", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "nd_to_nz GB/s" in out and "vs clone" in out
    data = json.loads(path.read_text())
    assert data["bench"] == "layout" and len(data["results"]) == 2
