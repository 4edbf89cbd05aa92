"""The CPU's exact integer product of the W8A8 linears is named with its reason by
``doctor``, by ``-v`` and in benchmark records, and is decided from what the CPU
is, not from a timing (a busy machine does not change it)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from ascend_fa.atb_ops import linear as linear_ops

from ascend_fa.cli import main


def _fresh(monkeypatch):
    monkeypatch.setattr(linear_ops, "_CPU_INT_MM", None)
    monkeypatch.setattr(linear_ops, "_CPU_PATH", None)
    monkeypatch.setattr(linear_ops, "_LOGGED", set())


def test_doctor_names_the_integer_product_path(monkeypatch, capsys):
    _fresh(monkeypatch)
    monkeypatch.delenv("ASCEND_FA_INT_GEMM", raising=False)
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    gemm = info["cpu_paths"]["int_gemm"]
    want = linear_ops.int_gemm_path()
    assert (gemm["path"], gemm["reason"], gemm["source"]) == (
        want.path,
        want.reason,
        "cpu",
    )
    assert info["cpu_paths"]["native"]
    assert "ASCEND_FA_INT_GEMM" in info["env"]
    monkeypatch.setenv("ASCEND_FA_INT_GEMM", "fp32")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert (
        "integer products (W8A8 linears, CPU): fp32 GEMM chunks "
        "(set by ASCEND_FA_INT_GEMM=fp32)" in out
    )
    assert "ASCEND_FA_INT_GEMM=fp32" in out.splitlines()


def test_doctor_reports_an_invalid_setting(monkeypatch, capsys):
    monkeypatch.setenv("ASCEND_FA_INT_GEMM", "fastest")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (
        "missing a valid setting (ASCEND_FA_INT_GEMM='fastest': expected auto, "
        "int_mm or fp32)" in out
    )


def test_verbose_logging_names_the_path(monkeypatch, caplog):
    _fresh(monkeypatch)
    monkeypatch.setenv("ASCEND_FA_INT_GEMM", "int_mm")
    with caplog.at_level(logging.DEBUG, logger="ascend_fa.atb_ops.linear"):
        linear_ops.int_gemm(
            torch.ones(3, 4, dtype=torch.int8), torch.ones(2, 4, dtype=torch.int8)
        )
    assert (
        "integer products on the CPU: torch._int_mm (int8 GEMM): set by "
        "ASCEND_FA_INT_GEMM=int_mm" in caplog.text
    )


def test_benchmark_records_carry_the_path(tmp_path, monkeypatch):
    from ascend_fa.benchmarks.results import (
        Record,
        check_results,
        machine_line,
        write_results,
    )

    _fresh(monkeypatch)
    monkeypatch.setenv("ASCEND_FA_INT_GEMM", "fp32")
    path = tmp_path / "r.json"
    write_results(path, [Record("kvcache", "cpu", "int8", {}, 0.1)])
    env = check_results(path)["environment"]
    assert env["int_gemm"]["path"] == "fp32"
    assert env["int_gemm"]["source"] == "setting"
    assert env["int_gemm"]["timed_shapes"] == {}
    assert "integer products: fp32 GEMM chunks (setting)" in machine_line()


@pytest.mark.slow
def test_the_choice_is_the_same_in_every_fresh_process():
    """``auto`` reads the CPU, so fresh processes agree whatever the load (the
    timing probe this replaces chose differently from one process to the next on
    a busy machine)."""
    code = (
        "from ascend_fa.atb_ops.linear import int_gemm_path as p; "
        "print(p().path, p().source)"
    )
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_FA_INT_GEMM"}
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.strip()
        for _ in range(2)
    }
    want = linear_ops._detect_path()
    assert seen == {f"{want.path} cpu"}


def _spin_seen(env_extra: dict[str, str]) -> str:
    """GOMP_SPINCOUNT as a fresh ``ascend-fa`` process leaves it for torch."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    }
    env.update(env_extra)
    code = (
        "import os, sys\n"
        "from ascend_fa import cli\n"
        "cli._short_omp_spin()\n"
        "print(os.environ.get('GOMP_SPINCOUNT', 'unset'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_cli_gives_openmp_a_short_spin_unless_the_user_chose():
    from ascend_fa.cli import OMP_SPIN_DEFAULT

    assert _spin_seen({}) == OMP_SPIN_DEFAULT
    assert _spin_seen({"GOMP_SPINCOUNT": "77"}) == "77"
    assert _spin_seen({"OMP_WAIT_POLICY": "ACTIVE"}) == "unset"


def test_no_spin_change_once_torch_is_loaded():
    import os

    import torch  # noqa: F401

    from ascend_fa import cli

    before = os.environ.get("GOMP_SPINCOUNT")
    cli._short_omp_spin()
    assert os.environ.get("GOMP_SPINCOUNT") == before
