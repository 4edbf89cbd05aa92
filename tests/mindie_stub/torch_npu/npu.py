"""``torch.npu`` / ``torch_npu.npu`` of the stand-in: one device (index 0) that is
the host, the ``npu`` PrivateUse1 backend name, and what MindIE's construction path
asks of the device module; anything else is refused (see the package docstring)."""

from __future__ import annotations

import sys

import torch

#: a package, for ``torch_npu.npu.config``
__path__: list[str] = []


def _touch(entry: str) -> None:
    from . import touch

    touch(entry)


def set_device(device) -> None:
    """atb_llm ``utils/dist.py`` ``initialize_distributed``: the device of rank 0."""
    _touch(f"call torch.npu.set_device({device})")
    if torch.device(device) not in (torch.device("npu:0"), torch.device("npu")):
        from . import StandInError

        raise StandInError(f"torch_npu stand-in: one device (npu:0), not {device}")


def is_available() -> bool:
    _touch("call torch.npu.is_available")
    return True


def device_count() -> int:
    _touch("call torch.npu.device_count")
    return 1


def current_device() -> int:
    _touch("call torch.npu.current_device")
    return 0


def set_compile_mode(jit_compile: bool = False) -> None:
    """atb_llm ``runner/model_runner.py`` L364 (operator compile mode: no effect
    without operators)."""
    _touch(f"call torch.npu.set_compile_mode(jit_compile={jit_compile})")


def synchronize(device=None) -> None:
    """Nothing runs on the stand-in's device, so there is nothing to wait for."""
    _touch("call torch.npu.synchronize")


def empty_cache() -> None:
    """The stand-in's device holds no cache (its tensors are host tensors)."""
    _touch("call torch.npu.empty_cache")


def _refusing(name: str):
    def fn(*args, **kwargs):
        from . import StandInError

        _touch(f"call torch.npu.{name}")
        raise StandInError(f"torch_npu stand-in: torch.npu.{name} was called")

    fn.__name__ = fn.__qualname__ = name
    return fn


#: Device functions atb_llm names on its inference path only: each raises.
NAMED_ONLY = ("mem_get_info", "stream", "current_stream", "default_stream")
for _name in NAMED_ONLY:
    globals()[_name] = _refusing(_name)


def register() -> None:
    """This module as ``torch.npu`` and the PrivateUse1 backend ``npu``."""
    from . import StandInModule, _module, refused_class

    # names only: Stream (atb_llm's inference path), Event (an annotation of
    # mindie_llm/text_generator/utils/model_output.py L41)
    for cls in ("Stream", "Event"):
        globals()[cls] = refused_class(f"torch.npu.{cls}")
    this = sys.modules[__name__]
    this.__class__ = StandInModule
    # atb_llm runner/model_runner.py L74 and the models set it at import
    this.config = _module("torch_npu.npu.config", {"allow_internal_format": False})
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    torch.npu = this
    sys.modules["torch.npu"] = this
