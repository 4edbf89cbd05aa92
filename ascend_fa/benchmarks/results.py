"""One result schema for every benchmark, device-clock timing, verdicts, comparison.

JSON written by ``ascend-fa bench NAME --json FILE`` (schema
``ascend-fa-bench/1``)::

    {
      "schema": "ascend-fa-bench/1",
      "environment": {"ascend_fa", "python", "torch", "torch_npu", "platform",
                      "cpu", "cpu_count", "threads", "device", "git_revision",
                      "int_gemm": {"path", "reason", "source", "timed_shapes"}},
      "records": [
        {"benchmark": "kvcache", "backend": "cpu", "mode": "int8_nz",
         "params": {"T": 4096, "Hkv": 8, ...},
         "median_s": 0.0113, "spread": 0.04, "repeats": 5,
         "ratio": 0.52, "baseline": "clone", "goal": ">= 0.5", "verdict": "ok"}
      ],
      "extra": {...}            # anything else the benchmark reports
    }

``spread`` is ``(max - min) / median`` of the timed repeats (0 for one repeat);
``ratio`` compares the record with its ``baseline`` measured in the same run;
``verdict`` is ``"ok"``/``"miss"`` against ``goal`` (or null without a goal).
:func:`compare_results` matches records of two files by ``(benchmark, backend, mode,
params)`` and flags a slowdown larger than both runs' spread as a regression.
``environment.int_gemm`` says which exact integer product the W8A8 linears ran on
the CPU (``int_mm`` or ``fp32``) and why
(:func:`~ascend_fa.atb_ops.linear.int_gemm_report`): calibration times differ
several-fold between the two.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ascend_fa.atb_ops.linear import int_gemm_report
from ascend_fa.tables import finite_or_none

__all__ = [
    "SCHEMA",
    "Timing",
    "Record",
    "environment",
    "machine_line",
    "time_on",
    "verdict",
    "write_results",
    "load_results",
    "check_results",
    "compare_results",
]

SCHEMA = "ascend-fa-bench/1"


@dataclass(frozen=True)
class Timing:
    """Median and relative spread of ``samples`` (seconds)."""

    samples: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        med = self.median_s
        if len(self.samples) < 2 or med <= 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / med


@dataclass
class Record:
    """One measured point (see the module doc for the fields)."""

    benchmark: str
    backend: str
    mode: str
    params: dict[str, Any]
    median_s: float
    spread: float = 0.0
    repeats: int = 1
    ratio: float | None = None
    baseline: str | None = None
    goal: str | None = None
    verdict: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        return json.dumps(
            [self.benchmark, self.backend, self.mode, self.params], sort_keys=True
        )


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(backend: str | None = None) -> dict[str, Any]:
    """Versions and machine facts that make two result files comparable."""
    import importlib.metadata

    import torch

    import ascend_fa

    try:
        npu_version: str | None = importlib.metadata.version("torch-npu")
    except importlib.metadata.PackageNotFoundError:
        npu_version = None
    device = _cpu_name()
    if backend == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    elif backend == "npu":
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            device = npu.get_device_name()
    return {
        "ascend_fa": ascend_fa.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_npu": npu_version,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device,
        "git_revision": _git_revision(),
        "int_gemm": int_gemm_report(),
    }


def machine_line() -> str:
    """One line naming the CPU and its integer-product path, for benchmark output
    whose times depend on it."""
    report = int_gemm_report()
    path = "torch._int_mm" if report["path"] == "int_mm" else "fp32 GEMM chunks"
    return (
        f"CPU: {_cpu_name()} ({os.cpu_count()} cores); integer products: {path} "
        f"({report['source']})"
    )


def time_on(
    fn: Callable[[], Any],
    device_type: str = "cpu",
    *,
    repeats: int = 5,
    warmup: int = 1,
    min_time: float = 0.0,
) -> Timing:
    """Time ``fn()`` with the device's own clock: CUDA/NPU events around the call and
    a synchronize before reading them; ``time.perf_counter`` on the CPU. ``repeats``
    timed runs after ``warmup`` (more until ``min_time`` seconds were measured)."""
    import torch

    events = None
    if device_type == "cuda":
        events, sync = torch.cuda.Event, torch.cuda.synchronize
    elif device_type == "npu":
        events, sync = torch.npu.Event, torch.npu.synchronize
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < repeats or (sum(samples) < min_time and len(samples) < 1000):
        gc.collect()
        if events is not None:
            sync()
            start, end = events(enable_timing=True), events(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return Timing(tuple(samples))


def verdict(value: float | None, goal: str | None) -> str | None:
    """``"ok"``/``"miss"`` of ``value`` against ``goal`` (``">= 0.5"``,
    ``"<= 1.25"``); None without either."""
    if value is None or goal is None or not math.isfinite(value):
        return None if goal is None else "miss"
    op, _, num = goal.strip().partition(" ")
    target = float(num)
    ok = value >= target if op == ">=" else value <= target
    return "ok" if ok else "miss"


def write_results(
    path: str | os.PathLike[str] | None,
    records: Iterable[Record],
    *,
    backend: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Write the result document to ``path`` (nothing when ``path`` is None) and
    return it. Non-finite numbers are written as null: the file is strict JSON."""
    if not path:
        return None
    doc = {
        "schema": SCHEMA,
        "environment": environment(backend),
        "records": [asdict(r) for r in records],
        "extra": extra or {},
    }
    text = json.dumps(finite_or_none(doc), indent=2, default=str, allow_nan=False)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n", encoding="utf-8")
    return doc


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A result document; ``ValueError`` naming the file when it is not one."""
    from ascend_fa.errors import FileFormatError

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileFormatError(
            f"not a benchmark result file ({exc})", path=path
        ) from None
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != SCHEMA
        or not isinstance(doc.get("records"), list)
    ):
        raise FileFormatError(
            f"not a benchmark result file (schema {SCHEMA} with records)", path=path
        )
    return doc


#: Field -> accepted JSON types of every record (None: null allowed).
_RECORD_FIELDS: dict[str, tuple[type | None, ...]] = {
    "benchmark": (str,),
    "backend": (str,),
    "mode": (str,),
    "params": (dict,),
    "median_s": (int, float, None),
    "spread": (int, float, None),
    "repeats": (int,),
    "ratio": (int, float, None),
    "baseline": (str, None),
    "goal": (str, None),
    "verdict": (str, None),
    "extra": (dict,),
}


def check_results(
    path: str | os.PathLike[str], benchmark: str | None = None
) -> dict[str, Any]:
    """:func:`load_results`, then every record checked field by field against the
    schema (and its ``benchmark`` against ``benchmark`` when given);
    ``FileFormatError`` naming the file, the record and the field otherwise.
    Returns the document."""
    from ascend_fa.errors import FileFormatError

    doc = load_results(path)
    if not isinstance(doc.get("environment"), dict):
        raise FileFormatError("no environment block", path=path)
    if not doc["records"]:
        raise FileFormatError("no records", path=path)
    for i, rec in enumerate(doc["records"]):
        if not isinstance(rec, dict):
            raise FileFormatError(f"record {i} is not an object", path=path)
        for key, types in _RECORD_FIELDS.items():
            value = rec.get(key)
            ok = (value is None and None in types) or (
                value is not None
                and not isinstance(value, bool)
                and isinstance(value, tuple(t for t in types if t is not None))
            )
            if key not in rec or not ok:
                raise FileFormatError(
                    f"record {i}: {key!r} is {value!r}, expected "
                    + " or ".join("null" if t is None else t.__name__ for t in types),
                    path=path,
                )
        if rec["verdict"] not in (None, "ok", "miss"):
            raise FileFormatError(
                f"record {i}: verdict {rec['verdict']!r} is not ok/miss/null",
                path=path,
            )
        if benchmark is not None and rec["benchmark"] != benchmark:
            raise FileFormatError(
                f"record {i} is from benchmark {rec['benchmark']!r}, expected "
                f"{benchmark!r}",
                path=path,
            )
    return doc


def compare_results(
    a: dict[str, Any], b: dict[str, Any]
) -> tuple[list[str], list[list[Any]], int]:
    """Side-by-side rows of the records ``a`` and ``b`` share: ``(headers, rows,
    regressions)``. ``change`` is ``100 * (b / a - 1)`` of the median time; a
    slowdown beyond both records' spread is flagged ``REGRESSION``."""
    index = {_key(r): r for r in a["records"] if isinstance(r, dict)}
    rows: list[list[Any]] = []
    regressions = 0
    for rb in b["records"]:
        if not isinstance(rb, dict):
            continue
        ra = index.get(_key(rb))
        if ra is None:
            continue
        ta, tb = ra.get("median_s"), rb.get("median_s")
        if not ta or not tb:
            continue
        change = 100.0 * (tb / ta - 1.0)
        noise = 100.0 * max(ra.get("spread") or 0.0, rb.get("spread") or 0.0)
        flag = ""
        if change > noise:
            flag = "REGRESSION"
            regressions += 1
        elif change < -noise:
            flag = "faster"
        params = ", ".join(f"{k}={v}" for k, v in (rb.get("params") or {}).items())
        rows.append(
            [
                rb.get("benchmark"),
                rb.get("backend"),
                rb.get("mode"),
                params,
                f"{ta * 1e3:.3g}",
                f"{tb * 1e3:.3g}",
                f"{change:+.1f}%",
                f"±{noise:.1f}%",
                flag,
            ]
        )
    headers = [
        "benchmark",
        "backend",
        "mode",
        "params",
        "A ms",
        "B ms",
        "change",
        "spread",
        "",
    ]
    return headers, rows, regressions


def _key(r: dict[str, Any]) -> str:
    return json.dumps(
        [r.get("benchmark"), r.get("backend"), r.get("mode"), r.get("params")],
        sort_keys=True,
    )
