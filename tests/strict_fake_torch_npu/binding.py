"""Bind a call to a release's schema the way the real binding does (a FAKE's part).

Positional arguments up to the ``*``, keywords by name; an unknown keyword, a
missing required argument, too many positionals or a value of the wrong type
raise :class:`BindError` (a ``TypeError``, as torch_npu's generated bindings raise).
"""

from __future__ import annotations

import inspect

import torch
from ascend_fa.backends.npu_capabilities import Param, Signature

__all__ = ["BindError", "bind", "python_signature"]


class BindError(TypeError):
    """The call does not bind to the schema of this release."""


def _type_ok(param: Param, value: object) -> bool:
    if value is None:
        return param.optional_type
    base = param.base_type
    if base == "Tensor":
        return isinstance(value, torch.Tensor)
    if base == "int":
        # torch.ops converts a torch.dtype given for an ``int`` to its enum value;
        # op-plugin's own test passes torch.qint8 to 26.0.0's ``int dtype``.
        if isinstance(value, torch.dtype):
            return True
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "bool":
        return isinstance(value, bool)
    if base == "str":
        return isinstance(value, str)
    if base == "ScalarType":
        return isinstance(value, torch.dtype)
    if base in ("SymInt[]", "int[]"):
        return isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    raise AssertionError(f"schema type {param.type!r} unknown to the fake binder")


def bind(sig: Signature, args: tuple, kwargs: dict) -> dict[str, object]:
    """``{argument name: value}`` with defaults filled in, or :class:`BindError`."""
    positional = [p for p in sig.params if not p.keyword_only]
    if len(args) > len(positional):
        raise BindError(
            f"{sig.name}() takes {len(positional)} positional arguments but "
            f"{len(args)} were given"
        )
    bound = {p.name: a for p, a in zip(positional, args)}
    for name, value in kwargs.items():
        if not sig.accepts(name):
            raise BindError(f"{sig.name}() got an unexpected keyword argument '{name}'")
        if name in bound:
            raise BindError(f"{sig.name}() got multiple values for argument '{name}'")
        bound[name] = value
    for p in sig.params:
        if p.name not in bound:
            if p.required:
                raise BindError(
                    f"{sig.name}() missing required argument '{p.name}' ({p.type})"
                )
            bound[p.name] = p.default
        if not _type_ok(p, bound[p.name]):
            raise BindError(
                f"{sig.name}(): argument '{p.name}' must be {p.type}, not "
                f"{type(bound[p.name]).__name__}"
            )
    return bound


def python_signature(sig: Signature) -> inspect.Signature:
    """An ``inspect.Signature`` of the schema (what the fake's callables expose)."""
    params = []
    for p in sig.params:
        kind = (
            inspect.Parameter.KEYWORD_ONLY
            if p.keyword_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = inspect.Parameter.empty if p.required else p.default
        params.append(inspect.Parameter(p.name, kind, default=default))
    return inspect.Signature(params)
