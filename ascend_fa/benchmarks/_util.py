"""Helpers shared by the benchmarks: timing, throughput, peak memory, tables."""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "time_fn",
    "gbps",
    "peak_rss_bytes",
    "print_table",
    "write_json",
    "MiB",
    "GiB",
]

MiB = 1 << 20
GiB = 1 << 30


def time_fn(
    fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, min_time: float = 0.0
) -> float:
    """Median wall time in seconds of ``fn()`` over ``repeats`` runs after ``warmup``.

    With ``min_time`` > 0 it keeps repeating until that much time has been measured.
    """
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    total = 0.0
    while len(samples) < repeats or total < min_time:
        gc.collect()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        total += elapsed
        if len(samples) >= 1000:
            break
    return statistics.median(samples)


def gbps(num_bytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes per second)."""
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
) -> str:
    """Print (and return) a GitHub-markdown table."""

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
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
