"""The artifact format, defined once: file names, tensor names, shapes, description.

Both the writer (:mod:`.writer`) and the validator (:mod:`.inspect`) — and every
reader of scales (evaluation, emulation, the processor's ``load_scales``) — take
their rules from here.

Files of an artifact directory::

    config.json                          the model config (loaders read it)
    quant_model_description.json         tensor name -> type, plus top-level keys
    quant_model_weights.safetensors      or -0000i-of-0000N shards + .index.json
    calibration_report.json              when a report is given
    calibration_recipe.yaml              the resolved recipe (``calibrate``)
    tokenizer files                      copied from the source

FA tensors per attention module ``<attn>`` (e.g. ``model.layers.0.self_attn``):

==========================  =======  ===========================================
name                        dtype    shape on disk
==========================  =======  ===========================================
``<attn>.fa_q.scale``       float32  ``[H, 1]`` query heads (MLA: ``[num_heads, 1]``)
``<attn>.fa_k.scale``       float32  ``[Hkv, 1]`` (MLA: ``[1, 1]``)
``<attn>.fa_v.scale``       float32  ``[Hkv, 1]`` (MLA: ``[1, 1]``)
``<attn>.fa_{q,k,v}.offset``  int8   zeros, same shape as the scale
==========================  =======  ===========================================

The shape rule: one value per head on dim 0, so tensor parallelism splits dim 0;
the file holds ``[H, 1]`` and a loader may expand it to ``[H, head_dim]`` (seed
004's table shows the loaded parameter). Readers accept ``[H]``, ``[H, 1]`` and
``[H, head_dim]`` with constant rows (:func:`per_head_vector`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "MOE_QUANTIZE_KEY",
    "mixed_moe_linears",
    "TARGETS",
    "DEFAULT_TARGET",
    "ASCEND_TARGETS",
    "ARTIFACT_DTYPES",
    "RESEARCH_DTYPES",
    "RESEARCH_METADATA_KEY",
    "KV_STRATEGIES",
    "KV_SIDES",
    "C8_TENSOR",
    "VLLM_KV_TENSOR",
    "LINEAR_QUANT_TYPES",
    "TARGET_METADATA_KEY",
    "c8_tensor_name",
    "vllm_kv_name",
    "dtype_name",
    "FA_BRANCHES",
    "FA_KINDS",
    "FA_QUANT_TYPES",
    "DESCRIPTION_FILE",
    "DESCRIPTION_VERSION",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "FA_WEIGHTS_NAME",
    "LEGACY_WEIGHTS_NAME",
    "REPORT_FILE",
    "RECIPE_FILE",
    "CONFIG_FILE",
    "TOKENIZER_FILES",
    "META_KEYS",
    "DESCRIPTION_OBJECT_KEYS",
    "MSMODELSLIM_TENSOR_TYPES",
    "description_problem",
    "is_msmodelslim_type",
    "FA_TENSOR",
    "ScaleMap",
    "fa_tensor_name",
    "is_meta_key",
    "per_head_vector",
    "disk_scale",
]

#: Submodule names of the three FA points (and the middle part of their tensor
#: names), in order: Q per query head, K and V per KV head.
FA_BRANCHES = ("fa_q", "fa_k", "fa_v")
#: The two tensors of each point.
FA_KINDS = ("scale", "offset")
#: ``fa_quant_type`` values: per-head GQA/MHA, and MLA (absorbed query + latent).
FA_QUANT_TYPES = ("FAQuant", "FAKQuant")

#: attention module name -> {"fa_q": (scale [H] fp32, offset [H] int8), ...}
ScaleMap = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]

DESCRIPTION_FILE = "quant_model_description.json"
#: Version of the description layout written here (msModelSlim-style).
DESCRIPTION_VERSION = "1.0.0"
WEIGHTS_NAME = "quant_model_weights.safetensors"
WEIGHTS_INDEX_NAME = "quant_model_weights.safetensors.index.json"
#: File that ``merge_into`` adds beside an export's weights (they stay untouched).
FA_WEIGHTS_NAME = "quant_model_weights_fa.safetensors"
#: Weights file name of older msModelSlim W8A8 exports (seed 003).
LEGACY_WEIGHTS_NAME = "quant_model_weight_w8a8.safetensors"
REPORT_FILE = "calibration_report.json"
#: The resolved recipe of the ``calibrate`` run that wrote the artifact (YAML; no
#: consumer reads it, and a source's ``.yaml`` files are never copied).
RECIPE_FILE = "calibration_recipe.yaml"
CONFIG_FILE = "config.json"
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

#: Top-level description keys that are not tensor names.
META_KEYS = frozenset(
    {
        "model_quant_type",
        "fa_quant_type",
        "version",
        "kv_quant_type",
        "kv_cache_type",
        "reduce_quant_type",
        "group_size",
        "metadata",
        "optional",
        "model_type",
        "quant_method",
    }
)
#: The JSON kind of the top-level description keys whose value is not a string:
#: msModelSlim's saver always writes ``"metadata": {...}``, ``"group_size": 0`` and
#: ``"optional": {...}`` (msmodelslim 26.1.0
#: core/quant_service/modelslim_v1/save/ascendv1.py ``AscendV1Saver.post_run``).
#: Every other key (the other :data:`META_KEYS`, ``<attn>.quant_type``, tensor
#: names) maps to a string.
DESCRIPTION_OBJECT_KEYS = {
    "metadata": "object",
    "optional": "object",
    "group_size": "integer",
}
#: Tensor types msModelSlim's saver writes (msmodelslim 26.1.0 save/ascendv1.py,
#: the ``write_tensor`` calls of ``AscendV1Saver``), plus the FlatQuant and SVD
#: variants its wrappers derive from them (``on_flat_clip_wrapper``:
#: ``X_DYNAMIC`` -> ``X_FLATQUANT_DYNAMIC``, else ``X_FLATQUANT``;
#: ``on_svd_wrapper``: ``_SVD_DYNAMIC`` / ``_SVD``).
MSMODELSLIM_TENSOR_TYPES = frozenset(
    {
        "FLOAT",
        "W8A8",
        "W8A8_DYNAMIC",
        "W8A8_MIX",
        "W8A16",
        "W16A16S",
        "WFP8AFP8_DYNAMIC",
        "W8A8_MXFP8",
        "W4A8_MXFP",
        "W4A8_DYNAMIC",
        "W4A4_DYNAMIC",
        "W4A4_MXFP4",
        "W4A4_MXFP4_DUALSCALE",
        "C8",
        "FAQuant",
    }
)
_DERIVED_TYPE = re.compile(r"^(?P<base>\w+?)_(?:FLATQUANT|SVD)(?P<dyn>_DYNAMIC)?$")

#: Consumers an artifact can be written for (``calibrate --target``).
TARGETS = ("mindie", "vllm-ascend", "vllm")
DEFAULT_TARGET = "mindie"
#: Targets that read the msModelSlim layout (description + Ascend tensor names).
ASCEND_TARGETS = ("mindie", "vllm-ascend")
#: ``--dtype`` -> the floating dtype of the weights (config.json ``torch_dtype``).
#: MindIE accepts only these two (Ascend/MindIE-LLM
#: examples/atb_models/atb_llm/runner/model_runner.py @8b4871ad: "`torch_dtype` is
#: only supported for type `float16` and `bfloat16`").
ARTIFACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: ``--dtype`` values for research artifacts: float32 weights evaluate folded
#: transforms and scales without a rounding of the weights, but no Ascend consumer
#: loads them (the rule above), so ``inspect --target`` reports them as not
#: deployable (the description's ``metadata`` records the dtype as research).
RESEARCH_DTYPES = {"fp32": torch.float32}
#: Key of the description's ``metadata`` dict that marks a research artifact.
RESEARCH_METADATA_KEY = "ascend_fa_research_dtype"
#: Quantized-linear types the description may carry (msModelSlim's names).
LINEAR_QUANT_TYPES = ("W8A8", "W8A8_DYNAMIC")
#: compressed-tensors ``kv_cache_scheme.strategy`` values vLLM accepts
#: (vllm-project/vllm vllm/model_executor/layers/quantization/compressed_tensors/
#: compressed_tensors.py, ``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``:
#: ``supported_strategies = ("tensor", "attn_head")``).
KV_STRATEGIES = ("tensor", "attn_head")
#: The two cache sides of a KV scale map.
KV_SIDES = ("k", "v")
#: Key of the description's ``metadata`` dict that records the target written.
TARGET_METADATA_KEY = "ascend_fa_target"

#: ``<attn>.{k,v}_proj.kv_cache_{scale,offset}``: C8 tensors (msmodelslim 26.1.0
#: core/quant_service/modelslim_v1/save/ascendv1.py ``on_dynamic_cache``;
#: vllm-ascend vllm_ascend/quantization/modelslim_config.py @182b75ea
#: ``get_cache_scale_mapper`` maps them to ``<attn>.attn.{k,v}_cache_{scale,offset}``).
C8_TENSOR = re.compile(
    r"^(?P<attn>.+)\.(?P<side>[kv])_proj\.kv_cache_(?P<kind>scale|offset)$"
)
#: ``<attn>.{q,k,v}_scale``: vLLM KV-cache scales (vllm-project/vllm
#: model_loader/weight_utils.py ``maybe_remap_kv_scale_name``: ``.k_scale`` ->
#: ``.attn.k_scale``).
VLLM_KV_TENSOR = re.compile(r"^(?P<attn>.+)\.(?P<side>[qkv])_scale$")


def c8_tensor_name(attn: str, side: str, kind: str) -> str:
    """``<attn>.k_proj.kv_cache_scale`` and friends (``side`` k/v, ``kind``
    scale/offset)."""
    if side not in KV_SIDES or kind not in FA_KINDS:
        raise ValueError(f"c8_tensor_name: no C8 tensor {side}.{kind}")
    return f"{attn}.{side}_proj.kv_cache_{kind}"


def vllm_kv_name(attn: str, side: str) -> str:
    """``<attn>.k_scale`` / ``<attn>.v_scale`` / ``<attn>.q_scale``."""
    if side not in ("q", *KV_SIDES):
        raise ValueError(f"vllm_kv_name: no vLLM scale {side!r}")
    return f"{attn}.{side}_scale"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (config.json's spelling)."""
    return str(dtype).removeprefix("torch.")


#: ``<attn>.<branch>.<kind>``: the name of an FA tensor.
FA_TENSOR = re.compile(r"^(?P<attn>.+)\.(?P<branch>fa_[qkv])\.(?P<kind>scale|offset)$")


def fa_tensor_name(attn: str, branch: str, kind: str) -> str:
    """``<attn>.<branch>.<kind>``, e.g. ``model.layers.0.self_attn.fa_q.scale``."""
    if branch not in FA_BRANCHES or kind not in FA_KINDS:
        raise ValueError(f"fa_tensor_name: no FA tensor {branch}.{kind}")
    return f"{attn}.{branch}.{kind}"


def is_meta_key(key: str, value: Any) -> bool:
    """Whether a description entry is metadata rather than a tensor's type."""
    return key in META_KEYS or key.endswith(".quant_type") or not isinstance(value, str)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    names = {dict: "object", list: "list", str: "string"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def description_problem(desc: Any) -> str | None:
    """Why ``desc`` is not a valid ``quant_model_description.json`` (None when it
    is): a JSON object whose keys of :data:`DESCRIPTION_OBJECT_KEYS` have that JSON
    kind (``group_size`` a non-negative integer) and every other value is a string.
    """
    if not isinstance(desc, dict):
        return f"must be a JSON object, got a JSON {_json_kind(desc)}"
    for key, value in desc.items():
        want = DESCRIPTION_OBJECT_KEYS.get(key, "string")
        have = _json_kind(value)
        if have != want:
            return f"{key!r} maps to a JSON {have}, expected a JSON {want}"
        if key == "group_size" and value < 0:
            return f"'group_size' is {value}, expected >= 0"
    return None


def is_msmodelslim_type(value: str) -> bool:
    """Whether ``value`` is a tensor type msModelSlim's saver writes
    (:data:`MSMODELSLIM_TENSOR_TYPES` or a FlatQuant / SVD variant of one)."""
    if value in MSMODELSLIM_TENSOR_TYPES:
        return True
    m = _DERIVED_TYPE.match(value)
    return bool(m) and (m["base"] + (m["dyn"] or "")) in MSMODELSLIM_TENSOR_TYPES


def per_head_vector(t: Any, name: str, heads: int | None = None) -> torch.Tensor:
    """``[H]``, ``[H, 1]`` or ``[H, head_dim]`` with constant rows -> ``[H]``.

    ``name`` (the tensor's name) leads every error; ``heads``, when given, must
    match ``H``.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() == 2:
        if t.shape[1] == 0 or not bool((t == t[:, :1]).all()):
            raise ValueError(
                f"{name} {tuple(t.shape)} varies along head_dim; expected one value "
                "per head ([H, 1] or [H, head_dim] with equal columns)"
            )
        t = t[:, 0]
    if t.dim() != 1 or (heads is not None and t.shape[0] != heads):
        want = "H" if heads is None else str(heads)
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [{want}], [{want}, 1] or "
            f"[{want}, head_dim]"
        )
    return t


def disk_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A per-head scale in its on-disk form: fp32 ``[H, 1]`` contiguous, finite and
    > 0 (``ValueError`` naming the tensor otherwise)."""
    s = per_head_vector(scale.detach(), name).to("cpu", torch.float32)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{name} must be finite and > 0")
    return s.reshape(-1, 1).contiguous()


#: The config.json key by which MindIE quantizes the MoE experts unlike the rest
#: (``quantize``, from ``model_quant_type``): Ascend/MindIE-LLM @8b4871a
#: ``examples/atb_models/atb_llm/models/deepseekv2/flash_causal_deepseekv2.py``
#: (``self.moe_quantize = getattr(config, "moe_quantize", self.quantize)``, the
#: experts' kernels), ``models/mixtral/modeling_mixtral.py`` and
#: ``models/glm4_moe/modeling_glm4_moe.py`` (``config.quantize =
#: config.moe_quantize`` while the experts' pack type is computed).
MOE_QUANTIZE_KEY = "moe_quantize"


def mixed_moe_linears(types: Mapping[str, str]) -> bool:
    """Whether static W8A8 linears sit next to W8A8_DYNAMIC MoE experts (routed
    or shared): ``model_quant_type`` is then ``W8A8`` and MindIE needs
    :data:`MOE_QUANTIZE_KEY` to run the experts per token."""
    values = set(types.values())
    return "W8A8" in values and any(
        t == "W8A8_DYNAMIC" and "expert" in n for n, t in types.items()
    )
