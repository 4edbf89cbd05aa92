"""Which linears of a model are quantized, in which groups, and where smoothing folds.

A **group** is a set of linears that read the same input: they share one activation
scale and offset (the consumers fuse them: vllm-ascend's ``packed_modules_mapping``
q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``, DeepSeek ``q_a_proj`` +
``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj``, vllm-project/vllm-ascend
``vllm_ascend/quantization/modelslim_config.py`` @182b75e; MindIE's
``Weights.get_per_tensor_sharded`` raises "`input_scale` are not equal" for fused
linears, Ascend/MindIE-LLM ``atb_llm/utils/weights.py`` @8b4871a), and a group is
quantized or kept float as a whole (vllm-ascend ``is_layer_skipped_ascend`` raises
"Detected some but not all shards ... are quantized").

Smoothing of a group is folded either into the norm before it (every reader of
that norm's output is in the group) or into the output rows of the linear that
produces its input (``v_proj`` for ``o_proj``: the attention output of query head
``h`` is a mix of V rows of KV head ``h // g``, so the factor is tied across the
``g`` query heads of a KV head; ``up_proj`` for ``down_proj``: ``act(gate) * up``
is linear in ``up``).

==============  ==========================================  =====================
model types     groups per decoder layer                    smoothing folds into
==============  ==========================================  =====================
llama, qwen2,   ``qkv`` q/k/v_proj                          ``input_layernorm``
qwen3, mistral, ``o`` o_proj                                ``v_proj`` rows (tied)
GQA + MoE
                ``gate_up`` gate/up_proj                    ``post_attention_layernorm``
                ``down`` down_proj                          ``up_proj`` rows
deepseek_v3     ``attn_in`` q_a_proj (or q_proj) +          ``input_layernorm``
                kv_a_proj_with_mqa
                ``q_b`` q_b_proj                            ``q_a_layernorm``
                ``o`` o_proj                                -
                dense MLP: ``gate_up``, ``down``            as above
MoE layers      ``shared_gate_up``, ``shared_down``         -, shared ``up_proj``
(any family)    (per token), routed ``experts`` (per token)
gemma3_text     as llama, but ``gate_up``                   pre_feedforward_layernorm
==============  ==========================================  =====================

A GQA + MoE family's dense layers (GLM-4-MoE's first ones) take the dense MLP
groups; its MoE layers the MoE groups, where the family's
:class:`~ascend_fa.families.MoeLayout` says the shared expert and its gate sit.

Gemma 3's ``post_attention_layernorm`` and ``post_feedforward_layernorm`` normalize
the attention and MLP *outputs* before the residual add (transformers
``models/gemma3/modeling_gemma3.py`` ``Gemma3DecoderLayer.forward``, v5.25.0): the
MLP's input norm is ``pre_feedforward_layernorm`` wherever a layer has one. Its
norms scale by ``1 + weight`` (:attr:`ascend_fa.families.AttentionKind.norm_offset`),
so the engine folds ``1 / s`` as ``(1 + w) / s - 1`` (:mod:`.norms`).

Kept float, always: ``lm_head`` and embeddings (both consumers describe them FLOAT);
DeepSeek ``kv_b_proj`` (vllm-ascend's MLA absorbs it into ``W_UK``/``W_UV`` and
asserts ``isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod)``,
``vllm_ascend/attention/mla_v1.py`` @182b75e, "We currently do not support quant
kv_b_proj"); the MoE routers and Qwen's ``shared_expert_gate``. Routed experts,
which transformers 5 holds as fused ``experts.gate_up_proj`` /
``experts.down_proj`` parameters rather than linears, are the plan's ``experts``;
they and the shared experts are quantized per token under either ``--linear``
(:meth:`LinearGroup.linear_type`, :mod:`.experts`), but for a consumer that loads the
shared experts under the model-level type (MindIE: :func:`shared_in_model_type`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ascend_fa.errors import UnsupportedError
from ascend_fa.families import (
    FAMILIES,
    MoeLayout,
    attention_kind,
    model_types,
    moe_layout,
)
from ascend_fa.hf_compat import require_transformers5

from .experts import is_fused_experts
from .modules import QuantizedLinear, check_linear_shape

__all__ = [
    "ATTENTION_KINDS",
    "GATED_KINDS",
    "GQA_MODEL_TYPES",
    "LayerPlan",
    "LinearGroup",
    "configured_plan",
    "linear_plan",
    "mlp_per_token",
    "require_fused_experts",
    "shared_in_model_type",
]

#: The model types whose family (:mod:`ascend_fa.families`) takes the GQA plan.
GQA_MODEL_TYPES = model_types(linear_plan="gqa")
#: Group kinds whose input is an MLP's gated product (see
#: :attr:`LinearGroup.gated_input`).
GATED_KINDS = ("down", "shared_down")


@dataclass(frozen=True)
class LinearGroup:
    """Linears that share one input (see the module doc).

    ``norm``: the norm whose weight absorbs smoothing (or None); ``fold``: the
    linear whose output rows absorb it (or None); ``tie``: query heads per KV head
    when the factor is tied across heads (``o`` group), else 1; ``head_dim`` then
    gives the width of one head.
    """

    name: str
    kind: str
    linears: tuple[str, ...]
    norm: str | None = None
    fold: str | None = None
    tie: int = 1
    head_dim: int = 0
    #: linears the group stands for when not one per name (routed experts: 3 x E)
    count: int = 0
    #: float linears that read the same input (DSA indexer): they take the
    #: smoothing's column factor, so a fold into ``norm`` leaves them exact
    readers: tuple[str, ...] = ()
    #: quantized per token (W8A8_DYNAMIC) whatever ``--linear`` says: MoE experts
    #: (see the module doc)
    dynamic: bool = False

    def linear_type(self, configured: str) -> str:
        """The group's linear type: ``configured`` (``--linear``), or W8A8_DYNAMIC
        for the MoE experts' groups whatever ``--linear`` says. msModelSlim's MoE
        recipes quantize the MLP per token next to static attention (msmodelslim
        26.1.0 ``lab_practice/qwen3_moe/qwen3-30b-a3b-w8a8.yaml`` ``mix_cfg``
        ``"*.mlp.*": w8a8_dynamic``; its DeepSeek default in
        ``pytorch/llm_ptq/llm_ptq_tools/quant_tools.py``): a static per-tensor
        input range per expert needs tokens routed to every expert, which a
        calibration set does not give."""
        return "W8A8_DYNAMIC" if self.dynamic else configured

    @property
    def smoothable(self) -> bool:
        return self.norm is not None or self.fold is not None

    @property
    def gated_input(self) -> bool:
        """Whether the group reads an MLP's gated product ``act(gate) * up`` (a
        ``down_proj``): a product of two projections, off the residual stream,
        whose static range gets ``LinearConfig.headroom``."""
        return self.kind in GATED_KINDS

    @property
    def size(self) -> int:
        """How many checkpoint linears the group holds."""
        return self.count or len(self.linears)


@dataclass
class LayerPlan:
    """The groups of decoder layer ``index`` (``prefix`` its dotted name), in the
    order the layer computes them."""

    index: int
    prefix: str
    groups: list[LinearGroup] = field(default_factory=list)
    #: the layer's routed experts (DeepSeek MoE: fused parameters, not linears;
    #: quantized only as W8A8_DYNAMIC, :mod:`.experts`), or None
    experts: LinearGroup | None = None


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _linear(model: nn.Module, name: str) -> nn.Module:
    mod = model.get_submodule(name)
    if not isinstance(mod, nn.Linear | QuantizedLinear):
        raise UnsupportedError(
            f"{name}: expected an nn.Linear, got {type(mod).__name__}"
        )
    return mod


def _mlp_groups(
    model: nn.Module, p: str, layout: MoeLayout | None
) -> tuple[list[LinearGroup], LinearGroup | None]:
    """The MLP groups of decoder layer ``p`` and its routed experts (or None): a
    dense MLP (``gate_proj`` present: dense models, and MoE models' first dense
    layers) folds as in the module doc; a MoE block has shared-expert groups
    (quantized per token, ``dynamic``) and the fused routed experts."""
    m = f"{p}.{layout.block if layout is not None else 'mlp'}"
    if _has(model, f"{m}.gate_proj") or layout is None:
        return [
            LinearGroup(
                f"{m}.gate_up",
                "gate_up",
                (f"{m}.gate_proj", f"{m}.up_proj"),
                norm=_mlp_norm(model, p),
            ),
            LinearGroup(f"{m}.down", "down", (f"{m}.down_proj",), fold=f"{m}.up_proj"),
        ], None
    groups = []
    if layout.shared is not None and _has(model, f"{m}.{layout.shared}.gate_proj"):
        s = f"{m}.{layout.shared}"
        groups += [
            # The norm output also feeds the router and the routed experts: no fold.
            LinearGroup(
                f"{s}.gate_up",
                "shared_gate_up",
                (f"{s}.gate_proj", f"{s}.up_proj"),
                dynamic=True,
            ),
            LinearGroup(
                f"{s}.down",
                "shared_down",
                (f"{s}.down_proj",),
                fold=f"{s}.up_proj",
                dynamic=True,
            ),
        ]
    routed = (
        model.get_submodule(f"{m}.experts") if _has(model, f"{m}.experts") else None
    )
    experts = None
    if is_fused_experts(routed):
        n = routed.gate_up_proj.shape[0]
        experts = LinearGroup(
            f"{m}.experts", "experts", (f"{m}.experts",), count=3 * n, dynamic=True
        )
    return groups, experts


def _mlp_norm(model: nn.Module, p: str) -> str:
    """The norm whose output is the MLP input: ``pre_feedforward_layernorm`` where
    the layer has one (Gemma 3's sandwich norms: its ``post_attention_layernorm``
    normalizes the attention output), else ``post_attention_layernorm``."""
    pre = f"{p}.pre_feedforward_layernorm"
    return pre if _has(model, pre) else f"{p}.post_attention_layernorm"


def _gqa_layer(model: nn.Module, cfg, i: int) -> LayerPlan:  # noqa: ANN001
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    mlp, experts = _mlp_groups(model, p, moe_layout(cfg.model_type))
    return LayerPlan(
        i,
        p,
        [
            LinearGroup(
                f"{a}.qkv",
                "qkv",
                (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                norm=f"{p}.input_layernorm",
            ),
            LinearGroup(
                f"{a}.o",
                "o",
                (f"{a}.o_proj",),
                fold=f"{a}.v_proj",
                tie=heads // kv,
                head_dim=head_dim,
            ),
            *mlp,
        ],
        experts,
    )


def _deepseek_layer(model: nn.Module, cfg, i: int) -> LayerPlan:  # noqa: ANN001
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    groups = []
    x = f"{a}.indexer"
    # DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa; glm's "shared" layers
    # have no indexer): wk and weights_proj read the input_layernorm output, wq_b
    # the q_a_layernorm output (msModelSlim 26.1.0 model/deepseek_v3_2/
    # model_adapter.py get_adapter_config_for_subgraph lists them as those norms'
    # targets). They stay float, the groups' readers: msModelSlim 26.1.0's
    # DeepSeek-V3.2 recipe (lab_practice/deepseek_v3_2/deepseek_w8a8.yaml)
    # excludes all three; MindIE 3.0.0 builds them with quant_config=None
    # (Ascend/MindIE-LLM mindie_llm/runtime/models/deepseek_v3/deepseek_v3.py
    # Indexer @8b4871a); vllm-ascend runs wk + weights_proj fused as
    # wk_weights_proj (vllm_ascend/attention/sfa_v1.py @182b75e).
    dsa = _has(model, f"{x}.wq_b")
    q_in = f"{a}.q_a_proj" if _has(model, f"{a}.q_a_proj") else f"{a}.q_proj"
    groups.append(
        LinearGroup(
            f"{a}.attn_in",
            "attn_in",
            (q_in, f"{a}.kv_a_proj_with_mqa"),
            norm=f"{p}.input_layernorm",
            readers=(f"{x}.wk", f"{x}.weights_proj") if dsa else (),
        )
    )
    if _has(model, f"{a}.q_b_proj"):
        groups.append(
            LinearGroup(
                f"{a}.q_b",
                "q_b",
                (f"{a}.q_b_proj",),
                norm=f"{a}.q_a_layernorm",
                readers=(f"{x}.wq_b",) if dsa else (),
            )
        )
    groups.append(LinearGroup(f"{a}.o", "o", (f"{a}.o_proj",)))
    mlp, experts = _mlp_groups(model, p, moe_layout(cfg.model_type))
    return LayerPlan(i, p, groups + mlp, experts)


def _qwen3_next_layer(model: nn.Module, cfg, i: int) -> LayerPlan:  # noqa: ANN001
    """Qwen3-Next: a full-attention layer takes the GQA attention groups (its
    q_proj's rows are query and output gate, one input; ``o_proj`` reads the gated
    attention output, which the gate scales per channel, so the smoothing still
    folds into ``v_proj``'s rows); a linear-attention layer quantizes
    ``in_proj_qkvz`` without smoothing and keeps ``in_proj_ba`` (the decay and
    beta gates) and ``out_proj`` (behind the gated RMSNorm) float, as
    msModelSlim's Qwen3-Next recipe does (msmodelslim 26.1.0
    ``lab_practice/qwen3_next/qwen3-next-80b-a3b-w8a8.yaml``: ``*self_attn*``
    but ``o_proj``, ``*mlp.experts*``, ``*linear_attn.in_proj_qkvz*``; its
    adapter smooths only the full-attention q/k/v, ``model/qwen3_next/
    model_adapter.py``). vllm-ascend loads ``in_proj_qkvz`` and ``in_proj_ba``
    as two linears (``vllm_ascend/ops/gdn.py`` @182b75e ``forward``), so they
    need not share a precision; its ``"in_proj"`` packed entry
    (``quantization/modelslim_config.py``) names no module of this model.
    ``o_proj`` is quantized: vllm-ascend builds it as a quantizable
    ``RowParallelLinear`` (vllm-project/vllm ``models/qwen3_next.py``
    @002d6073). ``in_proj_qkvz`` is per token (``dynamic``) whatever ``--linear``
    says: msModelSlim's recipe quantizes it ``w8a8_dynamic``, the form
    vllm-ascend's nightly Qwen3-Next W8A8 test loads
    (``tests/e2e/nightly/single_node/models/test_qwen3_next_w8a8.py`` @v0.13.0),
    and with no smoothing a static per-tensor range would take the hidden
    states' outlier channels whole. The MLP is the MoE core's
    (:func:`_mlp_groups`: shared expert and routed experts per token,
    ``shared_expert_gate`` and the router float)."""
    p = f"model.layers.{i}"
    if cfg.layer_types[i] == "full_attention":
        return _gqa_layer(model, cfg, i)
    a = f"{p}.linear_attn"
    qkvz = LinearGroup(f"{a}.qkvz", "qkvz", (f"{a}.in_proj_qkvz",), dynamic=True)
    mlp, experts = _mlp_groups(model, p, moe_layout(cfg.model_type))
    return LayerPlan(i, p, [qkvz, *mlp], experts)


def _qwen3_5_layer(model: nn.Module, cfg, i: int) -> LayerPlan:  # noqa: ANN001
    """Qwen3.5 / Qwen3.5-MoE: as Qwen3-Next (:func:`_qwen3_next_layer`), with the
    Gated DeltaNet input split per output: ``in_proj_qkv`` and ``in_proj_z``
    read the same input and vllm-ascend packs them as ``in_proj_qkvz`` (one
    group, per token, unsmoothed, as Qwen3-Next's); ``in_proj_b`` / ``in_proj_a``
    (packed ``in_proj_ba``: the beta and decay gates) and ``out_proj`` stay float
    (vllm_ascend/quantization/modelslim_config.py ``packed_modules_model_mapping``
    ``qwen3_5`` / ``qwen3_5_moe`` @v0.23.0 5cb98caa)."""
    p = f"model.layers.{i}"
    if cfg.layer_types[i] == "full_attention":
        return _gqa_layer(model, cfg, i)
    a = f"{p}.linear_attn"
    qkvz = LinearGroup(
        f"{a}.qkvz", "qkvz", (f"{a}.in_proj_qkv", f"{a}.in_proj_z"), dynamic=True
    )
    mlp, experts = _mlp_groups(model, p, moe_layout(cfg.model_type))
    return LayerPlan(i, p, [qkvz, *mlp], experts)


#: An attention kind's ``linear_plan`` -> the builder of one layer's plan.
_LAYER_PLANS = {
    "gqa": _gqa_layer,
    "deepseek_v3": _deepseek_layer,
    "qwen3_next": _qwen3_next_layer,
    "qwen3_5": _qwen3_5_layer,
}


def _planned_types() -> list[str]:
    return [t for t in model_types() if FAMILIES[t].linear_plan in _LAYER_PLANS]


def linear_plan(
    model: nn.Module, *, shared_dynamic: bool = True, mlp_dynamic: bool = False
) -> list[LayerPlan]:
    """The quantization plan of ``model`` (one :class:`LayerPlan` per decoder layer);
    ``shared_dynamic`` False puts the shared experts in ``--linear``'s type
    (:func:`shared_in_model_type`); ``mlp_dynamic`` runs every group but the
    attention's per token (:func:`mlp_per_token`).

    Raises :class:`UnsupportedError` for a model type without a plan, or a linear
    whose shape no consumer's kernel takes (naming it).
    """
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    n = int(cfg.num_hidden_layers)
    kind = attention_kind(model_type)
    layer_plan = _LAYER_PLANS.get(kind.linear_plan) if kind is not None else None
    if layer_plan is None:
        raise UnsupportedError(
            f"--linear: no quantized-linear plan for model_type {model_type!r} "
            f"(supported: {', '.join(_planned_types())})"
        )
    plans = [layer_plan(model, cfg, i) for i in range(n)]
    for plan in plans:
        for group in plan.groups:
            for name in group.linears:
                lin = _linear(model, name)
                check_linear_shape(name, lin.in_features, lin.out_features)
    plans = plans if shared_dynamic else shared_in_model_type(plans)
    return mlp_per_token(plans) if mlp_dynamic else plans


def configured_plan(model: nn.Module, config: Any) -> list[LayerPlan]:
    """:func:`linear_plan` under a :class:`~.engine.LinearConfig`'s
    ``shared_dynamic`` / ``mlp_dynamic``, its experts checked
    (:func:`require_fused_experts`) when ``--linear`` is W8A8_DYNAMIC."""
    plans = linear_plan(
        model, shared_dynamic=config.shared_dynamic, mlp_dynamic=config.mlp_dynamic
    )
    if config.quant_type == "W8A8_DYNAMIC":
        require_fused_experts(model, plans)
    return plans


def require_fused_experts(model: nn.Module, plans: list[LayerPlan]) -> None:
    """Refuse, in one line, W8A8_DYNAMIC routed experts the model holds as one MLP
    module per expert (transformers 4.57's DeepSeek-V3 layout; :mod:`.experts`
    quantizes transformers 5's fused parameters)."""
    unfused = [
        f"{p.prefix}.mlp.experts"
        for p in plans
        if p.experts is None and _has(model, f"{p.prefix}.mlp.experts")
    ]
    if unfused:
        require_transformers5(
            f"W8A8_DYNAMIC routed experts ({unfused[0]}: one module per expert)"
        )


#: The groups of a decoder layer's attention (the GQA plan).
ATTENTION_KINDS = ("qkv", "o")


def mlp_per_token(plans: list[LayerPlan]) -> list[LayerPlan]:
    """``plans`` with every group but the attention's (:data:`ATTENTION_KINDS`)
    per token (W8A8_DYNAMIC): the dense MLPs, the shared and the routed experts.
    MindIE 3.0.0's Qwen MoE model loads its attention under static ``w8a8`` when
    ``quantize`` is ``w8a8_dynamic`` and every other linear under ``quantize``
    (Ascend/MindIE-LLM ``examples/atb_models/atb_llm/models/qwen2/modeling_qwen2.py``
    @8b4871ad L154-163, ``models/qwen2_moe/modeling_qwen2_moe.py`` L172-243), as
    msModelSlim's Qwen3-MoE W8A8 recipe quantizes it (msmodelslim 26.1.0
    ``lab_practice/qwen3_moe/qwen3-30b-a3b-w8a8.yaml`` ``"*.mlp.*": w8a8_dynamic``)."""
    return [
        replace(
            p,
            groups=[
                g if g.kind in ATTENTION_KINDS else replace(g, dynamic=True)
                for g in p.groups
            ],
        )
        for p in plans
    ]


def shared_in_model_type(plans: list[LayerPlan]) -> list[LayerPlan]:
    """``plans`` with the shared experts' groups in ``--linear``'s type rather than
    per token: MindIE 3.0.0 loads the shared experts under the model-level
    ``quantize`` (only the routed experts under ``moe_quantize``;
    Ascend/MindIE-LLM ``examples/atb_models/atb_llm/models/deepseek/
    modeling_deepseek.py`` @8b4871ad L488-492, L601-603, L631), as msModelSlim's
    MoE recipes quantize them (``*mlp.experts*`` dynamic, msmodelslim 26.1.0
    ``lab_practice/glm4_moe/glm4_7_moe-w8a8-v1.yaml``). Shared experts see every
    token, so a static range is calibrated on all of them."""
    shared = ("shared_gate_up", "shared_down")
    return [
        replace(
            p,
            groups=[
                replace(g, dynamic=False) if g.kind in shared else g for g in p.groups
            ],
        )
        for p in plans
    ]
