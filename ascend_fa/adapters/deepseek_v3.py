"""FAKQuant adapter for transformers' ``deepseek_v3`` (MLA) attention.

Absorbed MLA, as the Ascend kernels run it, attends with

* the absorbed query ``q_abs = q_nope @ W_UK`` per head ``[B, H, S, R]``
  (``R`` = ``kv_lora_rank``, 512 on DeepSeek-V3), and
* the compressed latent ``c_kv`` after ``kv_a_layernorm`` ``[B, 1, T, R]``, which is
  both K and V (``V_h = c_kv @ W_UV[h]^T`` is applied after the softmax),

plus the RoPE parts ``q_pe``/``k_pe`` that are never quantized. ``W_UK`` ``[H, nope,
R]`` and ``W_UV`` ``[H, v, R]`` are the two row blocks of ``kv_b_proj.weight`` viewed
as ``[H, nope + v, R]``.

Transformers computes the non-absorbed form, so the adapter wires the three points
in without touching ``forward`` (through :mod:`.hf`):

* ``fa_k``/``fa_v``: a forward hook on ``kv_a_layernorm`` sends ``c_kv`` (as one head
  ``[B, 1, S, R]``) through both; the output of ``fa_k`` replaces the latent
  downstream. The deployed kernel dequantizes the latent cache with ``fa_k.scale``
  for both K and V (V shares it), so in fake-quant mode the one latent that feeds the
  cache, ``k_nope = W_UK c`` and ``V = W_UV c`` is the ``fa_k``-quantized one;
  ``fa_v`` is observed and exported for completeness of the format.
* ``fa_q``: the registered attention function (see :mod:`.base`)
  forms ``q_abs`` from the query it receives and calls ``fa_q``. When ``fa_q``
  returns its input (placeholder, observer) the original attention runs untouched,
  so logits stay bit-equal. When it returns a new tensor (fake-quant), attention is
  computed in the absorbed form — the original attention function is called on
  ``[q_abs | q_pe]``, ``[c_kv | k_pe]`` and ``c_kv`` (the full latent, captured by
  a pre-hook on ``kv_b_proj``), and ``W_UV`` is applied to its output.

DeepSeek Sparse Attention (``deepseek_v32``, ``glm_moe_dsa``) is this MLA plus an
indexer whose top-k keys mask the attention: the FA points are the same, the
indexer runs untouched (float, as the consumers keep it), and its top-k, which
transformers passes to a registered attention implementation as ``indices``, is
folded into the mask the wrapped function receives (:func:`_fold_topk`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascend_fa.hf_compat import require_transformers5

from .base import ATTENTION_HANDLERS, FAContext, InjectingAdapter, current_token_mask

__all__ = ["DeepseekV3Adapter", "split_kv_b", "absorbed_query"]

_LATENT = "_ascend_fa_latent"


def split_kv_b(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [H, nope, R], W_UV [H, v, R])`` from ``module.kv_b_proj.weight``.

    ``kv_b_proj`` maps ``R -> H * (nope + v)`` with output features grouped per head,
    nope first, so its weight ``[H * (nope + v), R]`` views as ``[H, nope + v, R]``.
    """
    h, nope, v = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    w = module.kv_b_proj.weight.view(h, nope + v, module.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def absorbed_query(module: nn.Module, query: torch.Tensor) -> torch.Tensor:
    """``q_nope @ W_UK`` per head.

    ``query [B, H, S, nope + rope]`` -> ``[B, H, S, R]``.
    """
    w_uk, _ = split_kv_b(module)
    q_nope = query[..., : module.qk_nope_head_dim]
    # [B, H, S, nope] @ [H, nope, R] broadcasts over B: one matmul per head.
    return torch.matmul(q_nope, w_uk.to(query.dtype))


def _latent_over_keys(latent: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The captured ``kv_b_proj`` input as ``[B, 1, T, R]`` over the key positions.

    transformers 5 expands the latent of the whole cache (``[B, 1, T, R]``); 4.57
    projects the new tokens' latent (``[B, S, R]``) and caches expanded K/V, so with
    a KV cache the latent of earlier positions no longer exists there.
    """
    latent = latent.reshape(key.shape[0], 1, -1, latent.shape[-1])
    if latent.shape[2] != key.shape[2]:
        require_transformers5("fake-quant MLA attention over a KV cache")
        raise ValueError(
            f"MLA latent covers {latent.shape[2]} positions, the keys {key.shape[2]}"
        )
    return latent


def _fold_topk(
    mask: torch.Tensor | None, indices: torch.Tensor, key: torch.Tensor
) -> torch.Tensor:
    """DeepSeek Sparse Attention's top-k ``indices`` ``[B, S, topk]`` folded into
    the attention ``mask`` ``[B, 1, S, T]`` as the model folds them for its eager /
    SDPA attention (unselected keys masked out): under a registered attention
    implementation transformers hands them over as ``indices`` instead
    (``modeling_deepseek_v32.py`` / ``modeling_glm_moe_dsa.py`` ``Attention.
    forward``), and the wrapped eager / SDPA function would ignore them."""
    b, s, t = indices.shape[0], indices.shape[1], key.shape[2]
    dropped = (
        indices.new_ones((b, s, t), dtype=torch.bool)
        .scatter(-1, indices.long(), False)
        .unsqueeze(1)
    )
    if mask is None:
        return ~dropped
    if mask.dtype == torch.bool:
        return mask & ~dropped
    return mask.masked_fill(dropped, torch.finfo(mask.dtype).min)


def _mla_handler(
    module: nn.Module,
    fn: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    if kwargs.get("indices") is not None:  # deepseek_v32 / glm_moe_dsa top-k
        attention_mask = _fold_topk(attention_mask, kwargs.pop("indices"), key)
    latent = module.__dict__.pop(_LATENT, None)
    q_abs = absorbed_query(module, query)
    q_out = module.fa_q(q_abs, current_token_mask(module, query.shape[2]))
    if q_out is q_abs or latent is None:
        # Observing only: the non-absorbed HF computation is the exact reference.
        return fn(module, query, key, value, attention_mask, **kwargs)
    nope, heads = module.qk_nope_head_dim, query.shape[1]
    _, w_uv = split_kv_b(module)
    latent = _latent_over_keys(latent, key).to(query.dtype)
    k_pe = key[:, :1, :, nope:]  # k_pe is shared by all heads: [B, 1, T, rope]
    q_cat = torch.cat([q_out, query[..., nope:]], dim=-1)  # [B, H, S, R + rope]
    k_cat = torch.cat([latent, k_pe], dim=-1).expand(-1, heads, -1, -1)
    v_lat = latent.expand(-1, heads, -1, -1)  # [B, H, T, R]
    # Same scaling, mask and backend as the model: only the operands change.
    out, weights = fn(module, q_cat, k_cat, v_lat, attention_mask, **kwargs)
    # out [B, S, H, R] -> per-head up-projection to V space [B, S, H, v]
    out = torch.einsum("bshr,hvr->bshv", out, w_uv.to(out.dtype))
    return out, weights


ATTENTION_HANDLERS["mla"] = _mla_handler


def _latent_hook(attn: nn.Module) -> Callable[..., Any]:
    def hook(_norm: nn.Module, _args: tuple, output: torch.Tensor) -> Any:
        if not hasattr(attn, "fa_k"):  # placeholders removed, hooks not (yet)
            return None
        b, s, r = output.shape
        x = output.reshape(b, 1, s, r)
        mask = current_token_mask(attn, s)
        attn.fa_v(x, mask)
        y = attn.fa_k(x, mask)
        return None if y is x else y.reshape(b, s, r)

    return hook


def _capture_latent_hook(attn: nn.Module) -> Callable[..., None]:
    def hook(_proj: nn.Module, args: tuple) -> None:
        # expand_kv calls kv_b_proj on the full latent [B, 1, T, R] (cache included).
        attn.__dict__[_LATENT] = args[0]

    return hook


class DeepseekV3Adapter(InjectingAdapter):
    """FAKQuant for DeepSeek-V3/R1 MLA attention modules.

    ============  ==========================================  ==============
    branch        observed tensor                             heads
    ============  ==========================================  ==============
    ``fa_q``      ``q_nope @ W_UK`` ``[B, H, S, R]``           H query heads
    ``fa_k``      ``c_kv`` after ``kv_a_layernorm`` ``[B,1,S,R]``  1
    ``fa_v``      same tensor as ``fa_k``                      1
    ============  ==========================================  ==============
    """

    fa_quant_type = "FAKQuant"
    kind = "mla"

    def is_attention(self, module: nn.Module) -> bool:
        return all(
            hasattr(module, a)
            for a in (
                "kv_a_layernorm",
                "kv_b_proj",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "num_heads",
                "config",
            )
        )

    def head_counts(self, module: nn.Module) -> dict[str, tuple[int, int]]:
        r = int(module.kv_lora_rank)
        return {"fa_q": (int(module.num_heads), r), "fa_k": (1, r), "fa_v": (1, r)}

    def after_inject(self, name: str, module: nn.Module, ctx: FAContext) -> None:
        self.keep_handles(
            module,
            [
                module.kv_a_layernorm.register_forward_hook(_latent_hook(module)),
                module.kv_b_proj.register_forward_pre_hook(
                    _capture_latent_hook(module)
                ),
            ],
        )
