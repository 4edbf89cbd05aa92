"""Scales of the paged emulation runtime: static ones read from an artifact or a
map, checked against the model, and the dynamic ones taken from a prompt.

==============  =============================  ======================================
runtime mode    static scales per layer        dynamic (from the prompt's K / V)
==============  =============================  ======================================
``int8_kv``     ``fa_k``, ``fa_v`` ``[Hkv]``    per-head absmax / 127
``faquant``     also ``fa_q`` ``[H]``           also the query's per-head absmax / 127
``c8``          ``k``, ``v`` ``[Hkv, D]``       per-channel absmax / 127
                (vllm-ascend C8)
``fp8_kv``      ``k``, ``v`` ``[1]`` or         per-head absmax / 448
                ``[Hkv]`` (vLLM FP8 E4M3)
==============  =============================  ======================================

Artifacts: FA scales through :func:`~ascend_fa.artifact.reader.read_fa_scales`
(``<attn>.fa_{q,k,v}.scale``), C8 and FP8 KV scales through
:func:`~ascend_fa.artifact.reader.read_kv_scales` (``<attn>.{k,v}_proj.
kv_cache_scale`` ``[Hkv*D]`` in the cache's channel order ``h*D + d``, and
``<attn>.{k,v}_scale``). Maps are keyed by the attention modules' dotted names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ascend_fa.artifact.format import FA_BRANCHES, per_head_vector
from ascend_fa.atb_ops import per_head_qparams
from ascend_fa.atb_ops.constants import FP8_E4M3_MAX

__all__ = [
    "KV_SCALE_MODES",
    "artifact_kind",
    "cache_mode",
    "dynamic_layer_scales",
    "dynamic_scales",
    "load_scales",
]

#: Runtime modes whose scales are KV-cache scales (``k`` / ``v``), and the
#: artifact kind (:func:`~ascend_fa.artifact.reader.read_kv_scales`) each reads.
KV_SCALE_MODES = {"c8": "c8", "fp8_kv": "fp8"}


def cache_mode(mode: str) -> str:
    """The :class:`~ascend_fa.kvcache.PagedKVCache` mode of a runtime mode (C8 is
    an int8 cache read with a float query, like ``int8_kv``)."""
    return "int8_kv" if mode == "c8" else mode


def artifact_kind(directory: str | Path) -> str | None:
    """``"fa"``, ``"c8"`` or ``"fp8"``: which scales an artifact deploys (None when
    it has none)."""
    from ascend_fa.artifact.reader import read_fa_scales, read_kv_scales

    if read_fa_scales(directory):
        return "fa"
    kv = read_kv_scales(directory)
    return None if kv is None else kv[0]


def dynamic_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-head symmetric scale ``[H]`` fp32 of ``x`` ``[B, H, S, D]``: the absmax over
    every batch row, token and channel of a head, through
    :func:`~ascend_fa.atb_ops.per_head_qparams` (so ``/ 127`` and the ``2**-23``
    floor are the calibrated scales' own rules)."""
    amax = x.detach().float().abs().amax(dim=(0, 2, 3))
    return per_head_qparams(-amax, amax)[0]


def _channel_scales(x: torch.Tensor) -> torch.Tensor:
    """C8 ``[H, D]``: each channel's absmax over batch rows and tokens, / 127."""
    amax = x.detach().float().abs().amax(dim=(0, 2))
    return per_head_qparams(-amax.reshape(-1), amax.reshape(-1))[0].view(amax.shape)


def _fp8_scales(x: torch.Tensor) -> torch.Tensor:
    """FP8 ``[H]``: each head's absmax / 448 (floored at the fp32 tiny)."""
    amax = x.detach().float().abs().amax(dim=(0, 2, 3))
    return torch.clamp(amax / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)


def dynamic_layer_scales(
    mode: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One layer's dynamic scales from a prompt's ``query`` ``[B, H, S, D]`` and new
    ``key`` / ``value`` ``[B, Hkv, S, D]`` (see the module doc's table)."""
    if mode == "c8":
        return {"k": _channel_scales(key), "v": _channel_scales(value)}
    if mode == "fp8_kv":
        return {"k": _fp8_scales(key), "v": _fp8_scales(value)}
    out = {"k": dynamic_scales(key), "v": dynamic_scales(value)}
    if mode == "faquant":
        out["q"] = dynamic_scales(query)
    return out


def _as_scale(value: Any, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise ValueError(f"scales: {name} must be a scale or (scale, offset)")
        scale, offset = value
    else:
        scale, offset = value, None
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ValueError(f"scales: {name} scale must be a floating tensor")
    # [H], or the artifact's on-disk shapes [H, 1] / [H, D] with constant rows.
    scale = per_head_vector(scale, f"scales: {name} scale")
    return scale.float().contiguous(), offset


def _read_artifact(path: Path, mode: str) -> Mapping[str, Any]:
    from ascend_fa.artifact.reader import read_fa_scales, read_kv_scales

    if not path.is_dir():
        raise FileNotFoundError(f"scales: artifact directory not found: {path}")
    want = KV_SCALE_MODES.get(mode)
    if want is None:
        scales = read_fa_scales(path)
        if not scales:
            raise ValueError(
                f"scales: artifact {path} has no <attn>.fa_{{q,k,v}}.scale tensors"
                f" (mode {mode!r} reads FA scales)"
            )
        return scales
    kv = read_kv_scales(path)
    if kv is None or kv[0] != want:
        found = "no KV-cache scales" if kv is None else f"{kv[0]} KV-cache scales"
        tensors = (
            "<attn>.{k,v}_proj.kv_cache_scale" if want == "c8" else "<attn>.{k,v}_scale"
        )
        raise ValueError(
            f"scales: mode {mode!r} reads {tensors} but artifact {path} has {found}"
        )
    return kv[1]


def _kv_layer(
    entry: Mapping[str, Any], name: str, mode: str, hkv: int, d: int
) -> dict[str, torch.Tensor]:
    layer = {}
    for side in ("k", "v"):
        t = entry.get(side)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"scales: {name}.{side} must be a floating tensor (mode {mode!r} "
                "needs k and v KV-cache scales)"
            )
        t = t.detach().to("cpu", torch.float32)
        if mode == "c8":
            if t.numel() != hkv * d:
                raise ValueError(
                    f"scales: {name}.{side} C8 scale has {t.numel()} values, the "
                    f"model needs Hkv*D = {hkv}*{d} = {hkv * d} (per channel)"
                )
            t = t.reshape(hkv, d)
        else:
            if t.numel() not in (1, hkv):
                raise ValueError(
                    f"scales: {name}.{side} FP8 scale has {t.numel()} values, the "
                    f"model needs 1 (per tensor) or Hkv = {hkv} (per head)"
                )
            t = t.reshape(-1)
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"scales: {name}.{side} scale must be finite and > 0")
        layer[side] = t.contiguous()
    return layer


def load_scales(
    scales: str | Path | Mapping[str, Any],
    *,
    mode: str,
    layer_names: list[str],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> list[dict[str, torch.Tensor]]:
    """Static scales per layer (``{"k", "v"[, "q"]}`` fp32, shapes as in the
    module doc) from an artifact directory or a map, checked against the model."""
    if isinstance(scales, str | Path):
        scales = _read_artifact(Path(scales), mode)
    if not isinstance(scales, Mapping):
        raise ValueError(
            f"scales must be None, an artifact directory or a mapping, got "
            f"{type(scales).__name__}"
        )
    need = FA_BRANCHES if mode == "faquant" else FA_BRANCHES[1:]
    heads = {"fa_q": num_heads, "fa_k": num_kv_heads, "fa_v": num_kv_heads}
    out = []
    for name in layer_names:
        entry = scales.get(name)
        if entry is None:
            raise ValueError(
                f"scales: no entry for attention module {name!r} (the map has "
                f"{len(scales)} entries, e.g. {next(iter(scales), None)!r})"
            )
        if mode in KV_SCALE_MODES:
            out.append(_kv_layer(entry, name, mode, num_kv_heads, head_dim))
            continue
        layer = {}
        for branch in need:
            if branch not in entry:
                raise ValueError(
                    f"scales: {name}.{branch} is missing (mode {mode!r} "
                    f"needs {', '.join(need)})"
                )
            scale, offset = _as_scale(entry[branch], f"{name}.{branch}")
            if scale.numel() != heads[branch]:
                raise ValueError(
                    f"scales: {name}.{branch}.scale has {scale.numel()} heads, "
                    f"the model has {heads[branch]}"
                )
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise ValueError(
                    f"scales: {name}.{branch}.scale must be finite and > 0"
                )
            if offset is not None and bool(torch.as_tensor(offset).any()):
                raise ValueError(
                    f"scales: {name}.{branch}.offset is non-zero; the Ascend "
                    "kernels take symmetric (offset 0) scales only"
                )
            layer[branch.removeprefix("fa_")] = scale
        out.append(layer)
    return out
