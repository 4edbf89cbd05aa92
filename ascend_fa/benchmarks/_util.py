"""Helpers shared by the benchmarks: timing, throughput, peak memory, tables."""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ascend_fa.tables import print_table

__all__ = [
    "AccuracySetup",
    "accuracy_setup",
    "add_accuracy_arguments",
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


#: ``--dtype`` of the accuracy benchmarks' artifacts -> torch dtype name.
ACCURACY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_accuracy_arguments(parser: Any) -> None:
    """The options every accuracy benchmark takes (what :func:`accuracy_setup`
    reads): model, sizes, batch, held-out tokens, artifact dtype."""
    parser.add_argument("--model", default=None, help="HF directory or .gguf")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    parser.add_argument(
        "--num-samples", type=int, default=0, help="calibration samples (32; quick 4)"
    )
    parser.add_argument(
        "--max-length", type=int, default=0, help="tokens per sample (512; quick 64)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--max-eval-tokens",
        type=int,
        default=0,
        help="held-out tokens per domain (all; quick 128)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(ACCURACY_DTYPES),
        default="bf16",
        help="artifact dtype (fp32: research artifacts, exact evaluation)",
    )


class AccuracySetup(NamedTuple):
    """What the accuracy benchmarks share: sizes, the artifact dtype, the model
    (loaded once, with its load time), the calibration split and the held-out
    ``windows`` (``prose`` / ``code``)."""

    num_samples: int
    max_length: int
    dtype: Any
    loaded: Any
    load_s: float
    calib: list[str]
    windows: dict[str, Any]


def accuracy_setup(args: Any) -> AccuracySetup:
    """The common start of an accuracy benchmark from its parsed ``args``
    (``num_samples``, ``max_length``, ``max_eval_tokens``, ``dtype`` ``bf16|fp16``,
    ``model``, ``gguf_file``, ``quick``): the demo model and the packaged
    calibration and held-out texts, at the ``--quick`` sizes when asked."""
    import torch

    from ascend_fa.calibration.data import calib_domain_texts, load_calib_texts
    from ascend_fa.calibration.methods import calibration_split
    from ascend_fa.evaluation import load_eval_text, token_windows
    from ascend_fa.models import load_model

    n = args.num_samples or (4 if args.quick else 32)
    length = args.max_length or (64 if args.quick else 512)
    max_eval = args.max_eval_tokens or (128 if args.quick else None)
    dtype = getattr(torch, ACCURACY_DTYPES[args.dtype])
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.gguf_file)
    load_s = time.perf_counter() - t0
    domain = getattr(args, "calib_domain", "all")
    if domain == "all":
        calib = calibration_split(load_calib_texts(), n)
    else:  # one domain's samples, all of them (the subsets are small)
        calib = calibration_split(calib_domain_texts(domain), n, heldout=0)
    windows = {
        d: token_windows(
            loaded.tokenizer, load_eval_text(d), window=512, max_tokens=max_eval
        )
        for d in ("prose", "code")
    }
    return AccuracySetup(n, length, dtype, loaded, load_s, calib, windows)
