"""The inputs of decoder layers, captured once for a layer-sequential pass, and
those of decoders whose layers differ by type (``config.layer_types``).

A layer-sequential pass (the linear calibration's, the attention calibration's
layer-major pass) captures what the first decoder layer receives
(:func:`capture_layer_inputs`) and runs every layer with those keyword
arguments. A hybrid model computes one mask per layer type: Qwen3-Next hands
its ``full_attention`` layers a causal mask and its ``linear_attention``
layers the recurrent (padding) mask (transformers
``models/qwen3_next/modeling_qwen3_next.py`` ``Qwen3NextModel.forward``,
``causal_mask_mapping[self.config.layer_types[i]]``, v5.25.0), so the first
layer's arguments are wrong for the others (with padding, SDPA refuses the 2-D
mask). For such models the captured keyword arguments are
``{TYPED_KWARGS: {layer type: that type's kwargs}}`` and every call goes through
:func:`layer_kwargs`; a call that skips it passes no mask and no RoPE and fails
loudly instead of running a layer with another type's mask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import UnsupportedError

__all__ = [
    "LayerInputs",
    "TYPED_KWARGS",
    "capture_layer_inputs",
    "capture_typed_inputs",
    "decoder_layer_type",
    "decoder_layers",
    "layer_kwargs",
    "mixed_layer_types",
]

#: The captured kwargs' key holding ``{layer type: kwargs}``.
TYPED_KWARGS = "ascend_fa_typed_kwargs"
#: ``(hidden [B, S, H], layer kwargs, token mask [B, S])`` of one batch at a layer.
LayerInputs = tuple[torch.Tensor, dict[str, Any], torch.Tensor]


class _Stop(Exception):
    """Ends a capturing forward early."""


def mixed_layer_types(model: nn.Module) -> list[str] | None:
    """``config.layer_types`` when it names more than one type, else None."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return list(types) if types and len(set(types)) > 1 else None


def decoder_layer_type(layer: nn.Module) -> str | None:
    """The type of decoder ``layer``: Qwen3-Next's ``block_type``, an
    ``attention_type``, or Gemma 3's ``self_attn.layer_type``; None when the layer
    does not say."""
    for attr in ("block_type", "attention_type"):
        found = getattr(layer, attr, None)
        if isinstance(found, str):
            return found
    # Gemma 3 keeps it on the attention module
    found = getattr(getattr(layer, "self_attn", None), "layer_type", None)
    return found if isinstance(found, str) else None


def layer_kwargs(layer: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call decoder ``layer`` with: ``kwargs``, or its
    type's entry when they are per type."""
    typed = kwargs.get(TYPED_KWARGS)
    if typed is None:
        return kwargs
    kind = decoder_layer_type(layer)
    if kind not in typed:
        raise UnsupportedError(
            f"{type(layer).__name__}: layer type {kind!r} is not one of the model's "
            f"layer types {sorted(typed)}"
        )
    return typed[kind]


class _StandIn(nn.Module):
    """Takes decoder layer ``index``'s place while inputs are captured: records its
    hidden states and kwargs and passes the hidden states on (no weight is read);
    the last one ends the forward."""

    def __init__(self, sink: dict[int, Any], index: int, last: bool) -> None:
        super().__init__()
        self.sink, self.index, self.last = sink, index, last

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.sink[self.index] = (hidden, kwargs)
        if self.last:
            raise _Stop
        return hidden


def capture_typed_inputs(
    model: nn.Module,
    layers: nn.ModuleList,
    types: list[str],
    batches: Iterable[dict[str, torch.Tensor]],
) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Per batch, the first layer's hidden states ``[B, S, H]`` and
    ``{TYPED_KWARGS: {type: kwargs}}`` read at the first layer of each type. The
    layers up to the last of those are stood in for during the forwards."""
    first = {t: types.index(t) for t in dict.fromkeys(types)}
    last = max(first.values())
    sink: dict[int, Any] = {}
    real = [layers[i] for i in range(last + 1)]
    for i in range(last + 1):
        layers[i] = _StandIn(sink, i, i == last)
    out = []
    try:
        for batch in batches:
            sink.clear()
            try:
                model(**batch, use_cache=False)
            except _Stop:
                pass
            typed = {t: sink[i][1] for t, i in first.items()}
            out.append((sink[0][0], {TYPED_KWARGS: typed}))
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    return out


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` (UnsupportedError naming the model without one)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedError(
            f"{type(model).__name__}: no model.layers decoder stack to calibrate"
        )
    return layers


def _token_mask(batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    mask = batch.get("attention_mask")
    mask = torch.ones(hidden.shape[:2], dtype=torch.bool) if mask is None else mask
    return mask.bool().to(hidden.device)


def capture_layer_inputs(
    model: nn.Module, layer: nn.Module, batches: Iterable[dict[str, torch.Tensor]]
) -> list[LayerInputs]:
    """``(hidden [B, S, H], layer kwargs, token mask [B, S])`` per batch: the inputs
    of ``layer`` (the first decoder layer), captured by a pre-hook that ends the
    forward there (nothing after it runs, nor needs weights). A model whose layers
    differ by type gets each type's kwargs (:mod:`.typed_inputs`; call layers with
    :func:`~.typed_inputs.layer_kwargs`)."""
    types = mixed_layer_types(model)
    if types is not None:
        batches = list(batches)
        typed = capture_typed_inputs(model, decoder_layers(model), types, batches)
        return [
            (hidden.detach(), kwargs, _token_mask(batch, hidden))
            for (hidden, kwargs), batch in zip(typed, batches, strict=True)
        ]
    caught: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def grab(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        caught.append(
            (hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        )
        raise _Stop

    # Prepended: runs before any other pre-hook of the layer (a streamed model's
    # loader), so capturing reads none of the layer's weights.
    handle = layer.register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
    out = []
    try:
        for batch in batches:
            try:
                model(**batch, use_cache=False)
            except _Stop:
                pass
            hidden, kwargs = caught.pop()
            out.append((hidden.detach(), kwargs, _token_mask(batch, hidden)))
    finally:
        handle.remove()
    return out
