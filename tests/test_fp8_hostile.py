"""FP8 conversion against careless and hostile inputs: paths read from files,
outputs that would destroy something, untrusted manifests, bad scales, pickles.

Every case ends in one typed error (exit 2 and one line through the CLI) naming
the file, before anything is written; no file outside the output changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_fp8 import make_bf16_checkpoint, make_fp8_checkpoint, tree_bytes

from ascend_fa.cli import main
from ascend_fa.errors import (
    AscendFAError,
    FileFormatError,
    InputError,
    OutputExistsError,
    UnsafePathError,
)
from ascend_fa.fp8 import (
    MANIFEST_NAME,
    FP8ConversionError,
    dequantize_checkpoint,
    quantize_checkpoint,
    read_safetensors_header,
)

INDEX = "model.safetensors.index.json"
SHARD2 = "model-00002-of-00003.safetensors"


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (links not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_cli(verb: str, inp: Path, out: Path, *extra: str) -> int:
    return main(
        ["fp8", verb, "--input", str(inp), "--output", str(out), "--quiet", *extra]
    )


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


def edit_index(root: Path, fn) -> None:
    path = root / INDEX
    body = json.loads(path.read_text())
    fn(body)
    path.write_text(json.dumps(body))


@pytest.fixture
def bf16(tmp_path) -> Path:
    make_bf16_checkpoint(tmp_path / "bf16")
    return tmp_path / "bf16"


# --------------------------------------------------------------------------------------
# Names read from the index
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "../outside.safetensors",
        "ABSOLUTE",
        "sub/model.safetensors",
        "..",
        "a\\b.safetensors",
        "",
    ],
)
def test_index_entry_leaving_the_directory_is_refused(tmp_path, bf16, capsys, entry):
    outside = tmp_path / "outside.safetensors"
    save_file({"x": torch.zeros(2, 2)}, str(outside))
    if entry == "ABSOLUTE":
        entry = str(outside)
    before = snapshot(tmp_path)
    edit_index(bf16, lambda b: b["weight_map"].update({"lm_head.weight": entry}))
    before = snapshot(tmp_path)
    with pytest.raises(UnsafePathError, match="weight_map entry 'lm_head.weight'"):
        quantize_checkpoint(bf16, tmp_path / "out", progress=False)
    assert run_cli("dequantize", bf16, tmp_path / "out") == 2
    one_line_error(capsys, INDEX, "lm_head.weight", "not a plain file name")
    assert snapshot(tmp_path) == before  # nothing read-and-rewritten, nothing new


def test_index_symlink_out_of_the_directory_is_refused(tmp_path, bf16, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (bf16 / SHARD2).rename(elsewhere / SHARD2)
    (bf16 / SHARD2).symlink_to(elsewhere / SHARD2)
    before = snapshot(tmp_path)
    assert run_cli("quantize", bf16, tmp_path / "out") == 2
    one_line_error(capsys, INDEX, "symbolic link", SHARD2)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.partial").exists()


def test_links_inside_the_directory_and_hub_cache_layout_are_accepted(tmp_path):
    """The Hugging Face hub cache stores snapshots/<rev>/<file> as links to
    ../../blobs/<hash>: that layout is read; links elsewhere are not."""
    repo = tmp_path / "models--org--m"
    make_bf16_checkpoint(tmp_path / "plain")
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted((tmp_path / "plain").rglob("*")):
        if p.is_file():
            rel = p.relative_to(tmp_path / "plain")
            blob = repo / "blobs" / hashlib.sha256(str(rel).encode()).hexdigest()
            p.rename(blob)
            (snap / rel).parent.mkdir(parents=True, exist_ok=True)
            (snap / rel).symlink_to(os.path.relpath(blob, (snap / rel).parent))
    result = quantize_checkpoint(snap, tmp_path / "out", progress=False)
    assert len(result.shards) == 3
    assert not any(p.is_symlink() for p in (tmp_path / "out").rglob("*"))
    assert (tmp_path / "out" / "inference" / "README.md").is_file()


def test_non_string_and_malformed_index(tmp_path, bf16, capsys):
    path = bf16 / INDEX
    cases = {
        "[1, 2]": "a JSON list",
        '{"weight_map": {"a": 5}}': "non-string",
        '{"weight_map": []}': "no weight_map",
        '{"weight_map": {}}': "no weight_map",
        "{" * 100000: "not valid JSON",
        '{"metadata": [], "weight_map": {"a": "b"}}': "metadata",
    }
    for text, needle in cases.items():
        path.write_text(text)
        with pytest.raises(FileFormatError, match=needle):
            quantize_checkpoint(bf16, tmp_path / "out", progress=False)
        assert run_cli("quantize", bf16, tmp_path / "out") == 2
        one_line_error(capsys, INDEX)
    assert not (tmp_path / "out.partial").exists()


def test_index_names_a_tensor_its_shard_lacks(tmp_path, bf16, capsys):
    edit_index(bf16, lambda b: b["weight_map"].update({"ghost.weight": SHARD2}))
    assert run_cli("quantize", bf16, tmp_path / "out") == 2
    one_line_error(capsys, INDEX, "'ghost.weight'", SHARD2, "does not contain it")


# --------------------------------------------------------------------------------------
# Files that are not safetensors
# --------------------------------------------------------------------------------------


class _Pwn:
    """Unpickling this writes a file: proof that a pickle was (not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


@pytest.mark.parametrize("kind", ["torch-zip", "raw-pickle"])
def test_pickled_shard_is_refused_unread(tmp_path, bf16, capsys, kind):
    marker = tmp_path / "pwned"
    target = bf16 / SHARD2
    if kind == "torch-zip":
        torch.save({"w": _Pwn(marker)}, target)
    else:
        target.write_bytes(pickle.dumps(_Pwn(marker), protocol=4))
    with pytest.raises(FileFormatError, match="pickled PyTorch checkpoint"):
        read_safetensors_header(target)
    assert run_cli("dequantize", bf16, tmp_path / "out") == 2
    one_line_error(capsys, SHARD2, "pickled")
    assert not marker.exists()


def test_directory_of_pickles_names_them(tmp_path, capsys):
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({"w": torch.zeros(2)}, d / "pytorch_model.bin")
    assert run_cli("quantize", d, tmp_path / "out") == 2
    one_line_error(capsys, "no *.safetensors", "pytorch_model.bin", "not read")


def test_fifo_shard_does_not_hang(tmp_path, bf16, capsys):
    (bf16 / SHARD2).unlink()
    os.mkfifo(bf16 / SHARD2)
    assert run_cli("quantize", bf16, tmp_path / "out") == 2
    one_line_error(capsys, "not a regular file")


def test_header_too_large_is_refused_before_reading_it(tmp_path, bf16):
    target = bf16 / SHARD2
    data = target.read_bytes()
    target.write_bytes((200 << 20).to_bytes(8, "little") + data[8:])
    with pytest.raises(FileFormatError, match="header length"):
        read_safetensors_header(target)


# --------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------


def test_output_overlapping_input_or_reference_is_refused(tmp_path, bf16, capsys):
    make_fp8_checkpoint(tmp_path / "ref")
    before = snapshot(tmp_path)
    for out in (bf16, bf16 / "sub", tmp_path):
        with pytest.raises(InputError, match="must not be, contain or lie inside"):
            quantize_checkpoint(bf16, out, progress=False)
    ref = ("--reference-fp8", str(tmp_path / "ref"))
    for out in (tmp_path / "ref", tmp_path / "ref" / "x"):
        assert run_cli("quantize", bf16, out, *ref) == 2
        one_line_error(capsys, "--reference-fp8")
    # --overwrite does not make any of it acceptable
    assert run_cli("quantize", bf16, bf16, "--overwrite", "--force") == 2
    one_line_error(capsys, "must not be")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("dangling", [False, True])
def test_output_symlink_is_never_written_through(tmp_path, bf16, capsys, dangling):
    target = tmp_path / "target"
    if not dangling:
        target.mkdir()
        (target / "keep.txt").write_text("precious")
    (tmp_path / "out").symlink_to(target, target_is_directory=True)
    for extra in ((), ("--overwrite",), ("--overwrite", "--force")):
        assert run_cli("quantize", bf16, tmp_path / "out", *extra) == 2
        one_line_error(capsys, "symbolic link")
    assert (tmp_path / "out").is_symlink()
    if dangling:
        assert not target.exists()
    else:
        assert tree_bytes(target) == {"keep.txt": b"precious"}


def test_partial_symlink_is_removed_not_followed(tmp_path, bf16, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("precious")
    (tmp_path / "out.partial").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        quantize_checkpoint(bf16, tmp_path / "out", progress=False)
    assert run_cli("quantize", bf16, tmp_path / "out", "--overwrite") == 0
    assert tree_bytes(victim) == {"data.txt": b"precious"}
    assert (tmp_path / "out" / INDEX).is_file()
    assert not (tmp_path / "out.partial").exists()


def test_foreign_partial_needs_force(tmp_path, bf16, capsys):
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "mine.txt").write_text("x")
    assert run_cli("quantize", bf16, tmp_path / "out", "--overwrite") == 2
    one_line_error(capsys, "--overwrite --force")
    assert (tmp_path / "out.partial" / "mine.txt").read_text() == "x"
    assert run_cli("quantize", bf16, tmp_path / "out", "--overwrite", "--force") == 0


def test_written_files_get_the_umask_mode(tmp_path, bf16):
    old = os.umask(0o022)
    try:
        quantize_checkpoint(bf16, tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    for p in (tmp_path / "out").rglob("*"):
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


def test_unwritable_output_parent_is_one_line(tmp_path, bf16, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert run_cli("quantize", bf16, locked / "out") == 2
        one_line_error(capsys, "ermission denied")
    finally:
        locked.chmod(0o700)


# --------------------------------------------------------------------------------------
# The resume manifest is untrusted
# --------------------------------------------------------------------------------------


def _interrupted_partial(bf16: Path, out: Path) -> Path:
    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(bf16, out, progress=False, on_shard_done=stop)
    return out.with_name(out.name + ".partial")


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[]", "a JSON list"),
        ("{}", "unknown manifest format"),
        ('{"format": "ascend-fa-fp8-manifest/1"}', "lacks params or inputs"),
        (
            '{"format": "ascend-fa-fp8-manifest/1", "params": {}, "inputs": {}, '
            '"done": {"x": {"size": "1", "sha256": 5}}}',
            "done list is malformed",
        ),
        (
            '{"format": "ascend-fa-fp8-manifest/1", "params": {}, "inputs": {}, '
            '"done": {"../../etc/passwd": {"size": 1, "sha256": "' + "0" * 64 + '"}}}',
            "not an output shard",
        ),
        ("{" * 50000, "not valid JSON"),
        ("\x00\xff", "not valid JSON"),
    ],
)
def test_bad_manifest_is_one_line_then_overwrite_starts_over(
    tmp_path, bf16, capsys, body, needle
):
    out = tmp_path / "out"
    partial = _interrupted_partial(bf16, out)
    (partial / MANIFEST_NAME).write_text(body, encoding="latin-1")
    with pytest.raises(FileFormatError, match=needle):
        quantize_checkpoint(bf16, out, progress=False)
    assert run_cli("quantize", bf16, out) == 2
    one_line_error(capsys, MANIFEST_NAME, "--overwrite")
    assert run_cli("quantize", bf16, out, "--overwrite") == 0
    assert (out / INDEX).is_file()


def test_manifest_symlink_is_refused(tmp_path, bf16, capsys):
    out = tmp_path / "out"
    partial = _interrupted_partial(bf16, out)
    real = tmp_path / "real.json"
    (partial / MANIFEST_NAME).rename(real)
    (partial / MANIFEST_NAME).symlink_to(real)
    assert run_cli("quantize", bf16, out) == 2
    one_line_error(capsys, "symbolic link")


def test_done_shard_replaced_by_a_symlink_is_converted_again(tmp_path, bf16):
    out = tmp_path / "out"
    partial = _interrupted_partial(bf16, out)
    done = partial / "model-00001-of-00003.safetensors"
    keep = tmp_path / "keep.safetensors"
    done.rename(keep)
    done.symlink_to(keep)
    before = keep.read_bytes()
    quantize_checkpoint(bf16, out, progress=False)
    assert keep.read_bytes() == before
    assert not (out / "model-00001-of-00003.safetensors").is_symlink()


# --------------------------------------------------------------------------------------
# Scales that would write inf, NaN or zeros
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, kind",
    [(0.0, "zero"), (-1e-3, "negative"), (float("inf"), "non-finite"),
     (float("nan"), "non-finite")],
)  # fmt: skip
def test_bad_scale_inv_refused_before_writing(tmp_path, capsys, value, kind):
    from safetensors import safe_open

    make_fp8_checkpoint(tmp_path / "fp8")
    shard = tmp_path / "fp8" / SHARD2
    with safe_open(str(shard), framework="pt") as h:
        ts = {k: h.get_tensor(k) for k in h.keys()}
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    ts[name][2, 1] = value
    save_file(ts, str(shard), metadata={"format": "pt"})
    before = snapshot(tmp_path)
    with pytest.raises(FileFormatError, match=rf"{kind} scale_inv in block \(2, 1\)"):
        dequantize_checkpoint(tmp_path / "fp8", tmp_path / "out", progress=False)
    assert run_cli("dequantize", tmp_path / "fp8", tmp_path / "out") == 2
    one_line_error(capsys, SHARD2, name, "block (2, 1)")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out.partial").exists()


def test_every_error_is_typed(tmp_path, bf16):
    """The library's refusals are AscendFAError (and FP8ConversionError where the
    FP8 code decides), so one ``except`` catches them all."""
    with pytest.raises(AscendFAError):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(FP8ConversionError):
        quantize_checkpoint(bf16, tmp_path / "out", block_size=(0, 1))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(OutputExistsError):
        quantize_checkpoint(bf16, tmp_path / "out")


def test_output_under_a_file_is_one_line(tmp_path, bf16, capsys):
    (tmp_path / "afile").write_text("x")
    assert run_cli("quantize", bf16, tmp_path / "afile" / "out") == 2
    one_line_error(capsys, "afile")
    assert (tmp_path / "afile").read_text() == "x"
