"""A decoder stack run one layer at a time (the linear engine, the layer-major FA
pass): what one layer's output hands the next."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["layer_step"]


def layer_step(out: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """A decoder layer's output as the next layer's ``(hidden, kwargs)``: glm_moe_dsa
    layers return ``(hidden, topk)`` and take it as ``prev_topk_indices`` (transformers
    ``modeling_glm_moe_dsa.py`` ``GlmMoeDsaModel.forward``)."""
    if not isinstance(out, tuple):
        return out, kwargs
    if "prev_topk_indices" in kwargs and len(out) > 1:
        kwargs = {**kwargs, "prev_topk_indices": out[1]}
    return out[0], kwargs
