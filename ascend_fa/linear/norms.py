"""Smoothing folded into a norm's weight, whichever form the norm scales by.

Most decoders' RMSNorm multiplies by ``weight``; zero-centred ones (Qwen3-Next's
``Qwen3NextRMSNorm``, which vLLM builds as ``GemmaRMSNorm``) multiply by
``1 + weight``. A smoothing factor ``s`` divides the norm's effective multiplier:
``weight / s``, or ``(1 + weight) / s - 1``.
"""

from __future__ import annotations

import torch
from torch import nn

from ascend_fa.errors import UnsupportedError

__all__ = ["fold_into_norm", "norm_weight_offset"]


def norm_weight_offset(norm: nn.Module, name: str = "norm") -> float:
    """0.0 for a norm whose output is ``normalized(x) * weight``, 1.0 for a
    zero-centred one, ``normalized(x) * (1 + weight)`` (Qwen3-Next's
    ``Qwen3NextRMSNorm``, vLLM's ``GemmaRMSNorm``), read from the norm itself: a
    row of ones normalizes to ones (up to ``eps``), so the output is the
    effective per-channel multiplier. The two candidates differ by 1 in every
    channel. Anything else is an :class:`UnsupportedError` naming ``name``."""
    w = norm.weight.detach()
    with torch.no_grad():
        y = norm(torch.ones(1, w.shape[-1], dtype=w.dtype, device=w.device))
    y, wf = y.float().reshape(-1), w.float().reshape(-1)
    errs = [float((y - (wf + off)).abs().max()) for off in (0.0, 1.0)]
    best = min(range(2), key=errs.__getitem__)
    if errs[best] > 0.05 * (1.0 + float(wf.abs().max())):
        raise UnsupportedError(
            f"{name}: {type(norm).__name__} scales by neither weight nor 1 + weight;"
            " smoothing cannot fold into it"
        )
    return float(best)


def fold_into_norm(norm: nn.Module, s: torch.Tensor, name: str = "norm") -> None:
    """Divide ``norm``'s effective multiplier by ``s`` ``[K]``: ``weight / s``,
    or for a zero-centred norm ``(1 + weight) / s - 1`` (computed in float64,
    stored in the weight's dtype; in bf16 a large factor leaves ``1 + weight``
    with the absolute precision of the stored value near -1, as msModelSlim's
    ``weight - 1`` on saving does)."""
    w = norm.weight.data
    off = norm_weight_offset(norm, name)
    folded = (w.double() + off) / s.double().to(w.device) - off
    w.copy_(folded.to(w.dtype))
