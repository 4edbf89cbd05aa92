"""The inputs of decoder layers, captured once and run layer by layer.

A layer-sequential pass (:mod:`.engine`) captures, per calibration batch, what the
first decoder layer receives — the hidden states ``[B, S, H]`` and the keyword
arguments the model computed for its layers (RoPE ``position_embeddings``, the
attention mask, ``position_ids``) — and then runs each layer on the previous
layer's outputs with those keyword arguments.

Models whose layers differ by attention type (``config.layer_types``, e.g. Gemma 3's
``sliding_attention`` / ``full_attention`` layers) give each type its own mask and
RoPE table (transformers ``models/gemma3/modeling_gemma3.py``
``Gemma3TextModel.forward``, v5.25.0: ``causal_mask_mapping[layer_type]`` and
``position_embeddings[layer_type]``). For them the captured keyword arguments hold
one entry per type (:data:`LAYER_TYPE_KWARGS`) and :func:`layer_kwargs` picks the
calling layer's; a call that skipped :func:`layer_kwargs` gets no mask and no RoPE
and fails instead of silently running a full layer with the sliding mask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import UnsupportedError

__all__ = [
    "LAYER_TYPE_KWARGS",
    "LayerInputs",
    "capture_layer_inputs",
    "layer_kwargs",
    "layer_type",
    "mixed_layer_types",
]

#: ``(hidden [B, S, H], layer kwargs, token mask [B, S])`` of one batch at a layer.
LayerInputs = tuple[torch.Tensor, dict[str, Any], torch.Tensor]
#: The captured kwargs' key holding ``{layer type: that type's kwargs}``.
LAYER_TYPE_KWARGS = "ascend_fa_layer_types"


class _Stop(Exception):
    """Ends a model forward once the wanted layer inputs are captured."""


def mixed_layer_types(model: nn.Module) -> list[str] | None:
    """``config.layer_types`` when it names more than one type, else None."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return list(types) if types and len(set(types)) > 1 else None


def layer_type(layer: nn.Module) -> str | None:
    """The attention type of decoder ``layer`` (``attention_type``, or its
    attention module's ``layer_type`` as Gemma 3 keeps it); None when unstated."""
    found = getattr(layer, "attention_type", None)
    if found is None:
        found = getattr(getattr(layer, "self_attn", None), "layer_type", None)
    return found


def layer_kwargs(layer: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments decoder ``layer`` is called with: ``kwargs`` itself,
    or its type's entry when the model's layers differ by type."""
    by_type = kwargs.get(LAYER_TYPE_KWARGS)
    if by_type is None:
        return kwargs
    kind = layer_type(layer)
    if kind not in by_type:
        raise UnsupportedError(
            f"{type(layer).__name__}: attention type {kind!r} is not one of the "
            f"model's layer types {sorted(by_type)}"
        )
    return by_type[kind]


def _token_mask(batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    mask = batch.get("attention_mask")
    mask = torch.ones(hidden.shape[:2], dtype=torch.bool) if mask is None else mask
    return mask.bool().to(hidden.device)


def _strip(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "hidden_states"}


class _Stand(nn.Module):
    """Stands in for decoder layer ``index`` while the inputs are captured: records
    them and passes the hidden states on (reads no weight); the last one ends the
    forward."""

    def __init__(self, sink: dict[int, Any], index: int, last: bool) -> None:
        super().__init__()
        self.sink, self.index, self.last = sink, index, last

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.sink[self.index] = (hidden, _strip(kwargs))
        if self.last:
            raise _Stop
        return hidden


def _capture_first(
    model: nn.Module, layer: nn.Module, batches: Iterable[dict[str, torch.Tensor]]
) -> list[LayerInputs]:
    caught: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def grab(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        caught.append((hidden, _strip(kwargs)))
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


def _capture_typed(
    model: nn.Module,
    layers: nn.ModuleList,
    types: list[str],
    batches: Iterable[dict[str, torch.Tensor]],
) -> list[LayerInputs]:
    first = {t: types.index(t) for t in dict.fromkeys(types)}
    last = max(first.values())
    sink: dict[int, Any] = {}
    real = [layers[i] for i in range(last + 1)]
    for i in range(last + 1):
        layers[i] = _Stand(sink, i, i == last)
    out = []
    try:
        for batch in batches:
            sink.clear()
            try:
                model(**batch, use_cache=False)
            except _Stop:
                pass
            hidden = sink[0][0]
            by_type = {t: sink[i][1] for t, i in first.items()}
            kwargs = {LAYER_TYPE_KWARGS: by_type}
            out.append((hidden.detach(), kwargs, _token_mask(batch, hidden)))
    finally:
        for i, module in enumerate(real):
            layers[i] = module
    return out


def capture_layer_inputs(
    model: nn.Module, layer: nn.Module, batches: Iterable[dict[str, torch.Tensor]]
) -> list[LayerInputs]:
    """``(hidden [B, S, H], layer kwargs, token mask [B, S])`` per batch: the inputs
    of ``layer`` (the first decoder layer), captured without running any decoder
    layer (nothing after the capture runs, nor needs weights). A model whose
    layers differ by type gets each type's kwargs (see the module doc): the first
    layer of each type is stood in for by a recorder, so no layer computes."""
    types = mixed_layer_types(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if types is None or not isinstance(layers, nn.ModuleList) or layers[0] is not layer:
        return _capture_first(model, layer, batches)
    return _capture_typed(model, layers, types, batches)
