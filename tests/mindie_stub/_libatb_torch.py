"""A STAND-IN for ``_libatb_torch`` (ATB's Python graph library) on MindIE-LLM's
model-construction path. It is not the library and builds no graph.

atb_llm imports it at module level (``nn/distributed/distributed.py`` L23,
``nn/network.py``: ``class AtbGraph(atb.GraphOperation)``, L232
``atb.BaseOperation``) through ``utils/mapping.py`` L31 and ``nn/modules``. The C++
graph path (the one the atb models run by default) never creates an object of it:
the two base classes refuse to be created, the four process-group functions refuse
to be called (:class:`StandInError`), and any other name is refused
(``AttributeError``).
"""

from __future__ import annotations

import sys
import types


class StandInError(RuntimeError):
    """Something of ATB's Python graph library was used."""


def _refused_init(self, *args, **kwargs) -> None:
    raise StandInError(
        f"_libatb_torch stand-in: {type(self).__name__} cannot be created (the C++ "
        "graph path builds no Python graph)"
    )


class BaseOperation:
    __init__ = _refused_init


class GraphOperation(BaseOperation):
    pass


def _refusing(name: str):
    def fn(*args, **kwargs):
        raise StandInError(f"_libatb_torch stand-in: {name} was called")

    fn.__name__ = name
    return fn


init_process_group = _refusing("init_process_group")
new_group = _refusing("new_group")
is_process_group_initialized = _refusing("is_process_group_initialized")
get_backend = _refusing("get_backend")


class _Refusing(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"_libatb_torch stand-in: {name} is not on the construction path"
        )


sys.modules[__name__].__class__ = _Refusing
