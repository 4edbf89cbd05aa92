"""Latent smoothing for MLA (DeepSeek-V3 FAKQuant), folded into the weights.

FAKQuant quantizes two tensors of absorbed MLA (:mod:`ascend_fa.adapters.deepseek_v3`):
the absorbed query ``q_abs = q_nope @ W_UK`` ``[B, H, S, R]`` with one static scale
per query head, and the latent ``c = kv_a_layernorm(c_kv)`` ``[B, 1, T, R]`` — the
cache, K and V at once — with **one** static scale for all ``R`` channels. A few
latent channels with a large range therefore set the step of every channel.

The logits' latent part is ``q_abs · c`` summed over ``r``; a per-channel factor
``s [R] > 0`` with ``c' = c · s`` and ``q_abs' = q_abs / s`` leaves it unchanged, and
so does ``W_UV`` applied to ``c'`` when its columns are divided by ``s``. Folded as

* ``kv_a_layernorm.weight[r] <- weight[r] · s[r]`` (the RMSNorm's output is
  ``normalized · weight``, so ``c`` is scaled per channel and nothing else reads
  it: transformers ``src/transformers/models/deepseek_v3/modeling_deepseek_v3.py``
  ``DeepseekV3Attention.forward`` sends ``kv_a_layernorm``'s output only to
  ``kv_b_proj``);
* ``kv_b_proj.weight[:, r] <- weight[:, r] / s[r]``: both row blocks, ``W_UK``
  (so ``q_abs = q_nope @ W_UK`` becomes ``q_abs / s``) and ``W_UV`` (so
  ``V = W_UV c`` is unchanged).

The RoPE parts (``q_pe``, ``k_pe``) are neither quantized nor touched. There is no
MLA form of ``v-rotation``: V is the latent itself, shared by every head and by K,
so rotating it means rotating the cache, which an orthogonal matrix cannot be
folded into through the RMSNorm's per-channel weight.

``s = (q / k) ** β`` per channel with ``q[r]`` the largest ``|q_abs[..., r]|`` over
all heads and calibration tokens and ``k[r]`` the largest ``|c[..., r]|``; ``β`` is
searched per layer in :data:`LATENT_EXPONENTS` (``0`` keeps the layer) by the
total-variation error of the causal attention probabilities of the latent logits
``scaling · q_abs c^T`` of a kept calibration sample with both sides fake-quantized
(per-head absmax for ``q_abs``, one absmax for the latent). Layer-local, like the
GQA transforms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ascend_fa.errors import UnsupportedError

from .common import causal_probs, fake_quant_absmax, first_row_sample

__all__ = [
    "LATENT_EXPONENTS",
    "LatentStats",
    "fold_latent_smoothing",
    "latent_smoothing_factors",
]

#: Exponents ``β`` of ``s = (q / k) ** β`` tried per MLA layer (0 keeps it as is).
LATENT_EXPONENTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625)


class LatentStats(nn.Module):
    """An FA point that returns its input and keeps the largest ``|x|`` per head
    and channel over real tokens (``abs_max`` ``[Hx, R]``) and the first
    :data:`~.common.SEARCH_TOKENS` real tokens of the first row it sees (``sample``
    ``[Hx, n, R]`` float32)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.abs_max: torch.Tensor | None = None
        self.sample: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        a = x.detach().abs().float()  # [B, Hx, S, R]
        if token_mask is not None:
            a = a * token_mask[:, None, :, None].to(a.dtype)
        m = a.amax(dim=(0, 2)).cpu()
        self.abs_max = m if self.abs_max is None else torch.maximum(self.abs_max, m)
        if self.sample is None:
            self.sample = first_row_sample(x, token_mask)
        return x


def _probs(q: torch.Tensor, c: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax ``[H, n, n]`` of ``q`` ``[H, n, R]`` against the latent ``c``
    ``[1, n, R]`` (shared by every head)."""
    return causal_probs(scaling * (q @ c.transpose(-1, -2)))


def latent_smoothing_factors(
    q_max: torch.Tensor,
    c_max: torch.Tensor,
    q_sample: torch.Tensor,
    c_sample: torch.Tensor,
    *,
    scaling: float,
    exponents: Sequence[float] = LATENT_EXPONENTS,
) -> tuple[float, torch.Tensor, dict[float, float]]:
    """Search ``β`` for one MLA layer: ``(β, s [R], {β: error})``.

    ``q_max`` ``[H, R]`` / ``c_max`` ``[1, R]``: largest ``|q_abs|`` per head and
    channel / largest ``|c|`` per channel over the calibration tokens; ``q_sample``
    ``[H, n, R]`` / ``c_sample`` ``[1, n, R]``: kept tokens. ``scaling``: the
    attention's softmax scale. The error of a ``β`` is the mean total variation
    ``½ Σ|P' - P|`` of the causal rows with ``q_abs / s`` and ``c · s``
    fake-quantized by the absmax the smoothed statistics give; ties keep the
    smaller ``β``.
    """
    q_max, c_max = q_max.float(), c_max.float()
    q_sample, c_sample = q_sample.float(), c_sample.float()
    qc, cc = q_max.amax(dim=0), c_max.amax(dim=0)  # [R]
    tiny = torch.finfo(torch.float32).tiny
    ratio = torch.where(
        (qc > tiny) & (cc > tiny), qc / cc.clamp(min=tiny), torch.ones_like(qc)
    )
    ref = _probs(q_sample, c_sample, scaling)
    errors: dict[float, float] = {}
    factors: dict[float, torch.Tensor] = {}
    # One exponent at a time: H x n x R per candidate (128 x 256 x 512 fp32 on
    # DeepSeek-V3 is 64 MiB), not all of them at once.
    for b in exponents:
        s = ratio ** float(b)
        q_abs = (q_max / s).amax(dim=-1)  # [H]
        c_abs = (c_max * s).amax(dim=-1)  # [1]
        p = _probs(
            fake_quant_absmax(q_sample / s, q_abs),
            fake_quant_absmax(c_sample * s, c_abs),
            scaling,
        )
        errors[float(b)] = float((0.5 * (p - ref).abs().sum(-1)).mean())
        factors[float(b)] = s
    # The smallest error; ties keep the smaller exponent (first in order).
    best = min(errors, key=lambda k: (errors[k], k))
    return best, factors[best], errors


@torch.no_grad()
def fold_latent_smoothing(module: nn.Module, factors: torch.Tensor) -> None:
    """Fold ``s`` ``[R]`` into an MLA ``module`` (see the module doc): computed in
    float64, stored in the weights' dtype."""
    norm = getattr(module, "kv_a_layernorm", None)
    proj = getattr(module, "kv_b_proj", None)
    if getattr(norm, "weight", None) is None:
        raise UnsupportedError(
            "qk-smoothing (MLA): kv_a_layernorm has no weight to carry the factor"
        )
    if type(proj) is not nn.Linear:
        raise UnsupportedError(
            f"kv_b_proj is {type(proj).__name__}, not a float nn.Linear: attention "
            "transforms are folded before the linears are quantized"
        )
    s = factors.double().reshape(-1)
    if s.numel() != norm.weight.numel() or s.numel() != proj.weight.shape[1]:
        raise ValueError(
            f"latent factors [{s.numel()}] do not match kv_lora_rank "
            f"{norm.weight.numel()}"
        )
    norm.weight.copy_((norm.weight.double() * s).to(norm.weight.dtype))
    proj.weight.copy_((proj.weight.double() / s[None, :]).to(proj.weight.dtype))
