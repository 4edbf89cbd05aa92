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
    "byte_tokenizer",
    "tiny_causal_lm",
    "tiny_deepseek",
    "tiny_llama",
    "save_tiny",
    "scale_map",
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
    path: Path, model_type: str, padding_side: str = "right", **extra: Any
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
    model = tiny_causal_lm(model_type, attn=None, **common, **kw, **extra)
    model.save_pretrained(path)
    byte_tokenizer(padding_side).save_pretrained(path)
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
