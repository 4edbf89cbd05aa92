"""A STAND-IN for torch_npu on MindIE-LLM's model-construction path. It is not
torch_npu and runs no device code.

``tests/mindie_own_driver.py`` puts ``tests/mindie_stub`` first on ``sys.path``, so
``import torch_npu`` in MindIE-LLM's ``atb_llm`` (which needs the CANN libraries)
finds this module. It holds exactly what atb_llm's import-time code and its model
construction (router, ``Weights``, the model class's ``__init__``) touch; everything
else is refused:

* an attribute that is not listed raises ``AttributeError`` naming it, and an
  unlisted submodule raises ``ImportError``;
* every NPU op that computes (:data:`NPU_OPS`) raises :class:`StandInError` when
  called; the layout casts ``npu_format_cast`` / ``npu_format_cast_`` are the identity
  (a CPU tensor has no device layout) and ``get_npu_format`` answers ND (2);
* the device is the host: ``torch.device("npu")`` parses (the PrivateUse1 backend is
  named ``npu``) and :class:`HostDevice` places every tensor asked for on ``npu``
  on the CPU instead, recording ``"npu tensor FUNC"`` (model construction moves
  weights and placeholders to the device; it computes nothing there);
* ``_C._npu_get_soc_version`` answers 224 (Ascend 910B4, the Atlas 800I A2 this
  project targets; atb_llm ``utils/initial.py`` ``NPUSocInfo``);
* every lookup, call and import is recorded in :data:`TOUCHED`.
"""

from __future__ import annotations

import importlib.abc
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["NPU_OPS", "SOC_VERSION", "StandInError", "TOUCHED", "HostDevice"]

__version__ = "2.7.1.stand-in"

#: What was looked up, called, imported or refused, in order.
TOUCHED: list[str] = []
#: The SoC the stand-in answers for: Ascend 910B4 (Atlas 800I A2).
SOC_VERSION = 224
#: ACL format ND (what a host tensor is).
FORMAT_ND = 2


class StandInError(RuntimeError):
    """An NPU op or feature the stand-in does not run was asked for."""


def touch(entry: str) -> None:
    if entry not in TOUCHED:
        TOUCHED.append(entry)


class StandInModule(types.ModuleType):
    """A module whose listed attributes resolve and whose others are refused."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        touch(f"refused {full}")
        raise AttributeError(
            f"torch_npu stand-in: {full} is not known (not on the construction path)"
        )

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if not name.startswith("_") or name in ("_C", "_npu_get_soc_version"):
            touch(f"attr {super().__getattribute__('__name__')}.{name}")
        return value


def refusing(qualname: str):
    def op(*args, **kwargs):
        touch(f"call {qualname}")
        raise StandInError(
            f"torch_npu stand-in: {qualname} was called; the stand-in runs no NPU "
            "op (only model construction is supported)"
        )

    op.__name__ = op.__qualname__ = qualname.rpartition(".")[2]
    return op


def refused_class(qualname: str) -> type:
    """A class the construction path names but must not create."""

    def __init__(self, *args, **kwargs) -> None:
        touch(f"call {qualname}")
        raise StandInError(f"torch_npu stand-in: {qualname} cannot be created")

    return type(qualname.rpartition(".")[2], (), {"__init__": __init__})


def _format_cast(tensor: torch.Tensor, acl_format: int, *args, **kwargs):
    """``npu_format_cast``: the identity (a CPU tensor has no device layout)."""
    touch(f"call torch_npu.npu_format_cast({acl_format})")
    return tensor


def _format_cast_(tensor: torch.Tensor, acl_format: int, *args, **kwargs):
    touch(f"call torch_npu.npu_format_cast_({acl_format})")
    return tensor


def _get_npu_format(tensor: torch.Tensor) -> int:
    touch("call torch_npu.get_npu_format")
    return FORMAT_ND


def _soc_version() -> int:
    touch("call torch_npu._C._npu_get_soc_version")
    return SOC_VERSION


#: NPU ops named on import or on the inference path (atb_llm; transformers'
#: ``integrations/npu_flash_attention.py`` imports ``npu_fusion_attention`` once
#: it sees torch_npu); calling one raises.
NPU_OPS = (
    "npu_prompt_flash_attention",
    "npu_trans_quant_param",
    "npu_fusion_attention",
)


def _is_npu(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "npu"
    if isinstance(device, str):
        return device.split(":")[0] == "npu"
    return False


class HostDevice(TorchFunctionMode):
    """Places every tensor asked for on ``npu`` on the CPU (recorded as ``"npu
    tensor NAME"``): a ``device=`` argument naming npu, ``Tensor.to(npu)``,
    ``Tensor.npu()`` (see :func:`_tensor_npu`). Nothing is computed on the
    device: the NPU ops refuse."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if _is_npu(kwargs.get("device")):
            touch(f"npu tensor {name}")
            kwargs["device"] = torch.device("cpu")
        if name == "to":
            args = list(args)
            for i, a in enumerate(args[1:], start=1):
                if _is_npu(a):
                    touch("npu tensor Tensor.to")
                    args[i] = torch.device("cpu")
            args = tuple(args)
        return func(*args, **kwargs)


def _tensor_npu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``Tensor.npu()``: the tensor on the host (the stand-in's device)."""
    touch("npu tensor Tensor.npu")
    return self


def _module(name: str, attrs: dict) -> StandInModule:
    mod = StandInModule(name)
    mod.__dict__.update(attrs)
    mod.__file__ = __file__
    sys.modules[name] = mod
    return mod


class _ProfilerLevel:
    """``torch_npu.profiler.ProfilerLevel``: the names MindIE's env reads
    (``mindie_llm/utils/env.py``), as strings."""

    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"
    Level_none = "Level_none"


#: The stand-in's submodules (name -> attributes).
SUBMODULES: dict[str, dict] = {
    "torch_npu._C": {"_npu_get_soc_version": _soc_version},
    "torch_npu._C._distributed_c10d": {
        "ProcessGroupHCCL": refused_class(
            "torch_npu._C._distributed_c10d.ProcessGroupHCCL"
        )
    },
    "torch_npu.profiler": {"ProfilerLevel": _ProfilerLevel},
}


class _Finder(importlib.abc.MetaPathFinder):
    """Refuses a ``torch_npu.*`` submodule the stand-in does not have."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torch_npu.") or fullname in sys.modules:
            return None
        touch(f"refused import {fullname}")
        raise ImportError(
            f"torch_npu stand-in: no module {fullname} (not on the construction path)"
        )


def _install() -> None:
    from . import npu as npu_module

    this = sys.modules[__name__]
    attrs: dict = {n: refusing(f"torch_npu.{n}") for n in NPU_OPS}
    attrs.update(
        npu_format_cast=_format_cast,
        npu_format_cast_=_format_cast_,
        get_npu_format=_get_npu_format,
        npu=npu_module,
    )
    for k, v in attrs.items():
        setattr(this, k, v)
    for name, sub in SUBMODULES.items():
        mod = _module(name, sub)
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)
    this.__class__ = StandInModule
    sys.meta_path.append(_Finder())
    torch.Tensor.npu = _tensor_npu
    npu_module.register()
    touch("import torch_npu")


_install()
