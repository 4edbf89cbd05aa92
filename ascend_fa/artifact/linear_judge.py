"""One judge of an artifact's quantized linear tensors (W8A8, W8A8_DYNAMIC).

Used wherever an artifact's linears are taken on trust: ``--merge-into`` (the
export's linears are copied byte for byte, so they are judged before anything is
written), ``inspect``, and ``eval`` / ``emulate`` when they load an artifact.

Per linear ``<p>`` whose ``<p>.weight`` the description types ``W8A8`` or
``W8A8_DYNAMIC`` (the layout of :mod:`ascend_fa.linear.modules`, which cites the
consumers' loaders):

======================  ==================  ==========================  ==========
tensor                  shape               dtype                       values
======================  ==================  ==========================  ==========
``<p>.weight``          ``[N, K]``          int8                        codes
``<p>.weight_scale``    ``[N, 1]``          fp16 / bf16 / fp32          finite > 0
``<p>.weight_offset``   ``[N, 1]``          a float or integer type     integers in
                                                                        int8 range
``<p>.input_scale``     one value           fp16 / bf16 / fp32          finite > 0
``<p>.input_offset``    one value           int8 or a float type        an integer
                                                                        in int8 range
``<p>.deq_scale``       ``[N]``             fp32, or int64 (fp32 bits)  finite > 0
``<p>.quant_bias``      ``[N]``             int32
``<p>.bias``            ``[N]``             fp16 / bf16 / fp32          finite
======================  ==================  ==========================  ==========

``W8A8`` needs ``weight``, ``input_scale``, ``input_offset``, ``deq_scale`` and
``quant_bias`` (msModelSlim's saver writes no ``weight_scale`` for it: the device
reads ``deq_scale``); ``W8A8_DYNAMIC`` needs ``weight`` and ``weight_scale``.
``weight_scale`` / ``weight_offset`` are exactly ``[N, 1]``: vllm-ascend creates
them so (:data:`SCALE_CITES`) and vLLM's ``weight_loader`` asserts that the file's
tensor has the parameter's shape, so ``[N]`` or ``[N, 1, 1]`` raise AssertionError
there (the real loader, 0.18.0 and 0.23.0.post1). msModelSlim writes ``[N, 1]``
(26.1.0 ``core/quant_service/modelslim_v1/save/ascendv1.py`` L341: its
per-channel scale, ``[N]``, unsqueezed), and so does ascend-fa; the rule holds
for every target.
``[N, K]`` is checked against the model: the source checkpoint's shape of the
same tensor when one is given, else the attention projections the config
implies (families whose projections are plain ``[heads * head_dim, hidden]``).
Shapes and dtypes come from the safetensors
headers; only the small tensors (scales, offsets, biases) are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ascend_fa.atb_ops.linear import decode_deq_scale
from ascend_fa.errors import FileFormatError
from ascend_fa.safe_files import (
    TensorEntry,
    check_string_map,
    read_json_object,
    safetensors_header,
)
from ascend_fa.safe_paths import resolve_inside

from .format import LINEAR_QUANT_TYPES

__all__ = [
    "LINEAR_PARTS",
    "SCALE_CITES",
    "linear_findings",
    "check_linears",
    "source_shapes",
    "config_linear_shapes",
]

_FLOATS = ("F16", "BF16", "F32")
_INTS = ("I8", "I16", "I32", "I64", "U8")
#: part -> (allowed safetensors dtypes, shape rule, value rule)
LINEAR_PARTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "weight": (("I8",), "NK", "codes"),
    "weight_scale": (_FLOATS, "N1", "positive"),
    "weight_offset": (_FLOATS + _INTS, "N1", "int8"),
    "input_scale": (_FLOATS, "1", "positive"),
    "input_offset": (("I8", *_FLOATS), "1", "int8"),
    "deq_scale": (("F32", "I64"), "N", "positive"),
    "quant_bias": (("I32",), "N", "codes"),
    "bias": (_FLOATS, "N", "finite"),
}
_REQUIRED = {
    "W8A8": ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"),
    "W8A8_DYNAMIC": ("weight", "weight_scale"),
}
#: Where the ``[N, 1]`` of ``weight_scale`` / ``weight_offset`` is enforced.
SCALE_CITES = (
    "vllm-project/vllm-ascend:vllm_ascend/quantization/methods/w8a8_dynamic.py"
    "@5cb98caaad get_perchannel_param L71-72 (w8a8_static.py L70-71) creates "
    "them [N, 1]; vllm-project/vllm:vllm/model_executor/layers/linear.py@v0.23.0 "
    "weight_loader asserts param_data.shape == loaded_weight.shape "
    "(RowParallelLinear L1525, v0.18.0: L1486; QKVParallelLinear L1383; "
    "MergedColumnParallelLinear L862)"
)
# Families whose attention projections are plain [heads * head_dim, hidden] (and
# o_proj the transpose): the config alone fixes their shapes.
_PLAIN_ATTENTION = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"}
)


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    v = config.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def config_linear_shapes(config: Mapping[str, Any] | None) -> dict[str, list[int]]:
    """``{"self_attn.q_proj": [out, in], ...}``: the attention projections'
    shapes ``config`` implies, for the families with plain projections (empty
    for the others, or when a size is missing)."""
    if not config or config.get("model_type") not in _PLAIN_ATTENTION:
        return {}
    hidden = _positive_int(config, "hidden_size")
    heads = _positive_int(config, "num_attention_heads")
    if hidden is None or heads is None:
        return {}
    kv = _positive_int(config, "num_key_value_heads") or heads
    dim = _positive_int(config, "head_dim") or hidden // heads
    return {
        "self_attn.q_proj": [heads * dim, hidden],
        "self_attn.k_proj": [kv * dim, hidden],
        "self_attn.v_proj": [kv * dim, hidden],
        "self_attn.o_proj": [hidden, heads * dim],
    }


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory
    (``model.safetensors.index.json``'s shards, or ``model.safetensors``); a hub
    cache snapshot's links into its repository's ``blobs/`` are followed, as the
    loader does."""
    blobs = [model_dir.parent.parent / "blobs"]
    allowed = blobs if model_dir.parent.name == "snapshots" else []
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = read_json_object(index, what="weights index")
        names = check_string_map(
            data.get("weight_map"), path=index, what="weight_map"
        ).values()
        where = index
    elif (model_dir / "model.safetensors").exists():
        names, where = ["model.safetensors"], model_dir
    else:
        return []
    return [
        resolve_inside(model_dir, n, source=where, what="weights file", allowed=allowed)
        for n in dict.fromkeys(names)
    ]


def source_shapes(model_dir: str | Path | None) -> dict[str, list[int]]:
    """tensor name -> shape of a source checkpoint's safetensors (headers only;
    empty when the directory has none: a GGUF source, a hub name)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return {}
    out: dict[str, list[int]] = {}
    for path in _checkpoint_files(Path(model_dir)):
        out.update({n: list(e.shape) for n, e in safetensors_header(path).items()})
    return out


def _linears(desc: Mapping[str, Any]) -> dict[str, str]:
    """linear prefix -> its type, for every ``<p>.weight`` typed as a quantized
    linear; a part typed so without a quantized ``<p>.weight`` maps to ``""``."""
    out: dict[str, str] = {}
    for name, kind in desc.items():
        if kind not in LINEAR_QUANT_TYPES:
            continue
        prefix, _, part = name.rpartition(".")
        if part == "weight":
            out[prefix] = str(kind)
        elif part in LINEAR_PARTS:
            out.setdefault(prefix, "")
    for prefix, kind in list(out.items()):
        if not kind and desc.get(f"{prefix}.weight") in LINEAR_QUANT_TYPES:
            out[prefix] = str(desc[f"{prefix}.weight"])
    return out


def _value_problem(name: str, rule: str, t: torch.Tensor) -> str | None:
    if rule == "codes":
        return None
    if name.endswith(".deq_scale"):
        t = decode_deq_scale(t)
    w = t.to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        return f"{name}: non-finite values"
    if rule == "positive" and not bool((w > 0).all()):
        return f"{name}: values <= 0 (min {float(w.min()):g}); a scale must be > 0"
    if rule == "int8" and not bool((w == w.round()).all()):
        return f"{name}: not integral (an offset is an int8 code)"
    if rule == "int8" and not bool(((w >= -128) & (w <= 127)).all()):
        return f"{name}: outside the int8 range [-128, 127]"
    return None


def _shape_problem(
    name: str, rule: str, shape: tuple[int, ...], n: int | None
) -> str | None:
    if rule == "NK":
        return None if len(shape) == 2 else f"{name}: shape {list(shape)}, expected 2-D"
    numel = 1
    for d in shape:
        numel *= d
    if rule == "N1":
        if n is not None and list(shape) == [n, 1]:
            return None
        return (
            f"{name}: shape {list(shape)}, expected [{n}, 1]: vLLM's weight_loader "
            f"raises AssertionError loading it into the [{n}, 1] parameter "
            f"vllm-ascend creates ({SCALE_CITES})"
        )
    if rule == "1":
        ok = numel == 1 and len(shape) <= 2
        return None if ok else f"{name}: shape {list(shape)}, expected one value [1]"
    # [N], [N, 1]: N values along dim 0
    ok = n is not None and len(shape) >= 1 and shape[0] == n and numel == n
    return None if ok else f"{name}: shape {list(shape)}, expected [{n}] or [{n}, 1]"


def linear_findings(
    where: Mapping[str, Path],
    desc: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    *,
    expected: Mapping[str, list[int]] | None = None,
) -> list[str]:
    """What is wrong with the quantized linears of an artifact whose tensors are
    in ``where`` (name -> file) and typed by ``desc`` (empty when nothing).

    ``expected``: tensor name -> shape of the model (:func:`source_shapes`);
    ``config`` adds the attention shapes of :func:`config_linear_shapes`.
    """
    out: list[str] = []
    by_config = config_linear_shapes(config)
    headers: dict[Path, dict[str, TensorEntry]] = {}

    def entry(name: str) -> TensorEntry:
        path = where[name]
        if path not in headers:
            headers[path] = safetensors_header(path)
        return headers[path][name]

    small: list[tuple[str, str]] = []
    for prefix, kind in sorted(_linears(desc).items()):
        if not kind:
            out.append(
                f"{prefix}: typed as a quantized linear but {prefix}.weight is not"
            )
            continue
        missing = [p for p in _REQUIRED[kind] if f"{prefix}.{p}" not in where]
        if missing:
            out.append(f"{prefix}: {kind} linear without {', '.join(missing)}")
            continue
        w = entry(f"{prefix}.weight")
        n = w.shape[0] if len(w.shape) == 2 else None
        for part, (dtypes, shape_rule, value_rule) in LINEAR_PARTS.items():
            name = f"{prefix}.{part}"
            if name not in where:
                continue
            e = entry(name)
            if e.dtype not in dtypes:
                out.append(
                    f"{name}: dtype {e.dtype}, expected {' or '.join(dtypes)} "
                    f"({kind} linear)"
                )
                continue
            problem = _shape_problem(name, shape_rule, e.shape, n)
            if problem:
                out.append(problem)
            elif value_rule != "codes":
                small.append((name, value_rule))
        want = (expected or {}).get(f"{prefix}.weight")
        if want is None:
            short = ".".join(prefix.split(".")[-2:])
            want = by_config.get(short) if ".layers." in f".{prefix}" else None
        if want is not None and n is not None and list(w.shape) != list(want):
            out.append(
                f"{prefix}.weight: shape {list(w.shape)}, the model's is {list(want)}"
            )
    out.extend(_read_values(where, small))
    return out


def _read_values(where: Mapping[str, Path], small: list[tuple[str, str]]) -> list[str]:
    out: list[str] = []
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, rule in small:
            path = where[name]
            try:
                if path not in handles:
                    handles[path] = stack.enter_context(
                        safe_open(str(path), framework="pt")
                    )
                t = handles[path].get_tensor(name)
            except (SafetensorError, OSError) as exc:
                out.append(f"{name}: cannot be read ({exc})")
                continue
            problem = _value_problem(name, rule, t)
            if problem:
                out.append(problem)
    return out


def check_linears(
    where: Mapping[str, Path],
    desc: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    *,
    expected: Mapping[str, list[int]] | None = None,
    source: str | Path,
    what: str = "artifact",
) -> None:
    """:func:`linear_findings`, the first finding raised as one
    :class:`~ascend_fa.errors.FileFormatError` naming ``source`` (with the
    number of further findings)."""
    found = linear_findings(where, desc, config, expected=expected)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise FileFormatError(
            f"{what}: quantized linear {found[0]}{more}", path=Path(source)
        )
