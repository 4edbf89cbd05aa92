"""The README's numbers reproduce: a table marked ``<!-- readme-numbers: ci -->``
is printed by the ``ascend-fa`` command in the ``bash`` block right after the
marker; this test runs that command and compares every number of its printed
table with the README's ``text`` block that follows, within the tolerances below.

Tolerances (absolute): perplexity change 0.05 percentage points, KL 5 % of the
value + 1e-4, top-1 0.003, cosine 5e-5, rel-L1 5e-4. The computation is
deterministic for a given torch build and CPU (one and two threads print the same
table). It is not across CPUs: a few ulps per float logit flip some int8 codes,
and the perplexity changes then move by up to 0.2 points, beyond these budgets;
the README says which CPU its table belongs to, and a new machine re-measures it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARK = "<!-- readme-numbers: ci -->"
PPL = re.compile(r"^([0-9.]+) \(([+-][0-9.]+)%\)$")


def marked_tables() -> list[tuple[int, str, list[str]]]:
    """``(line, command, table lines)`` for every marked table of the README."""
    lines = README.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        j = i + 1
        assert lines[j].strip() == "```bash", f"README.md:{j + 1}: bash block expected"
        command = lines[j + 1].strip()
        assert command.startswith("ascend-fa "), f"README.md:{j + 2}: {command}"
        k = j + 2
        while lines[k].strip() != "```text":
            k += 1
        end = k + 1
        while lines[end].strip() != "```":
            end += 1
        out.append((i + 1, command, lines[k + 1 : end]))
    return out


def parse_table(lines: list[str]) -> dict[str, dict[str, str]]:
    """Rows of a markdown table (first column = row name) -> {header: cell}."""
    rows = [ln for ln in lines if ln.startswith("|")]
    headers = [h.strip() for h in rows[0].strip("|").split("|")]
    table = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        table[cells[0]] = dict(zip(headers, cells))
    return table


def close(header: str, want: str, got: str) -> bool:
    if header.endswith("ppl (Δ%)"):
        mw, mg = PPL.match(want), PPL.match(got)
        if not (mw and mg):
            return abs(float(want) - float(got)) <= 1e-3 * abs(float(want))
        return abs(float(mw.group(2)) - float(mg.group(2))) <= 0.05
    w, g = float(want), float(got)
    if header.endswith(" KL"):
        return abs(w - g) <= 0.05 * abs(w) + 1e-4
    if header.endswith("top-1"):
        return abs(w - g) <= 0.003
    if "cos" in header:
        return abs(w - g) <= 5e-5
    if header.endswith("rel-L1"):
        return abs(w - g) <= 5e-4
    raise AssertionError(f"no tolerance for column {header!r}")


def test_every_marked_table_parses():
    tables = marked_tables()
    assert tables, f"the README has no {MARK} table"
    for line, _command, table in tables:
        rows = parse_table(table)
        assert "float" in rows and len(rows) >= 3, f"README.md:{line}"
        for name, row in rows.items():
            for header, cell in list(row.items())[1:]:
                # every cell is a number this test knows how to compare
                assert close(header, cell, cell), f"README.md:{line}: {name} {header}"


def test_close_refuses_a_real_difference():
    assert close("prose ppl (Δ%)", "34.33 (+0.139%)", "34.33 (+0.160%)")
    assert not close("prose ppl (Δ%)", "34.33 (+0.139%)", "34.36 (+0.239%)")
    assert not close("code KL", "0.00372", "0.00450")
    assert not close("code cos mean", "0.99841", "0.99830")


@pytest.mark.slow
@pytest.mark.parametrize("entry", marked_tables(), ids=lambda e: f"README.md:{e[0]}")
def test_marked_table_reproduces(entry, tmp_path):
    line, command, table = entry
    argv = shlex.split(command)
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_fa", *argv[1:]],
        cwd=tmp_path,
        env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        capture_output=True,
        text=True,
        timeout=5400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = parse_table(table)
    got = parse_table(proc.stdout.splitlines())
    assert set(got) == set(want), f"README.md:{line}: rows {sorted(got)}"
    bad = [
        f"{name} / {header}: README {cell}, now {got[name][header]}"
        for name, row in want.items()
        for header, cell in list(row.items())[1:]
        if not close(header, cell, got[name][header])
    ]
    assert not bad, f"README.md:{line}: numbers moved:\n" + "\n".join(bad)
