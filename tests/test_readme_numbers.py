"""The documented numbers reproduce: a table marked ``<!-- readme-numbers: ci -->``
in ``README.md`` or any ``docs/**/*.md`` page is printed by the ``ascend-fa``
command in the ``bash`` block right after the marker; the slow test runs that
command and compares every number of its printed table with the page's ``text``
block that follows (:func:`moved_cells`).

Why the check can hold on any x86-64 CPU and thread count: a marked command with
``eval --dtype fp64``. In fp32 the float logits of two CPUs (or of torch's AVX2 and
generic kernels) differ in the last bits, some INT8 codes round the other way and
the documented fp32 table moved by up to 0.23 perplexity points, 0.014 top-1 and 14 %
of a KL on another CPU. In fp64 the activations of two CPUs agree to about 1e-16,
the FA points quantize the same fp32 values, and every printed cell is the same.

An fp64 table's columns are compared within ``spread + margin``
(:data:`TOLERANCE`): ``spread`` is what the printed cell moved across the CPU
variants measured (:data:`VARIANTS`), ``margin`` two units of its last printed
digit (a value on a rounding boundary). The default suite proves both halves on a
tiny model: the fp64 table is the same under every variant, and scales one step
off (each scale ``x 128/127``) move cells beyond the tolerance. A table measured in
fp32 keeps the wider tolerances of :func:`close_fp32` and belongs to its CPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import byte_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The pages whose marked tables are checked: the README and the docs site.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MARK = "<!-- readme-numbers: ci -->"
PPL = re.compile(r"^([0-9.]+) \(([+-][0-9.]+)%\)$")

#: Column kind -> (spread measured across :data:`VARIANTS`, margin), absolute.
#: Spread 0: every printed cell of the fp64 table was equal under each variant.
TOLERANCE = {
    "ppl": (0.0, 2e-4),  # the float row's perplexity, 4 decimals
    "ppl Δ%": (0.0, 0.002),  # percentage points, 3 decimals
    "KL": (0.0, 2e-5),
    "top-1": (0.0, 2e-4),
    "cos": (0.0, 2e-5),
    "rel-L1": (0.0, 2e-5),
}

#: Another x86-64 CPU, simulated on this one: torch's generic (non-SIMD) kernels,
#: MKL and oneDNN limited to SSE4, one thread; and this CPU's kernels, two threads.
VARIANTS = {
    "generic kernels, 1 thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "OMP_NUM_THREADS": "1",
    },
    "native kernels, 2 threads": {"OMP_NUM_THREADS": "2"},
}


def marked_tables() -> list[tuple[str, str, list[str]]]:
    """``(page:line, command, table lines)`` for every marked table of every page
    (:data:`PAGES`)."""
    out = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            j = i + 1
            assert lines[j].strip() == "```bash", f"{name}:{j + 1}: bash block expected"
            command = lines[j + 1].strip()
            assert command.startswith("ascend-fa "), f"{name}:{j + 2}: {command}"
            k = j + 2
            while lines[k].strip() != "```text":
                k += 1
            end = k + 1
            while lines[end].strip() != "```":
                end += 1
            out.append((f"{name}:{i + 1}", command, lines[k + 1 : end]))
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


def tolerance(header: str) -> float:
    """``spread + margin`` of a column (:data:`TOLERANCE`)."""
    for suffix, kind in (
        ("ppl (Δ%)", "ppl Δ%"),
        (" KL", "KL"),
        ("top-1", "top-1"),
        ("rel-L1", "rel-L1"),
    ):
        if header.endswith(suffix):
            return sum(TOLERANCE[kind])
    if "cos" in header:
        return sum(TOLERANCE["cos"])
    raise AssertionError(f"no tolerance for column {header!r}")


def close_fp32(header: str, want: str, got: str) -> bool:
    """The tolerances of a table measured in fp32 (a command without ``--dtype
    fp64``): perplexity change 0.05 points, KL 5 % + 1e-4, top-1 0.003, cosine
    5e-5, rel-L1 5e-4. Such a table belongs to the CPU that measured it: on
    another CPU its cells move beyond these (module doc)."""
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


def close(header: str, want: str, got: str) -> bool:
    """Whether cell ``got`` equals ``want`` within its column's tolerance (an
    fp64 table)."""
    if header.endswith("ppl (Δ%)"):
        mw, mg = PPL.match(want), PPL.match(got)
        if not (mw and mg):  # the float row: a perplexity
            return abs(float(want) - float(got)) <= sum(TOLERANCE["ppl"])
        return abs(float(mw.group(2)) - float(mg.group(2))) <= tolerance(header)
    return abs(float(want) - float(got)) <= tolerance(header)


def moved_cells(want: list[str], got: list[str], fp64: bool = True) -> list[str]:
    """Every cell of table ``got`` (markdown lines) that moved from ``want``
    beyond its tolerance (:func:`close`, or :func:`close_fp32` for an fp32
    table), named ``row / column: want, got``; different rows are named too."""
    same = close if fp64 else close_fp32
    w, g = parse_table(want), parse_table(got)
    if set(w) != set(g):
        return [f"rows {sorted(g)}, expected {sorted(w)}"]
    return [
        f"{name} / {header}: documented {cell}, now {g[name][header]}"
        for name, row in w.items()
        for header, cell in list(row.items())[1:]
        if not same(header, cell, g[name][header])
    ]


def test_every_marked_table_parses():
    tables = marked_tables()
    assert tables, f"no page has a {MARK} table"
    for where, command, table in tables:
        same = close if "--dtype fp64" in command else close_fp32
        rows = parse_table(table)
        assert "float" in rows and len(rows) >= 3, where
        for name, row in rows.items():
            for header, cell in list(row.items())[1:]:
                # every cell is a number this test knows how to compare
                assert same(header, cell, cell), f"{where}: {name} {header}"


def test_close_refuses_a_real_difference():
    assert close("prose ppl (Δ%)", "34.3300 (+0.139%)", "34.3301 (+0.140%)")
    assert not close("prose ppl (Δ%)", "34.3300 (+0.139%)", "34.3310 (+0.142%)")
    assert not close("prose ppl (Δ%)", "32.1636", "32.1640")
    assert not close("code KL", "0.00372", "0.00375")
    assert not close("code top-1", "0.9628", "0.9638")  # one token of 1022
    assert not close("code cos mean", "0.99841", "0.99838")
    assert not close("code rel-L1", "0.05740", "0.05743")
    with pytest.raises(AssertionError, match="no tolerance"):
        close("code speed", "1", "1")
    # an fp32 table is compared as before (it belongs to its CPU)
    assert close_fp32("prose ppl (Δ%)", "34.33 (+0.139%)", "34.33 (+0.160%)")
    assert not close_fp32("prose ppl (Δ%)", "34.33 (+0.139%)", "34.36 (+0.239%)")
    assert not close_fp32("code KL", "0.00372", "0.00450")


# ------------------------------------------------- the check, on a tiny model
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Numbers: 3.14159, 2.71828, 1.41421 and 42; totals 17 + 25 = 42.",
    "User: how far is the station?\nAssistant: about twelve kilometres north.",
    "A short line of prose, then another one with more words in it.",
    "for (int i = 0; i < n; i++) { sum += a[i] * b[i]; }",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-layer LLaMA checkpoint (one wide V head: static INT8 has a visible
    error), its calibration file and held-out text."""
    root = tmp_path_factory.mktemp("fp64")
    model = tiny_llama(seed=3, num_hidden_layers=3)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[2] *= 40.0
    model.save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 2))
    held = root / "held.txt"
    held.write_text("\n\n".join(TEXTS[::-1] * 2))
    return root


def _eval_argv(root: Path, dtype: str) -> list[str]:
    return [
        "eval",
        "--model",
        str(root / "model"),
        "--compare-methods",
        "--calib-data",
        str(root / "calib.jsonl"),
        "--num-samples",
        "8",
        "--max-length",
        "48",
        "--data",
        str(root / "held.txt"),
        "--window",
        "96",
        "--dtype",
        dtype,
        "-q",
    ]


def test_fp64_table_is_the_same_on_other_kernels_and_threads(tiny):
    tables = {}
    for name, env in VARIANTS.items():
        proc = subprocess.run(
            [sys.executable, "-m", "ascend_fa", *_eval_argv(tiny, "fp64")],
            env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **env),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        tables[name] = [ln for ln in proc.stdout.splitlines() if ln.startswith("|")]
    first, *others = tables.values()
    assert len(parse_table(first)) == 10  # float + every method
    for table in others:
        assert table == first  # every printed cell, not only within tolerance


def _table(results) -> list[str]:
    from ascend_fa.evaluation import EvalReport
    from ascend_fa.tables import format_table

    title, headers, rows = EvalReport("tiny", None, {"held": results}).table()
    return format_table(headers, rows).splitlines()


def test_the_check_fails_on_scales_one_step_off(tiny):
    """The static methods' scales each one step wider (``s x 128/127``: code 127
    of the correct scale lands on 126): the check names the moved cells."""
    from ascend_fa.calibration import methods as cm
    from ascend_fa.calibration.data import load_calib_texts
    from ascend_fa.evaluation import evaluate, load_eval_text, token_windows
    from ascend_fa.models import load_model

    lm = load_model(tiny / "model", dtype=torch.float64, cache=False)
    texts = cm.calibration_split(load_calib_texts(tiny / "calib.jsonl"), 8)
    # the default row, the per-tensor row and the dynamic row (the clip searches
    # cost most and check nothing more here)
    methods = [
        m
        for m in cm.default_methods(8 * 48 * 16)
        if m.search is None and (m.per_tensor or m.dynamic or "default" in m.name)
    ]
    assert len(methods) == 3
    specs = cm.calibrate_methods(lm.model, lm.tokenizer, texts, methods, max_length=48)
    windows = token_windows(lm.tokenizer, load_eval_text(tiny / "held.txt"), window=96)
    right = evaluate(lm.model, windows, specs)
    off = {
        name: spec
        if isinstance(spec, str)
        else {
            attn: {b: (s * 128 / 127, o) for b, (s, o) in branches.items()}
            for attn, branches in spec.items()
        }
        for name, spec in specs.items()
    }
    wrong = evaluate(lm.model, windows, off)
    assert moved_cells(_table(right), _table(right)) == []
    moved = moved_cells(_table(right), _table(wrong))
    default = methods[0].name
    assert any(cell.startswith(f"{default} / ") for cell in moved), moved
    # dynamic quantization has no static scale: it does not move
    assert not any(c.startswith("dynamic per-token-per-head /") for c in moved)


@pytest.mark.slow
@pytest.mark.parametrize("entry", marked_tables(), ids=lambda e: e[0])
def test_marked_table_reproduces(entry, tmp_path):
    where, command, table = entry
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
    bad = moved_cells(table, proc.stdout.splitlines(), "--dtype fp64" in argv)
    assert not bad, f"{where}: numbers moved:\n" + "\n".join(bad)
