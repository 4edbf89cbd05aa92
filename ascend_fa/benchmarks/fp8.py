"""``ascend-fa bench fp8``: checkpoint conversion throughput and peak memory.

Builds a synthetic DeepSeek-like BF16 checkpoint (about 2 GB in 4 shards; ``--quick``
about 64 MB), then measures, each in a fresh child process so peaks do not mix:

* ``copy``: a plain safetensors read + write of every shard (``load_file`` +
  ``save_file``) -- the baseline;
* ``quantize``: :func:`ascend_fa.fp8.quantize_checkpoint` of the BF16 checkpoint;
* ``dequantize``: :func:`ascend_fa.fp8.dequantize_checkpoint` of the FP8 result,
  next to a plain copy of that FP8 checkpoint.

Throughput is GB/s of input (1e9 bytes) over wall time; CPU seconds (user + system,
worker processes included) are shown beside it because on a shared machine wall
time depends on the other load. The package import (and the native kernels'
one-time build) happens before the clock starts and is shown as ``import s``.
Goals: conversion at least 0.5x the copy of the same input; peak RSS at most 2.5x
the largest input shard. Temporary files are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._util import MiB, gbps, print_table
from .results import Record, verdict, write_results

NAME = "fp8"
HELP = "FP8 block quantize/dequantize of a checkpoint vs a plain safetensors copy"

#: Goals: conversion throughput relative to a copy of the same input, and peak RSS
#: relative to the largest input shard (memory bounded by one shard).
SPEED_GOAL = 0.5
RSS_GOAL = 2.5


def _ok(met: bool) -> str:
    return "ok" if met else "NOT MET"


#: DeepSeek-V3 Linear shapes [out, in] (kv_a_proj_with_mqa's 576 rows leave a
#: partial block row), cycled to fill the shards. --quick scales them down by 4.
_SHAPES = [
    ("mlp.experts.{e}.gate_proj.weight", (2048, 7168)),
    ("mlp.experts.{e}.up_proj.weight", (2048, 7168)),
    ("mlp.experts.{e}.down_proj.weight", (7168, 2048)),
    ("self_attn.kv_a_proj_with_mqa.weight", (576, 7168)),
    ("self_attn.q_a_proj.weight", (1536, 7168)),
]

# Runs in the child: time one operation, report it with this process's peak RSS
# (and the peak of its own worker processes, for --workers > 1). The peak is VmHWM
# of /proc/self/status, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so
# it would report the benchmark parent's footprint.
_CHILD = r"""
import json, os, resource, sys, time
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
mode, src, dst, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import torch
from safetensors.torch import load_file, save_file
from ascend_fa import fp8
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
# The conversion functions' imports (the package's op layer, the native kernels'
# library, built on the very first run) are set-up, not conversion work: done and
# timed here, before the clock starts, as the copy's safetensors import is.
t_import = time.perf_counter()
if mode != "copy":
    convert = {"quantize": fp8.quantize_checkpoint,
               "dequantize": fp8.dequantize_checkpoint}[mode]
    from ascend_fa.atb_ops.native import native_status
    path = native_status().describe() if mode == "dequantize" else "-"
else:
    path = "-"
t_import = time.perf_counter() - t_import
idle = hwm()
def cpu():
    return sum(r.ru_utime + r.ru_stime for r in (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN)))
cpu0 = cpu()
start = time.perf_counter()
if mode == "copy":
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(src, name))
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
            del tensors
else:
    convert(src, dst, workers=workers, progress=False)
elapsed = time.perf_counter() - start
cpu_s = cpu() - cpu0
peak = hwm()
if workers > 1:
    peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu_s, "peak_rss": peak,
                  "idle_rss": idle, "import_seconds": t_import, "path": path}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size-gb",
        type=float,
        default=2.0,
        help="checkpoint size in GB (default 2; --quick: 0.064)",
    )
    parser.add_argument("--shards", type=int, default=4, help="shards (default 4)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="--workers for the conversions (default 1)",
    )
    parser.add_argument(
        "--tmpdir",
        default=None,
        help="where to build the checkpoints (default: system temp)",
    )


def _build_checkpoint(root: Path, total: int, shards: int, quick: bool) -> list[int]:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    per_shard = total // shards
    weight_map: dict[str, str] = {}
    sizes = []
    layer = 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        used = 0
        k = 0
        while used < per_shard:
            pattern, (rows, cols) = _SHAPES[k % len(_SHAPES)]
            if quick:
                rows, cols = rows // 4, cols // 4
            tname = f"model.layers.{layer}.block{k // len(_SHAPES)}." + pattern.format(
                e=k
            )
            w = torch.randn(rows, cols, generator=gen).mul_(0.02).to(torch.bfloat16)
            tensors[tname] = w
            used += w.numel() * 2
            k += 1
        # small tensors that pass through unchanged: a norm and the MoE router
        hidden = 7168 // 4 if quick else 7168
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(
            hidden, dtype=torch.bfloat16
        )
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(
            64, hidden, generator=gen
        ).to(torch.bfloat16)
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
        sizes.append((root / name).stat().st_size)
        del tensors
        layer += 1
    (root / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2
        )
    )
    (root / "config.json").write_text(
        json.dumps(
            {"architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "bfloat16"}
        )
    )
    return sizes


def _child(mode: str, src: Path, dst: Path, workers: int) -> dict[str, float]:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(src), str(dst), str(workers)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench fp8 {mode} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shard_bytes(root: Path) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in root.glob("*.safetensors")]
    return sum(sizes), max(sizes)


def run(args: argparse.Namespace) -> int:
    total = int((0.064 if args.quick else args.size_gb) * 1e9)
    base = Path(tempfile.mkdtemp(prefix="ascend-fa-bench-fp8-", dir=args.tmpdir))
    rows = []
    verdicts: list[str] = []
    results: dict[str, dict[str, float]] = {}
    try:
        t0 = time.perf_counter()
        _build_checkpoint(base / "bf16", total, args.shards, args.quick)
        print(
            f"built a {total / 1e9:.3g} GB BF16 checkpoint in {args.shards} shards "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        plan = [  # (label, mode, input, output, baseline label, keep output)
            ("copy bf16", "copy", "bf16", "copy-bf16", None, False),
            ("quantize", "quantize", "bf16", "fp8", "copy bf16", True),
            ("copy fp8", "copy", "fp8", "copy-fp8", None, False),
            ("dequantize", "dequantize", "fp8", "deq", "copy fp8", False),
        ]
        for label, mode, src, dst, baseline, keep in plan:
            in_bytes, largest = _shard_bytes(base / src)
            r = _child(mode, base / src, base / dst, args.workers)
            r.update(
                in_bytes=in_bytes,
                largest_shard=largest,
                gbps=gbps(in_bytes, r["seconds"]),
            )
            results[label] = r
            if not keep:
                shutil.rmtree(base / dst)
            ratio = r["gbps"] / results[baseline]["gbps"] if baseline else 1.0
            rss_ratio = r["peak_rss"] / largest
            speed_ok, rss_ok = ratio >= SPEED_GOAL, rss_ratio <= RSS_GOAL
            goal = "-" if baseline is None else ("yes" if speed_ok and rss_ok else "no")
            r.update(vs_copy=ratio, rss_vs_largest_shard=rss_ratio)
            if baseline is not None:
                r.update(speed_goal_met=speed_ok, rss_goal_met=rss_ok)
                # --quick shards are smaller than the interpreter: no RSS verdict
                rss_verdict = "n/a at --quick sizes" if args.quick else _ok(rss_ok)
                verdicts.append(
                    f"{label}: {ratio:.2f}x {baseline} (>= {SPEED_GOAL}x copy: "
                    f"{_ok(speed_ok)}); peak RSS {rss_ratio:.2f}x the largest shard "
                    f"(<= {RSS_GOAL}x: {rss_verdict})"
                )
            rows.append(
                [
                    label,
                    in_bytes / 1e9,
                    largest / MiB,
                    r["import_seconds"],
                    r["seconds"],
                    r["cpu_seconds"],
                    r["gbps"],
                    ratio,
                    r["peak_rss"] / MiB,
                    r["idle_rss"] / MiB,
                    rss_ratio,
                    goal,
                ]
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print_table(
        [
            "op",
            "input GB",
            "largest shard MiB",
            "import s",
            "wall s",
            "CPU s",
            "GB/s",
            "vs copy",
            "peak RSS MiB",
            "idle RSS MiB",
            "RSS / shard",
            "goal met",
        ],
        rows,
        title=f"bench fp8 (workers={args.workers}; each op in a fresh process; "
        f"goals: >= {SPEED_GOAL}x copy GB/s, peak RSS <= {RSS_GOAL}x largest shard)",
    )
    for line in verdicts:
        print(line)
    paths = {r["path"] for r in results.values() if r.get("path", "-") != "-"}
    for p in sorted(paths):
        print(f"dequantize decode path: {p}")
    print(
        "import s: the package import before the clock starts (not in wall s, as "
        "the copy's safetensors import is not)"
    )
    if args.quick:
        print(
            "note: --quick shards are tiny, so the interpreter's idle RSS dominates "
            "the RSS ratio; the memory goal is meant for full-size shards"
        )
    baselines = {"quantize": "copy bf16", "dequantize": "copy fp8"}
    records = []
    for label, r in results.items():
        goal = f">= {SPEED_GOAL}" if label in baselines else None
        records.append(
            Record(
                NAME,
                "cpu",
                label.replace(" ", "_"),
                {"workers": args.workers, "input_bytes": r["in_bytes"]},
                r["seconds"],
                ratio=r.get("vs_copy"),
                baseline=baselines.get(label),
                goal=goal,
                verdict=verdict(r.get("vs_copy"), goal),
                extra={k: v for k, v in r.items() if k != "seconds"},
            )
        )
    write_results(args.json, records, backend="cpu")
    return 0
