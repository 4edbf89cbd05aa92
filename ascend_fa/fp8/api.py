"""The two checkpoint verbs, :func:`quantize_checkpoint` and
:func:`dequantize_checkpoint`, with their tensor selection and metadata rules.

Each verb validates every input (directory, index, shard headers, config, the
reference, the scales to dequantize, the output location) before anything is
written, then hands the shards to the resumable driver
(:func:`~ascend_fa.fp8.convert.run_conversion`) and returns a
:class:`ConversionResult`. Every failure is an :class:`~ascend_fa.errors.AscendFAError`
(operating-system errors included, wrapped as
:class:`~ascend_fa.fp8.errors.FP8ConversionError` naming the file).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..atb_ops.constants import FP8_BLOCK
from ..errors import AscendFAError
from .blocks import OUT_DTYPES, SCALE_SUFFIX, BadBlock, check_block, check_scale_inv
from .checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    Checkpoint,
    open_checkpoint,
    other_files,
    plan_dequantize,
    reference_selection,
)
from .convert import ShardTask, run_conversion
from .errors import FP8ConversionError, FP8FormatError, FP8InputError
from .output import MANIFEST_NAME, prepare_output, verify_finished, write_new_json
from .safetensors_io import ShardHeader, TensorEntry, read_tensor
from .selection import (
    DEFAULT_IGNORE,
    DEFAULT_INCLUDE,
    FLOAT_DTYPES,
    ignored_module_names,
    select_for_quantization,
    warn_split_fused,
)

__all__ = [
    "ConversionResult",
    "dequantize_checkpoint",
    "quantize_checkpoint",
]

log = logging.getLogger("ascend_fa.fp8")

_T = TypeVar("_T")


@dataclass
class ConversionResult:
    """What a checkpoint conversion did."""

    output: Path
    shards: list[str]
    converted: list[str]  # tensors quantized / dequantized
    resumed: list[str] = field(default_factory=list)  # shards reused from .partial
    passthrough_without_scale: list[str] = field(default_factory=list)
    input_bytes: int = 0


def _typed_errors(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Operating-system errors (permissions, a full disk, a vanished file) become
    one-line :class:`FP8ConversionError` naming the file; typed errors pass."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except AscendFAError:
            raise
        except OSError as exc:
            what = exc.strerror or str(exc)
            raise FP8ConversionError(what, path=exc.filename) from exc

    return wrapper


def _input_dirs(inp: Path, reference: Path | None) -> list[tuple[str, Path]]:
    out = [("input", inp)]
    if reference is not None:
        out.append(("--reference-fp8", reference))
    return out


@_typed_errors
def quantize_checkpoint(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    reference_fp8: str | os.PathLike[str] | None = None,
    block_size: Sequence[int] = FP8_BLOCK,
    include: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    workers: int = 1,
    overwrite: bool = False,
    force: bool = False,
    progress: bool = True,
    on_shard_done: Callable[[str], None] | None = None,
) -> ConversionResult:
    """BF16 checkpoint directory -> DeepSeek FP8 block-scale checkpoint directory.

    Same shard files as the input; every quantized ``<name>`` becomes
    ``float8_e4m3fn`` with ``<name>_scale_inv`` in the same shard; the index is
    rewritten; ``config.json`` gains ``quantization_config`` (its
    ``ignored_layers`` lists the module names kept in BF16, see
    :func:`ignored_module_names`, or is copied from ``reference_fp8``'s config);
    all other files are copied unchanged. Resumable, see :mod:`ascend_fa.fp8`.
    ``overwrite`` replaces an output this tool wrote; anything else needs ``force``
    as well. ``on_shard_done(name)`` is called as each shard is recorded.
    """
    block = check_block(block_size)
    inp, output = Path(input_dir), Path(output_dir)
    ckpt = open_checkpoint(inp)
    verify_finished(inp)  # a finished output of ours: its shards as written
    if ckpt.config and ckpt.config.get("quantization_config"):
        qc = ckpt.config["quantization_config"]
        raise FP8InputError(
            f"{inp / CONFIG_NAME} already has a quantization_config "
            f"(quant_method={qc.get('quant_method')!r}); quantize expects a BF16 "
            "checkpoint"
        )
    all_tensors = [t for h in ckpt.shards.values() for t in h.tensors.values()]
    ignore_patterns = list(DEFAULT_IGNORE if ignore is None else ignore)
    ref_dir = None
    if reference_fp8 is not None:
        if include is not None or ignore is not None:
            raise FP8InputError(
                "--include/--ignore cannot be combined with --reference-fp8 (the "
                "reference decides which tensors are quantized)"
            )
        wanted, ref_config, ref_dir = reference_selection(reference_fp8)
        ref_qc = (ref_config or {}).get("quantization_config") or {}
        ref_block = ref_qc.get("weight_block_size")
        if ref_block is not None and ref_block != list(block):
            raise FP8InputError(
                f"--reference-fp8 uses weight_block_size {ref_block!r}, but the "
                f"block size is {list(block)}"
            )
        ignored = ref_qc.get("ignored_layers")
        if ignored is not None and not (
            isinstance(ignored, list) and all(isinstance(x, str) for x in ignored)
        ):
            raise FP8FormatError(
                "quantization_config.ignored_layers is not a list of strings",
                path=ref_dir / CONFIG_NAME,
            )
        present = {t.name: t for t in all_tensors}
        missing = sorted(wanted - set(present))
        if missing:
            log.warning(
                "%d weight(s) with a scale in the reference are not in the "
                "input (e.g. %s)",
                len(missing),
                missing[0],
            )
        selected = sorted(wanted & set(present))
        for n in selected:
            t = present[n]
            if len(t.shape) != 2 or t.dtype not in FLOAT_DTYPES:
                raise FP8InputError(
                    f"tensor {n!r} ({t.dtype} {list(t.shape)}) has a scale in the "
                    "reference but is not a 2-D bf16/fp16/fp32 weight"
                )
        selection: dict[str, Any] = {
            "reference_sha256": hashlib.sha256(
                "\n".join(sorted(wanted)).encode()
            ).hexdigest()
        }
    else:
        include_patterns = list(DEFAULT_INCLUDE if include is None else include)
        selected = select_for_quantization(
            all_tensors, include_patterns, ignore_patterns
        )
        selection = {"include": include_patterns, "ignore": ignore_patterns}
        ignored = ignored_module_names(all_tensors, selected)
    names = {t.name for t in all_tensors}
    for n in sorted(names):
        if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in names:
            raise FP8InputError(f"input already has {n!r}; is it already quantized?")
    if not selected:
        log.warning("no tensor selected for quantization; the output is a copy")
    warn_split_fused(names, set(selected))
    copies = other_files(ckpt, {MANIFEST_NAME})
    partial = prepare_output(output, _input_dirs(inp, ref_dir), overwrite, force)
    where = ckpt.locate()
    per_shard: dict[str, set[str]] = {s: set() for s in ckpt.shards}
    for n in selected:
        per_shard[where[n]].add(n)
    tasks = [
        ShardTask(
            "quantize", inp / s, partial / s, block, selected=frozenset(per_shard[s])
        )
        for s in ckpt.shards
    ]
    params = {
        "command": "quantize",
        "block_size": list(block),
        "ignored_layers": ignored,
        **selection,
    }

    def finish(dest: Path, headers: dict[str, ShardHeader]) -> None:
        _write_index(ckpt, dest, headers)
        if ckpt.config is None:
            log.warning(
                "%s has no %s; no quantization_config written", inp, CONFIG_NAME
            )
            return
        qc: dict[str, Any] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
        if ignored is not None:
            qc["ignored_layers"] = ignored
        write_new_json(dest / CONFIG_NAME, {**ckpt.config, "quantization_config": qc})

    resumed = run_conversion(
        ckpt,
        output,
        partial,
        tasks,
        params,
        workers=workers,
        progress=progress,
        finish=finish,
        other_files=copies,
        on_shard_done=on_shard_done,
    )
    return ConversionResult(
        output, list(ckpt.shards), selected, resumed, input_bytes=ckpt.total_bytes
    )


def _write_index(ckpt: Checkpoint, dest: Path, headers: dict[str, ShardHeader]) -> None:
    if ckpt.index is None:
        return
    weight_map = {n: s for s, h in headers.items() for n in h.tensors}
    metadata = dict(ckpt.index.get("metadata") or {})
    metadata["total_size"] = sum(
        t.nbytes for h in headers.values() for t in h.tensors.values()
    )
    body = {k: v for k, v in ckpt.index.items() if k not in ("metadata", "weight_map")}
    write_new_json(
        dest / INDEX_NAME,
        {"metadata": metadata, **body, "weight_map": dict(sorted(weight_map.items()))},
    )


def _check_scales(
    converted: list[str], scales: dict[str, tuple[Path, TensorEntry]]
) -> None:
    """Every scale_inv finite and positive, checked before anything is written."""
    for name in converted:
        spath, entry = scales[name]
        if entry.dtype not in ("F32", "BF16", "F16"):
            continue  # refused by the shape/dtype check already
        try:
            check_scale_inv(read_tensor(spath, entry))
        except BadBlock as e:
            raise FP8FormatError(
                f"{entry.name!r} has {e.what} in block ({e.row}, {e.col}); "
                f"dequantizing {name!r} would write inf, NaN or zeros",
                path=spath,
            ) from None


@_typed_errors
def dequantize_checkpoint(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    allow_missing_scale: bool = False,
    workers: int = 1,
    overwrite: bool = False,
    force: bool = False,
    progress: bool = True,
    on_shard_done: Callable[[str], None] | None = None,
) -> ConversionResult:
    """DeepSeek FP8 block-scale checkpoint -> ``dtype`` (bfloat16 or float16).

    Every weight with a ``<name>_scale_inv`` becomes ``codes.float() * scale_inv``
    in ``dtype``; scales are dropped; ``quantization_config`` is removed from
    ``config.json`` and ``torch_dtype`` (a transformers-5 config's ``dtype``) set to
    ``dtype``. Other tensors pass through
    (one warning lists them); a 1-byte tensor without a scale is an error unless
    ``allow_missing_scale``. Every scale is checked (finite, positive, the right
    shape) before anything is written.
    """
    if dtype not in OUT_DTYPES:
        raise FP8InputError(
            f"--dtype must be one of {sorted(OUT_DTYPES)}, got {dtype!r}"
        )
    inp, output = Path(input_dir), Path(output_dir)
    ckpt = open_checkpoint(inp)
    verify_finished(inp)  # a finished output of ours: its shards as written
    plan = plan_dequantize(ckpt)
    where = ckpt.locate()
    if plan.unscaled_codes and not allow_missing_scale:
        name = plan.unscaled_codes[0]
        t = ckpt.shards[where[name]].tensors[name]
        raise FP8FormatError(
            f"tensor {name!r} ({t.dtype}) has no {name + SCALE_SUFFIX!r}; pass "
            "--allow-missing-scale to copy it unchanged",
            path=inp / where[name],
        )
    converted = sorted(plan.scales)
    if not converted:
        raise FP8FormatError(
            f"no *{SCALE_SUFFIX} tensors with a matching weight in {inp}; not a "
            "DeepSeek FP8 block-scale checkpoint",
            path=inp,
        )
    _check_scales(converted, plan.scales)
    if plan.orphans:
        log.warning(
            "%d scale(s) without a weight dropped (e.g. %s)",
            len(plan.orphans),
            plan.orphans[0],
        )
    if plan.passthrough:
        log.warning(
            "%d tensor(s) without %s passed through unchanged (e.g. %s)",
            len(plan.passthrough),
            SCALE_SUFFIX,
            ", ".join(plan.passthrough[:3]),
        )
    per_shard: dict[str, dict[str, tuple[Path, TensorEntry]]] = {
        s: {} for s in ckpt.shards
    }
    for n in converted:
        per_shard[where[n]][n] = plan.scales[n]
    drop: dict[str, set[str]] = {s: set() for s in ckpt.shards}
    for n in plan.scale_names:
        drop[where[n]].add(n)
    block = plan.block
    copies = other_files(ckpt, {MANIFEST_NAME})
    partial = prepare_output(output, [("input", inp)], overwrite, force)
    tasks = [
        ShardTask(
            "dequantize",
            inp / s,
            partial / s,
            block,
            scales=per_shard[s],
            drop=frozenset(drop[s]),
            out_dtype=dtype,
        )
        for s in ckpt.shards
    ]
    params = {
        "command": "dequantize",
        "dtype": dtype,
        "block_size": list(block),
        "allow_missing_scale": allow_missing_scale,
    }

    def finish(dest: Path, headers: dict[str, ShardHeader]) -> None:
        _write_index(ckpt, dest, headers)
        if ckpt.config is None:
            return
        cfg = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
        # the config's own spelling: torch_dtype, or a transformers-5 config's
        # dtype (both when it has both); none: torch_dtype. A key is not added
        # beside dtype, so the copy keeps the source's keys (calibrating it and
        # streaming the FP8 source write the same config.json).
        keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
        for k in keys:
            cfg[k] = dtype
        write_new_json(dest / CONFIG_NAME, cfg)

    resumed = run_conversion(
        ckpt,
        output,
        partial,
        tasks,
        params,
        workers=workers,
        progress=progress,
        finish=finish,
        other_files=copies,
        on_shard_done=on_shard_done,
    )
    return ConversionResult(
        output,
        list(ckpt.shards),
        converted,
        resumed,
        plan.passthrough,
        input_bytes=ckpt.total_bytes,
    )
