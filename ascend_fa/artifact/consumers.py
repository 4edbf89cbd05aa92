"""Each consumer's acceptance rules, re-implemented as checks on an artifact.

:func:`target_findings` returns one line per violation: the tensor or key, the rule,
and the consumer (with the source the rule comes from; full citations in
:mod:`.targets`). ``ascend-fa inspect --target T`` and the tests use these checks.

These rules were read at one commit of each consumer: vllm-ascend main @182b75ea and
MindIE 3.0.0 @8b4871ad, the ``main`` and ``3.0.0`` rows of :mod:`.releases`. What an
older release cannot load (C8 for some architectures, FAKQuant in 0.13.x) is that
table's, applied beside these by ``inspect --consumer-version``.

==============  ==========================================================
consumer        rules checked here
==============  ==========================================================
all targets     ``config.json`` present with ``torch_dtype`` float16 /
                bfloat16 (MindIE ``model_runner.py``; vLLM loads the dtype
                from it); a transformers-4 reader takes the RoPE that
                ``rope_parameters`` states (top-level ``rope_theta`` /
                ``rope_scaling``: :func:`~.model_files.rope_findings`); every
                attention layer quantized
mindie          description present; ``model_quant_type.lower()`` in
                MindIE's ``QUANTIZE_DESC_REQUIRED_LIST`` (never ``float``);
                ``fa_quant_type`` FAQuant / FAKQuant (``config.py``
                ``__check_fa_quant_type``); no C8 with FA (msModelSlim);
                per family (:mod:`.mindie_models`): a MindIE model exists,
                FA only where it builds FA3, config.json ``quantize`` where
                the router reads no description, experts in the type they
                load under, the config keys its config class requires
mindie,         no ``quantization_config`` in ``config.json`` (vLLM
vllm-ascend     ``get_quant_config``; msModelSlim removes it); every linear
                weight described (vllm-ascend ``get_linear_quant_type``
                indexes ``quant_description[prefix + ".weight"]``); a tied
                ``lm_head.weight`` described
vllm-ascend     ``fa_quant_type`` only ``FAKQuant`` (the one registered FA
                attention scheme; none for DeepSeek Sparse Attention, whose
                SFA backend reads no FA scale); GQA int8 cache is C8 with
                ``kv_cache_type: "C8"``, scales ``[Hkv*D]``, offsets 0;
                FAKQuant needs quantized MLA linears with ``weight_scale``
vllm            compressed-tensors ``quantization_config`` with a
                ``kv_cache_scheme`` vLLM validates; ``k_scale``/``v_scale``
                fp32 ``[1]`` or ``[Hkv]``; no tensor vLLM's ``load_weights``
                has no parameter for (Ascend-only names)
==============  ==========================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ascend_fa.families import reads_fa

from .format import (
    ASCEND_TARGETS,
    C8_TENSOR,
    FA_QUANT_TYPES,
    FA_TENSOR,
    KV_STRATEGIES,
    LINEAR_QUANT_TYPES,
    MOE_QUANTIZE_KEY,
    VLLM_KV_TENSOR,
    is_meta_key,
    mixed_moe_linears,
)
from .mindie_findings import mindie_findings
from .mindie_models import mindie_model
from .model_files import rope_findings

__all__ = [
    "ArtifactView",
    "MINDIE_QUANTIZE",
    "attention_modules",
    "header_view",
    "recorded_target",
    "target_findings",
]

#: MindIE's accepted ``quantize`` values (Ascend/MindIE-LLM @8b4871ad
#: examples/atb_models/atb_llm/utils/quantize/quant_type.py
#: ``QUANTIZE_DESC_REQUIRED_LIST``); ``float`` is not among them.
MINDIE_QUANTIZE = (
    "w8a8",
    "w8a8s",
    "w8a8sc",
    "w8a16",
    "w4a16",
    "w8a8_dynamic",
    "w8a8_pdmix",
    "w4a8_dynamic",
    "w8a8_mix",
    "w16a16s",
    "w16a16sc",
)

_MINDIE = "MindIE atb_llm"
_ASCEND = "vllm-ascend"
_VLLM = "vLLM"
_MSMS = "msModelSlim"
#: Tensor suffixes only Ascend loaders have parameters for.
_ASCEND_ONLY = re.compile(
    r"\.(fa_[qkv]\.(scale|offset)|kv_cache_(scale|offset)|deq_scale|quant_bias|"
    r"input_offset|weight_offset)$"
)


@dataclass
class ArtifactView:
    """What the rules look at: parsed JSON and tensor headers (no tensor data)."""

    config: dict[str, Any] | None
    desc: dict[str, Any] | None
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    fa_layers: set[str] = field(default_factory=set)

    @property
    def mla(self) -> bool:
        cfg = self.config or {}
        return (
            bool(cfg.get("kv_lora_rank"))
            or (self.desc or {}).get("fa_quant_type") == "FAKQuant"
        )


def attention_modules(names: list[str]) -> list[str]:
    """Attention modules of a checkpoint: every ``X`` with an ``X.o_proj.weight``."""
    suffix = ".o_proj.weight"
    return sorted({n[: -len(suffix)] for n in names if n.endswith(suffix)})


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _decoder_stack(attns: list[str], config: Mapping[str, Any] | None) -> list[str]:
    """``attns`` less DeepSeek's MTP layers (``model.layers.<i>`` with ``i >=
    num_hidden_layers``, ``num_nextn_predict_layers`` of them), which the
    artifact carries float: vllm-ascend builds them only as the speculative
    draft (``mtp_block``), whose attention reads no FA scale before its 0.26
    branch (an ``mtp_block.self_attn.fa_k.offset`` there is a KeyError) and loads
    an all-FLOAT MTP layer unquantized (the real loader, 0.18.0 / 0.23.0.post1,
    speculative decoding on and off)."""
    layers = (config or {}).get("num_hidden_layers")
    if not isinstance(layers, int) or not (config or {}).get(
        "num_nextn_predict_layers"
    ):
        return attns
    return [
        a
        for a in attns
        if (m := _LAYER_INDEX.match(a + ".")) is None or int(m.group(1)) < layers
    ]


def _layers_with(names: list[str], pattern: re.Pattern[str]) -> set[str]:
    return {m["attn"] for n in names if (m := pattern.match(n))}


def _common(target: str, v: ArtifactView, out: list[str]) -> None:
    cfg = v.config
    if cfg is None:
        out.append(f"config.json: missing (every {target} loader reads it)")
        return
    out.extend(rope_findings(cfg))
    dt = cfg.get("torch_dtype")
    if dt is None:
        out.append(
            "config.json: torch_dtype missing (MindIE model_runner and vLLM take the "
            "weights' dtype from it)"
        )
    elif target != "vllm" and dt not in ("float16", "bfloat16"):
        out.append(
            f"config.json: torch_dtype {dt!r}; MindIE loads only float16 or bfloat16 "
            f"({_MINDIE} runner/model_runner.py)" + _research_hint(dt)
        )
    elif dt == "float32":
        # vLLM itself loads float32 weights; a float32 artifact of ours is still a
        # research artifact (calibrate --dtype fp32): the FP8 KV scales and the
        # folded weights were meant for a bf16/fp16 deployment of the same model.
        out.append(
            "config.json: torch_dtype 'float32'" + _research_hint(dt) + "; "
            "deploy an artifact written with --dtype bf16 or fp16"
        )


def _research_hint(dt: object) -> str:
    return (
        " (a research artifact: calibrate --dtype fp32 keeps float32 weights for "
        "exact evaluation)"
        if dt == "float32"
        else ""
    )


def _ascend(target: str, v: ArtifactView, names: list[str], out: list[str]) -> None:
    consumer = _MINDIE if target == "mindie" else _ASCEND
    cfg = v.config or {}
    if "quantization_config" in cfg:
        out.append(
            "config.json: quantization_config present; vLLM's get_quant_config takes "
            f"it as the whole description so {_ASCEND} never reads "
            f"quant_model_description.json ({_MSMS} removes it)"
        )
    desc = v.desc
    if desc is None:
        out.append(f"quant_model_description.json: missing ({consumer})")
        return
    described = {k for k, val in desc.items() if not is_meta_key(k, val)}
    for n in names:
        if n.endswith(".weight") and n not in described:
            out.append(
                f"{n}: no description entry ({_ASCEND} get_linear_quant_type looks "
                "up quant_description[prefix + '.weight'])"
            )
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in desc:
        out.append(
            "lm_head.weight: tied lm_head not described (msModelSlim writes and "
            f"describes it; {_ASCEND} resolves the head's quant type from it)"
        )
    if desc.get("fa_quant_type") and desc.get("kv_cache_type"):
        out.append(
            "fa_quant_type + kv_cache_type: FA and KV-cache quantization together "
            f"({_MSMS}: 'KV-cache and FA cannot be quantized at the same time!')"
        )
    fa = desc.get("fa_quant_type")
    if fa is not None and fa not in FA_QUANT_TYPES:
        out.append(
            f"fa_quant_type: {fa!r}; MindIE accepts only FAQuant/FAKQuant "
            f"({_MINDIE} models/base/config.py __check_fa_quant_type)"
        )


def _reads_fa(target: str, v: ArtifactView) -> bool:
    """Whether ``target`` reads FA scales for this model (not for DeepSeek Sparse
    Attention: :func:`ascend_fa.families.reads_fa`, rules in :mod:`.releases`)."""
    return reads_fa((v.config or {}).get("model_type"), target)


def _linears(v: ArtifactView, attn: str) -> list[str]:
    """The MLA projections whose ``weight_scale`` the FAKQuant path reads:
    ``q_proj`` (``q_b_proj`` with a q LoRA) and ``fused_qkv_a_proj`` (``q_a_proj``
    + ``kv_a_proj_with_mqa``; ``kv_a_proj_with_mqa`` alone without a q LoRA)."""
    if f"{attn}.q_a_proj.weight" in v.shapes:
        return [f"{attn}.q_b_proj", f"{attn}.q_a_proj", f"{attn}.kv_a_proj_with_mqa"]
    return [f"{attn}.q_proj", f"{attn}.kv_a_proj_with_mqa"]


def _mindie(v: ArtifactView, attns: list[str], out: list[str]) -> None:
    desc = v.desc or {}
    # per family: MindIE's model, its FA3, its quantize source and expert types
    out.extend(mindie_findings(v.config, v.desc))
    mqt = desc.get("model_quant_type")
    if not isinstance(mqt, str) or mqt.lower() not in MINDIE_QUANTIZE:
        out.append(
            f"model_quant_type: {mqt!r}; MindIE sets quantize = "
            "model_quant_type.lower() and accepts only quantized types, not 'float' "
            f"({_MINDIE} models/base/router.py, config.py __check_quantize)"
        )
    mixed = mixed_moe_linears({k: v for k, v in desc.items() if isinstance(v, str)})
    m = mindie_model((v.config or {}).get("model_type"))
    if m is not None and m.attn is not None:
        mixed = False  # its own attention quantize: mindie_findings judges it
    if mixed and (v.config or {}).get(MOE_QUANTIZE_KEY) != "w8a8_dynamic":
        out.append(
            f"config.json: {MOE_QUANTIZE_KEY} is not 'w8a8_dynamic' while the MoE "
            "experts are W8A8_DYNAMIC next to W8A8 (model_quant_type W8A8): MindIE "
            "would run them with the static W8A8 kernels "
            f"({_MINDIE} models/deepseekv2/flash_causal_deepseekv2.py, "
            "models/mixtral/modeling_mixtral.py)"
        )
    if desc.get("fa_quant_type") is None and not _reads_fa("mindie", v):
        return  # DeepSeek Sparse Attention: the quantized linears only
    if desc.get("fa_quant_type") not in FA_QUANT_TYPES:
        out.append(
            "fa_quant_type: missing; a mindie artifact carries FAQuant/FAKQuant "
            "attention scales"
        )
        return
    for attn in attns:
        if attn not in v.fa_layers:
            out.append(
                f"{attn}: a layer with no FA scale (MindIE builds FA3 for every "
                f"layer once fa_quant_type is set: {_MINDIE} models/base/modeling.py)"
            )


def _vllm_ascend(v: ArtifactView, attns: list[str], out: list[str]) -> None:
    desc = v.desc or {}
    fa = desc.get("fa_quant_type")
    if fa is not None and fa != "FAKQuant":
        out.append(
            f"fa_quant_type: {fa!r}; {_ASCEND} registers only FAKQuant as an FA "
            "attention scheme (quantization/methods/kv_c8.py register_scheme); use "
            "C8 for GQA"
        )
    if v.mla and fa is None and not _reads_fa("vllm-ascend", v):
        # DeepSeek Sparse Attention: its SFA backend keeps the latent cache as it
        # runs it; the artifact carries the quantized linears only
        if desc.get("model_quant_type") not in LINEAR_QUANT_TYPES:
            out.append(
                f"model_quant_type: {desc.get('model_quant_type')!r}; a sparse-"
                "attention artifact without attention scales needs quantized linears"
            )
        return
    if v.mla:
        if fa != "FAKQuant":
            out.append(
                "fa_quant_type: an MLA model needs FAKQuant for vllm-ascend's int8 "
                "latent cache"
            )
        mqt = desc.get("model_quant_type")
        if mqt not in LINEAR_QUANT_TYPES:
            out.append(
                f"model_quant_type: {mqt!r}; FAKQuant reads the quantized MLA "
                f"linears' weight_scale ({_ASCEND} attention/mla_v1.py)"
            )
        for attn in _decoder_stack(attns, v.config):
            if attn not in v.fa_layers:
                out.append(f"{attn}: a layer with no FA scale ({_ASCEND} FAKQuant)")
            for lin in _linears(v, attn):
                if f"{lin}.weight_scale" not in v.shapes:
                    out.append(
                        f"{lin}.weight_scale: missing; the FAKQuant path reads it "
                        f"({_ASCEND} attention/mla_v1.py "
                        "_process_weights_for_fused_fa_quant)"
                    )
        return
    if desc.get("kv_cache_type") != "C8":
        out.append(
            f"kv_cache_type: {desc.get('kv_cache_type')!r}; vllm-ascend's int8 cache "
            "for dense attention is C8 (modelslim_config.py "
            "_add_kvcache_quant_metadata)"
        )
    cfg = v.config or {}
    heads = cfg.get("num_attention_heads")
    channels = None
    if isinstance(heads, int) and heads and isinstance(cfg.get("hidden_size"), int):
        kv = int(cfg.get("num_key_value_heads") or heads)
        channels = kv * int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    c8 = _layers_with(list(v.shapes), C8_TENSOR)
    for attn in attns:
        if attn not in c8:
            out.append(f"{attn}: a layer with no C8 scale ({_ASCEND} C8)")
            continue
        for side in ("k", "v"):
            for kind in ("scale", "offset"):
                name = f"{attn}.{side}_proj.kv_cache_{kind}"
                shape = v.shapes.get(name)
                if shape is None:
                    out.append(f"{name}: missing ({_ASCEND} C8)")
                    continue
                numel = 1
                for d in shape:
                    numel *= d
                if channels is not None and numel not in (channels, 1):
                    out.append(
                        f"{name}: {numel} values; C8 is per channel [Hkv*D] = "
                        f"[{channels}] ({_ASCEND} attention_v1.py "
                        "_prepare_c8_scales)"
                    )
                if (desc.get(name)) != "C8":
                    out.append(f"{name}: description type {desc.get(name)!r}, not 'C8'")


def _vllm(v: ArtifactView, attns: list[str], out: list[str]) -> None:
    qc = (v.config or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        out.append(
            "config.json: quantization_config.quant_method must be "
            "'compressed-tensors' (vLLM reads the KV scheme from it)"
        )
        return
    kvs = qc.get("kv_cache_scheme")
    if not isinstance(kvs, dict):
        out.append("config.json: quantization_config.kv_cache_scheme missing")
        return
    strategy = kvs.get("strategy")
    rules = [
        (kvs.get("num_bits") == 8 and kvs.get("type") == "float", "num_bits 8, float"),
        (strategy in KV_STRATEGIES, "strategy tensor or attn_head"),
        (kvs.get("symmetric") is True, "symmetric true"),
        (kvs.get("dynamic") is False, "dynamic false (static scales)"),
    ]
    for ok, rule in rules:
        if not ok:
            out.append(
                f"config.json: kv_cache_scheme needs {rule} ({_VLLM} "
                "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme)"
            )
    cfg = v.config or {}
    kv_heads = int(
        cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 0
    )
    n = 1 if strategy == "tensor" else kv_heads
    have = _layers_with(list(v.shapes), VLLM_KV_TENSOR)
    for attn in attns:
        if attn not in have:
            out.append(f"{attn}: a layer with no k_scale/v_scale ({_VLLM})")
            continue
        for side in ("k", "v"):
            name = f"{attn}.{side}_scale"
            shape = v.shapes.get(name)
            if shape is None:
                out.append(f"{name}: missing ({_VLLM})")
            elif shape != [n]:
                out.append(
                    f"{name}: shape {shape}; {_VLLM} creates [{n}] for strategy "
                    f"{strategy!r} (create_weights)"
                )
            elif v.dtypes.get(name) != "F32":
                out.append(f"{name}: dtype {v.dtypes.get(name)}; vLLM's is float32")
    for name in v.shapes:
        if _ASCEND_ONLY.search(name):
            out.append(
                f"{name}: vLLM has no parameter for this Ascend-only tensor and "
                "refuses it (models/llama.py load_weights: params_dict[name])"
            )
        elif name.endswith(".weight") and v.dtypes.get(name) in ("I8", "I32", "I64"):
            out.append(f"{name}: integer weight in a dense compressed-tensors artifact")


_TARGET_RULES: dict[str, Callable[[ArtifactView, list[str], list[str]], None]] = {
    "mindie": _mindie,
    "vllm-ascend": _vllm_ascend,
    "vllm": _vllm,
}


def target_findings(target: str, view: ArtifactView) -> list[str]:
    """Every rule of ``target`` that ``view`` breaks, one line each."""
    out: list[str] = []
    names = list(view.shapes)
    attns = attention_modules(names)
    _common(target, view, out)
    if target in ASCEND_TARGETS:
        _ascend(target, view, names, out)
    _TARGET_RULES[target](view, attns, out)
    return out


def recorded_target(
    desc: Mapping[str, Any] | None, config: Mapping[str, Any] | None
) -> str | None:
    """The target an artifact says it was written for: the description's
    ``metadata.ascend_fa_target``, else ``vllm`` for a compressed-tensors config,
    else ``vllm-ascend`` for a C8 description; None when nothing says."""
    from .format import TARGET_METADATA_KEY, TARGETS

    meta = (desc or {}).get("metadata")
    if isinstance(meta, dict) and meta.get(TARGET_METADATA_KEY) in TARGETS:
        return str(meta[TARGET_METADATA_KEY])
    qc = (config or {}).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return "vllm"
    if (desc or {}).get("kv_cache_type") == "C8":
        return "vllm-ascend"
    return None


def header_view(
    where: Mapping[str, Path],
    config: dict[str, Any] | None,
    desc: dict[str, Any] | None,
) -> ArtifactView:
    """An :class:`ArtifactView` from safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in where.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                sl = f.get_slice(name)
                shapes[name] = list(sl.get_shape())
                dtypes[name] = str(sl.get_dtype())
    fa = {m["attn"] for n in shapes if (m := FA_TENSOR.match(n))}
    return ArtifactView(config, desc, shapes, dtypes, fa)
