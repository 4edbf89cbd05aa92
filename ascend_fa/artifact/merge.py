"""Is a directory an msModelSlim W8A8 export of this model? (``--merge-into``)

:func:`check_merge_export` reads only JSON and safetensors headers, so the
``calibrate`` verb calls it before the model loads: a directory that is not an
export, or an export of another model (layer count or tensor shapes differ), is
refused in well under a second.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ascend_fa.errors import InputError, NotFoundError
from ascend_fa.safe_files import safetensors_header

from .format import (
    DESCRIPTION_FILE,
    LINEAR_QUANT_TYPES,
    is_meta_key,
    is_msmodelslim_type,
)
from .linear_judge import check_linears, source_shapes
from .reader import check_merge_target, read_artifact_config, read_description

__all__ = ["check_merge_export", "export_layer_count"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def export_layer_count(names: list[str]) -> int:
    """``max(i) + 1`` over tensor names containing ``layers.{i}.`` (0 when none)."""
    found = [int(m.group(1)) for n in names if (m := _LAYER.search(n))]
    return max(found) + 1 if found else 0


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:60]}... ({len(text)} characters)"


def _shapes(where: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape, from the safetensors headers."""
    out: dict[str, tuple[int, ...]] = {}
    for path in dict.fromkeys(where.values()):
        out.update({n: e.shape for n, e in safetensors_header(path).items()})
    return out


def _shape(where: Mapping[str, Path], name: str) -> list[int] | None:
    path = where.get(name)
    if path is None:
        return None
    with safe_open(str(path), framework="pt") as f:
        return list(f.get_slice(name).get_shape())


def check_merge_export(
    directory: str | Path,
    model_config: Mapping[str, Any] | None = None,
    *,
    source: str | Path | None = None,
) -> dict[str, Any]:
    """Refuse ``directory`` unless it is an msModelSlim W8A8 export (description
    with a quantized ``model_quant_type`` + readable safetensors weights) whose
    quantized linears pass :func:`~.linear_judge.linear_findings`, and whose model
    type, layer count and shapes match ``model_config`` and the checkpoint in
    ``source`` (when given). Returns the description.
    """
    directory = Path(directory)
    flag = f"--merge-into {directory}"
    if not (directory / DESCRIPTION_FILE).is_file():
        raise NotFoundError(
            f"{flag}: no {DESCRIPTION_FILE} (not an msModelSlim export)",
            path=directory,
        )
    desc = read_description(directory)
    mqt = desc.get("model_quant_type")
    if mqt not in LINEAR_QUANT_TYPES:
        raise InputError(
            f"{flag}: model_quant_type {mqt!r} in {DESCRIPTION_FILE}; a W8A8 export "
            f"has one of {', '.join(LINEAR_QUANT_TYPES)}"
        )
    unknown = sorted(
        (k, v)
        for k, v in desc.items()
        if not is_meta_key(k, v) and not is_msmodelslim_type(v)
    )
    if unknown:
        key, value = unknown[0]
        raise InputError(
            f"{flag}: {key!r} has type {value!r} in {DESCRIPTION_FILE}, which "
            "msModelSlim's saver never writes (W8A8, W8A8_DYNAMIC, FLOAT, C8 ...)"
        )
    # Readable export, safe names, valid headers, no FA tensors yet (reader rules).
    where = check_merge_target(directory)
    export_config = read_artifact_config(directory) or {}
    expected = source_shapes(source) if source is not None else {}
    mismatch = [
        f"{name} is {list(shape)}, the model's is {expected[name]}"
        for name, shape in _shapes(where).items()
        if name in expected and list(shape) != expected[name]
    ]
    if mismatch:
        raise InputError(f"{flag} belongs to another model: {mismatch[0]}")
    check_linears(
        where,
        desc,
        model_config or export_config,
        expected=expected,
        source=directory,
        what=f"--merge-into {directory}",
    )
    if model_config is None:
        _check_claims(flag, desc, export_config, None, expected, where, source)
        return desc
    mine, theirs = model_config.get("model_type"), export_config.get("model_type")
    if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs:
        raise InputError(
            f"{flag} belongs to another model: its config.json says model_type "
            f"{_cut(theirs)!r}, the model is {_cut(mine)!r}"
        )
    layers = model_config.get("num_hidden_layers")
    have = export_layer_count(list(where))
    if isinstance(layers, int) and have != layers:
        raise InputError(
            f"{flag} belongs to another model: it has {have} layers, the model has "
            f"{layers}"
        )
    hidden = model_config.get("hidden_size")
    vocab = model_config.get("vocab_size")
    emb = _shape(where, "model.embed_tokens.weight")
    if emb is not None and [vocab, hidden] != emb:
        raise InputError(
            f"{flag} belongs to another model: model.embed_tokens.weight is {emb}, "
            f"the model's is [{vocab}, {hidden}]"
        )
    heads = model_config.get("num_attention_heads")
    if isinstance(heads, int) and isinstance(hidden, int) and heads:
        kv = int(model_config.get("num_key_value_heads") or heads)
        dim = int(model_config.get("head_dim") or hidden // heads)
        k = _shape(where, "model.layers.0.self_attn.k_proj.weight")
        if k is not None and k[0] != kv * dim:
            raise InputError(
                f"{flag} belongs to another model: "
                f"model.layers.0.self_attn.k_proj.weight has {k[0]} rows, the model "
                f"has {kv} KV heads x {dim} = {kv * dim}"
            )
    _check_claims(flag, desc, export_config, model_config, expected, where, source)
    return desc


def _check_claims(
    flag: str,
    desc: Mapping[str, Any],
    config: Mapping[str, Any],
    model_config: Mapping[str, Any] | None,
    expected: Mapping[str, list[int]],
    where: Mapping[str, Path],
    source: str | Path | None,
) -> None:
    """The provenance rule every verb applies
    (:func:`~.provenance.provenance_findings`): an export that one of ours was
    merged into records its source and target; they must hold here too."""
    from .provenance import provenance_findings

    found = provenance_findings(
        desc,
        config,
        model_config=model_config,
        model_shapes=expected,
        artifact_shapes=_shapes(where),
        model=source if source is not None else "(the model)",
    )
    if found:
        raise InputError(f"{flag}: {found[0]}")
