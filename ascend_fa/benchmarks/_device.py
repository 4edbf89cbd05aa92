"""Benchmarks on a chosen backend: resolve ``--backend`` and time with its clock.

``cpu`` times with ``time.perf_counter``; ``cuda`` and ``npu`` record device events
around the call and synchronize, so queued kernels are counted and host overhead
between them is too. A backend that is not usable here is refused in one line
(:class:`~ascend_fa.errors.UnsupportedError`, exit 2 from the CLI).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..backends import Backend, get_backend
from ..errors import UnsupportedError

__all__ = [
    "BACKEND_CHOICES",
    "add_backend_argument",
    "bench_backend",
    "time_on",
    "time_pair",
]

BACKEND_CHOICES = ("cpu", "cuda", "npu", "auto")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="cpu",
        help="run on this backend (auto: npu, else cuda, else cpu); default cpu",
    )


def bench_backend(name: str) -> Backend:
    """The backend called ``name`` (``auto``: the selected one), usable here."""
    try:
        return get_backend(None if name == "auto" else name)
    except ValueError as exc:
        raise UnsupportedError(str(exc).split("\n")[0]) from exc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _timer(device: torch.device, clock: str = "wall"):
    """A function timing one call of ``fn`` on ``device``, in seconds. On CPU,
    ``clock="cpu"`` counts the process's CPU time (all its threads) instead of wall
    time: on a shared machine that is what a code change moves, not the load."""
    if device.type == "cpu":
        now = time.process_time if clock == "cpu" else time.perf_counter

        def host(fn: Callable[[], Any]) -> float:
            start = now()
            fn()
            return now() - start

        return host
    module = getattr(torch, device.type)

    def events(fn: Callable[[], Any]) -> float:
        begin = module.Event(enable_timing=True)
        end = module.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    return events


def time_on(
    device: torch.device,
    fn: Callable[[], Any],
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> float:
    """Median seconds of ``fn()`` on ``device`` over ``repeats`` after ``warmup``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    timer = _timer(device)
    samples = []
    for _ in range(repeats):
        gc.collect()
        samples.append(timer(fn))
    return statistics.median(samples)


def time_pair(
    device: torch.device,
    baseline: Callable[[], Any],
    fn: Callable[[], Any],
    *,
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
) -> tuple[float, float]:
    """Median seconds of ``baseline()`` and ``fn()``, measured alternately so both
    see the same machine (a ratio of two runs taken minutes apart on a shared host
    measures the load, not the code). ``clock``: ``wall`` or (CPU only) ``cpu``."""
    if clock not in ("wall", "cpu"):
        raise UnsupportedError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and device.type != "cpu":
        raise UnsupportedError(
            f"--clock cpu measures host CPU time; use the wall clock on {device.type}"
        )
    for _ in range(warmup):
        baseline()
        fn()
    _sync(device)
    timer = _timer(device, clock)
    base, other = [], []
    for _ in range(repeats):
        gc.collect()
        base.append(timer(baseline))
        other.append(timer(fn))
    return statistics.median(base), statistics.median(other)
