"""``ascend-fa selftest``: the library verb, its table, JSON and exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ascend_fa import selftest
from ascend_fa.cli import main
from ascend_fa.errors import UnsupportedError
from ascend_fa.selftest import run_selftest


@pytest.fixture(scope="module")
def cpu_result():
    return run_selftest("cpu")


def test_every_case_passes_on_cpu(cpu_result):
    assert cpu_result.ok and cpu_result.backend == "cpu"
    assert cpu_result.counts == {"PASS": 20, "FAIL": 0, "SKIP": 0}
    rows = {r.op: r for r in cpu_result.rows}
    write = rows["reshape_and_cache int8 nz"]
    assert (write.max_error, write.budget) == (0.0, 0.0)
    dec = rows["paged_attention int8_kv"]
    assert 0 <= dec.max_error <= dec.budget and "H=10 Hkv=1 D=128" in dec.shapes


@pytest.fixture
def two_cases(monkeypatch):
    """Only the first write and decode case (keeps the exit-status tests short)."""
    full = selftest._cases
    monkeypatch.setattr(
        selftest, "_cases", lambda t: [c for c in full(t) if c[0] in KEEP]
    )


KEEP = ("reshape_and_cache int8 nz", "paged_attention int8_kv")


def test_table(capsys, two_cases):
    assert main(["selftest", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| op " in out and "| max error " in out and "| budget " in out
    assert "| paged_attention int8_kv " in out and "| PASS " in out
    assert "2 passed, 0 failed, 0 skipped" in out


def test_json(capsys, two_cases):
    assert main(["selftest", "--backend", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["backend"] == "cpu" and len(doc["rows"]) == 2
    assert {"op", "shapes", "status", "max_error", "budget"} <= set(doc["rows"][0])


def test_a_failing_case_exits_1(capsys, monkeypatch, two_cases):
    # an impossible budget: the attention case must fail, and the verb says so
    monkeypatch.setattr(selftest, "EMULATION_FLOOR", -1.0)
    assert main(["selftest", "--backend", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_npu_without_torch_npu_is_one_line_exit_2():
    with pytest.raises(UnsupportedError, match="torch_npu is not installed"):
        run_selftest("npu")
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_fa", "selftest", "--backend", "npu"],
        capture_output=True,
        text=True,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "npu" in lines[0] and "torch_npu" in lines[0]
