"""Shared base of the PyTorch-reference backends (``cpu`` and ``cuda``).

Both run the default kernels of the ``ascend_fa::*`` custom ops, i.e. the pure
PyTorch emulation of the Ascend operators. They accept everything the op contracts
allow: any head dim with ``Hkv*D % C0 == 0``, fp16/bf16/fp32 queries, ND or NZ
caches, block sizes that are multiples of 16 (32 for int8).
"""

from __future__ import annotations

from typing import ClassVar

from .base import Backend, Capabilities

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """PyTorch emulation of the Ascend attention operators."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = "pure-PyTorch emulation of the Ascend operators"
