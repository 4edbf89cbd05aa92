"""How MindIE 3.0.0 runs each family, as data read from its model code.

MindIE's default backend is ``atb`` (``"backendType": "atb"``); each ``model_type``
is routed to one ``atb_llm/models/<folder>`` (paths below are under
``examples/atb_models/atb_llm/`` of Ascend/MindIE-LLM @8b4871ad = tag v3.0.0
unless they start with ``mindie_llm/`` or ``docs/``). Per family this table says
what that model does with an artifact:

* ``model``: the folder that runs it (None: no MindIE model, ``get_model`` raises
  ``NotImplementedError: unsupported model type``);
* ``fa3``: the FA scheme the model builds (``FA3.load`` / ``FA3.load_mla`` and
  ``enableFA3``), None where its attention reads no ``fa_*`` tensor;
* ``quantize_from``: where the router takes ``config.quantize``: the
  description's ``model_quant_type`` (the base router's ``config`` property), or
  only ``config.json``'s ``quantize`` key (routers that override ``config``);
* ``moe_quantize``: the model swaps ``config.quantize`` for ``config.json``'s
  ``moe_quantize`` while it builds the routed experts (and restores it after);
* ``shared``: what the shared experts load under (``"model"``: the model-level
  ``quantize``; None: no shared experts);
* ``uniform``: every linear must carry one type (a graph that registers the
  experts with the model-level type);
* ``attn``: the attention's own quantize (``FlashQwenAttention``,
  ``models/qwen2/modeling_qwen2.py`` L154-163): config.json's ``attn_quantize``
  when present, else static ``w8a8`` for a "moe" model whose ``quantize`` is
  ``w8a8_dynamic``; the experts, the shared expert and the dense MLPs load under
  ``quantize``. What runs best there is MindIE's own default: static W8A8
  attention (its norm fuses the per-tensor quantization, no per-token quantize
  before q/k/v/o) next to per-token MLPs, msModelSlim's Qwen3-MoE W8A8 recipe;
* ``attn_bias``: the attention loads q/k/v biases whatever config.json says
  (``models/glm4_moe/modeling_glm4_moe.py`` L254-261 ``bias=True``);
* ``dtype``: the dtype its config class forces; ``fa3_dtypes``: the dtypes its
  FA3 guide supports; ``config_keys``: keys its config class requires.

What :mod:`ascend_fa` writes for ``--target mindie`` follows from it
(:func:`mindie_refusal`, :func:`mindie_config`; the findings of
:mod:`ascend_fa.artifact.mindie_findings`); the tests walk MindIE's load path
per family from the same citations (``tests/mindie_loader.py``).

=============  ===========  =====  =========  ========  ======  ==========
model_type     model        FA3    quantize   routed    shared  notes
=============  ===========  =====  =========  ========  ======  ==========
llama          llama        FAQ    desc.      -         -
mistral        llama        FAQ    config     -         -       refused
qwen2          qwen2        FAQ    desc.      -         -
qwen3          qwen2        FAQ    desc.      -         -
deepseek_v3    deepseekv2   FAKQ   desc.      moe_q.    model   FA3 doc: fp16,
                                                                rope_scaling
kimi_k2        deepseekv2   FAKQ   desc.      moe_q.    model   as deepseek_v3
qwen2_moe      qwen2_moe    -      config     quantize  model   attn w8a8
qwen3_moe      qwen2_moe    -      config     quantize  -       attn w8a8
glm4_moe       glm4_moe     -      desc.      moe_q.    model   rope_scaling,
                                                                q/k/v bias
mixtral        mixtral      -      desc.      (graph)   -       uniform, fp16
deepseek_v32   runtime      -      desc.      per name  per n.  torch runtime
minimax_m2,    none
qwen3_next,
gemma3_text,
glm_moe_dsa,
gemma4_text
ernie4_5_moe   ernie_moe    -      desc.      -         -       refused (no
                                                                linear plan)
=============  ===========  =====  =========  ========  ======  ==========
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .release_types import MINDIE, MINDIE300, Citation

#: MindIE 3.0.0 architectures with no model at all (the release table's
#: ``mindie.no-model`` rule)
MINDIE_NO_MODEL = frozenset(
    {
        "MiniMaxM2ForCausalLM",
        "Qwen3NextForCausalLM",
        "Gemma3ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "GptOssForCausalLM",
        "Llama4ForCausalLM",
        "Llama4ForConditionalGeneration",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
    }
)
#: MindIE 3.0.0 MoE architectures whose model builds no FA3 (``mindie.fa3.moe``)
MINDIE_MOE_NO_FA3 = frozenset(
    {
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "Glm4MoeForCausalLM",
    }
)

__all__ = [
    "MINDIE_MODELS",
    "MINDIE_MOE_NO_FA3",
    "MINDIE_NO_MODEL",
    "LINEAR_TYPES",
    "MindieModel",
    "attention_names",
    "config_quantize",
    "mindie_attention_biases",
    "mindie_config",
    "mindie_required_keys",
    "mindie_model",
    "mindie_refusal",
    "mlp_per_token",
    "shared_in_model_type",
]

_A = "examples/atb_models/atb_llm"


def _c(path: str, where: str) -> Citation:
    full = path if path.startswith(("mindie_llm/", "docs/", "src/")) else f"{_A}/{path}"
    return Citation(MINDIE, full, MINDIE300, where)


@dataclass(frozen=True)
class MindieModel:
    """What MindIE 3.0.0 does with one ``model_type`` (see the module doc)."""

    model_type: str
    backend: str | None
    model: str | None
    fa3: str | None
    quantize_from: str = "description"
    moe_quantize: bool = False
    shared: str | None = None
    uniform: bool = False
    attn: str | None = None
    attn_bias: bool = False
    #: why ``--target mindie`` refuses the family although MindIE has a model
    refusal: str | None = None
    dtype: str | None = None
    fa3_dtypes: tuple[str, ...] = ("float16", "bfloat16")
    config_keys: tuple[str, ...] = ()
    #: (key MindIE reads, transformers 5's name of it): written when only the
    #: latter is in the source's config.json
    config_aliases: tuple[tuple[str, str], ...] = ()
    citations: tuple[Citation, ...] = ()

    def cites(self) -> str:
        return "; ".join(str(c) for c in self.citations)


_ROUTE = _c("models/__init__.py", "L94-97 get_model: unsupported model type")
_NO_RUNTIME = _c(
    "mindie_llm/runtime/models/__init__.py",
    "L47-48 get_router_ins: unsupported model type (runtime models: deepseek_v3, "
    "deepseek_v32, qwen2, qwen3, qwen3_moe)",
)
_BACKEND = _c("src/server/conf/config.json", 'L84 "backendType": "atb"')
_DESC = _c(
    "models/base/router.py",
    "L217-218 quantize = model_quant_type.lower() when config.json has none",
)
_BASE_FA3 = _c("models/base/modeling.py", "L96-97 FA3.load fa_q/fa_k/fa_v")
_QWEN2_FA3 = _c("models/qwen2/modeling_qwen2.py", "L147-149 FA3.load")
_W8A8_LOAD = _c(
    "utils/weights.py",
    "L758-770 get_multi_weights_col: w8a8 reads weight, deq_scale, quant_bias, "
    "input_scale, input_offset; L773-799 w8a8_dynamic: weight, weight_scale, "
    "weight_offset; a float weight returns early",
)
_FLOAT_LINEAR = _c(
    "utils/layers/linear/fast_linear.py",
    "L32-33 ValueError: linear type not matched, please check config.json quantize",
)
_QWEN_MOE_ROUTER = (
    _c(
        "models/qwen2_moe/router_qwen2_moe.py",
        "L22-29 config: Qwen2MoeConfig.from_pretrained (the description is not read)",
    ),
    _c(
        "models/qwen3_moe/router_qwen3_moe.py",
        "L24-34 model_type qwen2_moe; config: Qwen3MoeConfig.from_dict(config.json)",
    ),
    _c(
        "models/qwen2_moe/modeling_qwen2_moe.py",
        "L172-237 experts and L239-243 shared_expert under config.quantize "
        "(no moe_quantize reader)",
    ),
    _FLOAT_LINEAR,
    _c(
        "mindie_llm/runtime/layers/quantization/ms_model_slim/quantization_config.py",
        "L44-48 the torch runtime's qwen3_moe reads no fa_quant_type",
    ),
)
_QWEN_MOE_EXPERTS = _c(
    "models/qwen2_moe/configuration_qwen2_moe.py",
    "L28 num_experts: int = 60 (modeling_qwen2_moe.py L114 reads config.num_experts; "
    "a transformers-5 config says num_local_experts)",
)
_QWEN_MOE_ATTN = _c(
    "models/qwen2/modeling_qwen2.py",
    "L154-163 FlashQwenAttention (qwen2_moe L52): config.attn_quantize, else w8a8 "
    "for a moe model_type whose quantize is w8a8_dynamic",
)
_RUNNER_INT8 = _c(
    "runner/model_runner.py",
    "L290-292 int8 KV cache whenever fa_quant_type == FAQuant",
)

_GQA = dict(backend="atb", fa3="FAQuant")
_NONE = dict(backend=None, model=None, fa3=None)

#: ``model_type`` -> what MindIE 3.0.0 does with it.
MINDIE_MODELS: dict[str, MindieModel] = {
    m.model_type: m
    for m in (
        MindieModel(
            "llama",
            model="llama",
            **_GQA,
            citations=(
                _BACKEND,
                _DESC,
                _BASE_FA3,
                _c("models/llama/flash_causal_llama.py", "L210 enableFA3"),
            ),
        ),
        MindieModel(
            "mistral",
            model="llama",
            **_GQA,
            quantize_from="config.json",
            refusal=(
                "its router builds LlamaConfig.from_pretrained(config.json) and reads "
                "neither the description's model_quant_type nor its fa_quant_type "
                "(the quantized linears load as float: ValueError 'linear type not "
                "matched'; FA3 is built only from a quantization_config in "
                "config.json, which vLLM-based consumers take as the whole "
                "description); use --target vllm-ascend or vllm"
            ),
            citations=(
                _c("models/mistral/router_mistral.py", "L19 model_type llama"),
                _c(
                    "models/mistral/router_mistral.py",
                    "L22-27 get_config: LlamaConfig.from_pretrained (config.json only)",
                ),
                _BASE_FA3,
                _c("models/llama/flash_causal_llama.py", "L210 enableFA3"),
            ),
        ),
        MindieModel(
            "qwen2",
            model="qwen2",
            **_GQA,
            citations=(
                _DESC,
                _QWEN2_FA3,
                _c("models/qwen2/flash_causal_qwen2.py", "L478 enableFA3"),
            ),
        ),
        MindieModel(
            "qwen3",
            model="qwen2",
            **_GQA,
            citations=(
                _c("models/qwen3/router_qwen3.py", "L24 model_type qwen2"),
                _QWEN2_FA3,
                _c("models/qwen2/flash_causal_qwen2.py", "L478 enableFA3"),
            ),
        ),
        MindieModel(
            "deepseek_v3",
            backend="atb",
            model="deepseekv2",
            fa3="FAKQuant",
            moe_quantize=True,
            shared="model",
            fa3_dtypes=("float16",),
            config_keys=("rope_scaling",),
            citations=(
                _c("models/__init__.py", "L71-73 deepseek_v3 -> deepseekv2"),
                _c(
                    "models/deepseekv2/config_deepseekv2.py",
                    "L58 __init__(self, rope_scaling, **kwargs): a required argument",
                ),
                _c(
                    "models/deepseekv2/modeling_deepseekv2.py",
                    "L141-144 FA3.load_mla reads fa_q.scale, fa_k.scale",
                ),
                _c(
                    "models/deepseek/modeling_deepseek.py",
                    "L488-492 quantize = moe_quantize for the routed experts; "
                    "L601-603 restored; L631 shared_experts built after",
                ),
                _W8A8_LOAD,
                _c(
                    "docs/zh/user_guide/feature/fa3_quantization.md",
                    "FA3: DeepSeek R1/V3 only, float16 only",
                ),
            ),
        ),
        MindieModel(
            "kimi_k2",
            backend="atb",
            model="deepseekv2",
            fa3="FAKQuant",
            moe_quantize=True,
            shared="model",
            fa3_dtypes=("float16",),
            config_keys=("rope_scaling",),
            citations=(
                _c("models/__init__.py", "L113-114 kimi_k2 -> Kimik2Router"),
                _c(
                    "models/kimi_k2/router_kimi_k2.py",
                    "L21-27 Kimik2Router(Deepseekv2Router), model_type deepseekv2; "
                    "L74-79 get_config: KimiK2Config(DeepseekV2Config), "
                    "quantization_config.fa_quant_type -> NZ KV cache",
                ),
                _c(
                    "models/deepseekv2/modeling_deepseekv2.py",
                    "L141-144 FA3.load_mla reads fa_q.scale, fa_k.scale",
                ),
                _c(
                    "models/deepseek/modeling_deepseek.py",
                    "L488-492 quantize = moe_quantize for the routed experts; "
                    "L601-603 restored; L631 shared_experts built after",
                ),
                _W8A8_LOAD,
            ),
        ),
        MindieModel(
            "qwen2_moe",
            backend="atb",
            model="qwen2_moe",
            fa3=None,
            quantize_from="config.json",
            shared="model",
            attn="w8a8",
            config_aliases=(("num_experts", "num_local_experts"),),
            citations=(*_QWEN_MOE_ROUTER, _QWEN_MOE_ATTN, _QWEN_MOE_EXPERTS),
        ),
        MindieModel(
            "qwen3_moe",
            backend="atb",
            model="qwen2_moe",
            fa3=None,
            quantize_from="config.json",
            attn="w8a8",
            config_aliases=(("num_experts", "num_local_experts"),),
            citations=(*_QWEN_MOE_ROUTER, _QWEN_MOE_ATTN, _QWEN_MOE_EXPERTS),
        ),
        MindieModel(
            "glm4_moe",
            backend="atb",
            model="glm4_moe",
            fa3=None,
            moe_quantize=True,
            shared="model",
            config_keys=("rope_scaling",),
            attn_bias=True,
            citations=(
                _c(
                    "models/glm4_moe/modeling_glm4_moe.py",
                    "L243-246 attn_quantize; L254-261 q/k/v loaded with bias=True "
                    "(no attention_bias read)",
                ),
                _c(
                    "models/glm4_moe/modeling_glm4_moe.py",
                    "L157-160 quantize = moe_quantize for the routed experts; "
                    "L187-189 restored; L200-201 shared_experts built after; no FA3",
                ),
                _c(
                    "models/glm4_moe/config_glm4_moe.py",
                    "L51 __init__(self, rope_scaling, **kwargs): a required argument",
                ),
                _RUNNER_INT8,
            ),
        ),
        MindieModel(
            "mixtral",
            backend="atb",
            model="mixtral",
            fa3=None,
            moe_quantize=True,
            uniform=True,
            dtype="float16",
            citations=(
                _c(
                    "models/mixtral/flash_causal_mixtral.py",
                    "L165/L170 register_moe_layer(layer, self.quantize): the experts "
                    "registered with the model-level type; no enableFA3",
                ),
                _c(
                    "utils/data/weight_wrapper.py",
                    "L154-158 a w8a8 linear's quant_bias / deq_scale",
                ),
                _c("models/mixtral/config_mixtral.py", "L53 torch_dtype = float16"),
                _RUNNER_INT8,
            ),
        ),
        MindieModel(
            "deepseek_v32",
            backend="torch",
            model="deepseek_v32",
            fa3=None,
            citations=(
                _c(
                    "mindie_llm/runtime/models/deepseek_v32/router_deepseek_v32.py",
                    "DeepseekV32Router (the torch runtime only)",
                ),
                _c(
                    "mindie_llm/runtime/layers/quantization/ms_model_slim/"
                    "quantization_config.py",
                    "L67-100 per-linear type from the description; no fa_quant_type",
                ),
            ),
        ),
        *(
            MindieModel(t, **_NONE, citations=(_ROUTE, _NO_RUNTIME))
            for t in ("minimax_m2", "qwen3_next", "gemma3_text", "glm_moe_dsa")
        ),
        # MindIE 3.0.0 has no qwen3_5, gpt_oss nor llama4 model (atb_llm/models
        # and mindie_llm/runtime/models at 8b4871ad); the wrappers' language
        # models are listed under their own model_type too
        *(
            MindieModel(t, **_NONE, citations=(_ROUTE, _NO_RUNTIME))
            for t in (
                "qwen3_5",
                "qwen3_5_moe",
                "qwen3_5_text",
                "qwen3_5_moe_text",
                "gpt_oss",
                "llama4_text",
            )
        ),
        # nor a gemma4 model (atb_llm/models and mindie_llm/runtime/models at
        # 8b4871ad)
        MindieModel("gemma4_text", **_NONE, citations=(_ROUTE, _NO_RUNTIME)),
        MindieModel(
            "ernie4_5_moe",
            backend="atb",
            model="ernie_moe",
            fa3=None,
            attn="w8a8",
            refusal=(
                "its atb ernie_moe builds no FA3 (attention under config.json's "
                "attn_quantize, else static w8a8 for w8a8_dynamic) and serves only "
                "quantized linears, which ascend-fa does not write for ernie4_5_moe "
                "(no linear plan: routed experts, shared experts and moe_statics "
                "not yet judged by MindIE's own model construction); use --target "
                "vllm"
            ),
            citations=(
                _c(
                    "models/ernie_moe/flash_causal_ernie_moe.py",
                    "L84-89 attn_quantize, else w8a8 for w8a8_dynamic",
                ),
                _c(
                    "models/ernie_moe/modeling_ernie_moe.py",
                    "L41-55 the attention built under attn_quantize",
                ),
            ),
        ),
    )
}


def mindie_model(model_type: str | None) -> MindieModel | None:
    """The table's entry for ``model_type`` (None: a type ascend-fa does not
    calibrate, judged by the generic rules only)."""
    return MINDIE_MODELS.get(model_type) if model_type is not None else None


def shared_in_model_type(model_type: str | None) -> bool:
    """Whether MindIE loads ``model_type``'s shared experts under a static
    model-level ``quantize`` (they must then carry ``--linear``'s type, not
    W8A8_DYNAMIC)."""
    m = mindie_model(model_type)
    return m is not None and m.attn is None and (m.shared == "model" or m.uniform)


def mlp_per_token(model_type: str | None) -> bool:
    """Whether MindIE's model for ``model_type`` loads every linear but the
    attention's under ``quantize`` and the attention under its own (``attn``):
    the artifact then runs every MLP linear (dense MLPs, shared and routed
    experts) per token (W8A8_DYNAMIC, ``quantize`` ``w8a8_dynamic``) under
    ``--linear``'s attention type."""
    m = mindie_model(model_type)
    return m is not None and m.attn is not None


def mindie_refusal(
    model_type: str | None, *, linear_type: str | None, merge: bool = False
) -> str | None:
    """``calibrate --target mindie``'s one-line refusal for ``model_type`` with
    ``linear_type`` (the description's ``model_quant_type``), or None."""
    m = mindie_model(model_type)
    if m is None:
        return None
    head = f"--target mindie (MindIE 3.0.0) cannot run {model_type}"
    if m.model is None:
        return (
            f"{head}: MindIE has no model for it (no atb_llm/models nor "
            "mindie_llm/runtime/models folder: NotImplementedError 'unsupported "
            f"model type'); use --target vllm-ascend or vllm ({m.cites()})"
        )
    if m.refusal is not None:
        return f"{head}: {m.refusal} ({m.cites()})"
    if m.uniform and not merge and linear_type == "W8A8":
        return (
            f"{head} with --linear w8a8: its model loads every linear, the routed "
            "experts included, under one model-level quantize (its graph registers "
            "the experts with it), and the routed experts are W8A8_DYNAMIC; use "
            f"--linear w8a8_dynamic ({m.cites()})"
        )
    return None


LINEAR_TYPES = ("W8A8", "W8A8_DYNAMIC")


def attention_names(types: Mapping[str, str]) -> list[str]:
    return sorted(
        n.removesuffix(".q_proj.weight")
        for n in types
        if n.endswith(".self_attn.q_proj.weight")
    )


def config_quantize(
    m: MindieModel, model_quant_type: str, types: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """(``quantize``, ``attn_quantize``) a config.json-only router needs for these
    linear types: ``quantize`` the MLP linears' type (W8A8_DYNAMIC wherever a
    linear of the MLP is, as every MLP linear loads under it), ``attn_quantize``
    the attention's type where the model's own choice (``attn``) differs."""
    if model_quant_type == "FLOAT":
        return None, None
    mlp = {t for n, t in types.items() if ".mlp." in n and t in LINEAR_TYPES}
    quantize = "w8a8_dynamic" if "W8A8_DYNAMIC" in mlp else model_quant_type.lower()
    if m.attn is None:
        return quantize, None
    attn = {types.get(f"{a}.q_proj.weight") for a in attention_names(types)}
    attn -= {"FLOAT", None}  # a layer whose attention fell back to float loads as is
    attn_type = next(iter(attn)).lower() if len(attn) == 1 else None
    implied = m.attn if quantize == "w8a8_dynamic" else quantize
    if attn_type in ("w8a8", "w8a8_dynamic") and attn_type != implied:
        return quantize, attn_type
    return quantize, None


def mindie_attention_biases(
    model_type: str | None, shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, int]]:
    """The q/k/v biases MindIE's model for ``model_type`` loads that the
    checkpoint lacks (``attn_bias``: glm4_moe loads them whatever
    ``attention_bias`` says), as (name, length): written as exact zeros, the
    attention's output is unchanged. ``shapes``: the checkpoint's weight shapes."""
    m = mindie_model(model_type)
    if m is None or not m.attn_bias:
        return []
    out = []
    for attn in attention_names(dict.fromkeys(shapes, "")):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"{attn}.{proj}.bias"
            weight = shapes.get(f"{attn}.{proj}.weight")
            if name not in shapes and weight is not None:
                out.append((name, int(weight[0])))
    return out


def mindie_config(
    model_type: str | None,
    model_quant_type: str,
    mixed: bool,
    cfg: Mapping[str, Any],
    types: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The config.json keys MindIE's router for ``model_type`` needs beside the
    source's: ``quantize`` where the router reads only config.json (the MLP
    linears' type, ``types`` the description's), ``attn_quantize`` where the
    attention's type is not the one the model picks itself, ``moe_quantize`` where
    the model reads it and the experts differ from the model-level type,
    ``attention_bias`` where the model loads q/k/v biases (written as zeros when
    the source has none), a required ``rope_scaling`` (None when the source has
    none)."""
    m = mindie_model(model_type)
    out: dict[str, Any] = {}
    if m is None or m.backend != "atb":  # no model, or the runtime (per linear)
        return {"moe_quantize": "w8a8_dynamic"} if mixed else {}
    if m.quantize_from == "config.json" and model_quant_type != "FLOAT":
        quantize, attn = config_quantize(m, model_quant_type, types or {})
        out["quantize"] = quantize
        if attn is not None:
            out["attn_quantize"] = attn
    if m.moe_quantize and mixed:
        out["moe_quantize"] = "w8a8_dynamic"
    if m.attn_bias and cfg.get("attention_bias") is not True:
        out["attention_bias"] = True
    out.update(mindie_required_keys(model_type, cfg))
    return out


def mindie_required_keys(model_type: str | None, cfg: Mapping[str, Any]) -> dict:
    """The config.json keys MindIE's config class for ``model_type`` requires and
    ``cfg`` lacks (None), or reads under transformers 4's name where ``cfg`` has
    only transformers 5's: what a merged export needs whatever its linears are."""
    m = mindie_model(model_type)
    out: dict[str, Any] = {}
    if m is None or m.backend != "atb":
        return out
    for key in m.config_keys:
        if key not in cfg:
            out[key] = None
    for key, alias in m.config_aliases:
        if key not in cfg and alias in cfg:
            out[key] = cfg[alias]
    return out
