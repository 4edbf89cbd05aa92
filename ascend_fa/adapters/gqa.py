"""FAQuant adapter for transformers' GQA/MHA decoders: llama, qwen2, qwen3, mistral.

Injection goes through transformers' ``AttentionInterface`` registry instead of
rewriting ``forward``: the model's ``config._attn_implementation`` (say ``"sdpa"``) is
switched to ``"ascend_fa_fa3:sdpa"``, a registered attention function that runs the
module's ``fa_q``/``fa_k``/``fa_v`` on

* Q ``[B, H, S, D]`` after RoPE,
* K, V ``[B, Hkv, T, D]`` after the cache update and before ``repeat_kv``
  (``T`` = cached + current tokens),

and then calls the original implementation with their outputs. The wrapped name is
also registered in the attention-*mask* registry with the original's mask builder, so
the model builds exactly the mask it built before: with placeholders or observers
(which return their input) the logits are bit-equal.

Padding: a forward pre-hook on the injection root stashes the 2-D tokenizer
``attention_mask`` ``[B, T]`` (True = real token) for the duration of the forward;
the attention function hands its last ``S`` columns to ``fa_q`` and all ``T`` to
``fa_k``/``fa_v`` as ``token_mask``. This is exact for left and right padding and for
any attention backend (a 4-D mask is backend specific and may be ``None``).

The same machinery serves the MLA adapter (:mod:`ascend_fa.adapters.deepseek_v3`),
which registers its own per-kind handler in :data:`ATTENTION_HANDLERS`.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascend_fa.calibration.placeholder import (
    FA_BRANCHES,
    FA3QuantAdapterInterface,
    FA3QuantPlaceHolder,
)

__all__ = [
    "WRAPPED_PREFIX",
    "ATTENTION_HANDLERS",
    "FAContext",
    "GQAAdapter",
    "wrapped_attention_name",
    "original_attention_name",
    "token_masks",
]

#: Prefix of the registered attention implementations (``prefix + original``).
WRAPPED_PREFIX = "ascend_fa_fa3:"

# Attribute names set on injected modules (private, removed by ``remove``).
_KIND = "_ascend_fa_kind"
_CTX = "_ascend_fa_ctx"
_ROOT_CTX = "_ascend_fa_root_ctx"

#: kind -> handler(module, original_fn, query, key, value, attention_mask, **kwargs)
#: returning what the original attention function returns.
ATTENTION_HANDLERS: dict[str, Callable[..., Any]] = {}


class FAContext:
    """State shared by the modules injected under one root.

    ``token_mask`` ``[B, T]`` bool (True = real token) is valid during one forward
    of the root; ``configs`` maps ``id(config)`` to ``(config, original_impl)``.
    """

    def __init__(self) -> None:
        self.token_mask: torch.Tensor | None = None
        self.configs: dict[int, tuple[Any, str]] = {}
        self.handles: list[Any] = []


def wrapped_attention_name(original: str) -> str:
    """Register (once) and return the wrapping implementation name for ``original``."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = WRAPPED_PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention_function(original))
        # Same mask builder as the original so the model sees the very same mask;
        # an original without one (e.g. "paged|eager") gets none here either.
        masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        if original in masks:
            AttentionMaskInterface.register(name, masks[original])
    return name


def original_attention_name(name: str | None) -> str | None:
    """Inverse of :func:`wrapped_attention_name` (``name`` if it is not wrapped)."""
    if name is not None and name.startswith(WRAPPED_PREFIX):
        return name[len(WRAPPED_PREFIX):]
    return name


def _original_function(module: nn.Module, original: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is not in the registry: each modeling file passes its own
    # eager_attention_forward as the default, so take it from the module's file.
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)


def _make_attention_function(original: str) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        fn = _original_function(module, original)
        handler = ATTENTION_HANDLERS.get(getattr(module, _KIND, ""))
        if handler is None or not hasattr(module, "fa_q"):
            return fn(module, query, key, value, attention_mask, **kwargs)
        return handler(module, fn, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"ascend_fa_fa3_{original}"
    return attention


def token_masks(
    module: nn.Module, s: int, t: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(query_mask [B, S], kv_mask [B, T])`` from the stashed 2-D mask, or Nones.

    The 2-D mask covers cached + current tokens, so the current queries are its last
    ``S`` columns. A mask of another length (the caller passed something unusual)
    is not guessed at: every token is then observed.
    """
    ctx: FAContext | None = getattr(module, _CTX, None)
    mask = None if ctx is None else ctx.token_mask
    if mask is None or mask.shape[-1] != t or s > t:
        return None, None
    return mask[:, t - s:], mask


def _gqa_handler(
    module: nn.Module,
    fn: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    q_mask, kv_mask = token_masks(module, query.shape[2], key.shape[2])
    query = module.fa_q(query, q_mask)
    key = module.fa_k(key, kv_mask)
    value = module.fa_v(value, kv_mask)
    return fn(module, query, key, value, attention_mask, **kwargs)


ATTENTION_HANDLERS["gqa"] = _gqa_handler


def _stash_mask_hook(ctx: FAContext) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        # Only a 2-D [B, T] padding mask says which tokens are real; 4-D masks are
        # backend specific, so with one of those every token is observed.
        ctx.token_mask = mask.bool() if isinstance(mask, torch.Tensor) and (
            mask.dim() == 2
        ) else None

    return hook


def _clear_mask_hook(ctx: FAContext) -> Callable[..., None]:
    def hook(_module: nn.Module, _args: tuple, _output: Any) -> None:
        ctx.token_mask = None

    return hook


class _InjectingAdapter(FA3QuantAdapterInterface):
    """Shared injection/removal logic; subclasses describe their attention modules."""

    #: ``"FAQuant"`` (GQA/MHA) or ``"FAKQuant"`` (MLA): the artifact's fa_quant_type.
    fa_quant_type: str = "FAQuant"
    #: handler key in :data:`ATTENTION_HANDLERS`.
    kind: str = ""

    @abc.abstractmethod
    def is_attention(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module this adapter handles."""

    @abc.abstractmethod
    def head_counts(self, module: nn.Module) -> dict[str, tuple[int, int]]:
        """``{branch: (num_heads, head_dim)}`` for the three branches."""

    def _after_inject(self, name: str, module: nn.Module, ctx: FAContext) -> None:
        """Per-module extra wiring (hooks); default none."""

    def attention_modules(
        self, root_module: nn.Module, root_name: str = ""
    ) -> list[tuple[str, nn.Module]]:
        """Every attention module this adapter handles, with full dotted names."""
        out = []
        for name, module in root_module.named_modules():
            if self.is_attention(module):
                full = ".".join(p for p in (root_name, name) if p)
                out.append((full, module))
        return out

    def inject_fa3_placeholders(
        self,
        root_name: str,
        root_module: nn.Module,
        should_inject: Callable[[str], bool],
    ) -> None:
        ctx: FAContext | None = getattr(root_module, _ROOT_CTX, None)
        if ctx is None:
            ctx = FAContext()
            ctx.handles.append(root_module.register_forward_pre_hook(
                _stash_mask_hook(ctx), with_kwargs=True))
            ctx.handles.append(root_module.register_forward_hook(
                _clear_mask_hook(ctx), always_call=True))
            object.__setattr__(root_module, _ROOT_CTX, ctx)
        for name, module in self.attention_modules(root_module, root_name):
            if not should_inject(name):
                continue
            for branch, (heads, dim) in self.head_counts(module).items():
                # An existing fa_x (placeholder, observer or fake-quant) is kept:
                # injecting twice changes nothing.
                if not hasattr(module, branch):
                    module.add_module(branch, FA3QuantPlaceHolder(branch, heads, dim))
            if getattr(module, _CTX, None) is None:
                object.__setattr__(module, _CTX, ctx)
                object.__setattr__(module, _KIND, self.kind)
                self._after_inject(name, module, ctx)
            config = module.config
            if id(config) not in ctx.configs:
                current = config._attn_implementation
                original = original_attention_name(current) or "eager"
                ctx.configs[id(config)] = (config, original)
                config._attn_implementation = wrapped_attention_name(original)

    def remove_fa3_placeholders(self, root_module: nn.Module) -> None:
        """Undo :meth:`inject_fa3_placeholders`: drop ``fa_*`` submodules and hooks,
        restore each config's original attention implementation."""
        remove_injection(root_module)


def remove_injection(root_module: nn.Module) -> None:
    """Remove every trace of an injection under ``root_module`` (any adapter)."""
    for module in root_module.modules():
        for branch in FA_BRANCHES:
            if branch in module._modules:
                del module._modules[branch]
        for attr in (_CTX, _KIND):
            module.__dict__.pop(attr, None)
        for handle in module.__dict__.pop("_ascend_fa_handles", []):
            handle.remove()
    ctx: FAContext | None = root_module.__dict__.pop(_ROOT_CTX, None)
    if ctx is not None:
        for handle in ctx.handles:
            handle.remove()
        for config, original in ctx.configs.values():
            config._attn_implementation = original
        ctx.configs.clear()


class GQAAdapter(_InjectingAdapter):
    """FAQuant for llama / qwen2 / qwen3 / mistral attention modules.

    A module is one of ours when it has ``q_proj``, ``k_proj``, ``v_proj``,
    ``head_dim`` and ``num_key_value_groups`` (the shared HF attention layout).

    ============  =====================  ===================
    branch        observed tensor        heads
    ============  =====================  ===================
    ``fa_q``      Q ``[B, H, S, D]``      H query heads
    ``fa_k``      K ``[B, Hkv, T, D]``    Hkv KV heads
    ``fa_v``      V ``[B, Hkv, T, D]``    Hkv KV heads
    ============  =====================  ===================
    """

    fa_quant_type = "FAQuant"
    kind = "gqa"

    def is_attention(self, module: nn.Module) -> bool:
        return all(
            hasattr(module, a)
            for a in ("q_proj", "k_proj", "v_proj", "head_dim", "num_key_value_groups",
                      "config")
        )

    def head_counts(self, module: nn.Module) -> dict[str, tuple[int, int]]:
        cfg = module.config
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        dim = int(module.head_dim)
        return {"fa_q": (heads, dim), "fa_k": (kv_heads, dim), "fa_v": (kv_heads, dim)}
