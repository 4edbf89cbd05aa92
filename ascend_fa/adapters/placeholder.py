"""The FA3 injection point: ``FA3QuantPlaceHolder`` and the adapter interface.

An adapter injects three placeholders named ``fa_q``, ``fa_k``, ``fa_v`` into each
selected attention module and arranges for the attention computation to call them
on Q, K and V (see :mod:`ascend_fa.adapters`). The processor later swaps each
placeholder for an observer (calibration) and then a fake-quant module (evaluation);
all three kinds share one call contract:

``fa_x(x, token_mask=None) -> Tensor``

* ``x`` ``[B, H, S, D]`` — heads on axis 1 (``H`` = query heads for ``fa_q``, KV heads
  for ``fa_k``/``fa_v``; ``H = 1`` for the MLA latent);
* ``token_mask`` ``[B, S]`` bool or None — True where the token is real (padding
  tokens are not observed);
* returns a tensor of the same shape and dtype (the input itself for placeholders
  and observers).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
from torch import nn

from ascend_fa.artifact.format import FA_BRANCHES

__all__ = ["FA3QuantPlaceHolder", "FA3QuantAdapterInterface", "FA_BRANCHES"]


class FA3QuantPlaceHolder(nn.Module):
    """Identity marker for one FA quantization point.

    ``branch`` is ``"fa_q"``, ``"fa_k"`` or ``"fa_v"``; ``num_heads`` is the size of
    the head axis the point will see (used to size observers up front).
    """

    def __init__(
        self, branch: str, num_heads: int, head_dim: int | None = None
    ) -> None:
        super().__init__()
        if branch not in FA_BRANCHES:
            raise ValueError(
                f"FA3QuantPlaceHolder: branch must be one of {FA_BRANCHES}, "
                f"got {branch!r}"
            )
        if num_heads <= 0:
            raise ValueError(
                f"FA3QuantPlaceHolder: num_heads must be > 0, got {num_heads}"
            )
        self.branch = branch
        self.num_heads = int(num_heads)
        self.head_dim = head_dim

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return (
            f"branch={self.branch}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}"
        )


class FA3QuantAdapterInterface(abc.ABC):
    """What a model adapter implements (same interface as the reference tool)."""

    @abc.abstractmethod
    def inject_fa3_placeholders(
        self,
        root_name: str,
        root_module: nn.Module,
        should_inject: Callable[[str], bool],
    ) -> None:
        """Add ``fa_q``/``fa_k``/``fa_v`` placeholders to every attention module under
        ``root_module`` whose full dotted name (prefixed by ``root_name``) passes
        ``should_inject``, and route Q/K/V through them. Must be idempotent."""
