"""Helpers shared by the benchmarks: timing, throughput, peak memory, tables."""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

from ascend_fa.tables import print_table

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


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
