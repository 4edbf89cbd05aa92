"""A STAND-IN for ``acl`` (CANN's pyACL) on MindIE-LLM's model-construction path.
It is not pyACL and reaches no device.

atb_llm ``utils/weights.py`` L28 imports ``acl`` at module level; the
construction path calls nothing of it. Any attribute looked up is refused
(``AttributeError`` naming it): the module holds no name at all.
"""

from __future__ import annotations

import sys
import types


class _Refusing(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"acl stand-in: acl.{name} is not on the construction path"
        )


sys.modules[__name__].__class__ = _Refusing
