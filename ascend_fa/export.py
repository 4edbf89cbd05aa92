"""Write and read Ascend-format FA artifacts (``quant_model_description.json`` +
safetensors), and merge FA scales into an existing msModelSlim export.

Layout written by :func:`export_artifact`::

    DIR/
      config.json                          quantization_config: fa_quant_type + fa_*
      quant_model_description.json         tensor name -> type, plus top-level keys
      quant_model_weights.safetensors      (or -0000i-of-0000N shards + .index.json)
      calibration_report.json              when a report is given
      tokenizer files                      copied from the source, when it has them

Tensors per quantized attention module ``<attn>`` (e.g. ``model.layers.0.self_attn``):

==========================  =======  ===========================================
name                        dtype    shape
==========================  =======  ===========================================
``<attn>.fa_q.scale``       float32  ``[H, 1]`` query heads (MLA: ``[num_heads, 1]``)
``<attn>.fa_k.scale``       float32  ``[Hkv, 1]`` (MLA: ``[1, 1]``)
``<attn>.fa_v.scale``       float32  ``[Hkv, 1]`` (MLA: ``[1, 1]``)
``<attn>.fa_{q,k,v}.offset``  int8   zeros, same shape as the scale
==========================  =======  ===========================================

Description: every tensor name -> ``"FLOAT"`` (weights) or ``"FAQuant"`` (FA
tensors, both fa_quant_types), ``"<attn>.quant_type": "INT8"`` per quantized
module, ``"fa_quant_type"`` (``"FAQuant"`` GQA / ``"FAKQuant"`` MLA),
``"model_quant_type": "FLOAT"`` and ``"version"`` (:data:`DESCRIPTION_VERSION`).

Tied weights: a tensor that the model ties to another (``lm_head.weight`` ->
``model.embed_tokens.weight`` when ``tie_word_embeddings``) is not written, exactly
as ``save_pretrained`` does; loaders re-tie it from ``config.json``. Any other
tensor sharing storage is written as its own copy (safetensors refuses aliases).

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
from safetensors import safe_open
from safetensors.torch import save_file

from ascend_fa.calibration.placeholder import FA_BRANCHES

__all__ = [
    "DESCRIPTION_FILE",
    "DESCRIPTION_VERSION",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "FA_WEIGHTS_NAME",
    "REPORT_FILE",
    "TOKENIZER_FILES",
    "ScaleMap",
    "parse_size",
    "fa_tensors",
    "build_description",
    "checkpoint_state_dict",
    "export_artifact",
    "merge_into",
    "weight_files",
    "read_tensor_index",
    "read_fa_scales",
    "atomic_output_dir",
]

#: attention module name -> {"fa_q": (scale [H] fp32, offset [H] int8), ...}
ScaleMap = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]

DESCRIPTION_FILE = "quant_model_description.json"
#: Version of the description layout this module writes (msModelSlim-style).
DESCRIPTION_VERSION = "1.0.0"
WEIGHTS_NAME = "quant_model_weights.safetensors"
WEIGHTS_INDEX_NAME = "quant_model_weights.safetensors.index.json"
#: File that ``merge_into`` adds beside the existing weights (they stay untouched).
FA_WEIGHTS_NAME = "quant_model_weights_fa.safetensors"
LEGACY_WEIGHTS_NAME = "quant_model_weight_w8a8.safetensors"
REPORT_FILE = "calibration_report.json"
#: Files copied from the source checkpoint directory when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
_FA_NAME = re.compile(r"^(?P<attn>.+)\.(?P<branch>fa_[qkv])\.(?P<kind>scale|offset)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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
            scale = scale.detach().to("cpu", torch.float32).reshape(-1, 1).contiguous()
            offset = offset.detach().to("cpu").reshape(-1, 1)
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise ValueError(f"{attn}.{branch}.scale must be finite and > 0")
            if offset.shape != scale.shape or bool((offset != 0).any()):
                raise ValueError(f"{attn}.{branch}.offset must be zeros shaped like "
                                 f"the scale {tuple(scale.shape)}")
            out[f"{attn}.{branch}.scale"] = scale
            out[f"{attn}.{branch}.offset"] = torch.zeros_like(scale, dtype=torch.int8)
    return out


def build_description(
    weight_names: list[str],
    scales: ScaleMap,
    fa_quant_type: str,
    *,
    model_quant_type: str = "FLOAT",
) -> dict[str, str]:
    """The description of a FLOAT checkpoint plus FA tensors (see module doc)."""
    if fa_quant_type not in ("FAQuant", "FAKQuant"):
        raise ValueError(f"fa_quant_type must be FAQuant or FAKQuant, got "
                         f"{fa_quant_type!r}")
    desc: dict[str, str] = {
        "model_quant_type": model_quant_type,
        "fa_quant_type": fa_quant_type,
        "version": DESCRIPTION_VERSION,
    }
    desc.update(dict.fromkeys(weight_names, "FLOAT"))
    for attn in sorted(scales):
        desc[f"{attn}.quant_type"] = "INT8"
        for branch in FA_BRANCHES:
            desc[f"{attn}.{branch}.scale"] = "FAQuant"
            desc[f"{attn}.{branch}.offset"] = "FAQuant"
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


@contextlib.contextmanager
def atomic_output_dir(output: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``output`` when the block succeeds.

    An existing non-empty ``output`` is refused unless ``overwrite``. On error the
    temporary directory is deleted and ``output`` is untouched.
    """
    output = Path(output).absolute()
    if output.exists():
        if not output.is_dir():
            raise FileExistsError(f"output {output} exists and is not a directory")
        if any(output.iterdir()) and not overwrite:
            raise FileExistsError(f"output directory {output} exists and is not "
                                  "empty; pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    # mkdtemp creates 0700; give the artifact the permissions of a plain mkdir.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        if output.exists():
            # os.replace cannot replace a non-empty directory: move the old one
            # aside first, then drop it once the new one is in place.
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-",
                                        dir=output.parent))
            os.replace(output, old / "d")
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")


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
        save_file({k: tensors[k] for k in shards[0]}, str(directory / WEIGHTS_NAME),
                  metadata=metadata)
        return [WEIGHTS_NAME]
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    files, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        fname = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(directory / fname),
                  metadata=metadata)
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(_nbytes(t) for t in tensors.values())
    _write_json(directory / WEIGHTS_INDEX_NAME,
                {"metadata": {"total_size": total}, "weight_map": weight_map})
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
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a complete FLOAT + FA artifact to ``output`` atomically; return it.

    ``state_dict`` are the checkpoint tensors (see :func:`checkpoint_state_dict`);
    ``config`` the model's ``config.json`` as a dict (its ``quantization_config``
    is replaced: the weights written are floats). Tokenizer files are copied from
    ``source_dir`` when it has them, otherwise saved from ``tokenizer``.
    """
    if not scales:
        raise ValueError("no FA scales to export (the recipe selected no attention "
                         "module)")
    fa = fa_tensors(scales)
    clash = sorted(set(fa) & set(state_dict))
    if clash:
        raise ValueError(f"FA tensor names collide with model tensors: {clash[:3]}")
    tensors: dict[str, torch.Tensor] = {**state_dict, **fa}
    shard_bytes = parse_size(max_shard_size)
    with atomic_output_dir(output, overwrite=overwrite) as tmp:
        _write_shards(tmp, tensors, shard_bytes)
        _write_json(tmp / DESCRIPTION_FILE,
                    build_description(list(state_dict), scales, fa_quant_type))
        if config is not None:
            cfg = {k: v for k, v in dict(config).items()
                   if k not in ("quantization_config", "_attn_implementation_internal")}
            cfg["quantization_config"] = _fa_quantization_config(scales, fa_quant_type)
            _write_json(tmp / "config.json", cfg)
        copied = _copy_tokenizer_files(Path(source_dir) if source_dir else None, tmp)
        if not copied and tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if report is not None:
            _write_json(tmp / REPORT_FILE, report)
    return Path(output)


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of an artifact: the index's files when there is an
    index (``quant_model_weights*.index.json`` or ``*.safetensors.index.json``),
    plus every ``quant_model_weight*.safetensors`` not listed in it; otherwise all
    ``*.safetensors``."""
    directory = Path(directory)
    files: list[Path] = []
    for index in sorted(directory.glob("*.safetensors.index.json")):
        data = json.loads(index.read_text(encoding="utf-8"))
        for name in dict.fromkeys(data.get("weight_map", {}).values()):
            path = directory / name
            if path not in files:
                files.append(path)
    for path in sorted(directory.glob("*.safetensors")):
        if path not in files:
            files.append(path)
    return files


def read_tensor_index(directory: str | Path) -> dict[str, Path]:
    """tensor name -> file holding it (headers only; no tensor data is read).

    Raises ``ValueError`` when a name appears in two files or a listed file is
    missing.
    """
    where: dict[str, Path] = {}
    for path in weight_files(directory):
        if not path.is_file():
            raise ValueError(f"weight file listed in the index is missing: {path.name}")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"tensor {name} is in both {where[name].name} "
                                     f"and {path.name}")
                where[name] = path
    return where


def _per_head(t: torch.Tensor, name: str) -> torch.Tensor:
    """``[H]``, ``[H, 1]`` or ``[H, head_dim]`` (constant rows) -> ``[H]``."""
    if t.dim() == 2:
        if not bool((t == t[:, :1]).all()):
            raise ValueError(f"{name} {tuple(t.shape)} varies along head_dim; "
                             "expected one value per head")
        t = t[:, 0]
    if t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [H, 1] or "
                         "[H, head_dim]")
    return t


def read_fa_scales(directory: str | Path) -> ScaleMap:
    """The FA scales of an artifact (ours or msModelSlim's) as
    ``{attn: {"fa_q": (scale [H] fp32, offset [H] int8), ...}}``.

    Scales ``[H, 1]`` and ``[H, head_dim]`` (seed 004, any float dtype) are both
    accepted; offsets must be integral.
    """
    where = read_tensor_index(directory)
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:
        for name, path in where.items():
            m = _FA_NAME.match(name)
            if not m:
                continue
            if path not in handles:
                handles[path] = stack.enter_context(
                    safe_open(str(path), framework="pt"))
            t = handles[path].get_tensor(name)
            found.setdefault(m["attn"], {}).setdefault(m["branch"], {})[m["kind"]] = t
    scales: ScaleMap = {}
    for attn in sorted(found):
        entry = {}
        for branch in FA_BRANCHES:
            parts = found[attn].get(branch, {})
            if "scale" not in parts or "offset" not in parts:
                raise ValueError(f"{attn}.{branch}: scale and offset tensors are both "
                                 "required")
            where = f"{attn}.{branch}"
            scale = _per_head(parts["scale"], f"{where}.scale").to(torch.float32)
            offset = _per_head(parts["offset"], f"{where}.offset")
            if offset.is_floating_point() and not bool(
                (offset == offset.round()).all()
            ):
                raise ValueError(f"{attn}.{branch}.offset is not integral")
            entry[branch] = (scale.contiguous(), offset.to(torch.int8).contiguous())
        scales[attn] = entry
    return scales


def merge_into(
    target: str | Path,
    *,
    scales: ScaleMap,
    fa_quant_type: str,
    output: str | Path | None = None,
    report: Mapping[str, Any] | None = None,
    overwrite: bool = False,
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
        raise FileNotFoundError(f"--merge-into {target}: no {DESCRIPTION_FILE} "
                                "(not an msModelSlim export)")
    existing = read_tensor_index(target)
    if not existing:
        raise FileNotFoundError(f"--merge-into {target}: no safetensors weights "
                                f"({LEGACY_WEIGHTS_NAME} or quant_model_weights*)")
    if not scales:
        raise ValueError("no FA scales to merge (the recipe selected no attention "
                         "module)")
    try:
        desc = json.loads(desc_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{desc_path}: invalid JSON ({exc})") from None
    for attn in sorted(scales):
        if not any(n.startswith(attn + ".") for n in existing):
            raise ValueError(
                f"attention module {attn} is not in --merge-into {target} (no tensor "
                f"named {attn}.*); were the scales calibrated on another model?")
    fa = fa_tensors(scales)
    clash = sorted(n for n in fa if n in existing or n in desc)
    if clash:
        raise ValueError(f"--merge-into {target} already has FA entries (e.g. "
                         f"{clash[0]}); merge into an export without them")
    if (target / FA_WEIGHTS_NAME).exists():
        raise ValueError(f"--merge-into {target} already has {FA_WEIGHTS_NAME}")
    output = target if output is None else Path(output)
    in_place = output.absolute() == target.absolute()
    with atomic_output_dir(output, overwrite=overwrite or in_place) as tmp:
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
        _write_json(tmp / DESCRIPTION_FILE, desc)
        for index in sorted(tmp.glob("*.safetensors.index.json")):
            data = json.loads(index.read_text(encoding="utf-8"))
            data.setdefault("weight_map", {}).update(dict.fromkeys(fa, FA_WEIGHTS_NAME))
            meta = data.setdefault("metadata", {})
            if isinstance(meta.get("total_size"), int):
                meta["total_size"] += sum(_nbytes(t) for t in fa.values())
            _write_json(index, data)
        if (tmp / "config.json").is_file():
            cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
            qc = cfg.get("quantization_config")
            qc = dict(qc) if isinstance(qc, dict) else {}
            qc.update(_fa_quantization_config(scales, fa_quant_type))
            cfg["quantization_config"] = qc
            _write_json(tmp / "config.json", cfg)
        if report is not None:
            _write_json(tmp / REPORT_FILE, report)
    return output
