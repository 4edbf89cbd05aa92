"""Model adapters: where Q, K and V of each supported architecture are observed.

The model types and their attention kinds are declared in
:data:`ascend_fa.families.FAMILIES`; each kind names its adapter:

================  ===================================  =============
model_type        adapter                              fa_quant_type
================  ===================================  =============
``llama``         :class:`.gqa.GQAAdapter`             ``FAQuant``
``qwen2``         :class:`.gqa.GQAAdapter`             ``FAQuant``
``qwen3``         :class:`.gqa.GQAAdapter`             ``FAQuant``
``mistral``       :class:`.gqa.GQAAdapter`             ``FAQuant``
``gemma3_text``   :class:`.gqa.GQAAdapter`             ``FAQuant``
``deepseek_v3``   :class:`.deepseek_v3.DeepseekV3Adapter`  ``FAKQuant``
``qwen3_next``    :class:`.gqa.GQAAdapter`             ``FAQuant``
``deepseek_v32``  :class:`.deepseek_v3.DeepseekV3Adapter`  ``FAKQuant``
``glm_moe_dsa``   :class:`.deepseek_v3.DeepseekV3Adapter`  ``FAKQuant``
================  ===================================  =============

Qwen3-Next's ``full_attention`` layers (``self_attn``) have the GQA layout and are
the only ones the adapter finds; its ``linear_attention`` layers (``linear_attn``,
Gated DeltaNet) have no ``q_proj`` and get no FA point.

Every adapter implements ``inject_fa3_placeholders(root_name, root_module,
should_inject)`` (seed interface), ``remove_fa3_placeholders(root_module)``,
``attention_modules(root_module, root_name="")`` and carries ``fa_quant_type``;
:class:`.base.InjectingAdapter` is the shared base. Everything that touches a live
transformers model goes through :mod:`.hf` (attention functions registered in
``AttentionInterface``; FA points swapped with ``set_submodule``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ascend_fa.families import FAMILIES, attention_kind

from .base import InjectingAdapter, remove_injection
from .deepseek_v3 import DeepseekV3Adapter
from .gqa import GQAAdapter
from .hf import find_fa_modules

__all__ = [
    "DeepseekV3Adapter",
    "GQAAdapter",
    "InjectingAdapter",
    "get_adapter",
    "injected_points",
    "register_adapter",
    "remove_injection",
    "supported_model_types",
]

#: The adapter class each attention kind of :mod:`ascend_fa.families` names.
_ADAPTERS: dict[str, Callable[[], object]] = {
    "GQAAdapter": GQAAdapter,
    "DeepseekV3Adapter": DeepseekV3Adapter,
}
#: Adapters registered explicitly (:func:`register_adapter`), before the families.
_REGISTRY: dict[str, Callable[[], object]] = {}


def _factory(model_type: str) -> Callable[[], object] | None:
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    kind = attention_kind(model_type)
    return _ADAPTERS[kind.adapter] if kind is not None else None


def register_adapter(model_type: str, factory: Callable[[], object]) -> None:
    """Make ``get_adapter`` return ``factory()`` for models of ``model_type``."""
    _REGISTRY[model_type] = factory


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values that have an adapter, sorted."""
    return sorted({*FAMILIES, *_REGISTRY})


def get_adapter(model: nn.Module | str) -> GQAAdapter | DeepseekV3Adapter:
    """A fresh adapter for ``model`` (a module with ``.config``, or a model_type).

    Raises ``ValueError`` naming the model type and listing the supported ones.
    """
    if isinstance(model, str):
        model_type = model
    else:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type is None:
            raise ValueError(
                f"cannot pick an FA3 adapter: {type(model).__name__} has no "
                f"config.model_type; supported model types: "
                f"{', '.join(supported_model_types())}"
            )
    factory = _factory(model_type)
    if factory is None:
        raise ValueError(
            f"no FA3 adapter for model type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    return factory()


@contextlib.contextmanager
def injected_points(model: nn.Module) -> Iterator[tuple[Any, dict[str, nn.Module]]]:
    """FA points on every attention module for the duration of the block.

    Yields ``(adapter, {attn name: module})``. A model that already holds FA points
    keeps them (swap them with :func:`~ascend_fa.adapters.hf.swapped_points`, which
    restores them); otherwise placeholders are injected here and removed after.
    """
    adapter = get_adapter(model)
    mods = find_fa_modules(model)
    ours = not mods
    if ours:
        adapter.inject_fa3_placeholders("", model, lambda _name: True)
        mods = find_fa_modules(model)
    try:
        yield adapter, mods
    finally:
        if ours:
            adapter.remove_fa3_placeholders(model)
