"""The resumable conversion driver: one shard at a time (or in worker processes),
streamed chunk by chunk, recorded in the manifest as each shard finishes.

Memory per worker is one chunk of whole block rows plus the writer's staging
buffers (:data:`WORKER_BYTES` with the interpreter), independent of shard and
tensor size. On any exception -- ``KeyboardInterrupt`` and the ``SystemExit`` a
SIGTERM handler raises included -- the temporary files are removed and the manifest
keeps the finished shards, so rerunning the same command resumes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .blocks import (
    OUT_DTYPES,
    SCALE_SUFFIX,
    BadBlock,
    Workspace,
    check_scale_inv,
    chunk_rows,
    dequantize_chunk,
    quantize_chunk,
    scale_shape,
)
from .checkpoint import Checkpoint
from .errors import FP8FormatError, FP8InputError
from .output import (
    MANIFEST_NAME,
    check_no_strays,
    finish_output,
    load_manifest,
    remove_temp_files,
    write_manifest,
)
from .safetensors_io import (
    CONTENT_HASH,
    ITEMSIZE,
    ST_NAME,
    TORCH_DTYPE,
    PlannedTensor,
    ShardHeader,
    ShardWriter,
    TensorEntry,
    create_new_file,
    open_regular,
    read_into,
    read_safetensors_header,
    read_tensor,
)

__all__ = [
    "WORKER_BYTES",
    "ShardTask",
    "convert_shard",
    "plan_workers",
    "run_conversion",
]

log = logging.getLogger("ascend_fa.fp8")

#: Memory one worker process needs: interpreter + torch (~350 MiB) plus its chunk
#: workspace and write staging buffers (< 100 MiB); used by :func:`plan_workers`.
WORKER_BYTES = 512 << 20


@dataclass(frozen=True)
class ShardTask:
    """One shard to convert (picklable: it is sent to worker processes)."""

    mode: str  # "quantize" | "dequantize"
    src: Path
    dst: Path
    block: tuple[int, int]
    #: quantize: weight names to quantize in this shard
    selected: frozenset[str] = frozenset()
    #: dequantize: weight name -> (file, entry) of its scale
    scales: dict[str, tuple[Path, TensorEntry]] = field(default_factory=dict)
    #: dequantize: names dropped from the output (consumed scales, orphans)
    drop: frozenset[str] = frozenset()
    out_dtype: str = "bfloat16"


def convert_shard(
    task: ShardTask,
    progress: Callable[[int], None] | None = None,
    ws: Workspace | None = None,
) -> tuple[str, int, str]:
    """Convert one shard; returns ``(name, size, digest)`` of the written file
    (the :data:`~.safetensors_io.CONTENT_HASH` hex digest).

    Runs with one intra-op thread: each chunk op is a few hundred microseconds, too
    short to amortize an OpenMP fork/join, and on a busy machine a descheduled
    thread stalls every op's barrier (measured 10-50x slower). Parallelism comes
    from the writer's threads and from ``workers`` processes over shards instead.
    ``ws`` (chunk and write staging buffers) is reused across the shards one
    process converts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _convert(task, progress, Workspace() if ws is None else ws)
    finally:
        torch.set_num_threads(threads)


def _plan(task: ShardTask, header: ShardHeader) -> list[PlannedTensor]:
    out_dtype = OUT_DTYPES[task.out_dtype]
    plan = []
    for t in header.tensors.values():
        if task.mode == "quantize" and t.name in task.selected:
            if len(t.shape) != 2 or t.dtype not in ("BF16", "F16", "F32"):
                raise FP8FormatError(
                    f"tensor {t.name!r} changed since it was checked", path=task.src
                )
            plan.append(
                PlannedTensor(t.name, "F8_E4M3", t.shape, t.nbytes // ITEMSIZE[t.dtype])
            )
            nb = scale_shape(t.shape, task.block)
            plan.append(
                PlannedTensor(t.name + SCALE_SUFFIX, "F32", nb, nb[0] * nb[1] * 4)
            )
        elif task.mode == "dequantize" and t.name in task.scales:
            if len(t.shape) != 2 or t.dtype != "F8_E4M3":
                raise FP8FormatError(
                    f"tensor {t.name!r} changed since it was checked", path=task.src
                )
            nbytes = t.nbytes * out_dtype.itemsize
            plan.append(PlannedTensor(t.name, ST_NAME[out_dtype], t.shape, nbytes))
        elif t.name not in task.drop:
            plan.append(PlannedTensor(t.name, t.dtype, t.shape, t.nbytes))
    return plan


def _convert(
    task: ShardTask, progress: Callable[[int], None] | None, ws: Workspace
) -> tuple[str, int, str]:
    header = read_safetensors_header(task.src)
    writer = ShardWriter(task.dst, _plan(task, header), header.metadata, ws.staging)
    out_dtype = OUT_DTYPES[task.out_dtype]
    try:
        with open_regular(task.src) as f:
            for t in header.tensors.values():
                if task.mode == "quantize" and t.name in task.selected:
                    scale = _stream_quantize(f, task.src, t, task.block, ws, writer)
                    writer.write_tensor(scale)
                elif task.mode == "dequantize" and t.name in task.scales:
                    spath, sentry = task.scales[t.name]
                    scale = read_tensor(spath, sentry).float()
                    _stream_dequantize(
                        f, task.src, t, scale, task.block, out_dtype, ws, writer
                    )
                elif t.name not in task.drop:
                    writer.copy_from(f, t.begin, t.nbytes, task.src)
                if progress:
                    progress(t.nbytes)
        return (task.dst.name, *writer.close())
    except BaseException:
        writer.abort()
        raise


def _bad_block(path: Path, t: TensorEntry, b0: int, e: BadBlock, block) -> Exception:
    return FP8FormatError(
        f"tensor {t.name!r} has {e.what} in block ({b0 + e.row}, {e.col}) "
        f"(block size {list(block)})",
        path=path,
    )


def _stream_quantize(
    f: BinaryIO,
    path: Path,
    t: TensorEntry,
    block: tuple[int, int],
    ws: Workspace,
    writer: ShardWriter,
) -> torch.Tensor:
    rows, cols = t.shape
    dtype = TORCH_DTYPE[t.dtype]
    scales = torch.empty(scale_shape(t.shape, block))
    step = chunk_rows(cols, block[0])
    for r0 in range(0, rows, step):
        r = min(step, rows - r0)
        w = ws.get("in", (r, cols), dtype)
        read_into(f, t.begin + r0 * cols * dtype.itemsize, w, path)
        b0 = r0 // block[0]
        try:
            s = quantize_chunk(
                w, block, ws, writer.tensor_out((r, cols), torch.float8_e4m3fn)
            )
        except BadBlock as e:
            raise _bad_block(path, t, b0, e, block) from None
        scales[b0 : b0 + s.shape[0]] = s
    return scales


def _stream_dequantize(
    f: BinaryIO,
    path: Path,
    t: TensorEntry,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    ws: Workspace,
    writer: ShardWriter,
) -> None:
    rows, cols = t.shape
    try:  # once per tensor (the planner checked it too; the file may have changed)
        check_scale_inv(scale)
    except BadBlock as e:
        raise _bad_block(path, t, 0, e, block) from None
    step = chunk_rows(cols, block[0])
    for r0 in range(0, rows, step):
        r = min(step, rows - r0)
        q = ws.get("in", (r, cols), torch.float8_e4m3fn)
        read_into(f, t.begin + r0 * cols, q, path)
        b0 = r0 // block[0]
        try:
            dequantize_chunk(
                q,
                scale[b0 : b0 + -(-r // block[0])],
                block,
                ws,
                writer.tensor_out((r, cols), dtype),
            )
        except BadBlock as e:
            raise _bad_block(path, t, b0, e, block) from None


#: A worker process's buffers, reused across the shards it converts.
_WORKER_WS: list[Workspace] = []


def _worker_entry(task: ShardTask) -> tuple[str, int, str]:
    if not _WORKER_WS:
        _WORKER_WS.append(Workspace())
    return convert_shard(task, ws=_WORKER_WS[0])


def plan_workers(requested: int, num_shards: int, available: int | None = None) -> int:
    """Worker processes to use: at most ``requested``, the number of shards, the
    CPU count, and ``available // 2 // WORKER_BYTES`` (half of ``MemAvailable``).

    Each worker streams one tensor chunk at a time, so its memory is the
    interpreter plus a few chunk buffers (:data:`WORKER_BYTES`), not a shard.
    """
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise FP8InputError(f"--workers must be >= 1, got {requested}")
    if available is None:
        available = _mem_available()
    n = min(
        requested,
        max(num_shards, 1),
        os.cpu_count() or 1,
        max(1, available // 2 // WORKER_BYTES),
    )
    if n < requested:
        log.info(
            "using %d worker(s) instead of %d (shards, CPUs, memory)", n, requested
        )
    return n


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="fp8",
        dynamic_ncols=True,
    )


def _copy_into(partial: Path, rel: str, src: Path) -> None:
    """Copy ``src`` to ``partial / rel``, creating real directories on the way (a
    link or file in their place, left by anything, is removed first)."""
    parts = rel.split("/")
    d = partial
    for part in parts[:-1]:
        d = d / part
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            d.unlink()
        if not d.exists():
            d.mkdir()
    with open_regular(src) as fin:
        with os.fdopen(create_new_file(d / parts[-1]), "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)


def run_conversion(
    ckpt: Checkpoint,
    output: Path,
    partial: Path,
    tasks: list[ShardTask],
    params: dict[str, Any],
    *,
    workers: int,
    progress: bool,
    finish: Callable[[Path, dict[str, ShardHeader]], None],
    other_files: list[tuple[str, Path]],
    on_shard_done: Callable[[str], None] | None = None,
) -> list[str]:
    """Convert the shards (resuming), then ``finish`` writes index/config, the
    other files are copied, the manifest is marked complete and ``partial`` is
    renamed to ``output``. Returns the shards reused from an interrupted run.

    ``on_shard_done(name)`` is called after each shard is recorded in the manifest
    (progress reporting; an exception it raises interrupts the conversion as a
    signal would, leaving the resume state behind).
    """
    # Size, header and mtime identify an input shard without hashing hundreds of GB.
    inputs = {
        n: {
            "size": h.size,
            "header_sha256": h.header_sha256,
            "mtime_ns": h.path.stat().st_mtime_ns,
        }
        for n, h in ckpt.shards.items()
    }
    done = load_manifest(partial, params, inputs, {t.dst.name for t in tasks})
    remove_temp_files(partial)
    ours = {t.dst.name for t in tasks} | {MANIFEST_NAME}
    check_no_strays(partial, ours)
    todo = [t for t in tasks if t.dst.name not in done]
    resumed = sorted(done)
    if resumed:
        log.info(
            "resuming %s: %d of %d shards already done",
            partial,
            len(resumed),
            len(tasks),
        )
    write_manifest(partial, params, inputs, done)
    total = sum(ckpt.shards[t.src.name].size for t in tasks)
    bar = _progress_bar(total, sum(ckpt.shards[n].size for n in done), progress)

    def record(result: tuple[str, int, str]) -> None:
        name, size, digest = result
        done[name] = {"size": size, CONTENT_HASH: digest}
        write_manifest(partial, params, inputs, done)
        if on_shard_done is not None:
            on_shard_done(name)

    try:
        n_workers = plan_workers(workers, len(todo)) if todo else 1
        if n_workers <= 1:
            ws = Workspace()
            for t in todo:
                before = bar.n if bar is not None else 0
                record(convert_shard(t, bar.update if bar is not None else None, ws))
                if bar is not None:  # header bytes: land on the shard's size
                    bar.update(before + ckpt.shards[t.src.name].size - bar.n)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(n_workers) as pool:
                for result in pool.imap_unordered(_worker_entry, todo):
                    record(result)
                    if bar is not None:
                        bar.update(ckpt.shards[result[0]].size)
        check_no_strays(partial, ours)  # nothing but ours is renamed into place
        finish(partial, {t.dst.name: read_safetensors_header(t.dst) for t in tasks})
        for rel, src in other_files:
            _copy_into(partial, rel, src)
        write_manifest(partial, params, inputs, done, complete=True)
    except BaseException:
        remove_temp_files(partial)
        raise
    finally:
        if bar is not None:
            bar.close()
    finish_output(partial, output)
    return resumed
