"""Builders the tests share: tiny real transformers models, a byte-level tokenizer,
scale maps, and on-disk checkpoints and artifacts.

Every model here is a real transformers model built from its config with random
weights (``torch.manual_seed(seed)`` first, so a builder call is reproducible).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEEPSEEK_TINY",
    "MOE_TINY",
    "save_tiny_moe",
    "WRAPPED_TEXT",
    "save_tiny_wrapper",
    "artifact_tensors",
    "int8_fraction",
    "plan_int8_fraction",
    "byte_tokenizer",
    "tiny_causal_lm",
    "tiny_deepseek",
    "tiny_llama",
    "save_tiny",
    "save_kimi_k2",
    "add_mtp_layer",
    "scale_map",
    "SyntheticW8A8Linear",
    "quantize_linears",
    "msmodelslim_export",
    "TF4_LLAMA3_CONFIG",
    "TF4_QWEN3_CONFIG",
    "TF4_SOURCE_FILES",
    "transformers4_source",
]

#: A DeepSeek-V3 small enough for unit tests: MLA (R = 32, rope 8, nope 16, v 16),
#: MoE from layer 1 (4 routed experts, 1 shared), 4 heads.
DEEPSEEK_TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)


_MOE_COMMON: dict[str, Any] = dict(
    vocab_size=260,
    max_position_embeddings=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
)
#: Tiny MoE checkpoints of the GQA + MoE families: 4 layers, 4 routed experts,
#: every family's own MLP layout (shared experts, gates, first dense layers,
#: partial RoPE) switched on.
MOE_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        partial_rotary_factor=0.5,
    ),
    "mixtral": dict(num_local_experts=4),
    "minimax_m2": dict(
        num_local_experts=4, rotary_dim=8, bos_token_id=None, eos_token_id=257
    ),
}


def save_tiny_moe(path: Path, model_type: str, *, seed: int = 0, **extra: Any) -> Path:
    """A bf16 tiny checkpoint of MoE ``model_type`` (:data:`MOE_TINY`) with the
    byte tokenizer."""
    config = {**_MOE_COMMON, **MOE_TINY[model_type], **extra}
    model = tiny_causal_lm(model_type, seed=seed, attn=None, **config)
    model.to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


#: The language model of a tiny Qwen3.5 wrapper: 4 layers, the last one full
#: attention. vllm-ascend sizes one KV block to hold exactly one Gated DeltaNet
#: state (its patch_mamba_config.py asserts "Cannot align ssm_page_size and
#: attn_page_size" otherwise): [linear_num_value_heads, linear_key_head_dim,
#: linear_value_head_dim] = 4 x 32 x 32 = 128 tokens x Hkv 2 x D 16.
WRAPPED_TEXT: dict[str, Any] = dict(
    vocab_size=260,
    max_position_embeddings=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
_WRAPPED_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
#: wrapper model_type -> (its config class, its model class) in transformers
_WRAPPERS = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}


def save_tiny_wrapper(path: Path, model_type: str, *, seed: int = 0) -> Path:
    """A bf16 tiny multimodal checkpoint ``model_type`` (``qwen3_5`` /
    ``qwen3_5_moe``) as released: transformers' ``...ForConditionalGeneration``
    (``model.language_model.*``, a one-block vision tower ``model.visual.*``,
    ``lm_head``) with :data:`WRAPPED_TEXT`, and the byte tokenizer."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in _WRAPPERS[model_type])
    text = {**WRAPPED_TEXT, **(_WRAPPED_MOE if model_type.endswith("moe") else {})}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
        out_hidden_size=WRAPPED_TEXT["hidden_size"], num_position_embeddings=16,
        patch_size=4,
    )  # fmt: skip
    torch.manual_seed(seed)
    config = config_cls(
        text_config=text, vision_config=vision, tie_word_embeddings=False
    )
    model = model_cls(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def byte_tokenizer(padding_side: str = "right") -> Any:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens, ``<pad>`` = 256,
    ``</s>`` = 257 (vocabulary 258; the tiny models use 260)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"<pad>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        padding_side=padding_side,
    )


def tiny_causal_lm(
    model_type: str, *, seed: int = 0, attn: str | None = "sdpa", **config: Any
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type,
    **config))`` in eval mode, after ``torch.manual_seed(seed)``; ``attn`` sets the
    attention implementation (None keeps transformers' default)."""
    import transformers

    torch.manual_seed(seed)
    if attn is not None:
        config["attn_implementation"] = attn
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tiny_llama(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """LLaMA, hidden 64, 2 layers, 4 query heads, 2 KV heads (head_dim 16),
    vocabulary 260 (fits :func:`byte_tokenizer`), SDPA attention."""
    config: dict[str, Any] = dict(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config.update(overrides)
    return tiny_causal_lm("llama", seed=seed, **config)


def tiny_deepseek(seed: int = 0, attn: str | None = "sdpa", **overrides: Any) -> Any:
    """DeepSeek-V3 with :data:`DEEPSEEK_TINY` (``overrides`` replace entries)."""
    config = {**DEEPSEEK_TINY, **overrides}
    return tiny_causal_lm("deepseek_v3", seed=seed, attn=attn, **config)


def save_tiny(
    path: Path,
    model_type: str,
    padding_side: str = "right",
    dtype: torch.dtype | None = None,
    **extra: Any,
) -> Path:
    """A tiny checkpoint directory (safetensors + config + byte tokenizer) of
    ``model_type``: ``deepseek_v3`` (:data:`DEEPSEEK_TINY`), ``gpt2`` (no FA
    adapter: for refusals), or a GQA type (6 heads / 2 KV heads, head_dim 8,
    tied embeddings)."""
    common: dict[str, Any] = dict(vocab_size=260, max_position_embeddings=128)
    if model_type == "deepseek_v3":
        kw: dict[str, Any] = dict(DEEPSEEK_TINY)
    elif model_type == "gpt2":
        kw = dict(n_embd=16, n_layer=1, n_head=2, n_positions=128, vocab_size=260)
        common = {}
    else:
        kw = dict(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
        )
    model = tiny_causal_lm(model_type, attn=None, **{**common, **kw, **extra})
    if dtype is not None:  # a checkpoint stored in dtype (config torch_dtype too)
        model = model.to(dtype)
    model.save_pretrained(path)
    byte_tokenizer(padding_side).save_pretrained(path)
    return path


#: Kimi-K2 ships its DeepSeek-V3 config class for ``--trust-remote-code``
#: (config.json ``auto_map`` ``AutoConfig``); this one keeps every key of
#: config.json as an attribute under Kimi-K2's model_type.
KIMI_CONFIG_PY = """from transformers.configuration_utils import PretrainedConfig


class DeepseekV3Config(PretrainedConfig):
    model_type = "kimi_k2"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def save_kimi_k2(path: Path, **extra: Any) -> Path:
    """A tiny Kimi-K2 checkpoint: the DeepSeek-V3 of :func:`save_tiny` (bf16, the
    router keys of a released config: ``noaux_tc``, sigmoid scoring; no MTP) whose
    config.json is Kimi-K2's shape: ``model_type: kimi_k2``, ``architectures:
    [DeepseekV3ForCausalLM]``, RoPE as the top-level ``rope_theta`` /
    ``rope_scaling`` (no transformers-5 ``rope_parameters``), and an ``auto_map``
    to its own config class (``configuration_deepseek.py``)."""
    import json

    # Kimi-K2 has no MTP layer (num_nextn_predict_layers 0, as released)
    kw: dict[str, Any] = dict(
        topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0
    )
    save_tiny(path, "deepseek_v3", dtype=torch.bfloat16, **{**kw, **extra})
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config.update(
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=None,
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "configuration_deepseek.py").write_text(KIMI_CONFIG_PY)
    return path


def add_mtp_layer(path: Path, seed: int = 5) -> Path:
    """Turn the last decoder layer of the DeepSeek-V3 checkpoint at ``path`` into
    its multi-token-prediction layer, as DeepSeek-V3's release stores it:
    ``model.layers.<num_hidden_layers>.*`` (the decoder block's own names) plus
    ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]``, ``shared_head.norm`` /
    ``shared_head.head`` and ``embed_tokens``; config.json says one layer fewer and
    ``num_nextn_predict_layers: 1``."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    mtp = int(config["num_hidden_layers"]) - 1
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    dtype = tensors["model.embed_tokens.weight"].dtype
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    pre = f"model.layers.{mtp}."
    tensors[pre + "enorm.weight"] = torch.ones(h, dtype=dtype)
    tensors[pre + "hnorm.weight"] = torch.ones(h, dtype=dtype)
    tensors[pre + "eh_proj.weight"] = rand(h, 2 * h)
    tensors[pre + "shared_head.norm.weight"] = torch.ones(h, dtype=dtype)
    tensors[pre + "shared_head.head.weight"] = rand(v, h)
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config.update(num_hidden_layers=mtp, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def scale_map(
    attns: list[str], heads: tuple[int, int, int], seed: int = 0
) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``{attn: {fa_x: (scale [H] in [1e-3, 0.101), zeros int8 [H])}}`` with
    ``heads`` = (q heads, k heads, v heads)."""
    g = torch.Generator().manual_seed(seed)
    return {
        a: {
            b: (
                torch.rand(h, generator=g) * 0.1 + 1e-3,
                torch.zeros(h, dtype=torch.int8),
            )
            for b, h in zip(("fa_q", "fa_k", "fa_v"), heads, strict=True)
        }
        for a in attns
    }


class SyntheticW8A8Linear(torch.nn.Module):
    """A small real module implementing the ``QuantizedLinear`` protocol (the
    W8A8 linears of the package are built elsewhere): symmetric per-channel int8
    weight, and for ``"W8A8"`` a static per-tensor int8 input scale (``W8A8_DYNAMIC``
    quantizes the input per token at run time). ``forward`` runs the integer
    arithmetic in fp64 (exact for these sizes) and dequantizes.

    ``export_tensors`` returns the consumer tensors (vllm-ascend
    ``methods/w8a8_static.py`` / ``w8a8_dynamic.py`` names): ``weight`` int8
    ``[out, in]``, ``weight_scale``/``weight_offset`` ``[out, 1]``; static adds
    ``input_scale`` ``[1]`` (model dtype), ``input_offset`` ``[1]`` int8,
    ``quant_bias`` int32 ``[out]``, ``deq_scale`` fp32 ``[out]``.
    """

    def __init__(
        self,
        linear: torch.nn.Linear,
        quant_type: str = "W8A8",
        input_absmax: float = 4.0,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        ws = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=2**-23)
        self.quant_type = quant_type
        self.dtype = dtype
        self.register_buffer("qweight", torch.round(w / ws).clamp(-128, 127))
        self.register_buffer("weight_scale", ws)
        self.register_buffer("input_scale", torch.tensor([input_absmax / 127]))
        bias = linear.bias
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float().clone()
        )

    def _quant_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.double()
        if self.quant_type == "W8A8":
            s = self.input_scale.double()
        else:
            s = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=2**-23)
        return torch.round(xf / s).clamp(-128, 127), s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self._quant_input(x)
        acc = q @ self.qweight.double().t()
        y = acc * s * self.weight_scale.double().t()
        if self.bias is not None:
            y = y + self.bias.double()
        return y.to(x.dtype)

    def export_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {
            f"{prefix}.weight": self.qweight.to(torch.int8),
            f"{prefix}.weight_scale": self.weight_scale.to(self.dtype),
            f"{prefix}.weight_offset": torch.zeros_like(self.weight_scale).to(
                self.dtype
            ),
        }
        if self.quant_type == "W8A8":
            deq = (self.input_scale * self.weight_scale[:, 0]).float()
            bias = self.bias if self.bias is not None else torch.zeros(deq.shape)
            out[f"{prefix}.input_scale"] = self.input_scale.to(self.dtype)
            out[f"{prefix}.input_offset"] = torch.zeros(1, dtype=torch.int8)
            out[f"{prefix}.quant_bias"] = torch.round(bias / deq).to(torch.int32)
            out[f"{prefix}.deq_scale"] = deq
        return out


def quantize_linears(
    model: torch.nn.Module,
    quant_type: str = "W8A8",
    *,
    skip: tuple[str, ...] = ("lm_head",),
    dtype: torch.dtype = torch.bfloat16,
) -> list[str]:
    """Replace every ``nn.Linear`` (but names ending in ``skip``) with a
    :class:`SyntheticW8A8Linear` through ``set_submodule``; returns the names."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith(skip)
    ]
    for n in names:
        model.set_submodule(
            n, SyntheticW8A8Linear(model.get_submodule(n), quant_type, dtype=dtype)
        )
    return names


def msmodelslim_export(
    path: Path,
    model_dir: Path,
    *,
    layout: str = "single",
    quant_type: str = "W8A8",
    keep_quant_config: bool = False,
) -> dict[str, str]:
    """An msModelSlim-shaped W8A8 export of the checkpoint in ``model_dir``
    (seed 003 / msmodelslim 26.1.0 ascendv1 layout): every linear of the decoder
    layers quantized (``quant_model_weights*``), other tensors bf16 ``FLOAT``,
    ``quant_model_description.json``, ``config.json`` with ``torch_dtype`` (and the
    source's ``quantization_config`` only with ``keep_quant_config``, as an older
    export may have it), tokenizer files. ``layout``: ``single``
    (``quant_model_weights.safetensors``), ``shards`` (two shards + index) or
    ``legacy`` (``quant_model_weight_w8a8.safetensors``). Returns the description.
    """
    import json

    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    quantize_linears(model, quant_type, skip=("lm_head",))
    from ascend_fa.artifact import checkpoint_tensors

    ckpt = checkpoint_tensors(model, torch.bfloat16, tied_copies=True)
    path.mkdir(parents=True)
    desc: dict[str, Any] = {
        "model_quant_type": quant_type,
        "version": "1.0.0",
        "group_size": 0,
        "metadata": {},
        **ckpt.types,
    }
    names = list(ckpt.tensors)
    if layout == "shards":
        half = len(names) // 2
        weight_map = {}
        for i, part in enumerate((names[:half], names[half:]), start=1):
            fname = f"quant_model_weights-0000{i}-of-00002.safetensors"
            save_file({k: ckpt.tensors[k] for k in part}, str(path / fname))
            weight_map.update(dict.fromkeys(part, fname))
        (path / "quant_model_weights.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
        )
    else:
        fname = {
            "single": "quant_model_weights.safetensors",
            "legacy": "quant_model_weight_w8a8.safetensors",
        }[layout]
        save_file(ckpt.tensors, str(path / fname))
    (path / "quant_model_description.json").write_text(json.dumps(desc, indent=1))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    if keep_quant_config:
        cfg["quantization_config"] = {"quant_method": "w8a8"}
    else:
        cfg.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / f).is_file():
            (path / f).write_bytes((model_dir / f).read_bytes())
    return desc


#: A Llama-3.1 config.json as transformers 4.x writes it (the keys and spelling of
#: meta-llama/Llama-3.1-8B's, written by transformers 4.43): top-level
#: ``rope_theta`` and a ``llama3`` ``rope_scaling`` dict, ``torch_dtype``; sizes
#: shrunk to a tiny model.
TF4_LLAMA3_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 260,
}

#: A Qwen3 config.json as transformers 4.51 writes it (Qwen/Qwen3-0.6B's keys):
#: an integer ``rope_theta``, ``rope_scaling`` null, tied embeddings; tiny sizes.
TF4_QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 260,
}

#: The other model files of the sources above, byte for byte as written.
TF4_SOURCE_FILES: dict[str, str] = {
    "generation_config.json": (
        '{\n  "bos_token_id": 256,\n  "do_sample": true,\n  "eos_token_id": [\n'
        '    257\n  ],\n  "temperature": 0.6,\n  "top_p": 0.9,\n'
        '  "transformers_version": "4.43.0.dev0"\n}\n'
    ),
    "special_tokens_map.json": (
        '{\n  "eos_token": "</s>",\n  "pad_token": "<pad>"\n}\n'
    ),
    "chat_template.jinja": (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
    "LICENSE.txt": "tiny test model, no license terms\n",
}


def transformers4_source(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A checkpoint directory whose config.json is ``config`` written as
    transformers 4.x writes it (``json.dumps(indent=2, sort_keys=True)`` + a
    newline), with random bf16 weights, the byte tokenizer and
    :data:`TF4_SOURCE_FILES`."""
    import json

    import transformers

    path.mkdir(parents=True)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (path / "config.json").write_text(text)
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(text)  # save_pretrained rewrote it
    for name, content in TF4_SOURCE_FILES.items():
        (path / name).write_text(content)
    return path


def artifact_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def int8_fraction(src: Path, out: Path) -> float:
    """Of the source checkpoint's linear weight elements (2-D, not norms,
    embeddings or the head), the share the artifact ``out`` describes as W8A8 /
    W8A8_DYNAMIC (and holds as int8: asserted)."""
    import json

    desc = json.loads((Path(out) / "quant_model_description.json").read_text())
    art = artifact_tensors(out)
    total = int8 = 0
    for name, t in artifact_tensors(src).items():
        if t.dim() != 2 or "norm" in name or "embed" in name or "lm_head" in name:
            continue
        total += t.numel()
        if desc.get(name) in ("W8A8", "W8A8_DYNAMIC"):
            assert art[name].dtype == torch.int8, name
            int8 += t.numel()
    return int8 / total


def plan_int8_fraction(model: torch.nn.Module, *, head: bool = True) -> float:
    """Of ``model``'s linear weight elements (linears and fused routed experts;
    ``lm_head`` counted as float when ``head``), the share its linear plan
    quantizes (the groups' linears and the routed experts)."""
    from ascend_fa.linear import linear_plan

    plans = linear_plan(model)
    quantized = {n for p in plans for g in p.groups for n in g.linears}
    quantized |= {p.experts.linears[0] for p in plans if p.experts is not None}
    total = int8 = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (head or "lm_head" not in name):
            n = module.weight.numel()
        elif hasattr(module, "gate_up_proj") and module.gate_up_proj.dim() == 3:
            n = module.gate_up_proj.numel() + module.down_proj.numel()
        else:
            continue
        total += n
        int8 += n if name in quantized else 0
    return int8 / total
