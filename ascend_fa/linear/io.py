"""Quantized linears in and out of checkpoints.

* :func:`quantized_modules` — every :class:`~.modules.QuantizedLinear` of a model;
* :func:`export_state` — a checkpoint state dict with each quantized linear's own
  entries replaced by its ``export_tensors`` (already in the consumer's dtypes);
* :func:`load_quantized_model` — apply an artifact's tensors to a model of the same
  architecture: quantized linears become modules again (recognised by an int8
  ``<p>.weight``: with ``deq_scale`` W8A8, with only ``weight_scale`` W8A8_DYNAMIC),
  every other tensor the model has (smoothed norms, float linears) is copied in;
  a DeepSeek layer's per-expert int8 ``<experts>.{e}.{proj}.weight`` become one
  :class:`~.experts.W8A8DynamicExperts` in place of the fused experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_fa.errors import FileFormatError, NotFoundError
from ascend_fa.families import moe_layout

from .experts import (
    W8A8DynamicExperts,
    checkpoint_owner,
    expert_projections,
    expert_tensor_owner,
    is_fused_experts,
    memory_owner,
)
from .modules import QuantizedLinear, W8A8DynamicLinear, W8A8Linear

__all__ = [
    "artifact_model",
    "export_state",
    "load_quantized_model",
    "quantized_linear_names",
    "quantized_modules",
    "read_artifact_tensors",
    "spec_in_memory",
]

_SUFFIXES = (
    "weight",
    "weight_scale",
    "weight_offset",
    "input_scale",
    "input_offset",
    "deq_scale",
    "quant_bias",
    "bias",
)


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    """Dotted name -> quantized linear, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def export_state(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` (checkpoint names) with every quantized linear's entries replaced
    by its ``export_tensors`` (dtypes as the consumers read them, no cast)."""
    out = dict(state)
    for name, module in quantized_modules(model).items():
        for key in [k for k in out if k.startswith(name + ".")]:
            del out[key]
        out.update(module.export_tensors(name))
    return out


def read_artifact_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an artifact directory's weight files."""
    from safetensors import safe_open

    from ascend_fa.artifact.reader import read_tensor_index

    index = read_tensor_index(Path(directory))
    if not index:
        raise NotFoundError("no safetensors weights", path=directory)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in index.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def quantized_linear_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Prefixes ``<p>`` whose ``<p>.weight`` is int8 (a quantized linear)."""
    return sorted(
        k.removesuffix(".weight")
        for k, t in tensors.items()
        if k.endswith(".weight") and t.dtype == torch.int8
    )


def _model_dtype(parts: Mapping[str, torch.Tensor]) -> torch.dtype:
    for key in ("weight_scale", "input_scale", "bias"):
        t = parts.get(key)
        if t is not None and t.is_floating_point():
            return t.dtype
    return torch.float32


@torch.no_grad()
def _untie_if_needed(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """A tied model whose artifact carries its own ``lm_head.weight`` (a rotated
    residual stream unties the head, :mod:`ascend_fa.transforms.residual`) gets a
    separate head parameter before the tensors are copied in."""
    head = getattr(model, "lm_head", None)
    emb = (
        model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    )
    t = tensors.get("lm_head.weight")
    if t is None or head is None or emb is None:
        return
    if head.weight.data_ptr() != emb.weight.data_ptr():
        return
    if torch.equal(t.to(emb.weight.dtype), emb.weight.detach().cpu()):
        return
    head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        keys.pop("lm_head.weight", None)
    model.config.tie_word_embeddings = False


def load_quantized_model(
    model: nn.Module, tensors: Mapping[str, torch.Tensor]
) -> dict[str, QuantizedLinear]:
    """Apply an artifact's ``tensors`` to ``model`` (see the module doc); returns
    the quantized linears put in place. Raises :class:`FileFormatError` naming the
    tensor when one does not fit the model."""
    _untie_if_needed(model, tensors)
    state = model.state_dict()
    placed: dict[str, QuantizedLinear] = {}
    names = quantized_linear_names(tensors)
    experts: dict[str, set[int]] = {}
    expert_names: set[str] = set()
    layout = moe_layout(getattr(model.config, "model_type", None))
    for name in names:
        owner = expert_tensor_owner(name)
        if owner is None:
            continue
        in_memory = memory_owner(owner[0], layout)
        if _is_fused_experts(model, in_memory):
            experts.setdefault(in_memory, set()).add(owner[1])
            expert_names.add(name)
    for owner, hit in experts.items():
        float_mod = model.get_submodule(owner)
        n = int(float_mod.gate_up_proj.shape[0])
        if hit != set(range(n)):
            missing = min(set(range(n)) - hit, default=max(hit))
            raise FileFormatError(
                f"{owner}.{missing}: the model has experts 0..{n - 1}; the "
                f"artifact quantizes {len(hit)} experts (all of them or none)"
            )
        gate = expert_projections(layout)[0]
        first = f"{checkpoint_owner(owner, layout)}.0.{gate}.weight_scale"
        scale = tensors.get(first)
        module = W8A8DynamicExperts.from_tensors(  # names a missing tensor
            owner,
            tensors,
            _model_dtype({} if scale is None else {"weight_scale": scale}),
            act_fn=float_mod.act_fn,
            num_experts=n,
            layout=layout,
        )
        if tuple(module.gate_up_weight.shape) != tuple(float_mod.gate_up_proj.shape):
            raise FileFormatError(
                f"{owner}: experts {tuple(module.gate_up_weight.shape)} do not fit the "
                f"model's {tuple(float_mod.gate_up_proj.shape)}"
            )
        placed[owner] = module.to(float_mod.gate_up_proj.device)
    for name in names:
        if name in expert_names:
            continue
        try:
            float_mod = model.get_submodule(name)
        except AttributeError:
            raise FileFormatError(
                f"{name}.weight: the model has no module {name!r}"
            ) from None
        parts = {
            s: tensors[f"{name}.{s}"] for s in _SUFFIXES if f"{name}.{s}" in tensors
        }
        dtype = _model_dtype(parts)
        cls = W8A8Linear if "deq_scale" in parts else W8A8DynamicLinear
        module = cls.from_tensors(name, parts, dtype)
        if isinstance(float_mod, nn.Linear) and (
            module.in_features != float_mod.in_features
            or module.out_features != float_mod.out_features
        ):
            raise FileFormatError(
                f"{name}.weight: shape {tuple(parts['weight'].shape)} does not fit the "
                f"model's [{float_mod.out_features}, {float_mod.in_features}]"
            )
        params = list(float_mod.parameters()) or list(float_mod.buffers())
        placed[name] = module.to(params[0].device if params else "cpu")
    quant_keys = {f"{n}.{s}" for n in names for s in _SUFFIXES}
    for key, t in tensors.items():
        if key in quant_keys or key not in state:
            continue
        dst = state[key]
        if dst.shape != t.shape:
            raise FileFormatError(
                f"{key}: shape {tuple(t.shape)} does not fit the model's "
                f"{tuple(dst.shape)}"
            )
        dst.copy_(t.to(dst.dtype))
    for name, module in placed.items():
        model.set_submodule(name, module)
    return placed


def _is_fused_experts(model: nn.Module, name: str) -> bool:
    try:
        return is_fused_experts(model.get_submodule(name))
    except AttributeError:
        return False


def _weights_differ(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a floating tensor of the artifact differs from the model's own
    (cast to the artifact's dtype): folded transforms changed the weights."""
    state = model.state_dict()
    for key, t in tensors.items():
        dst = state.get(key)
        if dst is None or not t.is_floating_point() or dst.shape != t.shape:
            continue
        if not torch.equal(dst.detach().to("cpu", t.dtype), t):
            return True
    return False


def artifact_model(model: nn.Module, directory: str | Path) -> nn.Module | None:
    """A deep copy of ``model`` carrying the artifact's weights when the artifact
    has quantized linears or float weights other than the model's (folded
    attention transforms); None when its weights are the source's. ``eval`` and
    ``emulate`` run it beside the float ``model``."""
    import copy

    from ascend_fa.hf_compat import in_memory_prefix

    # a multimodal wrapper's artifact names its language model as the checkpoint
    # does (model.language_model.*): under the loaded text model's names
    rename = in_memory_prefix(model)
    tensors = {rename(n): t for n, t in read_artifact_tensors(directory).items()}
    if not quantized_linear_names(tensors) and not _weights_differ(model, tensors):
        return None
    quantized = copy.deepcopy(model)
    load_quantized_model(quantized, tensors)
    return quantized


def spec_in_memory(net: nn.Module, spec: Any) -> Any:
    """``spec`` (FA scales or a KV spec, keyed by the artifact's attention names)
    under ``net``'s names: a multimodal wrapper's artifact keeps the checkpoint's
    ``model.language_model.*``; the loaded language model says ``model.*``."""
    import dataclasses

    from ascend_fa.hf_compat import in_memory_prefix

    rename = in_memory_prefix(net)
    if isinstance(spec, Mapping):
        return {rename(a): v for a, v in spec.items()}
    if dataclasses.is_dataclass(spec) and isinstance(
        getattr(spec, "scales", None), Mapping
    ):
        scales = {rename(a): v for a, v in spec.scales.items()}
        return dataclasses.replace(spec, scales=scales)
    return spec
