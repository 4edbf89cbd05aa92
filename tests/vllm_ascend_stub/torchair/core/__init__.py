"""``torchair.core`` of the stand-in (see the package docstring)."""

from . import _concrete_graph  # noqa: F401
