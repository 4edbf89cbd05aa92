"""The one Hugging Face integration: how ascend-fa reaches into a transformers model.

Every change the package makes to a live model goes through this module, by one of
two documented mechanisms:

1. **Attention functions** — transformers' ``AttentionInterface`` registry.
   :func:`register_attention_function` registers a function under a new
   implementation name (and, optionally, the mask builder of another name, so the
   model builds exactly the mask it built before); a model is switched to it by
   setting ``config._attn_implementation``. The FA injection (``"ascend_fa_fa3:*"``,
   :mod:`.base`) and the paged-cache emulation (``"ascend_fa_paged"``,
   :mod:`ascend_fa.emulation`) both use it; nothing rewrites ``forward``.
2. **FA points** — the ``fa_q`` / ``fa_k`` / ``fa_v`` submodules an adapter injects.
   They are found with :func:`find_fa_modules` and replaced only through
   :func:`set_point` (``nn.Module.set_submodule``), permanently (the processor's
   stages) or for the duration of a block with :func:`swapped_points`, which
   restores the originals in ``finally`` (evaluation, reports, the clip search's
   capture, the calibration benchmark).

Hooks the package registers on modules are kept as removable handles and removed by
the owner's ``remove``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.placeholder import FA_BRANCHES
from ascend_fa.hf_compat import attention_function

__all__ = [
    "register_attention_function",
    "model_attention_function",
    "find_fa_modules",
    "fa_points",
    "set_point",
    "delete_points",
    "swapped_points",
    "run_forwards",
]


def register_attention_function(
    name: str, fn: Callable[..., Any], *, mask_like: str | None = None
) -> str:
    """Register ``fn`` as attention implementation ``name`` (once) and return ``name``.

    With ``mask_like`` the name also gets that implementation's mask builder, so a
    model switched to ``name`` receives the very mask it received before; without it
    transformers builds no mask (right for kernels that apply causality themselves).
    """
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, fn)
        masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        if mask_like is not None and mask_like in masks:
            AttentionMaskInterface.register(name, masks[mask_like])
    return name


def model_attention_function(module: nn.Module, impl: str) -> Callable[..., Any]:
    """The attention function implementation ``impl`` runs for ``module``
    (``"eager"``: the module's own file's ``eager_attention_forward``). The lookup
    differs between transformers versions: :func:`.hf_compat.attention_function`."""
    return attention_function(module, impl)


def _join(root_name: str, name: str) -> str:
    return ".".join(p for p in (root_name, name) if p)


def find_fa_modules(model: nn.Module, root_name: str = "") -> dict[str, nn.Module]:
    """Modules holding ``fa_q``/``fa_k``/``fa_v``: full dotted name -> module."""
    return {
        _join(root_name, name): module
        for name, module in model.named_modules()
        if any(b in module._modules for b in FA_BRANCHES)
    }


def fa_points(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(branch, point)]`` of one attention module, in branch order."""
    return [(b, module._modules[b]) for b in FA_BRANCHES if b in module._modules]


def set_point(module: nn.Module, branch: str, point: nn.Module) -> None:
    """Put ``point`` at ``module.<branch>`` (``branch`` one of ``fa_q/fa_k/fa_v``)."""
    if branch not in FA_BRANCHES:
        raise ValueError(
            f"set_point: branch must be one of {FA_BRANCHES}, got {branch}"
        )
    module.set_submodule(branch, point)


def delete_points(root: nn.Module) -> None:
    """Remove every ``fa_*`` submodule under ``root``."""
    for module in root.modules():
        for branch in FA_BRANCHES:
            if branch in module._modules:
                delattr(module, branch)


@contextmanager
def swapped_points(
    modules: dict[str, nn.Module],
    make: Callable[[str, str, nn.Module], nn.Module | None],
) -> Iterator[dict[tuple[str, str], nn.Module]]:
    """For the duration of the block, replace each point with ``make(name, branch,
    point)`` (``None`` keeps it); the originals come back in ``finally``.

    ``modules``: attention module name -> module (from :func:`find_fa_modules`).
    Yields ``{(name, branch): new point}`` for the points replaced.
    """
    saved: list[tuple[nn.Module, str, nn.Module]] = []
    placed: dict[tuple[str, str], nn.Module] = {}
    try:
        for name, module in modules.items():
            for branch, point in fa_points(module):
                new = make(name, branch, point)
                if new is None:
                    continue
                saved.append((module, branch, point))
                set_point(module, branch, new)
                placed[(name, branch)] = new
        yield placed
    finally:
        for module, branch, point in reversed(saved):
            set_point(module, branch, point)


@torch.no_grad()
def run_forwards(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    progress: Any = None,
) -> int:
    """The calibration loop: one forward per batch, no KV cache, only the last
    position's logits (the FA points see every token; the head is not needed).
    Returns the number of rows run; ``progress`` (a bar) advances by rows."""
    rows = 0
    for batch in batches:
        model(**batch, use_cache=False, logits_to_keep=1)
        n = int(next(iter(batch.values())).shape[0])
        rows += n
        if progress is not None:
            progress.update(n)
    return rows
