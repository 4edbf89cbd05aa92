"""An executable model of MindIE 3.0.0's loader (default backend ``atb``), per family.

It walks the load path of Ascend/MindIE-LLM @8b4871ad (= tag v3.0.0) as the code
is written, on an artifact directory: the router (which model folder, where
``quantize`` comes from, which config keys its config class requires), then every
decoder layer's modules in the order the model builds them, asking for the tensors
each one loads under the ``quantize`` value in force at that point. It returns
what was asked (``Load.asked``) and raises :class:`MindieLoadError` with MindIE's
own error where MindIE stops. It is independent of :mod:`ascend_fa`'s own rules
(:mod:`ascend_fa.artifact.mindie_models`), which it checks.

Paths are under ``examples/atb_models/atb_llm/`` unless they start with
``mindie_llm/``; each rule cites the line it was read from (``# MindIE: ...``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

#: MindIE: models/__init__.py L71-73 (deepseek_v3 -> deepseekv2), L113-114 and
#: kimi_k2/router_kimi_k2.py L21-27 (kimi_k2 -> Kimik2Router, deepseekv2), L94-97 (no
#: folder: NotImplementedError); qwen3/router_qwen3.py L24 (qwen3 -> qwen2 model);
#: mistral/router_mistral.py L19 (-> llama); qwen3_moe/router_qwen3_moe.py L24-26
#: (-> qwen2_moe model). The atb_llm/models folders at 8b4871ad have no
#: minimax / qwen3_next / gemma3 / glm_moe_dsa; deepseek_v32 runs on the torch
#: runtime only (mindie_llm/runtime/models/deepseek_v32), not modelled here.
ROUTES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "deepseek_v3": "deepseekv2",
    "kimi_k2": "deepseekv2",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen2_moe",
    "glm4_moe": "glm4_moe",
    "mixtral": "mixtral",
    # base/router.py L138-139 and models/__init__.py L148: ernie4_5_moe ->
    # ernie_moe
    "ernie4_5_moe": "ernie_moe",
}
#: MindIE: the routers that override the base ``config`` property and never read
#: quant_model_description.json (qwen2_moe/router_qwen2_moe.py L22-29,
#: qwen3_moe/router_qwen3_moe.py L29-34; mistral/router_mistral.py L22-27:
#: LlamaConfig.from_pretrained, config.json only); the others take
#: ``quantize = model_quant_type.lower()`` (base/router.py L217-218) and the
#: description into ``quantization_config`` (fa_quant_type included, L227-233).
CONFIG_ONLY_ROUTERS = ("qwen2_moe", "qwen3_moe", "mistral")
#: MindIE: the models that build FA3 when fa_quant_type is set: base/modeling.py
#: L96-97 (llama), qwen2/modeling_qwen2.py L147-149, deepseekv2/
#: modeling_deepseekv2.py L141-144 (FA3.load_mla: fa_q.scale and fa_k.scale only,
#: utils/layers/attention/fa3.py load_mla). qwen2_moe, glm4_moe and mixtral have no
#: FA3 (no enableFA3 in their flash_causal files).
FA3 = {
    "llama": ("fa_q.scale", "fa_q.offset", "fa_k.scale", "fa_k.offset", "fa_v.scale",
              "fa_v.offset"),
    "qwen2": ("fa_q.scale", "fa_q.offset", "fa_k.scale", "fa_k.offset", "fa_v.scale",
              "fa_v.offset"),
    "deepseekv2": ("fa_q.scale", "fa_k.scale"),
}  # fmt: skip
#: MindIE: the models that swap quantize for moe_quantize while loading the routed
#: experts and restore it before the shared experts: deepseek/modeling_deepseek.py
#: L488-492, L601-603, L631; glm4_moe/modeling_glm4_moe.py L157-160, L187-189,
#: L200-201; mixtral/modeling_mixtral.py L138-141, L198-200.
MOE_QUANTIZE_READERS = ("deepseekv2", "glm4_moe", "mixtral")
#: MindIE: mixtral/flash_causal_mixtral.py L165/L170 register the experts with the
#: model-level quantize (weight_wrapper.py L154-158 reads a w8a8 linear's
#: quant_bias and deq_scale).
GRAPH_MODEL_LEVEL_EXPERTS = ("mixtral",)
#: MindIE: qwen2/modeling_qwen2.py L154-163 (``FlashQwenAttention``, the attention
#: of qwen2_moe, modeling_qwen2_moe.py L52): the attention loads under
#: config.json's ``attn_quantize`` when present, else under ``w8a8`` when a "moe"
#: model's quantize is ``w8a8_dynamic``; glm4_moe/modeling_glm4_moe.py L243-246 reads
#: ``attn_quantize`` only; ernie_moe/flash_causal_ernie_moe.py L84-89 and
#: modeling_ernie_moe.py L41-55 as qwen2_moe.
OWN_ATTN_QUANTIZE = {"qwen2_moe": "w8a8", "ernie_moe": "w8a8"}
ATTN_QUANTIZE_READERS = ("qwen2_moe", "glm4_moe", "ernie_moe")
#: MindIE: glm4_moe/modeling_glm4_moe.py L254-261: q/k/v loaded with ``bias=True``
#: whatever ``attention_bias`` says; the others follow ``attention_bias``
#: (qwen2/modeling_qwen2.py L172-177 ``bias=config.attention_bias``).
ATTN_BIAS = ("glm4_moe",)
#: MindIE: glm4_moe/config_glm4_moe.py L51, deepseekv2/config_deepseekv2.py L58
#: ``__init__(self, rope_scaling, **kw)``.
REQUIRED_CONFIG_KEYS = {"glm4_moe": ("rope_scaling",), "deepseekv2": ("rope_scaling",)}
#: MindIE: mixtral/config_mixtral.py L53 ``self.torch_dtype = torch.float16``.
FORCED_DTYPE = {"mixtral": "float16"}


class MindieLoadError(Exception):
    """Where MindIE stops, with its own message."""


@dataclass
class Load:
    """What the walk asked for: tensor name -> the quantize it was loaded under."""

    model: str
    quantize: str | None
    fa_quant_type: str | None
    dtype: str
    asked: dict[str, str | None] = field(default_factory=dict)
    fa_read: set[str] = field(default_factory=set)


class _Checkpoint:
    def __init__(self, path: Path) -> None:
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, list[int]] = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    sl = st.get_slice(name)
                    self.dtypes[name] = str(sl.get_dtype())
                    self.shapes[name] = list(sl.get_shape())


def _linear(ck: _Checkpoint, load: Load, prefix: str, quantize: str | None) -> None:
    """One linear under ``quantize`` (utils/weights.py get_multi_weights_col /
    get_sharded): the weight always (L253 ``weight ... does not exist``); a float
    weight returns early (L762-763, L791-792) unless the model is float; int8
    under w8a8 reads deq_scale, quant_bias, input_scale, input_offset (L758-770);
    under w8a8_dynamic weight_scale, weight_offset (L773-799); an int8 weight
    under a float model: FastLinear's ValueError (fast_linear.py L32-33)."""
    name = f"{prefix}.weight"
    _ask(ck, load, name, quantize)
    if ck.dtypes[name] in ("F16", "BF16"):
        return
    if quantize is None or quantize == "float":
        raise MindieLoadError(
            f"{name}: ValueError: linear type not matched, please check "
            "`config.json` `quantize` parameter"
        )
    out = ck.shapes[name][0]
    if quantize == "w8a8":
        want = {"deq_scale": [out], "quant_bias": [out]}
        deq = "F32" if load.dtype == "bfloat16" else "I64"
        for suffix, shape in want.items():
            _ask(ck, load, f"{prefix}.{suffix}", quantize, shape)
        _dtype(ck, f"{prefix}.deq_scale", deq)
        _dtype(ck, f"{prefix}.quant_bias", "I32")
        for suffix in ("input_scale", "input_offset"):
            _ask(ck, load, f"{prefix}.{suffix}", quantize)
    elif quantize == "w8a8_dynamic":
        for suffix in ("weight_scale", "weight_offset"):
            _ask(ck, load, f"{prefix}.{suffix}", quantize, [out, 1])
    else:
        raise MindieLoadError(f"{name}: quantize {quantize!r} not modelled")


def _ask(
    ck: _Checkpoint,
    load: Load,
    name: str,
    quantize: str | None,
    shape: list[int] | None = None,
) -> None:
    if name not in ck.dtypes:
        raise MindieLoadError(f"AssertionError: weight {name} does not exist")
    if shape is not None and ck.shapes[name] != shape:
        raise MindieLoadError(f"{name}: shape {ck.shapes[name]}, loads {shape}")
    load.asked[name] = quantize


def _dtype(ck: _Checkpoint, name: str, want: str) -> None:
    if ck.dtypes[name] != want:
        raise MindieLoadError(f"{name}: {ck.dtypes[name]}, MindIE loads {want}")


def _router(model_type: str, cfg: dict[str, Any], desc: dict[str, Any] | None):
    model = ROUTES.get(model_type)
    if model is None:
        raise MindieLoadError(
            f"NotImplementedError: unsupported model type: {model_type}"
        )
    for key in REQUIRED_CONFIG_KEYS.get(model, ()):
        if key not in cfg:
            raise MindieLoadError(
                f"TypeError: __init__() missing 1 required positional argument: '{key}'"
            )
    quantize = cfg.get("quantize")
    fa = None
    if model_type not in CONFIG_ONLY_ROUTERS and desc is not None:
        if quantize is None and desc.get("model_quant_type") is not None:
            quantize = str(desc["model_quant_type"]).lower()
        fa = desc.get("fa_quant_type")
    return model, quantize, fa


def load_artifact(path: str | Path) -> Load:
    """Walk MindIE 3.0.0's atb load path on the artifact at ``path``."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    dfile = path / "quant_model_description.json"
    desc = json.loads(dfile.read_text()) if dfile.is_file() else None
    model, quantize, fa = _router(str(cfg.get("model_type")), cfg, desc)
    dtype = FORCED_DTYPE.get(model) or str(cfg.get("torch_dtype"))
    if dtype not in ("float16", "bfloat16"):
        raise MindieLoadError(f"torch_dtype {dtype!r}: model_runner loads fp16/bf16")
    load = Load(model, quantize, fa, dtype)
    ck = _Checkpoint(path)
    for i in range(int(cfg["num_hidden_layers"])):
        _layer(ck, load, cfg, i)
    _ask(ck, load, "model.embed_tokens.weight", None)
    _ask(ck, load, "model.norm.weight", None)
    if not cfg.get("tie_word_embeddings"):
        _linear(ck, load, "lm_head", quantize)
    return load


def _layer(ck: _Checkpoint, load: Load, cfg: dict[str, Any], i: int) -> None:
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    q = load.quantize
    if load.model == "deepseekv2":
        # deepseekv2/flash_causal_deepseekv2.py L269-271: mla_quantize = quantize
        heads = [f"{a}.kv_a_proj_with_mqa", f"{a}.kv_b_proj", f"{a}.o_proj"]
        if cfg.get("q_lora_rank"):
            heads += [f"{a}.q_a_proj", f"{a}.q_b_proj"]
        else:
            heads.append(f"{a}.q_proj")
    else:
        heads = [f"{a}.{n}_proj" for n in ("q", "k", "v", "o")]
    attn_q = q
    if load.model in ATTN_QUANTIZE_READERS and cfg.get("attn_quantize") is not None:
        attn_q = cfg["attn_quantize"]
    elif load.model in OWN_ATTN_QUANTIZE and q == "w8a8_dynamic":
        attn_q = OWN_ATTN_QUANTIZE[load.model]
    for lin in heads:
        _linear(ck, load, lin, attn_q)
    if load.model in ATTN_BIAS or cfg.get("attention_bias"):
        for lin in heads[:3]:
            _ask(ck, load, f"{lin}.bias", None)
    if load.fa_quant_type is not None and load.model in FA3:
        # stricter than MindIE: FA3.load_mla falls back to scales of 1 when its
        # two tensors are missing (fa3.py load_mla: except AssertionError)
        for t in FA3[load.model]:
            _ask(ck, load, f"{a}.{t}", q)
            load.fa_read.add(f"{a}.{t}")
    _ask(ck, load, f"{p}.input_layernorm.weight", None)
    _ask(ck, load, f"{p}.post_attention_layernorm.weight", None)
    _mlp(ck, load, cfg, i, p)


def _dense(cfg: dict[str, Any], model: str, i: int) -> bool:
    """deepseek / glm4_moe: first_k_dense_replace; qwen2_moe: mlp_only_layers and
    decoder_sparse_step (configuration_qwen2_moe.py L45-52); llama / qwen2: every
    layer; mixtral: none."""
    if model in ("llama", "qwen2"):
        return True
    if model == "mixtral":
        return False
    if model == "qwen2_moe":
        step = int(cfg.get("decoder_sparse_step") or 1)
        return i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step != 0
    return i < int(cfg.get("first_k_dense_replace") or 0)


def _mlp(ck: _Checkpoint, load: Load, cfg: dict[str, Any], i: int, p: str) -> None:
    q = load.quantize
    if _dense(cfg, load.model, i):
        for n in ("gate_proj", "up_proj", "down_proj"):
            _linear(ck, load, f"{p}.mlp.{n}", q)
        return
    if load.model == "mixtral":
        block, projs, n = (
            f"{p}.block_sparse_moe",
            ("w1", "w3", "w2"),
            "n_routed_experts",
        )
    else:
        block, projs = f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")
        n = "num_experts" if load.model == "qwen2_moe" else "n_routed_experts"
    # qwen2_moe/configuration_qwen2_moe.py L28: num_experts defaults to 60;
    # mixtral/config_mixtral.py L49: attribute_map num_local_experts ->
    # n_routed_experts
    experts = cfg.get(n, cfg.get("num_local_experts") if n != "num_experts" else 60)
    _ask(ck, load, f"{block}.gate.weight", None)
    routed = q
    if load.model in MOE_QUANTIZE_READERS and cfg.get("moe_quantize") is not None:
        routed = cfg["moe_quantize"]
    for e in range(int(experts)):
        for proj in projs:
            _linear(ck, load, f"{block}.experts.{e}.{proj}", routed)
            if load.model in GRAPH_MODEL_LEVEL_EXPERTS and routed != q:
                _linear(ck, load, f"{block}.experts.{e}.{proj}", q)
    shared = {"deepseekv2": "shared_experts", "glm4_moe": "shared_experts"}.get(
        load.model
    )
    if load.model == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        shared = "shared_expert"
        _ask(ck, load, f"{block}.shared_expert_gate.weight", None)
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _linear(ck, load, f"{block}.{shared}.{proj}", q)


def unread_fa(path: str | Path, load: Load) -> list[str]:
    """The attention modules with fa_* tensors of which the model reads none (no
    FA3 built there). MLA's ``FA3.load_mla`` reads fa_q.scale and fa_k.scale (the
    latent is K and V); the offsets and fa_v of msModelSlim's format ride along."""
    ck = _Checkpoint(Path(path))
    have = {n.split(".fa_")[0] for n in ck.dtypes if ".fa_" in n}
    read = {n.split(".fa_")[0] for n in load.fa_read}
    return sorted(have - read)
