"""``torch.npu`` / ``torch_npu.npu`` of the stand-in: one device (index 0), the
``npu`` PrivateUse1 backend name, and what the loading path asks of the device
module; anything else is refused (see the package docstring)."""

from __future__ import annotations

import sys

import torch

#: a package, for the stand-in's ``torch_npu.npu.*`` submodules
__path__: list[str] = []


def current_device() -> torch.device:
    """The host: tensors the loading path creates on "the current NPU"
    (``device=torch.npu.current_device()``) are made where the model is, on the
    CPU (torch_npu returns the index 0, which names the NPU)."""
    _touch("call torch.npu.current_device")
    return torch.device("cpu")


def device_count() -> int:
    _touch("call torch.npu.device_count")
    return 1


def is_available() -> bool:
    _touch("call torch.npu.is_available")
    return True


def set_device(device) -> None:
    _touch(f"call torch.npu.set_device({device})")


def _touch(entry: str) -> None:
    from . import _touch as touch

    touch(entry)


def _classes() -> None:
    from . import refused_class

    for name in ("Stream", "Event", "ExternalEvent", "NPUGraph"):
        globals()[name] = refused_class(f"torch.npu.{name}")


KNOWN = {
    "current_device": current_device,
    "device_count": device_count,
    "is_available": is_available,
    "set_device": set_device,
}


#: Device functions the loading path names (import-time assignments such as
#: vllm-ascend's ``torch.accelerator.memory_stats = torch.npu.memory_stats``) but
#: must not call: each raises StandInError when called.
NAMED_ONLY = (
    "empty_cache",
    "memory_stats",
    "memory_reserved",
    "reset_peak_memory_stats",
    # 0.25.1rc1 patch_torch_accelerator.py: torch.accelerator.get_memory_info
    "mem_get_info",
)


def _refusing(name: str):
    def fn(*args, **kwargs):
        from . import StandInError

        _touch(f"call torch.npu.{name}")
        raise StandInError(f"torch_npu stand-in: torch.npu.{name} was called")

    fn.__name__ = fn.__qualname__ = name
    return fn


for _name in NAMED_ONLY:
    globals()[_name] = _refusing(_name)


#: The kernels of the ``npu`` device: allocation only, each refusing (see
#: :func:`_refuse_allocation`); kept alive for the process.
_DEVICE_KERNELS: list = []
#: What allocates a tensor on a device (every factory and ``.to("npu")`` ends in
#: one of these two ATen ops).
ALLOCATORS = ("empty.memory_format", "empty_strided")


def _refuse_allocation(op: str):
    def kernel(*args, **kwargs):
        from . import StandInError

        _touch(f"refused npu tensor aten::{op}")
        raise StandInError(
            f"torch_npu stand-in: a tensor on the npu device was requested "
            f"(aten::{op}); the stand-in has no device memory and runs no device "
            "compute"
        )

    return kernel


def register() -> None:
    """This module as ``torch.npu`` and the PrivateUse1 backend ``npu``, whose
    tensor allocations are refused (:data:`ALLOCATORS`: the loading path asks
    for an ``npu`` tensor only to compute on it)."""
    from . import _StandInModule

    _classes()
    this = sys.modules[__name__]
    this.__class__ = _StandInModule
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    torch.npu = this
    sys.modules["torch.npu"] = this
    if not _DEVICE_KERNELS:
        lib = torch.library.Library("aten", "IMPL")
        for op in ALLOCATORS:
            lib.impl(op, _refuse_allocation(op), "PrivateUse1")
        _DEVICE_KERNELS.append(lib)
