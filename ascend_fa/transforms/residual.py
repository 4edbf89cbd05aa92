"""Residual-stream rotation ("R1" of QuaRot / SpinQuant), folded into the weights.

Every decoder layer reads the residual stream ``h`` ``[T, n]`` through an RMSNorm
and writes to it through ``o_proj`` and ``down_proj``. With an orthogonal ``Q``
``[n, n]`` the model may carry ``h' = h Q`` instead:

====================  ===========================================================
module                change (row vectors, ``y = x Wᵀ``)
====================  ===========================================================
``embed_tokens``      ``E' = E Q``
each RMSNorm          its weight ``γ`` moves into the linears that read it, and
                      becomes 1: ``rms(h Q) = rms(h)``, so ``norm(h') = norm(h) Q``
readers               ``W' = W diag(γ) Q`` (q/k/v_proj, gate/up_proj, lm_head)
writers               ``W' = Qᵀ W``, ``b' = b Q`` (o_proj, down_proj)
``lm_head``           ``W' = E diag(γ_final) Q`` (its own tensor, see below)
====================  ===========================================================

In float this is the same function (per-token ``KL(original || rotated)`` of a
fp32 model is ~1e-10); for INT8 the point is that after the rotation the inputs of
q/k/v and gate/up are **flat**: an outlier channel (SmolLM2 and most LLMs have a
few channels whose RMSNorm-ed values are 10-100x the rest) is spread over all
``n`` channels, so one per-tensor scale fits every token (each token's input has
the same norm after RMSNorm). ``Q`` is :func:`~.hadamard.random_hadamard` ``(n,
seed)``: data-independent, built bit-equal in any process.

**Tied embeddings.** ``lm_head`` reads ``norm(h) diag(γ_final)``; with a tied head
the rotated model would need ``Qᵀ diag(γ_final) Q`` (dense) between the final norm
and the head, which no consumer runs. So the rotation gives a tied model its own
``lm_head.weight = E diag(γ_final) Q`` and sets ``tie_word_embeddings = False``
(the checkpoint grows by one ``[vocab, n]`` matrix in the model dtype). The head
is untied even when ``γ_final`` happens to be constant: one rule for every model.

**Streaming.** The whole-model :func:`rotate_residual` is :func:`untie_head`, then
:func:`rotate_embeddings`, :func:`rotate_decoder_layer` for each layer and
:func:`rotate_head`; each step reads only its own module's weights and ``Q``
(:func:`rotation_matrix` ``(n, seed)``), so a calibration that holds one decoder
layer at a time applies the same bits by calling the steps as it loads the
modules: the embedding when it loads it (before layer 0), each layer when it loads
it, the head (from the checkpoint's head matrix, which is the embedding matrix of
a tied model) at the end.

The arithmetic runs in float64 and is rounded once to the weight's dtype.

Supported model types: llama, qwen2, qwen3, mistral (RMSNorm before every reader,
no embedding scale). Qwen3's per-head ``q_norm`` / ``k_norm`` act on head
dimensions and are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import attention_kind, model_types

from .hadamard import has_hadamard, random_hadamard

__all__ = [
    "ROTATABLE_MODEL_TYPES",
    "ResidualRotation",
    "is_rotated",
    "rotate_decoder_layer",
    "rotate_embeddings",
    "rotate_head",
    "rotate_residual",
    "rotation_matrix",
    "supports_rotation",
    "untie_head",
]

#: The model types whose family (:mod:`ascend_fa.families`) takes the rotation.
ROTATABLE_MODEL_TYPES = model_types(residual_rotation=True)
#: Why a declared family takes no rotation, where it is not evident.
_NOT_ROTATABLE = {
    "gemma3_text": ": its post_attention_layernorm / post_feedforward_layernorm "
    "weight each channel of the block outputs before the residual add, which "
    "no rotation of the residual stream commutes with",
}
#: Attribute set on a rotated model (``model.config``) so it is never rotated twice
#: and the artifact can record the rotation.
_MARK = "ascend_fa_residual_rotation"


@dataclass(frozen=True)
class ResidualRotation:
    """What was applied: ``size`` (the hidden size ``n``) and ``seed`` of
    :func:`rotation_matrix`; ``kind`` ``"hadamard"`` or ``"orthogonal"`` (no
    Hadamard construction of order ``n``); ``untied`` when the head was tied."""

    size: int
    seed: int
    kind: str
    untied: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "size": self.size,
            "seed": self.seed,
            "kind": self.kind,
            "untied": self.untied,
        }


def rotation_matrix(n: int, seed: int) -> torch.Tensor:
    """``Q`` ``[n, n]`` float64: :func:`~.hadamard.random_hadamard` ``(n, seed)``."""
    return random_hadamard(n, seed, torch.float64)


def _check_model(model: nn.Module) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    kind = attention_kind(model_type)
    if kind is None or not kind.residual_rotation:
        why = _NOT_ROTATABLE.get(str(model_type), "")
        raise UnsupportedError(
            f"residual rotation: model_type {model_type!r} is not supported"
            f"{why} (supported: {', '.join(model_types(residual_rotation=True))})"
        )
    inner = getattr(model, "model", None)
    if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise UnsupportedError(
            f"residual rotation: {type(model).__name__} has no model.layers"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise UnsupportedError("residual rotation: the model has no nn.Linear lm_head")
    return int(cfg.hidden_size), len(inner.layers)


def supports_rotation(model: nn.Module) -> bool:
    """Whether :func:`rotate_residual` can rotate ``model`` (its type and modules;
    the per-module checks of the rotation itself still apply)."""
    try:
        _check_model(model)
    except UnsupportedError:
        return False
    return True


def is_rotated(model: nn.Module) -> ResidualRotation | None:
    """The rotation applied to ``model`` (None when it was not rotated)."""
    rec = getattr(getattr(model, "config", None), _MARK, None)
    if not isinstance(rec, dict):
        return None
    return ResidualRotation(
        int(rec["size"]), int(rec["seed"]), str(rec["kind"]), bool(rec["untied"])
    )


def _norm_weight(model: nn.Module, name: str) -> torch.Tensor:
    norm = model.get_submodule(name)
    w = getattr(norm, "weight", None)
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, nn.Parameter):
        raise UnsupportedError(
            f"residual rotation: {name} is {type(norm).__name__}, not an RMSNorm "
            "with a weight (its scale cannot move into the next linears)"
        )
    if getattr(norm, "bias", None) is not None:
        raise UnsupportedError(f"residual rotation: {name} has a bias")
    return w


def _linear(model: nn.Module, name: str) -> nn.Linear:
    mod = model.get_submodule(name)
    if type(mod) is not nn.Linear:
        raise InputError(
            f"residual rotation: {name} is {type(mod).__name__}; rotate the float "
            "model before its linears are quantized"
        )
    return mod


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (float64) into ``param`` in place, rounded once."""
    param.data.copy_(value.to(param.dtype))


def _read(model: nn.Module, names: tuple[str, ...], norm: str, q: torch.Tensor):
    gamma = _norm_weight(model, norm)
    g = gamma.detach().double()
    for name in names:
        lin = _linear(model, name)
        w = lin.weight.detach().double()
        _set(lin.weight, (w * g.to(w.device)[None, :]) @ q.to(w.device))
    gamma.data.fill_(1.0)


def _write(model: nn.Module, name: str, q: torch.Tensor) -> None:
    lin = _linear(model, name)
    w = lin.weight.detach().double()
    qd = q.to(w.device)
    _set(lin.weight, qd.t() @ w)
    if lin.bias is not None:
        _set(lin.bias, lin.bias.detach().double() @ qd)


def _check_q(q: torch.Tensor, n: int) -> None:
    if not isinstance(q, torch.Tensor) or q.shape != (n, n):
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise InputError(f"rotation matrix must be [{n}, {n}], got {shape}")


@torch.no_grad()
def untie_head(model: nn.Module) -> bool:
    """Give a tied ``lm_head`` its own copy of the embedding matrix and set
    ``tie_word_embeddings = False``; returns whether it was tied."""
    _check_model(model)
    emb = model.get_input_embeddings().weight
    head = model.lm_head
    tied = head.weight is emb or head.weight.data_ptr() == emb.data_ptr()
    if tied:
        head.weight = nn.Parameter(emb.detach().clone(), requires_grad=False)
    # transformers keeps the tied pairs in a dict that writers (and
    # save_pretrained) use to drop the copy: the head is no copy any more.
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, dict):
        keys.pop("lm_head.weight", None)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return tied


@torch.no_grad()
def rotate_embeddings(model: nn.Module, q: torch.Tensor) -> None:
    """``E' = E Q`` (the embedding lookup then yields rotated rows)."""
    n, _ = _check_model(model)
    _check_q(q, n)
    emb = model.get_input_embeddings().weight
    if emb.data_ptr() == model.lm_head.weight.data_ptr():
        raise InputError("residual rotation: untie the head first (untie_head)")
    _set(emb, emb.detach().double() @ q.to(emb.device))


@torch.no_grad()
def rotate_decoder_layer(model: nn.Module, index: int, q: torch.Tensor) -> None:
    """Fold decoder layer ``index``'s two RMSNorm weights into its readers and
    rotate its readers and writers (see the module doc); reads only this layer."""
    n, layers = _check_model(model)
    _check_q(q, n)
    if not 0 <= index < layers:
        raise InputError(f"decoder layer {index} out of range (0..{layers - 1})")
    p = f"model.layers.{index}"
    a, m = f"{p}.self_attn", f"{p}.mlp"
    _read(
        model,
        (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
        f"{p}.input_layernorm",
        q,
    )
    _write(model, f"{a}.o_proj", q)
    _read(model, (f"{m}.gate_proj", f"{m}.up_proj"), f"{p}.post_attention_layernorm", q)
    _write(model, f"{m}.down_proj", q)


@torch.no_grad()
def rotate_head(model: nn.Module, q: torch.Tensor) -> None:
    """Fold the final norm into the (untied) ``lm_head`` and rotate it."""
    n, _ = _check_model(model)
    _check_q(q, n)
    emb = model.get_input_embeddings().weight
    if model.lm_head.weight.data_ptr() == emb.data_ptr():
        raise InputError("residual rotation: untie the head first (untie_head)")
    _read(model, ("lm_head",), "model.norm", q)


@torch.no_grad()
def rotate_residual(model: nn.Module, seed: int = 0) -> ResidualRotation:
    """Rotate ``model``'s residual stream in place (see the module doc) with
    :func:`rotation_matrix` ``(hidden_size, seed)``; returns what was applied
    (also recorded on ``model.config``). A model is rotated at most once."""
    n, layers = _check_model(model)
    if is_rotated(model) is not None:
        raise InputError("the model's residual stream is already rotated")
    for i in range(layers):
        p = f"model.layers.{i}"
        # Check every module before changing any, so a refusal leaves the model
        # as it was.
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _linear(model, f"{p}.self_attn.{name}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            _linear(model, f"{p}.mlp.{name}")
        _norm_weight(model, f"{p}.input_layernorm")
        _norm_weight(model, f"{p}.post_attention_layernorm")
    _norm_weight(model, "model.norm")
    _linear(model, "lm_head")
    q = rotation_matrix(n, seed)
    untied = untie_head(model)
    rotate_embeddings(model, q)
    for i in range(layers):
        rotate_decoder_layer(model, i, q)
    rotate_head(model, q)
    rec = ResidualRotation(
        n, seed, "hadamard" if has_hadamard(n) else "orthogonal", untied
    )
    setattr(model.config, _MARK, rec.to_dict())
    return rec
