"""The three consumers an artifact is written for, and what each one loads.

============  =================================  ==================================
target        attention / KV tensors             files
============  =================================  ==================================
``mindie``    FAQuant (GQA) / FAKQuant (MLA)     msModelSlim layout: description,
              ``<attn>.fa_{q,k,v}.{scale,off}``   ``quant_model_weights*``, no
              next to quantized linears          ``quantization_config``
``vllm-       GQA: C8 ``<attn>.{k,v}_proj.        same layout; ``kv_cache_type`` /
ascend``      kv_cache_{scale,offset}`` [Hkv*D]; ``kv_quant_type`` ``"C8"`` or
              MLA: FAKQuant + quantized MLA      ``fa_quant_type`` ``"FAKQuant"``
              linears
``vllm``      ``<attn>.{k,v}_scale`` fp32 ``[1]``  compressed-tensors
              (tensor) or ``[Hkv]`` (attn_head)  ``quantization_config`` in
                                                 ``config.json``; HF weight names
============  =================================  ==================================

Every rule cites the consumer source it comes from (repository, path, commit); the
commits are the vllm-ascend ``main`` and MindIE ``3.0.0`` rows of :mod:`.releases`,
whose table says what other releases load:

* vllm-project/vllm-ascend @182b75ea ``vllm_ascend/quantization/methods/kv_c8.py``
  registers ``("FAKQuant", "attention")`` as the only FA attention scheme
  (``register_scheme``); ``get_scheme_class("FAQuant", "attention")`` is None, so a
  GQA FAQuant description fails with ``NotImplementedError``. Dense attention's int8
  cache is C8 (``AscendC8KVCacheAttentionMethod``), found by description keys that
  contain ``k_proj.kv_cache_scale`` (``modelslim_config.py``
  ``_add_kvcache_quant_metadata``) and ``kv_cache_type == "C8"``.
* vllm-ascend ``vllm_ascend/attention/attention_v1.py`` ``_prepare_c8_scales``: the
  scale is viewed as ``[1, num_kv_heads, head_size]`` (channel ``h * D + d``) and the
  cache is written as ``round(x * (1 / scale) + offset)`` clamped to [-128, 127];
  the FIA decode path takes ``antiquant_scale`` only (symmetric).
* vllm-ascend ``vllm_ascend/attention/mla_v1.py`` ``_process_weights_for_fused_fa_
  quant`` reads ``q_proj.weight_scale`` and ``fused_qkv_a_proj.weight_scale``: the
  FAKQuant path needs quantized MLA linears.
* msmodelslim 26.1.0 ``pytorch/llm_ptq/llm_ptq_tools/llm_ptq_utils.py``
  ``QuantModelJsonDescription``: "KV-cache and FA cannot be quantized at the same
  time!"; ``core/quant_service/modelslim_v1/save/ascendv1.py``: C8 tensor names,
  ``kv_cache_type``/``kv_quant_type`` ``"C8"``, ``version``/``model_quant_type``/
  ``metadata``/``group_size`` top-level keys, ``remove_quantization_config``.
* Ascend/MindIE-LLM @8b4871ad ``examples/atb_models/atb_llm/models/base/router.py``:
  ``quantize = model_quant_type.lower()``; ``models/base/config.py``
  ``__check_quantize`` accepts only ``QUANTIZE_DESC_REQUIRED_LIST``
  (``atb_llm/utils/quantize/quant_type.py``: w8a8, w8a8_dynamic, ...; ``float`` is
  not in it).
* vllm-project/vllm ``compressed_tensors.py`` ``CompressedTensorsKVCacheMethod``:
  ``kv_cache_scheme`` ``num_bits`` 8, ``type`` float, ``strategy`` tensor or
  attn_head, ``symmetric`` true; ``k_scale``/``v_scale`` fp32 ``[1]`` or
  ``[num_kv_heads]``; ``model_loader/weight_utils.py`` ``get_quant_config`` takes
  ``config.json``'s ``quantization_config`` as the whole quantization config when
  present (the reason Ascend targets must not carry one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import reads_fa

from .format import (
    ARTIFACT_DTYPES,
    DEFAULT_TARGET,
    DESCRIPTION_VERSION,
    FA_BRANCHES,
    FA_QUANT_TYPES,
    KV_SIDES,
    KV_STRATEGIES,
    LINEAR_QUANT_TYPES,
    RESEARCH_DTYPES,
    TARGET_METADATA_KEY,
    TARGETS,
    ScaleMap,
    c8_tensor_name,
    dtype_name,
    fa_tensor_name,
    vllm_kv_name,
)

__all__ = [
    "KVScaleMap",
    "resolve_target",
    "resolve_dtype",
    "is_research_dtype",
    "check_target",
    "target_warning",
    "c8_tensors",
    "vllm_kv_tensors",
    "target_description",
    "compressed_tensors_config",
]

#: attention module name -> {"k": scale, "v": scale}: C8 ``[Hkv*D]`` per channel
#: (channel ``h * D + d``), or vLLM ``[1]`` / ``[Hkv]``.
KVScaleMap = dict[str, dict[str, torch.Tensor]]


def resolve_target(target: str | None) -> str:
    """``None`` -> the default target; an unknown name -> :class:`InputError`."""
    if target is None:
        return DEFAULT_TARGET
    if target not in TARGETS:
        raise InputError(
            f"--target {target!r} is not a known target; choose one of "
            f"{', '.join(TARGETS)}"
        )
    return target


def resolve_dtype(
    dtype: str | torch.dtype | None, *, research: bool = False
) -> torch.dtype:
    """``"bf16"``/``"fp16"`` (or ``bfloat16``/``float16``, or the torch dtype) ->
    the artifact's floating dtype; ``None`` -> bfloat16. ``research=True`` also
    accepts ``"fp32"``/``float32`` (:data:`RESEARCH_DTYPES`: exact evaluation,
    not deployable)."""
    if dtype is None:
        return torch.bfloat16
    table = {**ARTIFACT_DTYPES, **(RESEARCH_DTYPES if research else {})}
    if isinstance(dtype, torch.dtype):
        if dtype in table.values():
            return dtype
    elif dtype in table:
        return table[dtype]
    else:
        for t in table.values():
            if dtype == dtype_name(t):
                return t
    research_hint = (
        "; fp32 is a research dtype (calibrate --dtype fp32)"
        if not research and dtype in (*RESEARCH_DTYPES, "float32", torch.float32)
        else ""
    )
    raise InputError(
        f"--dtype {dtype!r} is not supported; choose one of "
        f"{', '.join(table)} (MindIE and vllm-ascend load float16 or "
        f"bfloat16 weights only{research_hint})"
    )


def is_research_dtype(dtype: torch.dtype) -> bool:
    """True for a dtype no consumer loads (:data:`RESEARCH_DTYPES`)."""
    return dtype in RESEARCH_DTYPES.values()


def check_target(
    target: str,
    *,
    mla: bool | None = None,
    model_quant_type: str | None = None,
    merge: bool = False,
    model_type: str | None = None,
) -> None:
    """Refuse, with the consumer's reason, a request the target cannot load.

    ``mla`` (None = not known yet), ``model_quant_type`` (the linears' type:
    ``"FLOAT"``, ``"W8A8"``, ``"W8A8_DYNAMIC"``; None = not known yet), ``merge``
    (``--merge-into``: the export brings its own quantized linears).
    """
    what = f"model type {model_type!r}" if model_type else "this model"
    if merge and target == "vllm":
        raise UnsupportedError(
            "--merge-into adds Ascend tensors to an msModelSlim export; --target vllm "
            "writes compressed-tensors (use --output)"
        )
    if target == "vllm" and mla:
        raise UnsupportedError(
            f"--target vllm cannot express {what}: vLLM's MLA cache holds the latent "
            "and the RoPE key under one k_scale, and ascend-fa observes only the "
            "latent (use --target vllm-ascend or mindie for DeepSeek MLA)"
        )
    linears_quantized = model_quant_type in LINEAR_QUANT_TYPES
    if target == "vllm" and linears_quantized:
        raise UnsupportedError(
            "--target vllm writes dense float weights with FP8 KV-cache scales "
            "(compressed-tensors 'dense', no config_groups); Ascend W8A8 linears "
            "load in mindie or vllm-ascend (use --linear none with --target vllm)"
        )
    if merge or model_quant_type is None or linears_quantized:
        return
    if target in ("mindie", "vllm-ascend") and not reads_fa(model_type, target):
        why = (
            "its sparse attention keeps the latent cache as it runs it"
            if mla
            else "MindIE's model for it builds no FA3"
        )
        raise UnsupportedError(
            f"--target {target} reads no attention scales for {what} ({why}; see "
            "docs/reference/compatibility.md): quantize the linears (--linear w8a8 / "
            "w8a8_dynamic)"
        )
    # --target mindie with float linears is allowed (an attention-only research
    # artifact): target_warning says, and inspect --target mindie refuses it.
    if target == "vllm-ascend" and mla:
        raise UnsupportedError(
            f"--target vllm-ascend cannot express {what} with float linears: its "
            "only MLA attention scheme (FAKQuant) reads the quantized MLA linears' "
            "weight_scale (vllm_ascend/attention/mla_v1.py); quantize the linears "
            "(--linear w8a8_dynamic) or --merge-into an msModelSlim W8A8 export"
        )


def target_warning(
    target: str, *, model_quant_type: str | None, merge: bool = False
) -> str | None:
    """The one-line warning for a request :func:`check_target` lets through but
    the consumer will not load, or None: ``--target mindie`` with float linears
    (``model_quant_type`` ``"FLOAT"``) and no ``--merge-into`` writes an
    attention-only research artifact (e.g. to measure the attention's accuracy
    alone); MindIE sets ``quantize = model_quant_type.lower()`` and refuses
    ``float`` (Ascend/MindIE-LLM ``examples/atb_models/atb_llm/models/base/
    config.py`` ``__check_quantize`` @8b4871a), so it loads FA quantization only
    beside quantized linears and ``inspect --target mindie`` reports the artifact
    as not deployable."""
    if target != "mindie" or merge or model_quant_type != "FLOAT":
        return None
    return (
        "--target mindie with --linear none writes an attention-only research "
        "artifact: MindIE loads FA quantization only beside quantized linears "
        "(model_quant_type 'FLOAT' is refused), so it is not deployable "
        "(ascend-fa inspect --target mindie says why; --linear w8a8 or "
        "--merge-into makes it deployable)"
    )


def _kv_scale(t: torch.Tensor, name: str, numel: int | tuple[int, ...]) -> torch.Tensor:
    s = t.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    sizes = numel if isinstance(numel, tuple) else (numel,)
    if s.numel() not in sizes:
        want = " or ".join(f"[{n}]" for n in sizes)
        raise ValueError(f"{name} has {s.numel()} values; expected {want}")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{name} must be finite and > 0")
    return s


def c8_tensors(kv: KVScaleMap, channels: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """C8 tensors: ``<attn>.{k,v}_proj.kv_cache_scale`` fp32 ``[Hkv*D]`` and
    ``kv_cache_offset`` zeros of the same shape.

    ``channels[attn]`` is ``Hkv * D``. The offsets are zeros: the FIA decode path
    takes only the antiquant scale (attention_v1.py ``_forward_c8_decode``), so C8
    is symmetric. The offset dtype is int32, the dtype msModelSlim's C8 IR declares
    for ``kv_cache_offset`` (msmodelslim 26.1.0 ir/attention.py
    ``FakeQuantDynamicCache``); vllm-ascend casts both to the model dtype on load.
    """
    out: dict[str, torch.Tensor] = {}
    for attn in sorted(kv):
        for side in KV_SIDES:
            name = c8_tensor_name(attn, side, "scale")
            if side not in kv[attn]:
                raise ValueError(f"{name}: missing")
            scale = _kv_scale(kv[attn][side], name, channels[attn])
            out[name] = scale
            out[c8_tensor_name(attn, side, "offset")] = torch.zeros(
                scale.shape, dtype=torch.int32
            )
    return out


def vllm_kv_tensors(
    kv: KVScaleMap, strategy: str, kv_heads: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """``<attn>.k_scale`` / ``<attn>.v_scale`` fp32: ``[1]`` for ``tensor``,
    ``[Hkv]`` for ``attn_head`` (vLLM ``CompressedTensorsKVCacheMethod.
    create_weights``: ``n_scales = num_kv_heads`` for attn_head, else 1)."""
    if strategy not in KV_STRATEGIES:
        raise InputError(
            f"kv cache strategy {strategy!r}; choose one of {', '.join(KV_STRATEGIES)}"
        )
    out: dict[str, torch.Tensor] = {}
    for attn in sorted(kv):
        n = 1 if strategy == "tensor" else kv_heads[attn]
        for side in KV_SIDES:
            name = vllm_kv_name(attn, side)
            if side not in kv[attn]:
                raise ValueError(f"{name}: missing")
            out[name] = _kv_scale(kv[attn][side], name, n)
    return out


def target_description(
    target: str | None,
    tensor_types: Mapping[str, str],
    *,
    model_quant_type: str,
    fa_scales: ScaleMap | None = None,
    fa_quant_type: str | None = None,
    c8: Mapping[str, torch.Tensor] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``quant_model_description.json`` of an Ascend-target artifact.

    ``tensor_types``: every checkpoint tensor -> its type (``"FLOAT"``,
    ``"W8A8"``, ...). FA tensors are typed ``"FAQuant"`` (both fa_quant_types, as
    msModelSlim writes them) with ``"<attn>.quant_type": "INT8"``; C8 tensors
    ``"C8"`` with ``kv_cache_type``/``kv_quant_type`` ``"C8"``. FA and C8 together
    are refused (msModelSlim never writes both).
    """
    if fa_scales and c8:
        raise ValueError(
            "FA and C8 KV-cache quantization cannot be written together "
            "(msModelSlim: 'KV-cache and FA cannot be quantized at the same time!')"
        )
    desc: dict[str, Any] = {
        "model_quant_type": model_quant_type,
        "version": DESCRIPTION_VERSION,
        "group_size": 0,
    }
    if fa_scales:
        if fa_quant_type not in FA_QUANT_TYPES:
            raise ValueError(
                f"fa_quant_type must be FAQuant or FAKQuant, got {fa_quant_type!r}"
            )
        desc["fa_quant_type"] = fa_quant_type
    if c8:
        desc["kv_cache_type"] = "C8"
        desc["kv_quant_type"] = "C8"
    meta = dict(metadata or {})
    if target is not None:
        meta[TARGET_METADATA_KEY] = target
    desc["metadata"] = meta
    desc.update(tensor_types)
    for attn in sorted(fa_scales or {}):
        desc[f"{attn}.quant_type"] = "INT8"
        for branch in FA_BRANCHES:
            for kind in ("scale", "offset"):
                desc[fa_tensor_name(attn, branch, kind)] = "FAQuant"
    desc.update(dict.fromkeys(c8 or {}, "C8"))
    return desc


def compressed_tensors_config(strategy: str) -> dict[str, Any]:
    """The ``quantization_config`` of a vLLM FP8 KV-cache artifact: no weight
    quantization (``config_groups`` empty, dense format) and a static symmetric
    FP8 ``kv_cache_scheme``."""
    if strategy not in KV_STRATEGIES:
        raise InputError(
            f"kv cache strategy {strategy!r}; choose one of {', '.join(KV_STRATEGIES)}"
        )
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": strategy,
            "symmetric": True,
            "dynamic": False,
        },
    }
