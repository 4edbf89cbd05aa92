"""Device layer: the ``Backend`` interface, the registry and the built-in backends.

``cpu`` and ``cuda`` run the PyTorch reference kernels of :mod:`ascend_fa.atb_ops`;
``npu`` maps the same ops to torch_npu and is imported lazily. Third-party backends
register through the entry-point group ``ascend_fa.backends``.
"""

from __future__ import annotations

from .base import (
    ATTENTION_MODES,
    KV_LAYOUTS,
    AttentionSpec,
    Availability,
    Backend,
    Capabilities,
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
    "backend_for_device",
    "clear_backend_cache",
    "get_backend",
    "list_backends",
    "register_backend",
    "select_backend",
]
