"""Smoothing folded into a norm that multiplies by ``offset + weight`` (Gemma: 1).

Dividing a channel's multiplier ``m = offset + w`` by ``s`` stores
``w' = m / s - offset``. In the artifact's dtype that subtraction cancels: for a
large ``s`` the new multiplier ``m / s`` is small while ``w'`` sits near
``-offset``, where a bf16 value has only ``2**-9`` of absolute resolution (a channel
with ``m / s = 0.02`` moves by up to 2 %; below ``2**-9`` it rounds to ``-1``, a zero
multiplier). So the stored weight is rounded to the artifact dtype here and the
linears' columns take the factor that multiplier really divides out,
``s_eff = m / (offset + w'_stored)`` (float64): the product norm x linear is the
unsmoothed one however the weight rounded. A multiplier that would round to zero
keeps the dtype's smallest step instead (``offset - eps`` in magnitude).
"""

from __future__ import annotations

import torch

__all__ = ["fold_offset_norm"]


@torch.no_grad()
def fold_offset_norm(
    weight: torch.Tensor, s: torch.Tensor, offset: float, dtype: torch.dtype
) -> torch.Tensor:
    """Divide the multipliers ``offset + weight`` ``[K]`` by ``s`` ``[K]`` in place,
    rounding the stored weight to ``dtype``; returns ``s_eff`` ``[K]`` (``s``'s
    dtype) for the reading linears' columns."""
    m = weight.double() + offset
    stored = (m / s.to(weight.device, torch.float64) - offset).to(dtype)
    realized = stored.double() + offset
    lost = (realized == 0) & (m != 0)
    if bool(lost.any()):
        step = torch.finfo(dtype).eps * torch.sign(m)
        stored = torch.where(lost, (step - offset).to(dtype), stored)
        realized = stored.double() + offset
    weight.copy_(stored.to(weight.dtype))
    return (m / realized).to(s.dtype)
