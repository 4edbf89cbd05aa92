"""Write FA artifacts atomically, and merge FA scales into an msModelSlim export.

The layout and every name come from :mod:`.format`. Tied weights: a tensor that the
model ties to another (``lm_head.weight`` -> ``model.embed_tokens.weight`` when
``tie_word_embeddings``) is not written, exactly as ``save_pretrained`` does; loaders
re-tie it from ``config.json``. Any other tensor sharing storage is written as its
own copy (safetensors refuses aliases).

Description: every tensor name -> ``"FLOAT"`` (weights) or ``"FAQuant"`` (FA
tensors, both fa_quant_types), ``"<attn>.quant_type": "INT8"`` per quantized
module, ``"fa_quant_type"`` (``"FAQuant"`` GQA / ``"FAKQuant"`` MLA),
``"model_quant_type": "FLOAT"`` and ``"version"`` (``DESCRIPTION_VERSION``).

Every write is atomic: files go to a temporary directory beside the output, which
is renamed over it at the end; on any error the temporary directory is removed and
an existing output is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ascend_fa.errors import AscendFAError, InputError, OutputExistsError
from ascend_fa.safe_files import read_json_object
from ascend_fa.safe_paths import (
    apply_plain_modes,
    check_output_parent,
    plain_dir_mode,
    refuse_symlink,
    signals_deferred,
)

from .format import (
    DESCRIPTION_FILE,
    DESCRIPTION_VERSION,
    FA_BRANCHES,
    FA_QUANT_TYPES,
    FA_WEIGHTS_NAME,
    LEGACY_WEIGHTS_NAME,
    REPORT_FILE,
    TOKENIZER_FILES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ScaleMap,
    disk_scale,
    fa_tensor_name,
)
from .reader import read_tensor_index

__all__ = [
    "parse_size",
    "fa_tensors",
    "build_description",
    "checkpoint_state_dict",
    "export_artifact",
    "merge_into",
    "atomic_output_dir",
    "check_output_dir",
    "is_own_artifact",
    "write_json",
    "write_extra_files",
]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``/``500MiB``/``1024`` (decimal as in HF; ``iB`` binary)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"shard size must be > 0 bytes, got {size}")
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot parse size {size!r}; use e.g. 5GB, 500MB, 2GiB")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"shard size must be > 0 bytes, got {size!r}")
    return value


def fa_tensors(scales: ScaleMap) -> dict[str, torch.Tensor]:
    """Artifact tensors for ``scales``: ``<attn>.fa_x.scale`` fp32 ``[H, 1]`` and
    ``<attn>.fa_x.offset`` int8 ``[H, 1]`` (zeros: the kernels are symmetric)."""
    out: dict[str, torch.Tensor] = {}
    for attn in sorted(scales):
        branches = scales[attn]
        missing = [b for b in FA_BRANCHES if b not in branches]
        if missing:
            raise ValueError(f"{attn}: missing FA branches {missing}")
        for branch in FA_BRANCHES:
            scale, offset = branches[branch]
            name = fa_tensor_name(attn, branch, "scale")
            scale = disk_scale(scale, name)
            offset = offset.detach().to("cpu").reshape(-1, 1)
            if offset.shape != scale.shape or bool((offset != 0).any()):
                raise ValueError(
                    f"{attn}.{branch}.offset must be zeros shaped like "
                    f"the scale {tuple(scale.shape)}"
                )
            out[name] = scale
            out[fa_tensor_name(attn, branch, "offset")] = torch.zeros_like(
                scale, dtype=torch.int8
            )
    return out


def build_description(
    weight_names: list[str],
    scales: ScaleMap,
    fa_quant_type: str,
    *,
    model_quant_type: str = "FLOAT",
) -> dict[str, str]:
    """The description of a FLOAT checkpoint plus FA tensors (see module doc)."""
    if fa_quant_type not in FA_QUANT_TYPES:
        raise ValueError(
            f"fa_quant_type must be FAQuant or FAKQuant, got {fa_quant_type!r}"
        )
    desc: dict[str, str] = {
        "model_quant_type": model_quant_type,
        "fa_quant_type": fa_quant_type,
        "version": DESCRIPTION_VERSION,
    }
    desc.update(dict.fromkeys(weight_names, "FLOAT"))
    for attn in sorted(scales):
        desc[f"{attn}.quant_type"] = "INT8"
        for branch in FA_BRANCHES:
            for kind in ("scale", "offset"):
                desc[fa_tensor_name(attn, branch, kind)] = "FAQuant"
    return desc


def checkpoint_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names, ready for safetensors.

    Drops tied copies (``model.all_tied_weights_keys``, HF's own rule), anything
    under an ``fa_q``/``fa_k``/``fa_v`` submodule, and non-persistent buffers
    (``state_dict`` already does); casts floating tensors to ``dtype``; clones
    tensors that still share storage with an earlier one.
    """
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict().items():
        if name in tied or any(f".{b}." in f".{name}" for b in FA_BRANCHES):
            continue
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.untyped_storage().data_ptr() and key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t.contiguous()
    return out


def is_own_artifact(directory: str | Path) -> bool:
    """Whether ``directory`` holds an artifact this package wrote: its
    ``calibration_report.json`` (a file msModelSlim never writes) is a JSON object
    beside a description. Only such a directory may be replaced by ``--overwrite``
    alone; anything else needs ``force``."""
    directory = Path(directory)
    report, desc = directory / REPORT_FILE, directory / DESCRIPTION_FILE
    if not report.is_file() or not desc.is_file():
        return False
    try:
        read_json_object(report, what="report")
    except AscendFAError:
        return False
    return True


_STALE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[A-Za-z0-9_]{8}$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _clean_stale(output: Path) -> None:
    """Remove what a killed run (SIGKILL, power loss) left beside ``output``: its
    temporary directory, and the moved-aside old output — put back when the new
    one never arrived."""
    siblings: list[Path] = []
    with contextlib.suppress(OSError):
        siblings = list(output.parent.iterdir())
    for entry in sorted(siblings, key=lambda p: p.name):
        m = _STALE.match(entry.name)
        if not m or m["name"] != output.name or _pid_alive(int(m["pid"])):
            continue
        if os.path.islink(entry) or not entry.is_dir():
            continue
        aside = entry / "d"
        if m["kind"] == "old" and aside.is_dir() and not os.path.lexists(output):
            os.replace(aside, output)
        shutil.rmtree(entry, ignore_errors=True)


def check_output_dir(
    output: str | Path, *, overwrite: bool = False, force: bool = False
) -> Path:
    """The refusals of :func:`atomic_output_dir`, made without writing anything
    (verbs call it before the model loads); returns ``output`` made absolute.

    Refused: an ``output`` that is a symlink (dangling or not), that exists and is
    not a directory, a non-empty one without ``overwrite``, one that is not an
    artifact of ours (:func:`is_own_artifact`) without ``force`` as well, and one
    whose parent cannot be written.
    """
    output = Path(output).absolute()
    refuse_symlink(output, what="output")
    if output.exists():
        if not output.is_dir():
            raise OutputExistsError("output exists and is not a directory", path=output)
        if any(output.iterdir()):
            if not overwrite:
                raise OutputExistsError(
                    f"output directory {output} exists and is not "
                    "empty; pass --overwrite to replace it",
                    path=output,
                )
            if not force and not is_own_artifact(output):
                raise OutputExistsError(
                    f"output directory {output} is not an ascend-fa artifact (no "
                    f"{REPORT_FILE}); --overwrite replaces only our own artifacts: "
                    "pass --force as well to replace it",
                    path=output,
                )
    check_output_parent(output)
    return output


@contextlib.contextmanager
def atomic_output_dir(
    output: str | Path, *, overwrite: bool = False, force: bool = False
) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``output`` when the block succeeds.

    Refused before anything is written: an ``output`` that is a symlink (dangling or
    not: a write never follows one), that exists and is not a directory, or whose
    parent cannot be written. An existing non-empty ``output`` is replaced only with
    ``overwrite``, and only when it holds an artifact of ours
    (:func:`is_own_artifact`) unless ``force`` as well. Written files get the
    umask's plain-file mode (0644 under umask 022). On any error — Ctrl-C and
    SIGTERM included — the temporary directory is deleted and ``output`` is
    untouched; the two renames that swap the new output in are not interrupted by
    either signal. What a killed run left behind is cleaned up on the next run.
    """
    output = Path(output).absolute()
    if output.parent.is_dir():
        _clean_stale(output)
    output = check_output_dir(output, overwrite=overwrite, force=force)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create the output's parent directory: {exc.strerror}",
            path=output.parent,
        ) from None
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent)
    )
    try:
        # mkdtemp creates 0700; give the artifact the permissions of a plain mkdir.
        os.chmod(tmp, plain_dir_mode())
        yield tmp
        apply_plain_modes(tmp)
        with signals_deferred():
            refuse_symlink(output, what="output")
            if output.exists():
                # os.replace cannot replace a non-empty directory: move the old one
                # aside first, then drop it once the new one is in place.
                old = Path(
                    tempfile.mkdtemp(
                        prefix=f".{output.name}.old-{os.getpid()}-", dir=output.parent
                    )
                )
                os.replace(output, old / "d")
                os.replace(tmp, output)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, output)
    except BaseException:
        with signals_deferred():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    path.write_text(
        json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def write_extra_files(directory: Path, files: Mapping[str, bytes] | None) -> None:
    """Write ``files`` (plain file name -> bytes, e.g. the picture report) into
    ``directory``; a name with a path separator is refused."""
    for name, data in (files or {}).items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"extra file name must be a plain file name: {name!r}")
        (directory / name).write_bytes(data)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_shards(
    directory: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int
) -> list[str]:
    """Greedy shards in insertion order; one file -> no index. Returns file names."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            {k: tensors[k] for k in shards[0]},
            str(directory / WEIGHTS_NAME),
            metadata=metadata,
        )
        return [WEIGHTS_NAME]
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {k: tensors[k] for k in names}, str(directory / fname), metadata=metadata
        )
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(_nbytes(t) for t in tensors.values())
    write_json(
        directory / WEIGHTS_INDEX_NAME,
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    return files


def _fa_quantization_config(scales: ScaleMap, fa_quant_type: str) -> dict[str, str]:
    cfg = {"fa_quant_type": fa_quant_type}
    for attn in sorted(scales):
        for kind in ("scale", "offset"):
            for branch in FA_BRANCHES:
                cfg[f"{attn}.{branch}.{kind}"] = "FAQuant"
    return cfg


def _copy_tokenizer_files(source_dir: Path | None, dest: Path) -> list[str]:
    copied = []
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            src = source_dir / name
            if src.is_file():
                shutil.copy2(src, dest / name)
                copied.append(name)
    return copied


def export_artifact(
    output: str | Path,
    *,
    state_dict: Mapping[str, torch.Tensor],
    scales: ScaleMap,
    fa_quant_type: str,
    config: Mapping[str, Any] | None = None,
    source_dir: str | Path | None = None,
    tokenizer: Any = None,
    report: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    force: bool = False,
) -> Path:
    """Write a complete FLOAT + FA artifact to ``output`` atomically; return it.

    ``state_dict`` are the checkpoint tensors (see :func:`checkpoint_state_dict`);
    ``config`` the model's ``config.json`` as a dict (its ``quantization_config``
    is replaced: the weights written are floats). Tokenizer files are copied from
    ``source_dir`` when it has them, otherwise saved from ``tokenizer``.
    """
    if not scales:
        raise ValueError(
            "no FA scales to export (the recipe selected no attention module)"
        )
    fa = fa_tensors(scales)
    clash = sorted(set(fa) & set(state_dict))
    if clash:
        raise ValueError(f"FA tensor names collide with model tensors: {clash[:3]}")
    tensors: dict[str, torch.Tensor] = {**state_dict, **fa}
    shard_bytes = parse_size(max_shard_size)
    with atomic_output_dir(output, overwrite=overwrite, force=force) as tmp:
        _write_shards(tmp, tensors, shard_bytes)
        write_json(
            tmp / DESCRIPTION_FILE,
            build_description(list(state_dict), scales, fa_quant_type),
        )
        if config is not None:
            cfg = {
                k: v
                for k, v in dict(config).items()
                if k not in ("quantization_config", "_attn_implementation_internal")
            }
            cfg["quantization_config"] = _fa_quantization_config(scales, fa_quant_type)
            write_json(tmp / "config.json", cfg)
        copied = _copy_tokenizer_files(Path(source_dir) if source_dir else None, tmp)
        if not copied and tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if report is not None:
            write_json(tmp / REPORT_FILE, report)
        write_extra_files(tmp, extra_files)
    return Path(output)


def merge_into(
    target: str | Path,
    *,
    scales: ScaleMap,
    fa_quant_type: str,
    output: str | Path | None = None,
    report: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    force: bool = False,
) -> Path:
    """Add FA tensors to an existing msModelSlim export ``target``.

    The result goes to ``output`` (default: ``target`` itself, replaced atomically).
    Every existing file is copied byte for byte; the FA tensors go to a new
    :data:`FA_WEIGHTS_NAME` (listed in the weights index when ``target`` has one),
    the description keeps every entry and gains the FA entries, ``fa_quant_type``
    and ``<attn>.quant_type``; ``config.json`` (when present) gains the
    ``quantization_config`` FA entries. Existing FA tensors are an error (merge
    into the export without them).
    """
    target = Path(target)
    desc_path = target / DESCRIPTION_FILE
    if not desc_path.is_file():
        raise FileNotFoundError(
            f"--merge-into {target}: no {DESCRIPTION_FILE} (not an msModelSlim export)"
        )
    existing = read_tensor_index(target)
    if not existing:
        raise FileNotFoundError(
            f"--merge-into {target}: no safetensors weights "
            f"({LEGACY_WEIGHTS_NAME} or quant_model_weights*)"
        )
    if not scales:
        raise ValueError(
            "no FA scales to merge (the recipe selected no attention module)"
        )
    try:
        desc = json.loads(desc_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{desc_path}: invalid JSON ({exc})") from None
    for attn in sorted(scales):
        if not any(n.startswith(attn + ".") for n in existing):
            raise ValueError(
                f"attention module {attn} is not in --merge-into {target} (no tensor "
                f"named {attn}.*); were the scales calibrated on another model?"
            )
    fa = fa_tensors(scales)
    clash = sorted(n for n in fa if n in existing or n in desc)
    if clash:
        raise ValueError(
            f"--merge-into {target} already has FA entries (e.g. "
            f"{clash[0]}); merge into an export without them"
        )
    if (target / FA_WEIGHTS_NAME).exists():
        raise ValueError(f"--merge-into {target} already has {FA_WEIGHTS_NAME}")
    output = target if output is None else Path(output)
    in_place = output.absolute() == target.absolute()
    # In place every file of the export is copied into the new directory: nothing
    # of it is lost, so no --force is needed.
    with atomic_output_dir(
        output, overwrite=overwrite or in_place, force=force or in_place
    ) as tmp:
        for src in sorted(target.iterdir()):
            dst = tmp / src.name
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
        save_file(fa, str(tmp / FA_WEIGHTS_NAME), metadata={"format": "pt"})
        desc["fa_quant_type"] = fa_quant_type
        desc.setdefault("model_quant_type", "FLOAT")
        desc.setdefault("version", DESCRIPTION_VERSION)
        for attn in sorted(scales):
            desc[f"{attn}.quant_type"] = "INT8"
        desc.update(dict.fromkeys(fa, "FAQuant"))
        write_json(tmp / DESCRIPTION_FILE, desc)
        for index in sorted(tmp.glob("*.safetensors.index.json")):
            data = json.loads(index.read_text(encoding="utf-8"))
            data.setdefault("weight_map", {}).update(dict.fromkeys(fa, FA_WEIGHTS_NAME))
            meta = data.setdefault("metadata", {})
            if isinstance(meta.get("total_size"), int):
                meta["total_size"] += sum(_nbytes(t) for t in fa.values())
            write_json(index, data)
        if (tmp / "config.json").is_file():
            cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
            qc = cfg.get("quantization_config")
            qc = dict(qc) if isinstance(qc, dict) else {}
            qc.update(_fa_quantization_config(scales, fa_quant_type))
            cfg["quantization_config"] = qc
            write_json(tmp / "config.json", cfg)
        if report is not None:
            write_json(tmp / REPORT_FILE, report)
        write_extra_files(tmp, extra_files)
    return output
