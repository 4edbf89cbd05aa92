"""Read artifacts: which files hold which tensors, and the FA scales.

Accepts ours and msModelSlim's layouts (:mod:`.format`): an index with shards,
``quant_model_weights*.safetensors``, or the older
``quant_model_weight_w8a8.safetensors``. Only headers are read to build the index;
scale tensors are read one by one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .format import (
    C8_TENSOR,
    FA_BRANCHES,
    FA_TENSOR,
    VLLM_KV_TENSOR,
    ScaleMap,
    per_head_vector,
)

__all__ = ["weight_files", "read_tensor_index", "read_fa_scales", "read_kv_scales"]


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
                    raise ValueError(
                        f"tensor {name} is in both {where[name].name} and {path.name}"
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
            if path not in handles:
                handles[path] = stack.enter_context(
                    safe_open(str(path), framework="pt")
                )
            t = handles[path].get_tensor(name)
            found.setdefault(m["attn"], {}).setdefault(m["branch"], {})[m["kind"]] = t
    scales: ScaleMap = {}
    for attn in sorted(found):
        entry = {}
        for branch in FA_BRANCHES:
            parts = found[attn].get(branch, {})
            if "scale" not in parts or "offset" not in parts:
                raise ValueError(
                    f"{attn}.{branch}: scale and offset tensors are both required"
                )
            where = f"{attn}.{branch}"
            scale = per_head_vector(parts["scale"], f"{where}.scale").to(torch.float32)
            offset = per_head_vector(parts["offset"], f"{where}.offset")
            if offset.is_floating_point() and not bool(
                (offset == offset.round()).all()
            ):
                raise ValueError(f"{attn}.{branch}.offset is not integral")
            entry[branch] = (scale.contiguous(), offset.to(torch.int8).contiguous())
        scales[attn] = entry
    return scales


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
