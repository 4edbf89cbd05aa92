"""What every injecting adapter shares: the wrapped attention function, the padding
mask hand-off, and :class:`InjectingAdapter` (inject / remove).

Injection goes through transformers' ``AttentionInterface`` registry (see
:mod:`.hf`) instead of rewriting ``forward``: the model's
``config._attn_implementation`` (say ``"sdpa"``) is switched to
``"ascend_fa_fa3:sdpa"``, a registered attention function that hands Q, K and V to
the module's kind-specific handler (:data:`ATTENTION_HANDLERS`), which runs the
``fa_q``/``fa_k``/``fa_v`` points and then the original implementation. The wrapped
name also gets the original's mask builder, so the model builds exactly the mask it
built before: with placeholders or observers (which return their input) the logits
are bit-equal.

Padding: a forward pre-hook on the injection root stashes the 2-D tokenizer
``attention_mask`` ``[B, T]`` (True = real token) for the duration of the forward;
:func:`token_masks` hands its last ``S`` columns to ``fa_q`` and all ``T`` to
``fa_k``/``fa_v`` as ``token_mask``. This is exact for left and right padding and for
any attention backend (a 4-D mask is backend specific and may be ``None``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.placeholder import (
    FA3QuantAdapterInterface,
    FA3QuantPlaceHolder,
)

from .hf import delete_points, model_attention_function, register_attention_function

__all__ = [
    "WRAPPED_PREFIX",
    "ATTENTION_HANDLERS",
    "FAContext",
    "InjectingAdapter",
    "context_of",
    "current_token_mask",
    "remove_injection",
    "wrapped_attention_name",
    "original_attention_name",
    "token_masks",
    "token_mask_scope",
]

#: Prefix of the registered attention implementations (``prefix + original``).
WRAPPED_PREFIX = "ascend_fa_fa3:"

# Attribute names set on injected modules (removed by ``remove_injection``).
_KIND = "_ascend_fa_kind"
_CTX = "_ascend_fa_ctx"
_ROOT_CTX = "_ascend_fa_root_ctx"
_HANDLES = "_ascend_fa_handles"

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


def context_of(module: nn.Module) -> FAContext | None:
    """The :class:`FAContext` of an injected attention module (None otherwise)."""
    return module.__dict__.get(_CTX)


def wrapped_attention_name(original: str) -> str:
    """Register (once) and return the wrapping implementation name for ``original``."""
    return register_attention_function(
        WRAPPED_PREFIX + original,
        _make_attention_function(original),
        mask_like=original,
    )


def original_attention_name(name: str | None) -> str | None:
    """Inverse of :func:`wrapped_attention_name` (``name`` if it is not wrapped)."""
    if name is not None and name.startswith(WRAPPED_PREFIX):
        return name[len(WRAPPED_PREFIX) :]
    return name


def _make_attention_function(original: str) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        fn = model_attention_function(module, original)
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
    ctx = context_of(module)
    mask = None if ctx is None else ctx.token_mask
    if mask is None or mask.shape[-1] != t or s > t:
        return None, None
    return mask[:, t - s :], mask


def current_token_mask(module: nn.Module, s: int) -> torch.Tensor | None:
    """The last ``s`` columns of the stashed 2-D mask ``[B, s]`` (None when absent
    or shorter)."""
    ctx = context_of(module)
    mask = None if ctx is None else ctx.token_mask
    if mask is None or mask.shape[-1] < s:
        return None
    return mask[:, mask.shape[-1] - s :]


def _stash_mask_hook(ctx: FAContext) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        # Only a 2-D [B, T] padding mask says which tokens are real; 4-D masks are
        # backend specific, so with one of those every token is observed.
        ctx.token_mask = (
            mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        )

    return hook


def _clear_mask_hook(ctx: FAContext) -> Callable[..., None]:
    def hook(_module: nn.Module, _args: tuple, _output: Any) -> None:
        ctx.token_mask = None

    return hook


@contextmanager
def token_mask_scope(
    root_module: nn.Module, mask: torch.Tensor | None
) -> Iterator[None]:
    """For the block, the FA points under ``root_module`` (the injection root) see
    ``mask`` as the forward's padding mask, exactly as the root's pre-hook would
    stash it from ``attention_mask`` (a 2-D ``[B, T]`` mask, else None). For
    running a single decoder layer, whose call does not pass through the root."""
    ctx: FAContext | None = root_module.__dict__.get(_ROOT_CTX)
    if ctx is None:
        yield
        return
    ctx.token_mask = (
        mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    )
    try:
        yield
    finally:
        ctx.token_mask = None


class InjectingAdapter(FA3QuantAdapterInterface):
    """Shared injection/removal logic; subclasses describe their attention modules.

    A subclass sets :attr:`fa_quant_type` and :attr:`kind` (its key in
    :data:`ATTENTION_HANDLERS`) and implements :meth:`is_attention` and
    :meth:`head_counts`; :meth:`after_inject` adds per-module wiring (hooks, kept as
    handles in ``module.__dict__["_ascend_fa_handles"]`` via :meth:`keep_handles`).
    """

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

    def after_inject(self, name: str, module: nn.Module, ctx: FAContext) -> None:
        """Per-module extra wiring (hooks) after the placeholders went in; none by
        default."""

    @staticmethod
    def keep_handles(module: nn.Module, handles: list[Any]) -> None:
        """Remember hook ``handles`` of ``module``; :func:`remove_injection` removes
        them."""
        module.__dict__.setdefault(_HANDLES, []).extend(handles)

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
        ctx: FAContext | None = root_module.__dict__.get(_ROOT_CTX)
        if ctx is None:
            ctx = FAContext()
            ctx.handles.append(
                root_module.register_forward_pre_hook(
                    _stash_mask_hook(ctx), with_kwargs=True
                )
            )
            ctx.handles.append(
                root_module.register_forward_hook(
                    _clear_mask_hook(ctx), always_call=True
                )
            )
            root_module.__dict__[_ROOT_CTX] = ctx
        for name, module in self.attention_modules(root_module, root_name):
            if not should_inject(name):
                continue
            for branch, (heads, dim) in self.head_counts(module).items():
                # An existing fa_x (placeholder, observer or fake-quant) is kept:
                # injecting twice changes nothing.
                if not hasattr(module, branch):
                    module.add_module(branch, FA3QuantPlaceHolder(branch, heads, dim))
            if context_of(module) is None:
                module.__dict__[_CTX] = ctx
                module.__dict__[_KIND] = self.kind
                self.after_inject(name, module, ctx)
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
    delete_points(root_module)
    for module in root_module.modules():
        for attr in (_CTX, _KIND):
            module.__dict__.pop(attr, None)
        for handle in module.__dict__.pop(_HANDLES, []):
            handle.remove()
    ctx: FAContext | None = root_module.__dict__.pop(_ROOT_CTX, None)
    if ctx is not None:
        for handle in ctx.handles:
            handle.remove()
        for config, original in ctx.configs.values():
            config._attn_implementation = original
        ctx.configs.clear()
