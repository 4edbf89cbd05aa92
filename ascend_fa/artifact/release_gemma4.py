"""vllm-ascend's verdict on Gemma 4 (text) artifacts, per release.

vllm-ascend up to 0.23.0.post1 has no ``gemma4`` entry in
``packed_modules_model_mapping`` (and 0.13.0 / 0.18.0 parse config.json with
transformers 4.57, which has no ``gemma4_text`` config). main maps Gemma 4
(``qkv_proj`` with K loaded into both the K and V shards on k_eq_v layers, per-layer
head_dim, experts), but ascend-fa writes no Gemma 4 linear or C8 plan judged by
that loader: every release refuses, and ``--target vllm`` (FP8 KV-cache scales,
loaded by the real vLLM 0.32) is the way to serve it quantized.
"""

from __future__ import annotations

from .release_types import MAIN as _MAIN
from .release_types import V023 as _V023
from .release_types import VLLM_ASCEND, Citation, Rule

__all__ = ["GEMMA4_RULES"]

_ALL = ("0.13.0", "0.18.0", "0.23.0.post1", "0.25.1rc1", "main")

GEMMA4_RULES: tuple[Rule, ...] = (
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
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/modelslim_config.py",
                _V023,
                "packed_modules_model_mapping",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/modelslim_config.py",
                _MAIN,
                "packed_modules_model_mapping",
            ),
        ),
        verb="cannot quantize",
    ),
)
