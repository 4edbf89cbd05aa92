"""Opening a Hugging Face checkpoint directory as untrusted input.

A checkpoint is ``model.safetensors.index.json`` + the shards its ``weight_map``
names, or a single ``model.safetensors``, or (no index) every ``*.safetensors`` in
the directory; ``config.json`` is optional. Everything read from a file is checked
before anything else is read or written:

* every shard name is a plain file name inside the directory: not absolute, no
  ``..``, no path separator; a symbolic link must resolve inside the directory (or,
  in the Hugging Face hub cache, into the repository's ``blobs/``: the hub stores
  ``snapshots/<rev>/<file>`` as a link to ``../../blobs/<hash>``, see
  https://huggingface.co/docs/hub/local-cache) -- else
  :class:`~ascend_fa.fp8.errors.FP8UnsafePathError` naming the index and the entry;
* JSON files are size-capped, nesting-safe and of the expected shape;
* every shard header is validated (:func:`read_safetensors_header`), every tensor
  the index lists is in its shard, and no tensor is stored twice.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atb_ops.constants import FP8_BLOCK
from ..errors import NotFoundError
from ..safe_files import unique_keys
from .blocks import SCALE_SUFFIX, check_block, scale_shape
from .errors import FP8FormatError, FP8InputError, FP8UnsafePathError
from .safetensors_io import (
    ITEMSIZE,
    ShardHeader,
    TensorEntry,
    open_regular,
    read_safetensors_header,
)

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "JSON_LIMIT",
    "SINGLE_NAME",
    "Checkpoint",
    "DequantPlan",
    "load_json",
    "member_path",
    "open_checkpoint",
    "other_files",
    "plan_dequantize",
    "reference_selection",
]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
#: Largest JSON file read (DeepSeek-V3's index, ~92k entries, is about 9 MB).
JSON_LIMIT = 64 << 20
#: Directories of a checkpoint that are never copied to the output.
_SKIP_DIRS = (".git", ".cache")

log = logging.getLogger("ascend_fa.fp8")


@dataclass
class Checkpoint:
    """A validated checkpoint directory."""

    root: Path
    shards: dict[str, ShardHeader]  # file name -> header, sorted by name
    index: dict[str, Any] | None
    config: dict[str, Any] | None

    def locate(self) -> dict[str, str]:
        """tensor name -> shard file name."""
        return {n: s for s, h in self.shards.items() for n in h.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(h.size for h in self.shards.values())


def load_json(path: Path, expect: type = dict) -> Any:
    """``path`` parsed as JSON of type ``expect``; any failure is one
    :class:`FP8FormatError` naming the file (never a RecursionError or traceback)."""
    with open_regular(path) as f:
        try:
            raw = f.read(JSON_LIMIT + 1)
        except OSError as exc:
            raise FP8FormatError(f"cannot read: {exc.strerror}", path=path) from None
    if len(raw) > JSON_LIMIT:
        raise FP8FormatError(f"larger than {JSON_LIMIT >> 20} MiB", path=path)
    try:
        obj = json.loads(raw, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as exc:
        raise FP8FormatError(
            f"not valid JSON ({type(exc).__name__}: {exc})", path=path
        ) from None
    if not isinstance(obj, expect):
        raise FP8FormatError(
            f"a JSON {type(obj).__name__}, expected a JSON "
            f"{'object' if expect is dict else expect.__name__}",
            path=path,
        )
    return obj


def _inside(target: Path, base: Path) -> bool:
    return target == base or base in target.parents


def _escaping_link(p: Path, root: Path) -> Path | None:
    """The target of ``p`` if it is a symbolic link leading out of ``root`` (and
    not into the hub cache's ``blobs/`` beside a ``snapshots/<rev>`` root)."""
    if not p.is_symlink():
        return None
    base, target = root.resolve(), p.resolve()
    if _inside(target, base):
        return None
    if (
        base.parent.name == "snapshots"
        and target.parent == base.parent.parent / "blobs"
    ):
        return None
    return target


def member_path(root: Path, name: Any, source: Path, entry: str) -> Path:
    """``root / name`` if ``name`` (read from ``source``, as ``entry``) is a plain
    file name whose file stays inside ``root``; raises :class:`FP8UnsafePathError`
    naming ``source`` and ``entry`` otherwise."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(c in name for c in "/\\\0")
    ):
        raise FP8UnsafePathError(
            f"{entry} names {name!r}, which is not a plain file name in {root} "
            "(absolute paths, '..' and path separators are refused)",
            path=source,
        )
    p = root / name
    target = _escaping_link(p, root)
    if target is not None:
        raise FP8UnsafePathError(
            f"{entry} names {name!r}, a symbolic link to {target}, outside {root}; "
            "refusing to follow it",
            path=source,
        )
    return p


def _plain_str_map(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(v, str) for v in obj.values())


def open_checkpoint(root: str | os.PathLike[str]) -> Checkpoint:
    """Open and validate the checkpoint directory ``root`` (see the module doc)."""
    d = Path(root)
    if not d.is_dir():
        what = "is not a directory" if d.exists() else "does not exist"
        raise NotFoundError(f"input directory {d} {what}", path=d)
    index = None
    index_path = d / INDEX_NAME
    if index_path.exists() or index_path.is_symlink():
        member_path(d, INDEX_NAME, d, "the index")
        index = load_json(index_path)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise FP8FormatError("no weight_map (or an empty one)", path=index_path)
        if not _plain_str_map(wm):
            raise FP8FormatError(
                "weight_map maps a tensor to a non-string", path=index_path
            )
        if not isinstance(index.get("metadata", {}), dict):
            raise FP8FormatError("metadata is not a JSON object", path=index_path)
        names = sorted(set(wm.values()))
        tensor_of = {s: t for t, s in wm.items()}
        for n in names:  # all names checked before any file is opened
            member_path(d, n, index_path, f"weight_map entry {tensor_of[n]!r}")
        for n in names:
            if not (d / n).exists():
                raise FP8FormatError(
                    f"lists shard {n}, which is missing from {d}", path=index_path
                )
            if not (d / n).is_file():
                raise FP8FormatError(
                    f"lists shard {n}, which is not a regular file", path=index_path
                )
    elif (d / SINGLE_NAME).is_file():
        names = [SINGLE_NAME]
        member_path(d, SINGLE_NAME, d, "the checkpoint file")
    else:
        names = sorted(p.name for p in d.glob("*.safetensors") if p.is_file())
        for n in names:
            member_path(d, n, d, "the checkpoint file")
        if not names:
            pickled = sorted(
                p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth")
            )
            hint = (
                f" ({', '.join(pickled[:3])} look pickled; pickled checkpoints are not "
                "read: convert them to safetensors first)"
                if pickled
                else ""
            )
            raise FP8FormatError(f"no *.safetensors files in {d}{hint}", path=d)
    shards = {n: read_safetensors_header(d / n) for n in names}
    if index is not None:
        for tname, shard in index["weight_map"].items():
            if tname not in shards[shard].tensors:
                raise FP8FormatError(
                    f"maps {tname!r} to {shard}, which does not contain it",
                    path=index_path,
                )
    seen: dict[str, str] = {}
    for s, h in shards.items():
        for n in h.tensors:
            if n in seen:
                raise FP8FormatError(
                    f"tensor {n!r} is stored in both {seen[n]} and {s}", path=d / s
                )
            seen[n] = s
    config = None
    if (d / CONFIG_NAME).exists() or (d / CONFIG_NAME).is_symlink():
        member_path(d, CONFIG_NAME, d, "the config")
        config = load_json(d / CONFIG_NAME)
        qc = config.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise FP8FormatError(
                "quantization_config is not a JSON object", path=d / CONFIG_NAME
            )
    return Checkpoint(d, shards, index, config)


def other_files(ckpt: Checkpoint, skip: set[str]) -> list[tuple[str, Path]]:
    """``(relative name, path)`` of the files besides the shards, index, config and
    ``skip`` that a conversion copies unchanged (tokenizer, generation config,
    code, ...). Links must stay inside the checkpoint (as for shards); special
    files (FIFOs, sockets, devices) and linked directories are not copied."""
    skip = {INDEX_NAME, CONFIG_NAME, *ckpt.shards, *skip}
    out = []
    for dirpath, dirnames, files in os.walk(ckpt.root):
        here = Path(dirpath)
        rel_dir = here.relative_to(ckpt.root)
        dirnames[:] = sorted(
            n for n in dirnames if not (rel_dir == Path(".") and n in _SKIP_DIRS)
        )
        for n in list(dirnames):
            if (here / n).is_symlink():
                log.warning("%s is a linked directory; not copied", rel_dir / n)
                dirnames.remove(n)
        for n in sorted(files):
            rel = (rel_dir / n).as_posix()
            if rel in skip:
                continue
            p = here / n
            target = _escaping_link(p, ckpt.root)
            if target is not None:
                raise FP8UnsafePathError(
                    f"{rel} is a symbolic link to {target}, outside the checkpoint; "
                    "refusing to follow it",
                    path=ckpt.root,
                )
            if not p.is_file():
                log.warning("%s is not a regular file; not copied", rel)
                continue
            if p.suffix == ".safetensors":
                log.warning(
                    "%s is not part of the checkpoint's index; copied unchanged", rel
                )
            out.append((rel, p))
    return out


def reference_selection(
    ref: str | os.PathLike[str],
) -> tuple[set[str], dict[str, Any] | None, Path]:
    """Weights with a ``*_scale_inv`` in the reference index, its config (or None),
    and the reference directory."""
    p = Path(ref)
    index_path = p / INDEX_NAME if p.is_dir() else p
    if not index_path.is_file():
        raise NotFoundError(
            f"--reference-fp8: {index_path} not found (need the FP8 checkpoint's "
            f"{INDEX_NAME})",
            path=index_path,
        )
    index = load_json(index_path)
    wm = index.get("weight_map")
    if not isinstance(wm, dict):
        raise FP8FormatError("no weight_map", path=index_path)
    selected = {n[: -len(SCALE_SUFFIX)] for n in wm if n.endswith(SCALE_SUFFIX)}
    if not selected:
        raise FP8FormatError(
            f"no *{SCALE_SUFFIX} tensors; not an FP8 block checkpoint", path=index_path
        )
    cfg_path = index_path.parent / CONFIG_NAME
    config = load_json(cfg_path) if cfg_path.is_file() else None
    qc = (config or {}).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise FP8FormatError("quantization_config is not a JSON object", path=cfg_path)
    return selected, config, index_path.parent


@dataclass
class DequantPlan:
    """Which tensors of an FP8 block checkpoint dequantization touches."""

    block: tuple[int, int]
    #: weight name -> (file, entry) of its ``<name>_scale_inv``
    scales: dict[str, tuple[Path, TensorEntry]] = field(default_factory=dict)
    #: tensors without a scale, passed through unchanged
    passthrough: list[str] = field(default_factory=list)
    #: the 1-byte (non-bool) ones among them: most likely codes missing a scale
    unscaled_codes: list[str] = field(default_factory=list)
    #: every ``*_scale_inv`` (dropped from the output); those without a weight
    scale_names: set[str] = field(default_factory=set)
    orphans: list[str] = field(default_factory=list)


def plan_dequantize(ckpt: Checkpoint) -> DequantPlan:
    """Pair every weight with its ``<name>_scale_inv`` and check both: the weight a
    2-D ``F8_E4M3`` tensor, the scale a float tensor ``[ceil(out/BR),
    ceil(in/BC)]`` with the block size of ``quantization_config`` (default
    ``[128, 128]``), whose ``fmt`` must be ``e4m3`` when given (the only format
    the DeepSeek block rule defines)."""
    where = ckpt.locate()
    entries = {t.name: t for h in ckpt.shards.values() for t in h.tensors.values()}
    scaled = any(
        n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in entries for n in entries
    )
    # The config only matters for the block weights: a checkpoint without any is
    # read as it is, whatever quantization_config says.
    cfg_path = ckpt.root / CONFIG_NAME
    qc = (ckpt.config or {}).get("quantization_config") or {}
    fmt = qc.get("fmt") if scaled else None
    if fmt is not None and fmt != "e4m3":
        raise FP8FormatError(
            f"quantization_config.fmt is {fmt!r}; only 'e4m3' block checkpoints "
            "are supported",
            path=cfg_path,
        )
    try:
        block = check_block((scaled and qc.get("weight_block_size")) or FP8_BLOCK)
    except FP8InputError as exc:
        raise FP8FormatError(
            f"quantization_config.weight_block_size: {exc.message}", path=cfg_path
        ) from None
    plan = DequantPlan(block)
    for name, t in sorted(entries.items()):
        if name.endswith(SCALE_SUFFIX):
            plan.scale_names.add(name)
            if name[: -len(SCALE_SUFFIX)] not in entries:
                plan.orphans.append(name)
            continue
        sname = name + SCALE_SUFFIX
        if sname not in entries:
            plan.passthrough.append(name)
            if ITEMSIZE.get(t.dtype) == 1 and t.dtype != "BOOL":
                plan.unscaled_codes.append(name)
            continue
        s = entries[sname]
        if t.dtype != "F8_E4M3" or len(t.shape) != 2:
            raise FP8FormatError(
                f"tensor {name!r} has a scale but is {t.dtype} {list(t.shape)}, not "
                "a 2-D F8_E4M3 weight",
                path=ckpt.root / where[name],
            )
        expect = list(scale_shape(t.shape, block))
        if list(s.shape) != expect or s.dtype not in ("F32", "BF16", "F16"):
            raise FP8FormatError(
                f"{sname!r} is {s.dtype} {list(s.shape)}; expected a float tensor "
                f"{expect} for {name!r} {list(t.shape)} with block {list(block)}",
                path=ckpt.root / where[sname],
            )
        plan.scales[name] = (ckpt.root / where[sname], s)
    return plan
