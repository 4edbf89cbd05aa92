"""A STAND-IN for torch_npu on vllm-ascend's weight-loading path. It is not torch_npu
and runs no device code.

``tests/vllm_ascend_driver.py`` puts this package's parent directory first on
``sys.path`` in a vllm-ascend environment (``ci/vllm_ascend_env.sh``), so that
``import torch_npu`` (which needs the CANN libraries) finds this module instead.
What it has is exactly what vllm-ascend's import-time code and its loading path
(config, model construction, ``load_weights``, ``process_weights_after_loading``)
touch, listed in :data:`ATTRIBUTES`, :data:`SUBMODULES`, :data:`NPU_OPS` and
:mod:`.npu`; everything else is refused:

* an attribute of a stand-in module that is not listed raises ``AttributeError``
  naming it, and an unlisted submodule raises ``ImportError``;
* every NPU op in :data:`NPU_OPS` is a function that raises :class:`StandInError`
  when called (no NPU op is silently a no-op), except ``npu_format_cast``: the
  layout cast (ND <-> FRACTAL_NZ) is the identity here, since a CPU tensor has no
  device layout; the test states that exception;
* every lookup, call and import is recorded in :data:`TOUCHED` (``"attr NAME"``,
  ``"call NAME"``, ``"import NAME"``, ``"refused NAME"``), which the driver reports.

``torch.npu`` (:mod:`.npu`) is registered as the ``npu`` PrivateUse1 backend's
module (``torch.utils.rename_privateuse1_backend("npu")``), with one device (0)
whose tensor allocation raises :class:`StandInError` (recorded as ``"refused npu
tensor ..."``): a step that computes on the device fails there, naming itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch

__all__ = ["ATTRIBUTES", "NPU_OPS", "StandInError", "TOUCHED", "format_cast"]

__version__ = "2.13.0.stand-in"

#: What was looked up, called, imported or refused, in order.
TOUCHED: list[str] = []


class StandInError(RuntimeError):
    """An NPU op or feature the stand-in does not run was called."""


def _touch(entry: str) -> None:
    if entry not in TOUCHED:
        TOUCHED.append(entry)


class _StandInModule(types.ModuleType):
    """A module whose listed attributes resolve and whose others are refused."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        _touch(f"refused {full}")
        raise AttributeError(
            f"torch_npu stand-in: {full} is not known (not on the loading path)"
        )

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if not name.startswith("_"):
            _touch(f"attr {super().__getattribute__('__name__')}.{name}")
        return value


def _refusing_op(name: str):
    def op(*args, **kwargs):
        _touch(f"call torch_npu.{name}")
        raise StandInError(
            f"torch_npu stand-in: torch_npu.{name} was called; the stand-in runs "
            "no NPU op (only the loading path is supported)"
        )

    op.__name__ = op.__qualname__ = name
    return op


def format_cast(tensor: torch.Tensor, acl_format: int, *args, **kwargs):
    """``npu_format_cast``: the identity (a CPU tensor has no device layout)."""
    _touch(f"call torch_npu.npu_format_cast({acl_format})")
    return tensor


#: The NPU ops vllm-ascend names at import time or on the loading path; calling
#: any but ``npu_format_cast`` raises :class:`StandInError`.
NPU_OPS = (
    "npu_format_cast",
    "npu_fusion_attention",
)


def refused_class(qualname: str) -> type:
    """A class the loading path names (annotations, isinstance checks) but must
    not create: instantiating it raises :class:`StandInError`."""

    def __init__(self, *args, **kwargs) -> None:
        _touch(f"call {qualname}")
        raise StandInError(f"torch_npu stand-in: {qualname} cannot be created")

    return type(qualname.rpartition(".")[2], (), {"__init__": __init__})


class _Options:
    """``ProcessGroupHCCL.Options``: a plain record of the fields set on it."""

    def __init__(self, *args, **kwargs) -> None:
        _touch("call ProcessGroupHCCL.Options")
        self.hccl_config: dict = {}
        self._timeout = None


class _ProcessGroupHCCL:
    Options = _Options

    def __init__(self, *args, **kwargs) -> None:
        raise StandInError("torch_npu stand-in: ProcessGroupHCCL cannot be created")


def _hccl_available() -> bool:
    _touch("call torch.distributed.is_hccl_available")
    return False


def _hccl_comm_name(self, rank: int) -> str:
    _touch("call ProcessGroup.get_hccl_comm_name")
    return f"torch_npu-stand-in-hccl-{rank}"


def _tensor_npu(self: torch.Tensor, device=None, non_blocking: bool = False, **kw):
    """``Tensor.npu()`` (torch_npu adds it): a copy to the current NPU, which here
    is the host (:func:`.npu.current_device`), so the tensor itself (vllm-ascend
    0.25.1rc1 / main build the MoE layer's ``moe_load`` counter with it)."""
    _touch("call torch.Tensor.npu")
    return self


def _module(name: str, attrs: dict) -> _StandInModule:
    mod = _StandInModule(name)
    mod.__dict__.update(attrs)
    mod.__file__ = __file__
    sys.modules[name] = mod
    return mod


#: The stand-in's submodules (name -> attributes).
SUBMODULES: dict[str, dict] = {
    "torch_npu._C": {
        "_NPUTaskGroupHandle": refused_class("torch_npu._C._NPUTaskGroupHandle"),
    },
    "torch_npu._C._distributed_c10d": {"ProcessGroupHCCL": _ProcessGroupHCCL},
    # vllm-ascend's worker module: the ATB extension registration (refused when
    # called: the stand-in runs no ATB op) and the profiler
    "torch_npu.op_plugin": {},
    "torch_npu.op_plugin.atb": {},
    "torch_npu.op_plugin.atb._atb_ops": {
        "_register_atb_extensions": _refusing_op("_register_atb_extensions"),
    },
    "torch_npu.profiler": {},
    "torch_npu.profiler.dynamic_profile": {},
    # the model runner sets allow_internal_format = True at import (NZ casts)
    "torch_npu.npu.config": {"allow_internal_format": False},
    # the device allocator's annotations (sleep mode only)
    "torch_npu.npu.memory": {
        "NPUPluggableAllocator": refused_class(
            "torch_npu.npu.memory.NPUPluggableAllocator"
        ),
    },
    # vllm-ascend 0.13 utils.py: from torch_npu.npu.streams import Event
    "torch_npu.npu.streams": {"Event": refused_class("torch_npu.npu.streams.Event")},
}


class _DtypeName:
    """A torch_npu dtype the loading path names but never makes a tensor of
    (vllm-ascend main ``quantization/utils.py`` builds tuples of them at import):
    a named token, equal only to itself, which no tensor's dtype matches."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name} (stand-in token)"


#: The top-level attributes besides the NPU ops.
ATTRIBUTES: dict = {
    n: _DtypeName(n) for n in ("float4_e2m1fn_x2", "hifloat8", "float8_e8m0fnu")
}


class _Finder(importlib.abc.MetaPathFinder):
    """Refuses a ``torch_npu.*`` submodule the stand-in does not have."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torch_npu.") or fullname in sys.modules:
            return None
        _touch(f"refused import {fullname}")
        raise ImportError(
            f"torch_npu stand-in: no module {fullname} (not on the loading path)"
        )


def _install() -> None:
    from . import npu as npu_module

    this = sys.modules[__name__]
    this.__class__ = _StandInModule
    attrs = {n: _refusing_op(n) for n in NPU_OPS}
    attrs["npu_format_cast"] = format_cast
    attrs.update(ATTRIBUTES)
    attrs["npu"] = npu_module
    for k, v in attrs.items():
        setattr(this, k, v)
    for name, sub in SUBMODULES.items():
        mod = _module(name, sub)
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)
    this._C._distributed_c10d = sys.modules["torch_npu._C._distributed_c10d"]
    sys.meta_path.append(_Finder())
    # torch_npu adds is_hccl_available to torch.distributed; no HCCL runs here
    torch.distributed.is_hccl_available = _hccl_available
    # The driver's process groups answer for the "npu" device with gloo; MoE
    # layers ask that backend for its HCCL communicator name when they are built
    # (vllm-ascend 0.18 token_dispatcher.py), a string only an MC2 kernel reads.
    torch.distributed.ProcessGroupGloo.get_hccl_comm_name = _hccl_comm_name
    torch.Tensor.npu = _tensor_npu
    npu_module.register()
    _touch("import torch_npu")


_install()
