"""Shared base of the PyTorch-reference backends (``cpu`` and ``cuda``).

Both run the default kernels of the ``ascend_fa::*`` custom ops, i.e. the pure
PyTorch emulation of the Ascend operators. They accept everything the op contracts
allow: any head dim with ``Hkv*D % C0 == 0``, fp16/bf16/fp32 queries, ND or NZ
caches, block sizes that are multiples of 16 (32 for int8).
"""

from __future__ import annotations

from typing import ClassVar

from ..atb_ops import attention as _attention  # noqa: F401  (registers the attention ops)
from ..atb_ops import cache as _cache  # noqa: F401  (registers the cache-write ops)
from .base import Backend, Capabilities

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """PyTorch emulation of the Ascend attention operators.

    CPU and CUDA tensors reach the default (reference) kernels of the
    ``ascend_fa::*`` ops: no device kernel is registered for their dispatch keys.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = "pure-PyTorch emulation of the Ascend operators"
