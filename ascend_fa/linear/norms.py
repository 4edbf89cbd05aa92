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


def fold_into_norm(
    norm: nn.Module,
    s: torch.Tensor,
    name: str = "norm",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Divide ``norm``'s effective multiplier ``m`` (``weight``, or ``1 + weight``
    for a zero-centred norm) by ``s`` ``[K]`` and return the factor it really
    divides out, ``m_old / m_new``, for the readers' columns (``s`` for a plain
    norm, whose ``weight / s`` keeps its relative precision).

    A zero-centred norm's new weight is computed in float64 and rounded to
    ``dtype`` (the artifact's; the weight's own by default), the precision the
    consumer runs it at. A large ``s`` puts the stored weight near -1, where ``1 +
    weight`` keeps only the absolute precision of that value (bf16: 2**-8): the
    returned factor then differs from ``s`` by that rounding, and taking it for
    the columns keeps the product exact. A multiplier that would round to zero is
    kept one step away from it (a channel is never dropped)."""
    w = norm.weight.data
    if not norm_weight_offset(norm, name):
        # weight / s keeps its relative precision: the columns take s itself
        w.div_(s.to(w))
        return s
    dtype = dtype or w.dtype
    old = w.double() + 1.0
    target = old / s.double().to(w.device) - 1.0
    stored = target.to(dtype).double()
    eps = float(torch.finfo(dtype).eps)
    lost = (stored == -1.0) & (old != 0)
    step = torch.where(target > -1.0, eps / 2, -eps)
    stored = torch.where(lost, (step - 1.0).to(dtype).double(), stored)
    w.copy_(stored.to(w.dtype))
    new = w.double() + 1.0
    return torch.where((old == 0) | (new == 0), s.double(), old / new).to(s.dtype)
