"""``ascend-fa bench calibration``: exact recall window vs the full-sort reference.

For each ``[H, N]`` fp32 case it times :func:`recall_window` (two-level chunk
selection + ``topk`` of the tails) and :func:`recall_window_sort_ref` (``torch.sort``
of every head, then a vectorized float64 scan — already far faster than the
reference tool's per-window Python loop) in the same run, checks that both return
identical ``lo``/``hi``, and measures each one's peak extra memory.

Memory: every measurement runs in a fresh spawned process that allocates the input,
warms up on a small tensor, resets the kernel's peak-RSS counter
(``/proc/self/clear_refs`` = 5), runs the function once and reads ``VmHWM`` from
``/proc/self/status``; "extra" is peak RSS minus RSS just before the call. This
counts every byte the call touches, including allocations torch does not track
(``topk``/``sort`` scratch buffers). Where ``/proc`` is unavailable it prints n/a.

Finally it times one :class:`PerHeadObserver` update on the DeepSeek absorbed-query
shape ``[1, 128, 4096, 512]`` (fp32 and bf16).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
from typing import Any

import torch

from ._util import MiB, print_table, time_fn
from .results import Record, verdict, write_results

NAME = "calibration"
HELP = "exact recall window (topk of tails) vs full-sort reference; observer update"

FULL_CASES = [(32, 1 << 20), (128, 1 << 21)]
QUICK_CASES = [(16, 1 << 16), (32, 1 << 18)]
FULL_OBSERVER = (1, 128, 4096, 512)
QUICK_OBSERVER = (1, 16, 256, 512)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ratio",
        type=float,
        default=0.9999,
        help="recall ratio (default 0.9999, the Q/K default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="timed runs of recall_window (default 5, quick 3)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory subprocesses"
    )


def _proc_status() -> tuple[int, int] | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    hwm = re.search(r"VmHWM:\s+(\d+) kB", text)
    rss = re.search(r"VmRSS:\s+(\d+) kB", text)
    if not (hwm and rss):
        return None
    return int(hwm.group(1)) * 1024, int(rss.group(1)) * 1024


def _measure_extra(h: int, n: int, ratio: float, which: str) -> int | None:
    """Peak RSS minus RSS before one call (runs in a fresh process)."""
    from ascend_fa.calibration import recall_window, recall_window_sort_ref

    fn = recall_window if which == "fast" else recall_window_sort_ref
    x = torch.randn(h, n, generator=torch.Generator().manual_seed(0))
    fn(torch.randn(2, 4096), ratio)  # warm-up: thread pool, lazy imports
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    before = _proc_status()
    fn(x, ratio)
    after = _proc_status()
    if before is None or after is None:
        return None
    return max(0, after[0] - before[1])


def _extra_in_child(h: int, n: int, ratio: float, which: str) -> int | None:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_measure_extra, (h, n, ratio, which))


def _pct(extra: int | None, base: int) -> str:
    return "n/a" if extra is None else f"{100.0 * extra / base:.2f}%"


def _mib(extra: int | None) -> str:
    return "n/a" if extra is None else f"{extra / MiB:.1f}"


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    repeats = args.repeats or (3 if quick else 5)
    ratio = args.ratio
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, ratio {ratio}, "
        f"fp32 inputs (torch.randn), recall_window median of {repeats}, sort "
        "reference median of 1-3",
        flush=True,
    )
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    for h, n in QUICK_CASES if quick else FULL_CASES:
        result = _window_case(args, h, n, repeats)
        rows.append(_window_row(result))
        results.append(result)
    all_ok = all(r["identical"] for r in results)
    print_table(
        [
            "H",
            "N",
            "input MiB",
            "recall_window ms",
            "sort ref ms",
            "speedup",
            "identical",
            "extra MiB",
            "extra % input",
            "sort ref extra %",
        ],
        rows,
        title="recall_window vs full-sort reference (same run)",
    )
    results += _observer_updates(QUICK_OBSERVER if quick else FULL_OBSERVER, ratio)
    print(
        f"goal: >= 20x faster than the sort reference, identical outputs, extra "
        f"memory < 25% of the input; identical in every case: "
        f"{'yes' if all_ok else 'NO'}",
        flush=True,
    )
    records = [_record(r, ratio) for r in results]
    write_results(getattr(args, "json", None), records, backend="cpu")
    return 0 if all_ok else 1


def _window_case(args: argparse.Namespace, h: int, n: int, repeats: int) -> dict:
    """recall_window against the sort reference on one ``[h, n]`` input: times,
    identity, and (in a child process) the extra memory of each."""
    from ascend_fa.calibration import recall_window, recall_window_sort_ref

    quick, ratio = bool(args.quick), args.ratio
    x = torch.randn(h, n, generator=torch.Generator().manual_seed(0))
    t_fast = time_fn(lambda x=x: recall_window(x, ratio), repeats=repeats)
    t_ref = time_fn(
        lambda x=x: recall_window_sort_ref(x, ratio),
        repeats=1 if not quick else 3,
        warmup=0,
    )
    lo, hi = recall_window(x, ratio)
    ref_lo, ref_hi = recall_window_sort_ref(x, ratio)
    same = bool(torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi))
    size = x.numel() * x.element_size()
    del x
    extra = extra_ref = None
    if not args.no_memory:
        extra = _extra_in_child(h, n, ratio, "fast")
        extra_ref = _extra_in_child(h, n, ratio, "ref")
    return {
        "H": h,
        "N": n,
        "input_bytes": size,
        "recall_window_s": t_fast,
        "sort_ref_s": t_ref,
        "speedup": t_ref / t_fast,
        "identical": same,
        "extra_bytes": extra,
        "sort_ref_extra_bytes": extra_ref,
    }


def _window_row(r: dict) -> list[Any]:
    size = r["input_bytes"]
    return [
        r["H"],
        r["N"],
        size // MiB,
        r["recall_window_s"] * 1e3,
        r["sort_ref_s"] * 1e3,
        f"{r['speedup']:.1f}x",
        "yes" if r["identical"] else "NO",
        _mib(r["extra_bytes"]),
        _pct(r["extra_bytes"], size),
        _pct(r["sort_ref_extra_bytes"], size),
    ]


def _observer_updates(shape: tuple[int, ...], ratio: float) -> list[dict]:
    """One PerHeadObserver update per dtype, timed and tabled."""
    from ascend_fa.calibration import PerHeadObserver

    obs_rows, results = [], []
    for dtype in (torch.float32, torch.bfloat16):
        xq = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        obs = PerHeadObserver(shape[1], ratio=ratio)
        t_obs = time_fn(lambda xq=xq, obs=obs: obs.update(xq), repeats=3)
        obs_rows.append(
            [
                str(list(shape)),
                str(dtype).removeprefix("torch."),
                t_obs * 1e3,
                xq.numel() * xq.element_size() // MiB,
            ]
        )
        results.append(
            {"observer_shape": list(shape), "dtype": str(dtype), "update_s": t_obs}
        )
        del xq, obs
    print_table(
        ["x shape", "dtype", "update ms", "input MiB"],
        obs_rows,
        title="one PerHeadObserver(recall_window, union) update",
    )
    return results


def _record(r: dict, ratio: float) -> Record:
    if "speedup" not in r:
        return Record(
            NAME,
            "cpu",
            "observer_update",
            {"shape": r["observer_shape"], "dtype": r["dtype"]},
            r["update_s"],
            repeats=3,
        )
    speed_ok = verdict(r["speedup"], ">= 20")
    extra_ok = r["extra_bytes"] is None or r["extra_bytes"] < 0.25 * r["input_bytes"]
    return Record(
        NAME,
        "cpu",
        "recall_window",
        {"H": r["H"], "N": r["N"], "ratio": ratio},
        r["recall_window_s"],
        ratio=r["speedup"],
        baseline="full sort",
        goal=">= 20",
        verdict="ok" if speed_ok == "ok" and extra_ok and r["identical"] else "miss",
        extra={
            "baseline_s": r["sort_ref_s"],
            "identical": r["identical"],
            "extra_bytes": r["extra_bytes"],
        },
    )
