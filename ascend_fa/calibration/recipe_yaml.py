"""Reading a recipe's YAML safely, and its validation errors as one line.

A recipe is untrusted input: at most :data:`MAX_RECIPE_BYTES`, no aliases (each
can multiply the document), nesting capped at :data:`MAX_RECIPE_DEPTH`, all
refused from the parser's events before anything is built. A validation error
names the file, the YAML path (``spec.process[0].ratio.q``) and its line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import ValidationError

from ascend_fa.errors import FileFormatError

__all__ = [
    "MAX_RECIPE_BYTES",
    "MAX_RECIPE_DEPTH",
    "RecipeError",
    "format_errors",
    "node_lines",
    "parse_document",
    "yaml_path",
]

#: Largest recipe document, in bytes (the packaged recipes are under 2 KiB).
MAX_RECIPE_BYTES = 64 * 1024
#: Deepest nesting of YAML collections in a recipe.
MAX_RECIPE_DEPTH = 32


class RecipeError(FileFormatError):
    """A recipe failed to parse or validate; the message names path and line (a
    :class:`~ascend_fa.errors.FileFormatError`, so also a ``ValueError``)."""


def node_lines(
    node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int]
) -> None:
    """Fill ``out`` with the line of every key and item under ``node``."""
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value
            node_lines(value, path + (k,), out)
            # A key's path points at the key's own line (a block value starts later).
            out[path + (k,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            node_lines(item, path + (i,), out)


def yaml_path(loc: Iterable[Any]) -> str:
    """A validation location as a YAML path: ``spec.process[0].ratio.q``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "<root>"


def format_errors(
    exc: ValidationError, lines: dict[tuple[Any, ...], int], source: str
) -> str:
    """Every problem of ``exc`` in one line, each naming ``source``, the key and
    its line."""
    msgs = []
    for err in exc.errors():
        # Pydantic puts the failing member of a union or tagged type into loc as a
        # non-key string (e.g. "float"); keep only the parts that exist in the YAML.
        loc = tuple(err["loc"])
        path: tuple[Any, ...] = ()
        line = lines.get((), None)
        for part in loc:
            if path + (part,) in lines:
                path = path + (part,)
                line = lines[path]
            elif err["type"] in ("extra_forbidden", "missing") and part == loc[-1]:
                path = path + (part,)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {str(path[-1])!r}"
        elif err["type"] == "missing":
            msg = f"missing required key {str(path[-1])!r}"
        elif "input" in err and err["type"] not in ("missing", "value_error"):
            msg += f" (got {err['input']!r})"
        where = f"{source}: {yaml_path(path)}"
        if line is not None:
            where += f" (line {line})"
        if f"{where}: {msg}" not in msgs:  # a scalar ratio fails once per branch
            msgs.append(f"{where}: {msg}")
    # one line: every problem, each naming the file, the key and its line
    return "invalid recipe: " + "; ".join(msgs)


# libyaml's parser when PyYAML has it: the pure-Python scanner is ~10x slower.
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _RecipeLoader(_SAFE_LOADER):  # type: ignore[misc, valid-type]
    """The safe loader; with the pure-Python scanner, flow collections are capped
    at :data:`MAX_RECIPE_DEPTH` levels while scanning (its per-level state makes
    deep ``[[[[...`` quadratic). Aliases and depth are checked on the event stream
    first (:func:`_check_events`)."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= MAX_RECIPE_DEPTH:
            raise yaml.scanner.ScannerError(
                None,
                None,
                f"nested more than {MAX_RECIPE_DEPTH} levels deep",
                self.get_mark(),
            )
        super().fetch_flow_collection_start(TokenClass)


def _check_events(text: str) -> None:
    """Refuse aliases (``*name``, and so ``<<:`` merges: each can multiply the
    document — the "billion laughs" bomb) and nesting deeper than
    :data:`MAX_RECIPE_DEPTH`, from the parser's events, before anything is
    built."""
    depth = 0
    for event in yaml.parse(text, Loader=_RecipeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.MarkedYAMLError(
                None,
                None,
                "aliases (*name) are not allowed in recipes",
                event.start_mark,
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_RECIPE_DEPTH:
                raise yaml.MarkedYAMLError(
                    None,
                    None,
                    f"nested more than {MAX_RECIPE_DEPTH} levels deep",
                    event.start_mark,
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def parse_document(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """``(node, data)`` of the YAML ``text`` after the size, alias and depth
    checks (:class:`RecipeError` naming ``source``)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: recipe is larger than {MAX_RECIPE_BYTES} bytes")
    try:
        _check_events(text)
        loader = _RecipeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        msg = " ".join(str(exc).split())
        raise RecipeError(f"{source}: not valid YAML: {msg}") from None
    except RecursionError:
        raise RecipeError(f"{source}: not valid YAML: nested too deeply") from None
    return node, data
