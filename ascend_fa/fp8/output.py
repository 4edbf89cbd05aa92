"""The output directory of a conversion: where it may go, the resume manifest, and
the final rename.

A conversion writes ``OUTPUT.partial/`` and renames it to ``OUTPUT`` when complete.
``OUTPUT.partial/.ascend_fa_fp8_manifest.json`` records the parameters, the input
shards (size, header hash, mtime) and every finished output shard (size, xxh3-128
of its bytes); a rerun with the same parameters and inputs resumes from it. A
manifest of the first format (``.../1``, shards hashed with sha256) is still
resumed: its shards are verified by sha256 (and hashed with xxh3-128 in the same
read for the new manifest). The finished output
keeps the manifest (marked ``"complete": true``): it is how ``--overwrite``
recognises a directory this tool wrote, and a checksum list of the shards.

Rules (the output side of "never destroy what we did not make"):

* ``OUTPUT`` may not be, contain or lie inside an input; it may not be a symbolic
  link (dangling or not), and ``OUTPUT.partial`` is never written through a link
  (with ``--overwrite`` the link itself is removed, never its target);
* an existing non-empty ``OUTPUT`` is replaced only with ``overwrite``, and only if
  it holds a manifest of ours, unless ``force`` is given as well;
* the manifest is untrusted JSON: anything but the exact shape written here is a
  one-line :class:`~ascend_fa.fp8.errors.FP8FormatError`, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from ..errors import OutputExistsError
from .checkpoint import load_json
from .errors import FP8FormatError, FP8InputError, FP8UnsafePathError
from .safetensors_io import CONTENT_HASH, create_new_file, open_regular

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "file_digests",
    "finish_output",
    "is_conversion_output",
    "load_manifest",
    "partial_dir",
    "prepare_output",
    "remove_temp_files",
    "write_manifest",
    "check_no_strays",
    "verify_finished",
    "write_new_file",
    "write_new_json",
]

log = logging.getLogger("ascend_fa.fp8")

MANIFEST_NAME = ".ascend_fa_fp8_manifest.json"
MANIFEST_FORMAT = "ascend-fa-fp8-manifest/2"
#: Formats read back -> the hash their shard records carry (hex digest length).
_RECORD_HASH = {
    "ascend-fa-fp8-manifest/1": ("sha256", 64),
    MANIFEST_FORMAT: (CONTENT_HASH, 32),
}
_HASHERS = {"sha256": hashlib.sha256, CONTENT_HASH: xxhash.xxh3_128}
_HASH_BYTES = 16 << 20


def partial_dir(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def file_digests(path: Path, algorithms: Sequence[str]) -> dict[str, str]:
    """Hex digests of ``path`` for each of ``algorithms`` (``"sha256"``,
    ``"xxh3_128"``), all from one read of the file."""
    hashers = {a: _HASHERS[a]() for a in algorithms}
    buf = bytearray(_HASH_BYTES)
    view = memoryview(buf)
    with open_regular(path) as f:
        while n := f.readinto(buf):
            for h in hashers.values():
                h.update(view[:n])
    return {a: h.hexdigest() for a, h in hashers.items()}


def write_new_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a freshly created ``path`` (never through a link)."""
    fd = create_new_file(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_new_json(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    write_new_file(path, text.encode("utf-8"))


def _known_format(fmt: Any) -> bool:
    return isinstance(fmt, str) and fmt in _RECORD_HASH


def _manifest_of(directory: Path) -> dict | None:
    """The parsed manifest in ``directory``, or None if there is no valid one."""
    path = directory / MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        return None
    try:
        body = load_json(path)
    except FP8FormatError:
        return None
    return body if _known_format(body.get("format")) else None


def is_conversion_output(path: Path) -> bool:
    """Whether ``path`` is a real directory holding a manifest of this tool."""
    return path.is_dir() and not path.is_symlink() and _manifest_of(path) is not None


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def prepare_output(
    output: Path, inputs: list[tuple[str, Path]], overwrite: bool, force: bool
) -> Path:
    """Check where the output may go (see the module doc) and clear what
    ``overwrite`` allows; returns ``OUTPUT.partial`` (not created yet).

    ``inputs`` are ``(option name, directory)`` pairs the output must keep clear of.
    Nothing is written unless every check passed.
    """
    if output.is_symlink():
        raise FP8UnsafePathError(
            "is a symbolic link; refusing to write through it (give the real "
            "directory, or remove the link)",
            path=output,
        )
    out_r = output.resolve()
    for what, d in inputs:
        if _overlaps(out_r, d.resolve()):
            raise FP8InputError(
                f"output {output} must not be, contain or lie inside the {what} {d}",
                path=output,
            )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise OutputExistsError(
                f"output {output} already exists; pass --overwrite to replace it",
                path=output,
            )
        if not force and not is_conversion_output(output):
            raise OutputExistsError(
                f"output {output} exists and is not an ascend-fa FP8 conversion "
                f"output (no {MANIFEST_NAME}); pass --overwrite --force to replace "
                "it anyway",
                path=output,
            )
    partial = partial_dir(output)
    if partial.is_symlink():
        if not overwrite:
            raise FP8UnsafePathError(
                "is a symbolic link; refusing to write through it (remove it, or "
                "pass --overwrite to remove the link, not its target)",
                path=partial,
            )
        log.warning("removing the symbolic link %s (not its target)", partial)
        partial.unlink()
    elif partial.exists():
        ours = partial.is_dir() and (
            (partial / MANIFEST_NAME).is_file() or not any(partial.iterdir())
        )
        if overwrite and (ours or force):
            if partial.is_dir():
                shutil.rmtree(partial)
            else:
                partial.unlink()
        elif not partial.is_dir() or overwrite:
            raise OutputExistsError(
                f"{partial} exists and is not a conversion in progress of ours; "
                "remove it, or pass --overwrite --force",
                path=partial,
            )
    return partial


def _bad_manifest(partial: Path, why: str) -> FP8FormatError:
    return FP8FormatError(
        f"cannot resume {partial}: {why}; pass --overwrite to start over",
        path=partial / MANIFEST_NAME,
    )


def _valid_record(rec: Any, key: str, length: int) -> bool:
    return (
        isinstance(rec, dict)
        and isinstance(rec.get("size"), int)
        and not isinstance(rec.get("size"), bool)
        and rec["size"] >= 0
        and isinstance(rec.get(key), str)
        and len(rec[key]) == length
    )


def _verified(f: Path, rec: dict, key: str) -> dict | None:
    """The record of the finished shard ``f`` in the current format when its size
    and ``key`` hash match ``rec``, else None (one read of the file)."""
    if f.is_symlink() or not f.is_file() or f.stat().st_size != rec["size"]:
        return None
    digests = file_digests(f, sorted({key, CONTENT_HASH}))
    if digests[key] != rec[key]:
        return None
    return {"size": rec["size"], CONTENT_HASH: digests[CONTENT_HASH]}


def load_manifest(
    partial: Path, params: dict, inputs: dict, shard_names: set[str]
) -> dict[str, dict]:
    """Finished shards of an interrupted run (verified by size and content hash;
    returned as records of the current format), or ``{}`` for a fresh start
    (``partial`` is then created, empty)."""
    if not partial.exists():
        partial.mkdir(parents=True)
        return {}
    path = partial / MANIFEST_NAME
    if path.is_symlink():
        raise _bad_manifest(partial, f"{MANIFEST_NAME} is a symbolic link")
    if not path.is_file():
        if any(partial.iterdir()):
            raise FP8InputError(
                f"{partial} exists without a manifest (not a conversion in progress "
                "of ours); delete it, or pass --overwrite --force to replace it",
                path=partial,
            )
        return {}
    try:
        manifest = load_json(path)
    except FP8FormatError as exc:
        raise _bad_manifest(partial, exc.message) from None
    if not _known_format(manifest.get("format")):
        raise _bad_manifest(partial, "unknown manifest format")
    key, length = _RECORD_HASH[manifest["format"]]
    old_params, old_inputs, done = (
        manifest.get(k) for k in ("params", "inputs", "done")
    )
    if not isinstance(old_params, dict) or not isinstance(old_inputs, dict):
        raise _bad_manifest(partial, "the manifest lacks params or inputs")
    if not isinstance(done, dict) or not all(
        _valid_record(r, key, length) for r in done.values()
    ):
        raise _bad_manifest(partial, "the manifest's done list is malformed")
    stray = sorted(set(done) - shard_names)
    if stray:
        raise _bad_manifest(
            partial, f"the manifest lists {stray[0]!r}, not an output shard"
        )
    if old_params != params:
        diff = sorted(
            k
            for k in set(params) | set(old_params)
            if params.get(k) != old_params.get(k)
        )
        raise FP8InputError(
            f"cannot resume {partial}: the interrupted run used different parameters "
            f"({', '.join(diff)}); rerun it with the same parameters, or pass "
            "--overwrite to start over",
            path=partial,
        )
    if old_inputs != inputs:
        raise FP8InputError(
            f"cannot resume {partial}: the input shards changed since the interrupted "
            "run; pass --overwrite to start over",
            path=partial,
        )
    verified = {}
    for name, rec in done.items():
        f = partial / name
        new = _verified(f, rec, key)
        if new is not None:
            verified[name] = new
        else:
            log.warning("%s: finished shard failed verification; converting again", f)
    return verified


def check_no_strays(partial: Path, allowed: set[str]) -> None:
    """Refuse an entry of ``partial`` that is neither one of ``allowed`` (the
    output shards and the manifest) nor a temporary file: the finished output is
    ``partial`` renamed, so a stray file would land in it."""
    stray = sorted(
        p.name
        for p in partial.iterdir()
        if p.name not in allowed and not p.name.endswith(".tmp")
    )
    if stray:
        shown = stray[0] if len(stray[0]) <= 80 else stray[0][:60] + "..."
        raise FP8InputError(
            f"{partial} holds {shown!r}, which is no file of this conversion (the "
            "finished output is this directory renamed); remove it and rerun (the "
            "finished shards are kept)",
            path=partial,
        )


def verify_finished(directory: Path) -> None:
    """When ``directory`` is a finished conversion output of ours (a complete
    manifest), check every shard it records against its size and content hash;
    a shard changed since it was written is an :class:`FP8FormatError` naming
    it. A directory without our manifest is not checked."""
    manifest = _manifest_of(directory)
    if manifest is None or manifest.get("complete") is not True:
        return
    key, length = _RECORD_HASH[manifest["format"]]
    done = manifest.get("done")
    path = directory / MANIFEST_NAME
    if not isinstance(done, dict) or not all(
        _valid_record(r, key, length) for r in done.values()
    ):
        raise FP8FormatError("the manifest's done list is malformed", path=path)
    for name, rec in sorted(done.items()):
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise FP8FormatError(
                f"manifest entry {name[:80]!r} is no file name", path=path
            )
        f = directory / name
        if _verified(f, rec, key) is None:
            raise FP8FormatError(
                f"shard {name} does not match {MANIFEST_NAME} (size or {key} "
                "differs): it changed after the conversion wrote it",
                path=f,
            )


def write_manifest(
    partial: Path, params: dict, inputs: dict, done: dict, complete: bool = False
) -> None:
    """Atomically replace the manifest (a reader sees the old or the new one)."""
    body = {
        "format": MANIFEST_FORMAT,
        "complete": complete,
        "params": params,
        "inputs": inputs,
        "done": dict(sorted(done.items())),
    }
    tmp = partial / (MANIFEST_NAME + ".tmp")
    write_new_json(tmp, body)
    os.replace(tmp, partial / MANIFEST_NAME)


def remove_temp_files(partial: Path) -> None:
    """Remove the ``*.tmp`` files an interrupted run left (killed workers, an
    interrupted write); the finished shards and the manifest stay."""
    if partial.is_dir() and not partial.is_symlink():
        for stale in partial.glob("*.tmp"):
            try:
                stale.unlink()
            except OSError as exc:  # a directory named *.tmp is not ours
                log.warning("could not remove %s: %s", stale, exc.strerror)


def finish_output(partial: Path, output: Path) -> None:
    """Rename the finished ``partial`` to ``output``; an existing output (checked
    by :func:`prepare_output`) is moved aside first and removed after."""
    if output.exists() or output.is_symlink():
        old = output.with_name(output.name + f".old-{os.getpid()}")
        os.replace(output, old)
        os.replace(partial, output)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(partial, output)
