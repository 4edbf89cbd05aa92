"""Ctrl-C and SIGTERM delivered to real ``ascend-fa`` processes mid-run.

Each test starts ``python -m ascend_fa VERB ...`` (through a small driver that
announces when the run has reached the step to interrupt, and holds there) on a
tiny saved model, delivers the signal, and checks: exit status 130 (SIGINT) or 143
(SIGTERM), stderr ending in the one line ``ascend-fa VERB: interrupted`` with no
traceback, no temporary directory left beside the output, an existing output
untouched, and a next run that starts clean. A SIGKILLed run cannot clean up; the
next run removes what it left.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

from ascend_fa.cli import main  # noqa: E402

FAST = ["--num-samples", "3", "--max-length", "16", "--batch-size", "3"]
FAST += ["--heldout", "1"]

# The driver: wrap one library function so that the run announces "READY" on
# stderr when it gets there and then holds (the signal arrives during the hold,
# inside the verb, with its temporary files in place); then run the real CLI.
DRIVER = """
import importlib, sys, time
module_name, attr = sys.argv[1].rsplit(".", 1)
module = importlib.import_module(module_name)
real = getattr(module, attr)
def gate(*args, **kwargs):
    result = real(*args, **kwargs) if {after} else None
    print("READY", file=sys.stderr, flush=True)
    time.sleep(120)
    return result if {after} else real(*args, **kwargs)
setattr(module, attr, gate)
from ascend_fa.cli import main
sys.exit(main(sys.argv[2:]))
"""

BUDGET_S = 300  # startup + imports + a tiny model on a loaded 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("src") / "llama", "llama")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny) -> Path:
    out = tmp_path_factory.mktemp("art") / "art"
    assert main(["calibrate", "--model", str(tiny), *FAST, "--output", str(out)]) == 0
    return out


def start(
    tmp_path: Path, gate: str, args: list[str], *, after: bool
) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(after=after))
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(driver), gate, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


def wait_ready(proc: subprocess.Popen) -> list[str]:
    """Read stderr until READY; returns the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + BUDGET_S
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.strip() == "READY":
            return lines
    proc.kill()
    raise AssertionError("the run never got to the gate:\n" + "".join(lines))


def finish(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def assert_interrupted(rc: int, err: str, verb: str, sig: int) -> None:
    assert rc == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[-1] == f"ascend-fa {verb}: interrupted", err


def digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
    }


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_calibrate_interrupted_while_writing(tmp_path, tiny, sig):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    proc = start(
        tmp_path,
        "ascend_fa.artifact.writer.save_file",
        ["calibrate", "--model", str(tiny), *FAST, "--output", str(out)],
        after=True,
    )
    wait_ready(proc)
    temps = [p for p in work.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(temps) == 1 and any(temps[0].iterdir())  # mid-write, files in it
    rc, err = finish(proc, sig)
    assert_interrupted(rc, err, "calibrate", sig)
    assert list(work.iterdir()) == []  # temp dir removed, no output
    # the next run starts clean
    assert main(["calibrate", "--model", str(tiny), *FAST, "--output", str(out)]) == 0
    assert [p.name for p in work.iterdir()] == ["out"]


def test_calibrate_interrupted_while_replacing_keeps_the_old_output(
    tmp_path, tiny, artifact
):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    shutil.copytree(artifact, out)
    before = digest(out)
    proc = start(
        tmp_path,
        "ascend_fa.artifact.writer.save_file",
        ["calibrate", "--model", str(tiny), *FAST, "--seed", "5", "--output"]
        + [str(out), "--overwrite"],
        after=True,
    )
    wait_ready(proc)
    rc, err = finish(proc, signal.SIGTERM)
    assert_interrupted(rc, err, "calibrate", signal.SIGTERM)
    assert [p.name for p in work.iterdir()] == ["out"]
    assert digest(out) == before


def test_calibrate_killed_leftovers_cleaned_by_next_run(tmp_path, tiny):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    proc = start(
        tmp_path,
        "ascend_fa.artifact.writer.save_file",
        ["calibrate", "--model", str(tiny), *FAST, "--output", str(out)],
        after=True,
    )
    wait_ready(proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate(timeout=60)
    assert [p.name[:9] for p in work.iterdir()] == [".out.tmp-"]
    assert main(["calibrate", "--model", str(tiny), *FAST, "--output", str(out)]) == 0
    assert [p.name for p in work.iterdir()] == ["out"]


@pytest.mark.parametrize(
    ("verb", "gate", "sig"),
    [
        ("eval", "ascend_fa.evaluation.evaluate", signal.SIGINT),
        pytest.param(
            "emulate",
            "ascend_fa.emulation.verb.greedy_plain",
            signal.SIGTERM,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "inspect",
            "ascend_fa.artifact.inspect_artifact",
            signal.SIGINT,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_other_verbs_interrupted(tmp_path, tiny, artifact, verb, gate, sig):
    if verb == "inspect":
        args = ["inspect", str(artifact)]
    else:
        args = [verb, "--model", str(tiny), "--artifact", str(artifact)]
    if verb == "eval":
        args += ["--json", str(tmp_path / "res.json")]
    before = digest(artifact)
    proc = start(tmp_path, gate, args, after=False)
    wait_ready(proc)
    rc, err = finish(proc, sig)
    assert_interrupted(rc, err, verb, sig)
    assert digest(artifact) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver.py"]
