"""A STAND-IN for ATB-Models' torch library ``libatb_speed_torch.so`` (the
``ModelTorch`` / ``OperationTorch`` TorchScript classes atb_llm creates). It is not
the library and runs no graph.

atb_llm loads the library with ``torch.classes.load_library(
$ATB_SPEED_HOME_PATH/lib/libatb_speed_torch.so)`` (``utils/initial.py``
``load_atb_speed``) and then creates ``torch.classes.ModelTorch.ModelTorch(name)``
and ``torch.classes.OperationTorch.OperationTorch(name)``. :func:`install` puts a
stand-in for ``torch.classes`` in place whose ``load_library`` accepts exactly that
file and whose classes are those the library's ``TORCH_LIBRARY`` blocks define
(``atb_framework/pytorch/adapter/model/model_torch.cpp`` L328-351,
``operation/operation_torch.cpp`` L303-313), as strict as the library:

* a namespace or class the library does not define is refused (``RuntimeError``,
  as torch's own lookup of an unknown class), and so is any before the library is
  loaded;
* ``set_param`` parses its argument as JSON and refuses a model name no
  ``REGISTER_MODEL`` of the source tree registers (``ModelFactory::CreateInstance``
  returns null) and an operation name neither ``g_funcMap``
  (``operation_creator.cpp``) nor a ``REGISTER_OPERATION`` has;
* every method that runs the graph or hands it device tensors (``execute*``,
  ``set_weight``, ``set_kv_cache`` ...) raises :class:`StandInError`;
* everything is recorded in :data:`CREATED` (class, name, params).

The names are read from the MindIE-LLM source tree the harness runs, so the
stand-in knows exactly the models and operations of that commit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

__all__ = ["CREATED", "StandInError", "install"]

#: (class, name, [params set]) per object created, in order.
CREATED: list[dict] = []
_LIB = "lib/libatb_speed_torch.so"
_ATB = "examples/atb_models/atb_framework"


class StandInError(RuntimeError):
    """A graph was asked to run or to take device tensors."""


def _registered(src: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(model names, operation names) the library at ``src`` registers."""
    root = src / _ATB
    models: set[str] = set()
    ops: set[str] = set()
    reg_model = re.compile(r"REGISTER_MODEL\(\s*(\w+)\s*,\s*(\w+)\s*\)")
    reg_op = re.compile(r"REGISTER_OPERATION\(\s*(\w+)\s*,\s*(\w+)\s*\)")
    for f in root.rglob("*"):
        if f.suffix not in (".h", ".cpp") or "pytorch/atb_torch" in str(f):
            continue
        text = f.read_text(errors="replace")
        if "#define REGISTER_" in text:
            continue
        models.update(f"{a}_{b}" for a, b in reg_model.findall(text))
        ops.update(f"{a}_{b}" for a, b in reg_op.findall(text))
    creator = root / "pytorch/adapter/operation/operation_creator.cpp"
    block = creator.read_text().split("g_funcMap = {", 1)[1].split("};", 1)[0]
    ops.update(re.findall(r'\{\s*"(\w+)"\s*,', block))
    return frozenset(models), frozenset(ops)


def _refusing(cls: str, method: str):
    def fn(self, *args, **kwargs):
        raise StandInError(
            f"ATB stand-in: {cls}({self._name!r}).{method} was called; the stand-in "
            "runs no graph (only model construction is supported)"
        )

    fn.__name__ = method
    return fn


class _Graph:
    """One ``ModelTorch`` / ``OperationTorch`` object."""

    kind = ""
    known: frozenset[str] = frozenset()

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise RuntimeError(f"{self.kind}: expected a str name, got {name!r}")
        self._name = name
        self._record = {"class": self.kind, "name": name, "params": []}
        CREATED.append(self._record)

    def set_param(self, param: str):
        json.loads(param)  # the library parses it (nlohmann::json::parse)
        if self._name not in self.known:
            raise RuntimeError(
                f"{self.kind}: {self._name} create fail: no such name in "
                "libatb_speed_torch (ModelFactory / OperationFactory)"
            )
        self._record["params"].append(param)
        return 0


class ModelTorch(_Graph):
    kind = "ModelTorch"


class OperationTorch(_Graph):
    kind = "OperationTorch"

    def set_name(self, name: str) -> None:
        self._record["op_name"] = name


for _m in ("set_weight", "set_format_to_nz", "set_kv_cache", "skip_event", "execute",
           "execute_out", "update_weights_ptr", "clear_internal_tensors",
           "reset_execution_status"):  # fmt: skip
    setattr(ModelTorch, _m, _refusing("ModelTorch", _m))
for _m in ("execute", "execute_out", "execute_with_param", "execute_out_with_param"):
    setattr(OperationTorch, _m, _refusing("OperationTorch", _m))


class _Static:
    """``Context`` / ``Event``: static methods only, each refused."""

    def __init__(self, cls: str, methods: tuple[str, ...]) -> None:
        self._cls = cls
        self._methods = methods

    def __getattr__(self, name: str):
        if name not in self._methods:
            raise RuntimeError(f"{self._cls} has no attribute {name}")

        def fn(*args, **kwargs):
            raise StandInError(f"ATB stand-in: {self._cls}.{name} was called")

        return fn


class _Namespace:
    def __init__(self, name: str, classes: dict) -> None:
        self._name = name
        self._classes = classes

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._classes:
            raise RuntimeError(f"Tried to instantiate class '{self._name}.{name}', "
                               "but it does not exist!")  # fmt: skip
        return self._classes[name]


class _Classes:
    """The stand-in's ``torch.classes``."""

    def __init__(self, home: Path, models, ops) -> None:
        self._want = (home / _LIB).resolve()
        self._loaded: list[str] = []
        ModelTorch.known, OperationTorch.known = models, ops
        ctx = ("enable_cache_workspace", "disable_cache_workspace", "resume_hccl_comm")
        self._spaces = {
            "ModelTorch": _Namespace(
                "ModelTorch",
                {
                    "ModelTorch": ModelTorch,
                    "Context": _Static("ModelTorch.Context", ctx),
                    "Event": _Static("ModelTorch.Event", ("record", "wait")),
                },
            ),
            "OperationTorch": _Namespace(
                "OperationTorch", {"OperationTorch": OperationTorch}
            ),
        }

    def load_library(self, path: str) -> None:
        if Path(path).resolve() != self._want:
            raise OSError(f"ATB stand-in: no library at {path} (only {self._want})")
        self._loaded.append(path)

    @property
    def loaded_libraries(self) -> list[str]:
        return list(self._loaded)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if not self._loaded or name not in self._spaces:
            raise RuntimeError(f"Tried to access the namespace torch.classes.{name}, "
                               "but no loaded library defines it")  # fmt: skip
        return self._spaces[name]


def install(src: Path, home: Path) -> None:
    """``torch.classes`` as the stand-in library of the source tree ``src``, to be
    loaded from ``home`` (``$ATB_SPEED_HOME_PATH``)."""
    models, ops = _registered(src)
    torch.classes = _Classes(home, models, ops)
