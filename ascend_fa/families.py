"""Model families as data: every supported ``config.model_type`` declared once.

A family names its attention kind; the kind says what the code paths read for
it — where Q/K/V are observed (the adapter), the FA quantization the artifact
records, the RoPE layout, the linear plan (smoothing groups, expert layout), and
which optional paths apply (the residual rotation, the paged emulation, KV-cache
targets, carried checkpoint layers past the decoder stack). The adapters
(:mod:`ascend_fa.adapters`), the linear plans (:mod:`ascend_fa.linear.plan`), the
transforms, the emulation and ``calibrate`` read this registry; a new family whose
structure matches an existing kind is one more entry in :data:`FAMILIES`.

=============  ======  ===============================================
model_type     kind    notes
=============  ======  ===============================================
``llama``      gqa     q/k/v_proj, rotate-half RoPE over the head
``qwen2``      gqa     as llama, q/k/v biases
``qwen3``      gqa     as llama, per-head q_norm / k_norm before RoPE
``mistral``    gqa     as llama
``deepseek_v3``  mla   absorbed MLA latent, decoupled RoPE; MoE; MTP layer
``qwen3_moe``  gqa     as qwen3; MoE (routed experts only)
``qwen2_moe``  gqa     as qwen2; MoE, one shared expert behind a sigmoid gate
``glm4_moe``   gqa     partial RoPE; first dense layers, then MoE with
                       shared experts
``mixtral``    gqa     as mistral; MoE, checkpoint experts ``w1/w3/w2``
                       under ``block_sparse_moe``
``minimax_m2`` gqa     partial RoPE, full-width q_norm / k_norm; MoE as
                       mixtral
``qwen3_next``  gqa_   Gated DeltaNet ``linear_attention`` layers and
               hybrid  gated ``full_attention`` layers (q_proj also gives
                       a per-channel output gate; q_norm / k_norm;
                       partial RoPE); MoE with a gated shared expert
``deepseek_v32`` mla   as deepseek_v3, plus a DSA indexer (kept float)
``glm_moe_dsa``  mla   as deepseek_v32; "shared" layers reuse the top-k
``gemma3_text``  gqa   as qwen3; sliding / full layers (``layer_types``);
                       norms scale by ``1 + weight``; sandwich norms
``qwen3_5``    gqa_    as qwen3_next (dense MLP); Gated DeltaNet
               hybrid  projections ``in_proj_qkv`` / ``in_proj_z`` /
                       ``in_proj_b`` / ``in_proj_a``; released as the
                       multimodal wrapper (:data:`WRAPPERS`)
``qwen3_5_moe`` gqa_   as qwen3_5; MoE as qwen3_next
               hybrid
``gpt_oss``    gqa     sliding / full layers, per-head attention sinks;
                       MoE (fused, biased experts); vLLM target only
``llama4_text`` gqa    chunked / full layers, NoPE layers, interleaved
                       (complex) RoPE; MoE; vLLM target only
``kimi_k2``    mla     deepseek_v3 under its own model_type (Kimi-K2's
                       config.json); built through transformers'
                       DeepSeek-V3 classes (:data:`BUILT_AS`)
``gemma4_text`` gqa    sliding / full layers with their own head_dim and
                       KV heads; k_eq_v full layers (no ``v_proj``);
                       unit softmax scale; vLLM target only
``ernie4_5_moe`` gqa   interleaved RoPE; MoE (routed + shared experts,
                       ``moe_statics``); vLLM target only
=============  ======  ===============================================

A multimodal wrapper (:class:`Wrapper`, :data:`WRAPPERS`) is calibrated through
its language model (transformers' ``AutoModelForCausalLM`` builds the text model
from the wrapper's checkpoint); the artifact keeps the checkpoint's own names
and its vision tower, float and byte for byte.

A family transformers has no class of its own for is built through the classes
of the one :data:`BUILT_AS` names: the checkpoint's ``config.json`` (and so the
artifact's) keeps its own ``model_type``, which the consumers' mappings key on;
in memory the model is the other family's (its adapter, linear plan and weight
conversions).

The MoE families also have a :class:`MoeLayout` in :data:`MOE_LAYOUTS`: where the
routed experts (transformers 5's fused ``experts.gate_up_proj`` / ``down_proj``
parameters), the shared expert(s) and the shared-expert gate sit in a decoder
layer, and the per-expert checkpoint names the consumers load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "FAMILIES",
    "GEMMA3",
    "GQA",
    "GQA_MOE",
    "GQA_HYBRID",
    "MLA",
    "MLA_DSA",
    "AttentionKind",
    "attention_kind",
    "is_mla",
    "MOE_LAYOUTS",
    "MoeLayout",
    "moe_layout",
    "QWEN3_5",
    "VLLM_ONLY",
    "GEMMA4",
    "ERNIE4_5_MOE",
    "WRAPPERS",
    "Wrapper",
    "wrapper",
    "BUILT_AS",
    "built_as",
    "NOT_CALIBRATED",
    "family_refusal",
    "reads_fa",
    "model_types",
    "norm_offset",
]


@dataclass(frozen=True)
class AttentionKind:
    """What one attention structure contributes to each code path.

    ``adapter``: the adapter class name in :mod:`ascend_fa.adapters`;
    ``fa_quant_type``: the description's FA quantization; ``observed``: where the
    FA points sit; ``rope``: the RoPE layout the transforms must respect;
    ``linear_plan``: the plan builder of :mod:`ascend_fa.linear.plan` (its
    smoothing groups and expert layout); ``residual_rotation``,
    ``paged_emulation``, ``kv_cache_targets`` (C8 / FP8 KV-cache scales instead of
    FA scales on vllm-ascend / vllm) and ``carried_layers`` (checkpoint layers
    past ``num_hidden_layers`` copied into the artifact) say which paths apply.
    ``norm_offset``: the RMSNorms multiply by ``norm_offset + weight`` (Gemma: 1),
    so a factor ``f`` folds into a norm as ``(offset + w) * f - offset``.
    """

    name: str
    adapter: str
    fa_quant_type: str
    observed: str
    rope: str
    linear_plan: str
    residual_rotation: bool
    paged_emulation: bool
    kv_cache_targets: bool
    carried_layers: bool
    #: the Ascend targets whose consumer reads this kind's FA scales (the others
    #: get the quantized linears only)
    fa_targets: tuple[str, ...] = ("mindie", "vllm-ascend")
    norm_offset: float = 0.0


GQA = AttentionKind(
    name="gqa",
    adapter="GQAAdapter",
    fa_quant_type="FAQuant",
    observed="Q after RoPE [B, H, S, D]; K, V after the cache update, before "
    "repeat_kv [B, Hkv, T, D] (the registered attention function)",
    rope="rotate-half pairs (i, i + D/2) over the whole head",
    linear_plan="gqa",
    residual_rotation=True,
    paged_emulation=True,
    kv_cache_targets=True,
    carried_layers=False,
)

#: GQA attention with a MoE MLP: as :data:`GQA`, without the residual rotation
#: (it rotates dense ``gate/up/down_proj`` only, not fused experts and routers).
#: MindIE 3.0.0's MoE models build no FA3 (Ascend/MindIE-LLM @8b4871ad: no
#: ``enableFA3`` in ``atb_llm/models/{qwen2_moe,glm4_moe,mixtral}``, qwen3_moe
#: routes to qwen2_moe; MiniMax-M2 has no model; the table with its citations is
#: :mod:`ascend_fa.artifact.mindie_models`): ``--target mindie`` writes their
#: quantized linears only.
GQA_MOE = replace(GQA, residual_rotation=False, fa_targets=("vllm-ascend",))

MLA = AttentionKind(
    name="mla",
    adapter="DeepseekV3Adapter",
    fa_quant_type="FAKQuant",
    observed="absorbed query q_nope @ W_UK [B, H, S, R]; the latent c_kv after "
    "kv_a_layernorm as K and V [B, 1, T, R]; the RoPE parts stay float",
    rope="decoupled RoPE part (qk_rope_head_dim), never quantized",
    linear_plan="deepseek_v3",
    residual_rotation=False,
    paged_emulation=False,
    kv_cache_targets=False,
    carried_layers=True,
)

#: Qwen3-Next: only ``config.layer_types`` ``"full_attention"`` layers have softmax
#: attention (``self_attn``, the GQA adapter's layout); the ``"linear_attention"``
#: layers (``linear_attn``, Gated DeltaNet) keep a recurrent state that no consumer
#: quantizes: vLLM builds it as a mamba-style state whose dtype comes from
#: ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype``, not the KV-cache dtype
#: (vllm-project/vllm ``vllm/model_executor/models/qwen3_next.py`` @002d6073
#: ``get_mamba_state_dtype_from_config``), so FA / C8 / FP8 scales sit on the
#: full-attention layers only. No residual rotation (zero-centred ``1 + w`` norms
#: and the linear-attention projections would need their own folds) and no paged
#: emulation (it carries softmax K/V between decode steps, not the recurrent state).
GQA_HYBRID = AttentionKind(
    name="gqa_hybrid",
    adapter="GQAAdapter",
    fa_quant_type="FAQuant",
    observed="full-attention layers only: Q after q_norm and RoPE [B, H, S, D] "
    "(the output gate split off q_proj stays float); K, V before repeat_kv "
    "[B, Hkv, T, D]",
    rope="rotate-half pairs (i, i + r/2) over the first r = partial_rotary_factor "
    "* D channels; the rest pass unrotated",
    linear_plan="qwen3_next",
    residual_rotation=False,
    paged_emulation=False,
    kv_cache_targets=True,
    carried_layers=False,
)

#: MLA with a DeepSeek Sparse Attention indexer (``self_attn.indexer``: ``wq_b``,
#: ``wk``, ``k_norm``, ``weights_proj``; its top-k selection masks the MLA
#: attention). The adapter and the FA points are MLA's; the indexer runs float, as
#: the consumers keep it. Neither Ascend consumer reads FA scales for it: the
#: sparse attention that serves these models has no FAKQuant path (vllm-ascend
#: ``attention/sfa_v1.py`` at every tag; MindIE 3.0.0 lists FA3 quantization
#: unsupported for DeepSeek-V3.2 and has no glm_moe_dsa model; the rules and
#: their citations are :mod:`ascend_fa.artifact.releases`), so those targets
#: get the quantized linears only.
MLA_DSA = replace(
    MLA,
    observed=MLA.observed + "; the DSA indexer runs float and its top-k mask "
    "reaches the attention unchanged",
    fa_targets=(),
)

#: Gemma 3 (text): GQA attention with per-head q_norm / k_norm, every layer softmax
#: attention (``layer_types`` alternates sliding-window and full layers); its
#: RMSNorms scale by ``1 + weight`` and the attention and MLP outputs pass through
#: their own norms before the residual add (``post_attention_layernorm``,
#: ``post_feedforward_layernorm``), so the MLP reads ``pre_feedforward_layernorm``
#: (the GQA plan folds gate/up there) and no orthogonal rotation of the residual
#: stream commutes with the block (transformers ``models/gemma3/modeling_gemma3.py``,
#: v5.25.0).
GEMMA3 = replace(
    GQA,
    rope=GQA.rope + "; sliding layers use their own theta",
    residual_rotation=False,
    norm_offset=1.0,
)

#: Qwen3.5 / Qwen3.5-MoE (text): Qwen3-Next's hybrid (Gated DeltaNet
#: ``linear_attention`` layers, gated ``full_attention`` layers with q_norm /
#: k_norm and partial RoPE, ``1 + w`` norms), with the DeltaNet input projections
#: split per output (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
#: ``in_proj_a``), which vllm-ascend packs as ``in_proj_qkvz`` = [qkv, z] and
#: ``in_proj_ba`` = [b, a] (vllm_ascend/quantization/modelslim_config.py
#: ``packed_modules_model_mapping`` @v0.23.0 5cb98caa: ``qwen3_5`` /
#: ``qwen3_5_moe``), so the two halves of a packed pair share one type
#: (transformers ``models/qwen3_5/modeling_qwen3_5.py`` v5.25.0).
QWEN3_5 = replace(GQA_HYBRID, linear_plan="qwen3_5")

#: gpt-oss and Llama 4 (text): GQA attention the GQA adapter observes as it does
#: Llama's (gpt-oss: the per-head sinks join the softmax after Q/K/V, transformers
#: ``models/gpt_oss/modeling_gpt_oss.py`` ``s_aux``; Llama 4: K after its
#: interleaved RoPE and L2 qk-norm, ``models/llama4/modeling_llama4.py``, v5.25.0),
#: written for vLLM only (``--target vllm``: FP8 KV-cache scales). No Ascend
#: consumer quantizes them: vllm-ascend has no quantization mapping for either
#: (:mod:`ascend_fa.artifact.releases` rule ``quant.no-mapping``) and MindIE
#: 3.0.0 has no model; no linear plan (gpt-oss's experts are biased and
#: interleaved, Llama 4's sit in ``feed_forward``), no residual rotation, and no
#: paged emulation (it runs neither sinks, chunked attention nor NoPE layers).
VLLM_ONLY = replace(
    GQA,
    rope="gpt-oss: rotate-half over the head (YaRN); Llama 4: interleaved pairs "
    "(2i, 2i + 1) on the RoPE layers, none on the NoPE layers",
    linear_plan="none",
    residual_rotation=False,
    paged_emulation=False,
    fa_targets=(),
)

#: Gemma 4 (text): sliding and full layers, each with its own ``head_dim`` /
#: KV heads (``per_layer_config``); on ``attention_k_eq_v`` full layers there is
#: no ``v_proj`` and V is K's projection before ``k_norm`` / RoPE, normed by a
#: scale-free ``v_norm``; softmax scale 1 (q_norm / k_norm instead); KV-shared
#: layers reuse an earlier layer's K / V (transformers
#: ``models/gemma4/modeling_gemma4.py`` ``Gemma4TextAttention``, v5.25.0). The
#: GQA adapter observes Q / K / V where the attention interface receives them,
#: so every layer's scales are per its own heads. Written for vLLM only (FP8
#: KV-cache scales): vllm-ascend 0.13.0 / 0.18.0 / 0.23.0.post1 have no gemma4
#: mapping and ascend-fa has no Gemma 4 linear / C8 plan for main's (rule
#: ``quant.gemma4-no-plan``); MindIE 3.0.0 has no model. No paged emulation
#: (per-layer head_dim), no residual rotation (sandwich norms, as Gemma 3).
GEMMA4 = replace(
    VLLM_ONLY,
    rope="rotate-half, per layer type its own rope_parameters (sliding / full)",
)

#: ERNIE-4.5-MoE: GQA attention with interleaved RoPE over the whole head
#: (transformers ``models/ernie4_5_moe/modeling_ernie4_5_moe.py``
#: ``apply_rotary_pos_emb``, v5.25.0), routed experts (fused in memory) beside
#: shared experts and a router with ``moe_statics``. Written for vLLM only (FP8
#: KV-cache scales, loaded by vLLM 0.32's ``Ernie4_5_MoeForCausalLM``):
#: vllm-ascend has no ernie mapping (rule ``quant.ernie-no-mapping``); MindIE's
#: atb ``ernie_moe`` (a linears-only model reading ``attn_quantize``) needs the
#: quantized linears ascend-fa does not yet write in its layout (refused).
ERNIE4_5_MOE = replace(
    VLLM_ONLY, rope="interleaved pairs (2i, 2i + 1) over the whole head"
)

#: ``config.model_type`` -> its attention kind, in the order they are listed.
FAMILIES: dict[str, AttentionKind] = {
    "llama": GQA,
    "qwen2": GQA,
    "qwen3": GQA,
    "mistral": GQA,
    "deepseek_v3": MLA,
    "qwen3_moe": GQA_MOE,
    "qwen2_moe": GQA_MOE,
    "glm4_moe": GQA_MOE,
    "mixtral": GQA_MOE,
    "minimax_m2": GQA_MOE,
    "qwen3_next": GQA_HYBRID,
    "deepseek_v32": MLA_DSA,
    "glm_moe_dsa": MLA_DSA,
    "gemma3_text": GEMMA3,
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": QWEN3_5,
    # the language models inside the wrappers (their config's model_type)
    "qwen3_5_text": QWEN3_5,
    "qwen3_5_moe_text": QWEN3_5,
    "gpt_oss": VLLM_ONLY,
    "llama4_text": VLLM_ONLY,
    "kimi_k2": MLA,
    "gemma4_text": GEMMA4,
    "ernie4_5_moe": ERNIE4_5_MOE,
}

#: ``config.model_type`` -> the family whose transformers classes build it, for
#: the families transformers has no class of its own for. Kimi-K2's config.json
#: says ``model_type: kimi_k2`` with ``architectures: [DeepseekV3ForCausalLM]``
#: and ships a DeepSeek-V3 config class for ``--trust-remote-code``
#: (moonshotai/Kimi-K2-Instruct ``config.json``); vLLM maps ``kimi_k2`` to its
#: ``DeepseekV3Config`` (vllm ``vllm/transformers_utils/config.py``
#: ``_CONFIG_REGISTRY``, 0.18 / 0.23 / 0.32), vllm-ascend keys its packed modules
#: on ``kimi_k2`` (``vllm_ascend/quantization/modelslim_config.py``, v0.23.0).
BUILT_AS: dict[str, str] = {"kimi_k2": "deepseek_v3"}

_NO_MINDIE = (
    "MindIE 3.0.0 has no model for it (no atb_llm/models nor mindie_llm/runtime/"
    "models folder: NotImplementedError 'unsupported model type')"
)
#: ``config.model_type`` -> why no artifact is written for it, per target
#: (``"*"``: every other target): families transformers builds whose structure
#: no kind here covers, refused in one line by ``calibrate`` (exit 2, before
#: anything loads) and reported by ``inspect`` (exit 1).
#:
#: * LongCat-Flash (transformers ``models/longcat_flash/modeling_longcat_flash.py``
#:   v5.25.0 ``LongcatFlashDecoderLayer``): two MLA attentions per decoder layer
#:   (``self_attn.0`` / ``self_attn.1``, each its own latent cache, layer index
#:   ``2 * i + j``), two dense MLPs and a shortcut MoE whose router also picks
#:   zero-computation (identity) experts; vllm-ascend maps its packed modules
#:   (``modelslim_config.py`` ``longcat_flash``, v0.23.0) but the DeepSeek-V3
#:   adapter and linear plan observe one attention and one MLP per layer.
#: * DeepSeek-V4 (transformers ``DeepseekV4Config``): compressed / sliding-window
#:   attention (one 512-wide KV head, ``compress_rates``), hash-routed MoE layers
#:   and hyper-connections; vllm-ascend serves it through its own model
#:   (``vllm_ascend/models/deepseek_v4.py``, v0.23.0: ``AscendDeepseekV4SWACache``,
#:   an indexer cache quantized on the fly) with no FAKQuant or C8 path, and reads
#:   its W8A8 linears under DeepSeek-V4's own checkpoint names
#:   (``modelslim_config.py`` ``QUANT_MODEL_PREFIX_MAPPINGS``: ``layers.*.attn.*``,
#:   ``ffn.*``), which no linear plan here writes.
NOT_CALIBRATED: dict[str, dict[str, str]] = {
    "longcat_flash": {
        "mindie": _NO_MINDIE,
        "*": "each decoder layer has two MLA attentions (self_attn.0 / "
        "self_attn.1, two latent caches) beside a shortcut MoE with "
        "zero-computation experts, which ascend-fa's DeepSeek-V3 adapter and "
        "linear plan (one attention, one MLP per layer) do not cover; vllm-ascend "
        "0.23.0.post1 maps its packed modules, but no artifact of it is written "
        "here",
    },
    "deepseek_v4": {
        "mindie": _NO_MINDIE,
        "*": "vllm-ascend 0.23.0.post1 serves it through its own model "
        "(vllm_ascend/models/deepseek_v4.py: compressed sliding-window cache) "
        "with no FAKQuant or C8 path, and reads its W8A8 linears under "
        "DeepSeek-V4's own checkpoint names (modelslim_config.py "
        "QUANT_MODEL_PREFIX_MAPPINGS), which ascend-fa's linear plans do not "
        "write; MindIE 3.0.0 has no model for it",
    },
}


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose language model is calibrated.

    ``text_prefix``: where the checkpoint keeps the language model's decoder
    (the text model's ``model.`` names sit under it; ``lm_head`` stays at the
    top); ``kept``: the prefixes of the towers written float as the checkpoint
    holds them (names, dtype and bytes); ``text_type``: the language model's
    ``model_type``.
    """

    text_prefix: str
    kept: tuple[str, ...]
    text_type: str

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of the text model's tensor (or module) ``name``."""
        if name.startswith("model."):
            return self.text_prefix + name[len("model.") :]
        return name


#: ``config.model_type`` of a wrapper -> where its language model sits. Qwen3.5's
#: released checkpoints are ``Qwen3_5ForConditionalGeneration`` /
#: ``Qwen3_5MoeForConditionalGeneration``: ``model.language_model.*``,
#: ``model.visual.*``, ``lm_head`` (transformers ``models/qwen3_5/
#: modeling_qwen3_5.py`` v5.25.0), the names vLLM's ``Qwen3_5ForConditional
#: Generation`` maps (vllm ``models/qwen3_5.py`` ``hf_to_vllm_mapper``, v0.23.0).
WRAPPERS: dict[str, Wrapper] = {
    "qwen3_5": Wrapper("model.language_model.", ("model.visual.",), "qwen3_5_text"),
    "qwen3_5_moe": Wrapper(
        "model.language_model.", ("model.visual.",), "qwen3_5_moe_text"
    ),
}


def wrapper(model_type: str | None) -> Wrapper | None:
    """The wrapper layout of ``model_type`` (None: not a multimodal wrapper)."""
    return WRAPPERS.get(model_type) if model_type is not None else None


@dataclass(frozen=True)
class MoeLayout:
    """Where a MoE decoder layer keeps its experts (names relative to the layer).

    ``block``: the MLP module (a MoE block in MoE layers, a dense MLP with
    ``gate_proj`` in dense ones); its ``experts`` child holds the routed experts;
    ``shared``: the shared expert MLP inside ``block`` (None: none); ``shared_gate``:
    the ``[1, H]`` linear whose sigmoid scales the shared expert's output (kept
    float: a one-row GEMM, and the consumers declare it unquantized);
    ``checkpoint_block`` / ``projections``: the checkpoint's name of ``block`` and
    of each expert's gate / up / down projection, which the consumers' expert
    mappings read: Mixtral and MiniMax-M2 load
    ``block_sparse_moe.experts.{e}.w1/w3/w2`` (vllm 0.32.0
    ``vllm/model_executor/models/mixtral.py`` / ``minimax_m2.py``,
    ``ckpt_names=("w1", "w2", "w3")``), the others
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
    """

    block: str = "mlp"
    shared: str | None = None
    shared_gate: str | None = None
    checkpoint_block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


_MIXTRAL_MOE = MoeLayout(
    checkpoint_block="block_sparse_moe", projections=("w1", "w3", "w2")
)

#: ``config.model_type`` -> the layout of its MoE layers (MoE families only).
MOE_LAYOUTS: dict[str, MoeLayout] = {
    "deepseek_v3": MoeLayout(shared="shared_experts"),
    "qwen3_moe": MoeLayout(),
    "qwen2_moe": MoeLayout(shared="shared_expert", shared_gate="shared_expert_gate"),
    "glm4_moe": MoeLayout(shared="shared_experts"),
    "mixtral": _MIXTRAL_MOE,
    "minimax_m2": _MIXTRAL_MOE,
    "qwen3_next": MoeLayout(shared="shared_expert", shared_gate="shared_expert_gate"),
    "qwen3_5_moe_text": MoeLayout(
        shared="shared_expert", shared_gate="shared_expert_gate"
    ),
    "deepseek_v32": MoeLayout(shared="shared_experts"),
    "glm_moe_dsa": MoeLayout(shared="shared_experts"),
    "kimi_k2": MoeLayout(shared="shared_experts"),
}


def built_as(model_type: str | None) -> str | None:
    """The model type whose transformers classes build ``model_type`` (itself
    unless :data:`BUILT_AS` names another)."""
    return BUILT_AS.get(model_type, model_type) if model_type is not None else None


def moe_layout(model_type: str | None) -> MoeLayout | None:
    """The MoE layout of ``model_type`` (None for a dense or unknown family)."""
    return MOE_LAYOUTS.get(model_type) if model_type is not None else None


def family_refusal(model_type: str | None, target: str | None) -> str | None:
    """One line saying why ``target`` gets no artifact of ``model_type``
    (:data:`NOT_CALIBRATED`), or None."""
    reasons = NOT_CALIBRATED.get(model_type) if model_type is not None else None
    if reasons is None:
        return None
    why = reasons.get(target or "", reasons["*"])
    where = f"--target {target}" if target else "no target"
    return f"{model_type} ({where}): no artifact is written for it: {why}"


def attention_kind(model_type: str | None) -> AttentionKind | None:
    """The kind of ``model_type``, or None when no family declares it."""
    return FAMILIES.get(model_type) if model_type is not None else None


def model_types(**wanted: object) -> tuple[str, ...]:
    """The declared model types whose kind has every ``field=value`` of
    ``wanted`` (e.g. ``model_types(residual_rotation=True)``), in order."""
    return tuple(
        t
        for t, kind in FAMILIES.items()
        if all(getattr(kind, k) == v for k, v in wanted.items())
    )


def reads_fa(model_type: str | None, target: str) -> bool:
    """Whether ``target``'s consumer reads FA scales for ``model_type``: an Ascend
    target (mindie, vllm-ascend) only where the kind lists it in ``fa_targets``
    (not for DeepSeek Sparse Attention, nor MindIE's MoE models); other targets,
    undeclared types: yes."""
    kind = attention_kind(model_type)
    if kind is None or target not in ("mindie", "vllm-ascend"):
        return True
    return target in kind.fa_targets


def norm_offset(model_type: str | None) -> float:
    """What ``model_type``'s RMSNorms add to their weight (0 when none declared)."""
    kind = attention_kind(model_type)
    return kind.norm_offset if kind is not None else 0.0


def is_mla(model_type: str | None) -> bool:
    """Whether ``model_type`` is a multi-head latent attention family."""
    kind = attention_kind(model_type)
    return kind is not None and kind.name == "mla"
