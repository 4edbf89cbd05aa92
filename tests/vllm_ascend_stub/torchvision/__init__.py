"""A STAND-IN for torchvision on vllm-ascend's weight-loading path. It is not
torchvision and transforms no image.

vllm-ascend's worker patches import vLLM's multimodal Qwen model modules for every
model (``patch_qwen3_5``), which import transformers' Qwen2-VL image processor,
which imports torchvision at module level. The registry's torchvision wheels are
CUDA builds that cannot load beside the CPU torch, and the loading path of a text
model transforms no image. So ``import torchvision`` and any ``torchvision.*``
submodule resolve to modules whose every attribute is a placeholder: a class
placeholder can be subclassed and named in annotations, and any call of one
raises :class:`StandInError` (recorded in :data:`TOUCHED`, which the driver
reports; the test asserts nothing was called).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# a valid version (transformers 5.14 parses it): the local label says what it is
__version__ = "0.28.0+standin"

#: ``"call NAME"`` for every placeholder called.
TOUCHED: list[str] = []


class StandInError(RuntimeError):
    """A torchvision function was called on the loading path."""


class _Meta(type):
    """Placeholder classes: their attributes (enum members, methods) are
    placeholders too."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_Placeholder,), {"__module__": cls.__module__})
        setattr(cls, name, value)
        return value


class _Placeholder(metaclass=_Meta):
    """A name torchvision has; calling or creating it is refused."""

    def __new__(cls, *args, **kwargs):
        TOUCHED.append(f"call {cls.__module__}.{cls.__qualname__}")
        raise StandInError(
            f"torchvision stand-in: {cls.__module__}.{cls.__qualname__} was called"
        )


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _Module(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
