"""FAQuant adapter for transformers' GQA/MHA decoders: llama, qwen2, qwen3, mistral,
the MoE GQA families, gemma3_text (its sliding-window and full layers alike) and the
full-attention layers of qwen3_next (gated attention: its ``q_proj`` gives
the query and a per-channel output gate; the attention function receives the query
alone, after ``q_norm`` and partial RoPE, and the gate multiplies the output after).

The registered attention function (see :mod:`.base`) runs the module's
``fa_q``/``fa_k``/``fa_v`` on

* Q ``[B, H, S, D]`` after RoPE,
* K, V ``[B, Hkv, T, D]`` after the cache update and before ``repeat_kv``
  (``T`` = cached + current tokens),

and then calls the original implementation with their outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .base import ATTENTION_HANDLERS, InjectingAdapter, token_masks

__all__ = ["GQAAdapter"]


def _gqa_handler(
    module: nn.Module,
    fn: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    q_mask, kv_mask = token_masks(module, query.shape[2], key.shape[2])
    query = module.fa_q(query, q_mask)
    key = module.fa_k(key, kv_mask)
    value = module.fa_v(value, kv_mask)
    return fn(module, query, key, value, attention_mask, **kwargs)


ATTENTION_HANDLERS["gqa"] = _gqa_handler


class GQAAdapter(InjectingAdapter):
    """FAQuant for llama / qwen2 / qwen3 / mistral attention modules.

    A module is one of ours when it has ``q_proj``, ``k_proj``, ``v_proj``,
    ``head_dim`` and ``num_key_value_groups`` (the shared HF attention layout).

    ============  =====================  ===================
    branch        observed tensor        heads
    ============  =====================  ===================
    ``fa_q``      Q ``[B, H, S, D]``      H query heads
    ``fa_k``      K ``[B, Hkv, T, D]``    Hkv KV heads
    ``fa_v``      V ``[B, Hkv, T, D]``    Hkv KV heads
    ============  =====================  ===================
    """

    fa_quant_type = "FAQuant"
    kind = "gqa"

    def is_attention(self, module: nn.Module) -> bool:
        return all(
            hasattr(module, a)
            for a in (
                "q_proj",
                "k_proj",
                "v_proj",
                "head_dim",
                "num_key_value_groups",
                "config",
            )
        )

    def head_counts(self, module: nn.Module) -> dict[str, tuple[int, int]]:
        cfg = module.config
        heads = int(cfg.num_attention_heads)
        # the module's own grouping, not the config's num_key_value_heads: Gemma
        # 4's full layers have their own KV-head count (per_layer_config)
        kv_heads = heads // int(module.num_key_value_groups)
        dim = int(module.head_dim)
        return {"fa_q": (heads, dim), "fa_k": (kv_heads, dim), "fa_v": (kv_heads, dim)}
