"""How every command prints results: plain-text tables (GitHub markdown) and
strict JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["print_table", "format_table", "strict_json", "finite_or_none"]


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by ``None``, through
    dicts, lists and tuples: JSON has no NaN, and a reader that chokes on one is
    right to."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int = 2) -> str:
    """Strict JSON text of ``obj`` (non-finite floats as null), ending in a newline."""
    return json.dumps(finite_or_none(obj), indent=indent, allow_nan=False) + "\n"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
) -> str:
    """A GitHub-markdown table (floats with 3 significant digits below 1000)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
        for i, h in enumerate(headers)
    ]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
) -> str:
    """Print (and return) :func:`format_table`."""
    text = format_table(headers, rows, title)
    print(text, flush=True)
    return text
