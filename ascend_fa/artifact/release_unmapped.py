"""vllm-ascend's verdict on the families it has no quantization of ours for:
Gemma 4 (text) and ERNIE-4.5-MoE, per release.

vllm-ascend up to 0.23.0.post1 has no ``gemma4`` entry in
``packed_modules_model_mapping`` (and 0.13.0 / 0.18.0 parse config.json with
transformers 4.57, which has no ``gemma4_text`` config). main maps Gemma 4
(``qkv_proj`` with K loaded into both the K and V shards on k_eq_v layers, per-layer
head_dim, experts), but ascend-fa writes no Gemma 4 linear or C8 plan judged by
that loader: every release refuses, and ``--target vllm`` (FP8 KV-cache scales,
loaded by the real vLLM 0.32) is the way to serve it quantized.

No release here (0.13.0 ``quant_config.py``, 0.18.0 / 0.23.0.post1 and main
``modelslim_config.py``) has an ``ernie4_5_moe`` entry in
``packed_modules_model_mapping``: vLLM's fused ``qkv_proj`` / ``gate_up_proj`` /
experts find no checkpoint names in the description.
"""

from __future__ import annotations

from .release_types import MAIN as _MAIN
from .release_types import V023 as _V023
from .release_types import VLLM_ASCEND, Citation, Rule

__all__ = ["UNMAPPED_RULES"]

_ALL = ("0.13.0", "0.18.0", "0.23.0.post1", "0.25.1rc1", "main")
#: Where each release's packed-module mapping is (what both rules cite).
_MAPPING = tuple(
    Citation(
        VLLM_ASCEND,
        "vllm_ascend/quantization/modelslim_config.py",
        ref,
        "packed_modules_model_mapping",
    )
    for ref in (_V023, _MAIN)
)

UNMAPPED_RULES: tuple[Rule, ...] = (
    Rule(
        "quant.gemma4-no-plan",
        "vllm-ascend",
        "*",
        _ALL,
        frozenset({"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"}),
        False,
        "no gemma4 quantization mapping up to 0.23.0.post1 (no "
        "packed_modules_model_mapping entry; 0.13.0 / 0.18.0 read config.json "
        "with transformers 4.57, which has no gemma4_text config); main's "
        "(qkv_proj with K loaded into both K and V on k_eq_v layers, per-layer "
        "head_dim) has no ascend-fa linear / C8 plan judged by its loader; use "
        "--target vllm (FP8 KV-cache scales)",
        _MAPPING,
        verb="cannot quantize",
    ),
    Rule(
        "quant.ernie-no-mapping",
        "vllm-ascend",
        "*",
        _ALL,
        frozenset({"Ernie4_5_MoeForCausalLM"}),
        False,
        "no quantization mapping for ernie4_5_moe (no "
        "packed_modules_model_mapping entry: vLLM's fused qkv_proj, gate_up_proj "
        "and experts find no checkpoint names in quant_model_description.json); "
        "use --target vllm (FP8 KV-cache scales)",
        _MAPPING,
        verb="cannot quantize",
    ),
)
