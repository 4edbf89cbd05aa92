"""Release rules of the DeepSeek Sparse Attention architectures
(``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``: MLA + a lightning indexer).

Neither Ascend consumer reads FA scales for them: vllm-ascend serves every
``use_sparse`` model with its SFA backend, which has no FAKQuant path, and MindIE
3.0.0 runs DeepSeek-V3.2 on its runtime's sparse attention without FA3 (it has no
glm_moe_dsa model: rule ``mindie.no-model`` of :mod:`.releases`). :mod:`.releases`
puts these rules first (each names its architectures, so the generic MLA rules
never see these models first).
"""

from __future__ import annotations

from .release_types import (
    MAIN,
    MINDIE,
    MINDIE300,
    VLLM_ASCEND,
    Citation,
    Rule,
)

__all__ = ["DSA_RULES"]

_LATER = ("0.25.1rc1", "main")
_VLLM_ASCEND_ALL = ("0.13.0", "0.18.0", "0.23.0.post1", *_LATER)
#: DeepSeek Sparse Attention architectures (MLA + a lightning indexer)
_DSA = frozenset({"DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"})
#: Ascend/MindIE-LLM 3.0.0: DeepSeek-V3.2's router and its model guide
_MINDIE_V32 = (
    Citation(
        MINDIE,
        "mindie_llm/runtime/models/deepseek_v32/router_deepseek_v32.py",
        MINDIE300,
        "DeepseekV32Router: the runtime DeepseekV3ForCausalLM with its SFA layer "
        "(the model guide docs/zh/user_guide/models/deepseek/deepseek_v3.2.md, "
        "table 2: W8A8 yes, KV-cache and FA3 quantization no)",
    ),
    Citation(
        MINDIE,
        "mindie_llm/runtime/layers/attention/sparse_attention_layer.py",
        MINDIE300,
        "SFA: key, value and index caches, no fa_* parameter",
    ),
    Citation(
        MINDIE,
        "mindie_llm/runtime/layers/quantization/ms_model_slim/quantization_config.py",
        MINDIE300,
        "reads model_quant_type / kv_quant_type, never fa_quant_type",
    ),
)

#: the rules, in the order :data:`.releases.RULES` starts with them
DSA_RULES: tuple[Rule, ...] = (
    Rule(
        "fakquant.sfa",
        "vllm-ascend",
        "FAKQuant",
        _VLLM_ASCEND_ALL,
        _DSA,
        False,
        "serves DeepSeek Sparse Attention models with its SFA backend, which has no "
        "FAKQuant path: the fa_* scales load into the MLA attention and are never "
        "read, the latent cache stays unquantized (its sparse C8 is a runtime "
        "switch, enable_sparse_c8 / enable_sparse_li_c8, that quantizes per token)",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/attention/sfa_v1.py",
                MAIN,
                "no fa_quant_layer (mla_v1.py's FAKQuant switch); same at "
                "v0.13.0 / v0.18.0 / v0.23.0 / v0.25.1rc1",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/platform.py",
                MAIN,
                "get_attn_backend_cls: (use_mla, use_sparse) -> AscendSFABackend",
            ),
        ),
        silent=True,
    ),
    Rule(
        "mindie.fakquant-dsa",
        "mindie",
        "FAKQuant",
        ("3.0.0",),
        _DSA,
        False,
        "runs DeepSeek-V3.2 on its runtime's sparse attention, which reads no fa_* "
        "tensor (FA3 quantization unsupported for it); it loads the quantized "
        "linears",
        _MINDIE_V32,
    ),
)
