"""Device layer: the ``Backend`` interface, the registry and the built-in backends.

Every call takes one route: public API -> ``torch.ops.ascend_fa.<op>`` -> the kernel
registered for the tensors' dispatch key. ``cpu`` and ``cuda`` tensors reach the
PyTorch reference kernels of :mod:`ascend_fa.atb_ops`; ``npu`` registers its
torch_npu mapping for the PrivateUse1 key once torch_npu is imported (lazily). A
backend states what it can run (:meth:`Backend.unsupported_reasons`, the NPU's from
the per-release table in :mod:`ascend_fa.backends.npu_capabilities`) and how caches
are laid out. Third-party backends register through the entry-point group
``ascend_fa.backends`` and add kernels for their own dispatch key.
"""

from __future__ import annotations

from .base import (
    ATTENTION_MODES,
    KV_LAYOUTS,
    AttentionSpec,
    Availability,
    Backend,
    Capabilities,
    CapabilityError,
)
from .registry import (
    ENTRY_POINT_GROUP,
    ENV_VAR,
    BackendInfo,
    backend_for_device,
    clear_backend_cache,
    get_backend,
    list_backends,
    register_backend,
    select_backend,
)

__all__ = [
    "ATTENTION_MODES",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "KV_LAYOUTS",
    "AttentionSpec",
    "Availability",
    "Backend",
    "BackendInfo",
    "Capabilities",
    "CapabilityError",
    "backend_for_device",
    "clear_backend_cache",
    "get_backend",
    "list_backends",
    "register_backend",
    "select_backend",
]
