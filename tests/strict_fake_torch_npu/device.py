"""A FAKE ``npu`` device for subprocess tests: tensors whose device is ``npu``.

:func:`enable` names torch's PrivateUse1 backend ``npu`` (what torch_npu does on
import, and irreversible, hence subprocesses only), registers a fake device module
``torch.npu`` and makes ``torch.empty(..., device="npu")`` work. A tensor on the fake
device is a :class:`FakeNPUTensor`: its device is ``npu`` and its data lives in a
host tensor. Ordinary aten ops run on that host data; ``ascend_fa::*`` ops are
redispatched to the PrivateUse1 key, i.e. to the kernels the ``npu`` backend
registered, exactly as a real NPU tensor would reach them.
"""

from __future__ import annotations

import time

import torch
from torch.utils._pytree import tree_map

__all__ = ["FakeNPUTensor", "enable", "to_npu"]

_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


class FakeNPUTensor(torch.Tensor):
    """A tensor on the fake ``npu`` device (host storage in ``.host``)."""

    # results of ``.cpu()`` & co. must stay plain tensors, not re-wrapped views
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            device="npu",
        )
        t.host = host
        return t

    def __repr__(self) -> str:
        return f"FakeNPUTensor({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "ascend_fa":
            return func.redispatch(_PRIVATEUSE1, *args, **kwargs)
        # A device argument says where the result goes: the host (``.cpu()``,
        # ``.to("cpu")``: return plain host tensors) or the fake device (compute on
        # the host data, wrap the result).
        target = []

        def unwrap(x):
            if isinstance(x, FakeNPUTensor):
                return x.host
            if isinstance(x, torch.device):
                target.append(x.type)
                return torch.device("cpu")
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if target and target[-1] == "cpu":
            return out
        if func._schema.is_mutable and args and isinstance(args[0], FakeNPUTensor):
            return args[0]

        def wrap(x):
            return FakeNPUTensor(x) if isinstance(x, torch.Tensor) else x

        return tree_map(wrap, out)


class _Event:
    """``torch.npu.Event`` of the fake device: host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        return None


class _FakeNPUModule:
    """``torch.npu`` of the fake device."""

    Event = _Event

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        return None

    def get_device_name(self, device=None) -> str:
        return "fake npu (host memory)"

    def manual_seed_all(self, seed: int) -> None:
        return None

    def _is_in_bad_fork(self) -> bool:
        return False


_LIB = None


def enable() -> None:
    """Make ``npu`` a device of this process (call once, before any npu tensor)."""
    global _LIB
    if _LIB is not None:
        return
    from torch.utils.backend_registration import (
        _setup_privateuseone_for_python_backend,
    )

    _setup_privateuseone_for_python_backend("npu", backend_module=_FakeNPUModule())
    lib = torch.library.Library("aten", "IMPL")

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):  # fmt: skip
        return FakeNPUTensor(torch.empty(size, dtype=dtype))

    def empty_strided(size, stride, dtype=None, layout=None, device=None,
                      pin_memory=None):  # fmt: skip
        return FakeNPUTensor(torch.empty_strided(size, stride, dtype=dtype))

    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    _LIB = lib


def to_npu(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of host tensor ``t`` on the fake device (None stays None)."""
    return None if t is None else t.to("npu")
