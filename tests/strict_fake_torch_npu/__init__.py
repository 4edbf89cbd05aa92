"""A STRICT FAKE of torch_npu for tests, one per release. It is not torch_npu and
runs no device code.

:func:`install` puts a :class:`StrictFakeTorchNPU` for one release (7.1.0, 7.2.0,
7.3.0 or 26.0.0) into ``sys.modules["torch_npu"]``. The module has exactly the calls
that release has (per the capability table's copy of its
``op_plugin_functions.yaml``); each call

* binds its arguments to that release's schema, raising ``TypeError`` for an
  unknown keyword, a missing argument or a wrongly typed value (:mod:`.binding`),
* enforces every documented rule of the call, raising :class:`FakeRuleViolation`
  naming the rule id (:mod:`.ops`),
* writes the bytes the real op writes / returns the values it returns, so the NPU
  mapping is checked for values against the CPU reference, not only arguments,
* is recorded in :attr:`StrictFakeTorchNPU.calls` (name and bound arguments).

:mod:`.device` adds a fake ``npu`` device (tensors whose device is ``npu``, storage
on the host) for subprocess tests that drive the public API end to end.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from ascend_fa.backends import npu as npu_backend
from ascend_fa.backends.npu_capabilities import CALLS, RELEASES, CallSpec

from .binding import BindError, bind, python_signature
from .ops import ENFORCED_RULES, OPS, FakeRuleViolation

__all__ = [
    "BindError",
    "Call",
    "ENFORCED_RULES",
    "FakeRuleViolation",
    "RELEASES",
    "StrictFakeTorchNPU",
    "install",
    "uninstall",
]


@dataclass
class Call:
    """One recorded call: the function name and its bound arguments."""

    name: str
    args: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        return self.args[key]


class _FakeFunction:
    """``torch_npu.<name>`` of the fake: bind, record, enforce, compute."""

    def __init__(self, owner: StrictFakeTorchNPU, spec: CallSpec) -> None:
        self._owner = owner
        self._spec = spec
        self.__name__ = spec.name
        self.__signature__ = python_signature(spec.signature)

    def __call__(this, /, *args, **kwargs):  # the schema may name an argument self
        bound = bind(this._spec.signature, args, kwargs)
        this._owner.calls.append(Call(this._spec.name, bound))
        return OPS[this._spec.name](this._owner.release, bound)


class StrictFakeTorchNPU(types.ModuleType):
    """The fake module object installed as ``sys.modules["torch_npu"]``."""

    def __init__(self, release: str) -> None:
        if release not in RELEASES:
            raise ValueError(f"no strict fake for torch_npu {release!r}")
        super().__init__("torch_npu")
        self.__file__ = __file__
        self.release = release
        self.calls: list[Call] = []
        for name, spec in CALLS[release].items():
            setattr(self, name, _FakeFunction(self, spec))

    def calls_to(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    @property
    def call_names(self) -> list[str]:
        return [c.name for c in self.calls]


def install(release: str) -> StrictFakeTorchNPU:
    """Install a fresh fake for ``release`` and make the backend import it anew."""
    fake = StrictFakeTorchNPU(release)
    sys.modules["torch_npu"] = fake
    npu_backend.reset_torch_npu()
    return fake


def uninstall() -> None:
    """Remove the fake and forget the backend's import."""
    sys.modules.pop("torch_npu", None)
    npu_backend.reset_torch_npu()
