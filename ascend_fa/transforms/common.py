"""What the attention transforms' exponent searches share: the kept sample of a
statistics point, symmetric INT8 fake-quantization by an absmax, and the causal
softmax the searches score."""

from __future__ import annotations

import torch

__all__ = ["SEARCH_TOKENS", "causal_probs", "fake_quant_absmax", "first_row_sample"]

#: Real tokens of the first calibration row kept per layer for an exponent search.
SEARCH_TOKENS = 256
_INT8_MAX = 127.0


def first_row_sample(
    x: torch.Tensor, token_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The first :data:`SEARCH_TOKENS` real tokens of row 0 of ``x`` ``[B, H, S,
    D]`` as ``[H, n, D]`` float32 on the CPU; None when the row has none."""
    row = x[0].detach().float().cpu()  # [H, S, D]
    if token_mask is not None:
        row = row[:, token_mask[0].cpu().bool()]
    return row[:, :SEARCH_TOKENS] if row.shape[1] else None


def fake_quant_absmax(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Symmetric INT8 per head: ``absmax`` ``[..., H]`` -> ``x`` ``[..., H, n, D]``
    dequantized."""
    scale = (absmax / _INT8_MAX).clamp(min=1e-12)[..., None, None]
    return torch.clamp(torch.round(x / scale), -_INT8_MAX, _INT8_MAX) * scale


def causal_probs(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax of ``logits`` ``[..., n, n]`` with the future masked."""
    n = logits.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
