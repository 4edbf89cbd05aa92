"""vLLM FusedMoE method running ascend-fa's W8A8_DYNAMIC routed experts.

Imported only by :mod:`ascend_fa.serving.vllm_config` (inside vLLM). The
parameters are vllm-ascend's (``w13_weight`` int8 ``[E, 2I, H]``, ``w2_weight``
int8 ``[E, H, I]``, ``w13_weight_scale`` / ``w13_weight_offset`` ``[E, 2I, 1]``,
``w2_weight_scale`` / ``w2_weight_offset`` ``[E, H, 1]``: vllm-project/vllm-ascend
``vllm_ascend/quantization/methods/w8a8_dynamic.py``), filled from the per-expert
checkpoint tensors ``<experts>.{e}.{gate,up,down}_proj.{weight,weight_scale,
weight_offset}`` through vLLM's expert mapping (``gate`` -> the first ``I`` rows of
``w13``, ``up`` -> the last ``I``). After loading, the layer holds
:class:`~ascend_fa.linear.experts.W8A8DynamicExperts` built from them, and
``apply`` is its forward on vLLM's routing (``topk_ids``, ``topk_weights``): the
code ``eval`` runs, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
    FusedMoEMethodBase,
)

from ascend_fa.linear.experts import W8A8DynamicExperts

__all__ = ["AscendW8A8DynamicMoEMethod"]

_NAMES = ("w13_weight", "w13_weight_scale", "w13_weight_offset", "w2_weight",
          "w2_weight_scale", "w2_weight_offset")  # fmt: skip


def _loader(name: str, layer_name: str, inter: int) -> Callable:
    """vLLM's per-expert loader call -> rows of expert ``expert_id``: ``w1``
    (gate) the first ``inter`` rows of ``w13``, ``w3`` (up) the last, ``w2``
    (down) all."""

    def load(param, loaded_weight, weight_name="", shard_id="", expert_id=0,
             return_success=False):  # fmt: skip
        want_int = not param.dtype.is_floating_point
        if (not loaded_weight.dtype.is_floating_point) != want_int:
            raise ValueError(
                f"{layer_name}.{expert_id}: {name} needs {param.dtype}, the "
                f"checkpoint holds {loaded_weight.dtype} (W8A8_DYNAMIC experts)"
            )
        dst = param.data[expert_id]
        if shard_id == "w1":
            dst = dst[:inter]
        elif shard_id == "w3":
            dst = dst[inter:]
        if tuple(dst.shape) != tuple(loaded_weight.shape):
            raise ValueError(
                f"{layer_name}.{expert_id}: {name} ({shard_id}) is "
                f"{list(loaded_weight.shape)}, the layer needs {list(dst.shape)}"
            )
        dst.copy_(loaded_weight)
        return True if return_success else None

    return load


class AscendW8A8DynamicMoEMethod(FusedMoEMethodBase):
    """Routed experts W8A8_DYNAMIC (module doc); SiLU-gated experts only."""

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):  # fmt: skip
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        w13, w2 = (e, 2 * i), (e, h)
        shapes = {"w13_weight": (*w13, h), "w13_weight_scale": (*w13, 1),
                  "w13_weight_offset": (*w13, 1), "w2_weight": (*w2, i),
                  "w2_weight_scale": (*w2, 1),
                  "w2_weight_offset": (*w2, 1)}  # fmt: skip
        layer_name = getattr(layer, "layer_name", "") or "experts"
        for name, shape in shapes.items():
            dtype = torch.int8 if name.endswith("_weight") else params_dtype
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            p.weight_loader = _loader(name, layer_name, i)
        layer.ascend_dtype = params_dtype

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        activation = str(getattr(self.moe, "activation", "silu")).lower()
        if "silu" not in activation:
            raise ValueError(
                f"{getattr(layer, 'layer_name', 'experts')}: activation "
                f"{activation}; the ascend-fa W8A8_DYNAMIC experts run SiLU-gated "
                "experts"
            )
        layer.ascend_experts = W8A8DynamicExperts(
            layer.w13_weight.data, layer.w13_weight_scale.data.float(),
            layer.w2_weight.data, layer.w2_weight_scale.data.float(),
            act_fn=torch.nn.SiLU(), dtype=layer.ascend_dtype,
        )  # fmt: skip
        for name in _NAMES:
            delattr(layer, name)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None,
              shared_experts_input=None):  # fmt: skip
        return layer.ascend_experts(x, topk_ids, topk_weights)
