"""Read artifacts: which files hold which tensors, and the FA scales.

Accepts ours and msModelSlim's layouts (:mod:`.format`): an index with shards,
``quant_model_weights*.safetensors``, or the older
``quant_model_weight_w8a8.safetensors``. Only headers are read to build the index;
scale tensors are read one by one.

Every file here is untrusted: index entries are plain names inside the directory
(:mod:`ascend_fa.safe_paths`), JSON files must have the right shape and
safetensors headers the valid layout (:mod:`ascend_fa.safe_files`); anything else
is a :class:`~ascend_fa.errors.FileFormatError` /
:class:`~ascend_fa.errors.UnsafePathError` naming the file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ascend_fa.errors import FileFormatError, NotFoundError
from ascend_fa.safe_files import (
    check_string_map,
    read_json_object,
    safetensors_header,
)
from ascend_fa.safe_paths import resolve_inside

from .format import (
    C8_TENSOR,
    CONFIG_FILE,
    DESCRIPTION_FILE,
    FA_BRANCHES,
    FA_TENSOR,
    FA_WEIGHTS_NAME,
    LEGACY_WEIGHTS_NAME,
    VLLM_KV_TENSOR,
    ScaleMap,
    description_problem,
    per_head_vector,
)

# Scale and offset dtypes a reader accepts (msModelSlim writes fp32/fp16/bf16
# scales and int8 or float offsets); anything else (fp8, bool, complex, packed
# types) is refused before any arithmetic on it.
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OFFSET_DTYPES = (
    *_SCALE_DTYPES,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)

__all__ = [
    "weight_files",
    "read_tensor_index",
    "read_fa_scales",
    "read_description",
    "read_artifact_config",
    "check_merge_target",
    "read_kv_scales",
]


def _index_entries(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a weights index: tensor name -> file name."""
    data = read_json_object(index, what="weights index")
    if "weight_map" not in data:
        raise FileFormatError("weights index has no weight_map", path=index)
    return check_string_map(data["weight_map"], path=index, what="weight_map")


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of an artifact: the index's files when there is an
    index (``quant_model_weights*.index.json`` or ``*.safetensors.index.json``),
    plus every ``quant_model_weight*.safetensors`` not listed in it; otherwise all
    ``*.safetensors``.

    An index entry that is not a plain file name inside ``directory`` (absolute,
    ``..``, a separator, a symlink leading out) raises
    :class:`~ascend_fa.errors.UnsafePathError`, a malformed index
    :class:`~ascend_fa.errors.FileFormatError` — both before any weights file is
    opened; a ``*.safetensors`` symlink leading out of the directory is refused
    the same way.
    """
    directory = Path(directory)
    files: list[Path] = []
    for index in sorted(directory.glob("*.safetensors.index.json")):
        for name in dict.fromkeys(_index_entries(index).values()):
            path = resolve_inside(
                directory, name, source=index, what="weight_map entry"
            )
            if path not in files:
                files.append(path)
    for path in sorted(directory.glob("*.safetensors")):
        if path not in files:
            files.append(
                resolve_inside(
                    directory, path.name, source=directory, what="weights file"
                )
            )
    return files


def read_tensor_index(directory: str | Path) -> dict[str, Path]:
    """tensor name -> file holding it (headers only; no tensor data is read).

    Raises :class:`~ascend_fa.errors.FileFormatError` (a ``ValueError``) when a
    name appears in two files, a listed file is missing, or a header is not a
    valid safetensors layout (truncated, corrupt, a pickle).
    """
    where: dict[str, Path] = {}
    for path in weight_files(directory):
        if not path.is_file():
            raise FileFormatError(
                f"weight file listed in the index is missing: {path.name}", path=path
            )
        for name in safetensors_header(path):
            if name in where:
                raise FileFormatError(
                    f"tensor {name} is in both {where[name].name} and {path.name}",
                    path=path,
                )
            where[name] = path
    return where


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
            m = FA_TENSOR.match(name)
            if not m:
                continue
            try:
                if path not in handles:
                    handles[path] = stack.enter_context(
                        safe_open(str(path), framework="pt")
                    )
                t = handles[path].get_tensor(name)
            except (SafetensorError, OSError) as exc:
                raise FileFormatError(f"cannot read {name}: {exc}", path=path) from None
            found.setdefault(m["attn"], {}).setdefault(m["branch"], {})[m["kind"]] = t
    scales: ScaleMap = {}
    for attn in sorted(found):
        entry = {}
        for branch in FA_BRANCHES:
            parts = found[attn].get(branch, {})
            if "scale" not in parts or "offset" not in parts:
                raise FileFormatError(
                    f"{attn}.{branch}: scale and offset tensors are both required",
                    path=directory,
                )
            name = f"{attn}.{branch}"
            for kind, allowed in (("scale", _SCALE_DTYPES), ("offset", _OFFSET_DTYPES)):
                if parts[kind].dtype not in allowed:
                    raise FileFormatError(
                        f"{name}.{kind} has dtype {parts[kind].dtype}, which a "
                        f"{kind} cannot have",
                        path=directory,
                    )
            try:
                scale = per_head_vector(parts["scale"], f"{name}.scale")
                offset = per_head_vector(parts["offset"], f"{name}.offset")
            except ValueError as exc:
                raise FileFormatError(str(exc), path=directory) from None
            wide = offset.to(torch.float64)
            if not bool((wide == wide.round()).all()):
                raise FileFormatError(
                    f"{attn}.{branch}.offset is not integral", path=directory
                )
            if not bool(((wide >= -128) & (wide <= 127)).all()):
                raise FileFormatError(
                    f"{attn}.{branch}.offset is outside the int8 range", path=directory
                )
            entry[branch] = (
                scale.to(torch.float32).contiguous(),
                offset.to(torch.int8).contiguous(),
            )
        scales[attn] = entry
    return scales


def read_description(directory: str | Path) -> dict[str, Any]:
    """The ``quant_model_description.json`` of ``directory``: a JSON object whose
    values are strings, but for the objects and numbers msModelSlim's saver writes
    at the top level (``metadata``, ``optional``, ``group_size``:
    :func:`~.format.description_problem`)."""
    path = Path(directory) / DESCRIPTION_FILE
    if not path.is_file():
        raise NotFoundError(f"no {DESCRIPTION_FILE}", path=directory)
    desc = read_json_object(path, what="description")
    problem = description_problem(desc)
    if problem is not None:
        raise FileFormatError(f"description: {problem}", path=path)
    return desc


def read_artifact_config(directory: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of ``directory`` as a JSON object (None when absent); a
    ``quantization_config`` in it must be an object too."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        return None
    config = read_json_object(path, what="config")
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise FileFormatError(
            "config quantization_config must be a JSON object", path=path
        )
    return config


def check_merge_target(directory: str | Path) -> dict[str, Path]:
    """Check that ``directory`` is an msModelSlim export ``merge_into`` can take,
    reading only JSON files and safetensors headers (it runs before any model is
    loaded); returns its tensor index.

    An export has a description (:func:`read_description`), safetensors weights
    (:func:`read_tensor_index`: indexes, names and headers valid), a parseable
    ``config.json`` when it has one, and no FA tensors yet.
    """
    directory = Path(directory)
    flag = f"--merge-into {directory}"
    if not directory.is_dir():
        raise NotFoundError(f"{flag}: not a directory", path=directory)
    if not (directory / DESCRIPTION_FILE).is_file():
        raise NotFoundError(
            f"{flag}: no {DESCRIPTION_FILE} (not an msModelSlim export)",
            path=directory,
        )
    desc = read_description(directory)
    read_artifact_config(directory)
    existing = read_tensor_index(directory)
    if not existing:
        raise NotFoundError(
            f"{flag}: no safetensors weights ({LEGACY_WEIGHTS_NAME} or "
            "quant_model_weights*)",
            path=directory,
        )
    fa = sorted(n for n in [*existing, *desc] if FA_TENSOR.match(n))
    if fa or (directory / FA_WEIGHTS_NAME).exists():
        first = fa[0] if fa else FA_WEIGHTS_NAME
        raise FileFormatError(
            f"{flag} already has FA entries (e.g. {first}); merge into an export "
            "without them",
            path=directory,
        )
    return existing


def read_kv_scales(
    directory: str | Path,
) -> tuple[str, dict[str, dict[str, torch.Tensor]]] | None:
    """The KV-cache scales of a C8 or vLLM artifact, or None when it has neither.

    Returns ``("c8", {attn: {"k": [Hkv*D], "v": [Hkv*D]}})`` for
    ``<attn>.{k,v}_proj.kv_cache_scale`` or ``("fp8", {attn: {"k": [n], "v": [n]}})``
    for vLLM's ``<attn>.{k,v}_scale`` (``n`` = 1 or Hkv), all fp32 and flattened.
    """
    where = read_tensor_index(directory)
    found: dict[str, dict[str, dict[str, Path]]] = {"c8": {}, "fp8": {}}
    for name, path in where.items():
        c8 = C8_TENSOR.match(name)
        if c8 and c8["kind"] == "scale":
            found["c8"].setdefault(c8["attn"], {})[c8["side"]] = path
            continue
        vk = VLLM_KV_TENSOR.match(name)
        if vk and vk["side"] in ("k", "v"):
            found["fp8"].setdefault(vk["attn"], {})[vk["side"]] = path
    if found["c8"] and found["fp8"]:
        raise ValueError(f"{directory}: both C8 and vLLM KV scales; which is deployed?")
    kind = "c8" if found["c8"] else "fp8"
    if not found[kind]:
        return None
    names = {
        "c8": lambda a, s: f"{a}.{s}_proj.kv_cache_scale",
        "fp8": lambda a, s: f"{a}.{s}_scale",
    }[kind]
    out: dict[str, dict[str, torch.Tensor]] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for attn in sorted(found[kind]):
            sides = found[kind][attn]
            if set(sides) != {"k", "v"}:
                raise ValueError(f"{attn}: both K and V KV-cache scales are required")
            entry = {}
            for side, path in sides.items():
                if path not in handles:
                    handles[path] = stack.enter_context(
                        safe_open(str(path), framework="pt")
                    )
                t = handles[path].get_tensor(names(attn, side))
                entry[side] = t.to(torch.float32).reshape(-1).contiguous()
            out[attn] = entry
    return kind, out
