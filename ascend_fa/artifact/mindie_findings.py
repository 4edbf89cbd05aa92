"""What MindIE 3.0.0 would not load, or would run otherwise than the
description says, judged from the per-family data of
:mod:`ascend_fa.artifact.mindie_models` (``inspect --target mindie`` and the
plugin's start-up read these lines)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .mindie_models import (
    LINEAR_TYPES,
    MindieModel,
    attention_names,
    config_quantize,
    mindie_model,
)

__all__ = ["mindie_findings"]


def _expert_kind(name: str) -> str | None:
    if ".shared_expert" in name:
        return "shared"
    if ".experts." in name:
        return "routed"
    return None


def mindie_findings(
    config: Mapping[str, Any] | None, desc: Mapping[str, Any] | None
) -> list[str]:
    """What MindIE 3.0.0's model for this artifact's ``model_type`` would not load
    or would run otherwise than the description says, one line each."""
    cfg = config or {}
    m = mindie_model(cfg.get("model_type"))
    if m is None or desc is None:
        return []
    t = cfg.get("model_type")
    out: list[str] = []
    if m.model is None:
        return [
            f"config.json: model_type {t!r}: MindIE 3.0.0 has no model for it "
            f"(NotImplementedError 'unsupported model type'; {m.cites()})"
        ]
    if m.refusal is not None:
        out.append(f"config.json: model_type {t!r}: MindIE 3.0.0's {m.refusal}")
    fa = desc.get("fa_quant_type")
    if fa is not None and m.fa3 is None:
        out.append(
            f"fa_quant_type: {fa!r}; MindIE 3.0.0's {m.model} model for {t} builds no "
            f"FA3, the fa_* tensors would go unused ({m.cites()})"
        )
    mqt = str(desc.get("model_quant_type") or "").lower()
    types = {k: v for k, v in desc.items() if isinstance(v, str)}
    if m.quantize_from == "config.json":
        quantize, attn = config_quantize(m, mqt.upper() or "FLOAT", types)
        if cfg.get("quantize") != quantize:
            out.append(
                f"config.json: quantize is {cfg.get('quantize')!r}, not {quantize!r}: "
                f"MindIE's {t} router reads only config.json (not the description), "
                "loads every MLP linear under it, and builds a float model without "
                f"it ({m.cites()})"
            )
        elif m.attn is not None and cfg.get("attn_quantize") != attn:
            out.append(
                f"config.json: attn_quantize is {cfg.get('attn_quantize')!r}, not "
                f"{attn!r}: without it MindIE's {t} attention loads under "
                f"{m.attn!r} when quantize is 'w8a8_dynamic', else under quantize "
                f"({m.cites()})"
            )
    wrong = _misloaded(m, mqt, types, cfg) if m.backend == "atb" else None
    if wrong:
        name, kind, want = wrong
        what = {"linear": "linears", "attention": "attention linears"}
        out.append(
            f"{name}: {types[name]} but MindIE 3.0.0 loads {t}'s {kind} "
            f"{what.get(kind, 'experts')} under quantize {want!r} ({m.cites()})"
        )
    if m.attn_bias:
        for attn_name in attention_names(types):
            if f"{attn_name}.q_proj.bias" not in types:
                out.append(
                    f"{attn_name}.q_proj.bias: missing; MindIE's {t} attention loads "
                    f"q/k/v biases whatever attention_bias says ({m.cites()})"
                )
                break
    for key in m.config_keys:
        if key not in cfg:
            out.append(
                f"config.json: {key} missing; MindIE's {t} config class requires it "
                f"({m.cites()})"
            )
    for key, alias in m.config_aliases:
        if key not in cfg and alias in cfg:
            out.append(
                f"config.json: {key} missing (only {alias}); MindIE's {t} config "
                f"class reads {key} and takes its own default ({m.cites()})"
            )
    return out


def _misloaded(
    m: MindieModel, mqt: str, types: Mapping[str, str], cfg: Mapping[str, Any]
) -> tuple[str, str, str] | None:
    """The first linear weight whose described type is not the one MindIE loads
    it under: shared experts (and, in a uniform model, every linear) under the
    model-level ``quantize``; routed experts under ``moe_quantize`` where read; in
    a model with its own attention quantize (``attn``) the attention under it
    and every other linear under config.json's ``quantize``."""
    moe = mqt
    if m.moe_quantize and not m.uniform:
        moe = str(cfg.get("moe_quantize") or mqt)
    if m.attn is not None:
        q = str(cfg.get("quantize") or mqt)
        attn = cfg.get("attn_quantize") or (m.attn if q == "w8a8_dynamic" else q)
    for name, typ in types.items():
        if not name.endswith(".weight") or typ not in LINEAR_TYPES:
            continue
        if m.attn is not None:
            kind = "attention" if ".self_attn." in name else "linear"
            want = attn if kind == "attention" else q
            if typ.lower() != want:
                return name, kind, want
            continue
        kind = _expert_kind(name) or ("linear" if m.uniform else None)
        if kind is None:
            continue
        if m.uniform or (kind == "shared" and m.shared == "model"):
            want = mqt
        elif kind == "routed":
            want = moe
        else:
            continue
        if typ.lower() != want:
            return name, kind, want
    return None
