"""What ``calibrate`` checks and decides before the model loads: the linear type a
target deploys, the fallback argument, the source config, counts and output
locations, the streaming options and plan; and the small helpers around the export
(the picture report, the carried MTP tensors). Kept apart from :mod:`.job` so the
verb reads as its steps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ascend_fa.errors import InputError
from ascend_fa.families import is_mla

__all__ = [
    "LINEAR_TYPES",
    "check_locations",
    "check_positive",
    "check_streaming",
    "default_linear",
    "parse_fallback",
    "picture_files",
    "source_config",
    "streaming_plan",
    "warn_target",
    "with_carried",
    "with_wrapper",
    "wrapper_names",
]


#: ``--linear`` value -> the description's ``model_quant_type``.
LINEAR_TYPES = {"none": "FLOAT", "w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC"}


def default_linear(target: str, mla: bool | None, model_type: str | None = None) -> str:
    """The linears a target deploys by default: MindIE loads attention quantization
    only beside quantized linears (W8A8; W8A8_DYNAMIC for the MoE models that load
    every linear under one type, :mod:`ascend_fa.artifact.mindie_models`);
    vllm-ascend's FAKQuant path reads the quantized MLA linears (W8A8_DYNAMIC), its
    GQA C8 path keeps them float; vLLM's KV-cache scheme needs none."""
    if target == "mindie":
        from ascend_fa.artifact.mindie_models import mindie_model

        m = mindie_model(model_type)
        return "w8a8_dynamic" if m is not None and m.uniform else "w8a8"
    if target == "vllm-ascend" and mla:
        return "w8a8_dynamic"
    return "none"


def parse_fallback(value: int | str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if isinstance(value, bool) or n < 0:
        raise InputError(
            f"--linear-fallback must be a number >= 0 or 'auto', got {value!r}"
        )
    return n


def source_config(model: str | Path | None) -> dict[str, Any] | None:
    """A HF checkpoint directory's ``config.json`` as a dict (None for GGUF, the
    default model, or no such file: the loader reports that). A config that is
    not a JSON object, repeats a key, or has an impossible structural key
    (:func:`~ascend_fa.config_checks.check_model_config`) is refused here, before
    anything else is said about the model."""
    from ascend_fa.config_checks import check_model_config
    from ascend_fa.safe_files import read_json_object

    if model is None:
        return None
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    data = read_json_object(path, what="model config")
    check_model_config(data, path)
    return data


def picture_files(report: dict[str, Any]) -> dict[str, bytes]:
    """``{calibration_report.png: bytes}``, or nothing (with a warning) when
    matplotlib cannot draw here."""
    import logging

    from .plots import REPORT_PNG, render_report_png

    try:
        return {REPORT_PNG: render_report_png(report)}
    except ImportError as exc:
        logging.getLogger(__name__).warning(
            "no picture report: %s (pip install matplotlib)", exc
        )
        return {}


def check_positive(**values: int) -> None:
    for flag, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"--{flag.replace('_', '-')} must be > 0, got {value!r}")


def check_locations(
    model: str | Path | None,
    output: str | Path | None,
    merge_into: str | Path | None,
    *,
    overwrite: bool,
    force: bool,
) -> None:
    """Every refusal about where we write, before the model loads: the output is
    not the model or the merge target, nor inside or around them; it is not a
    symlink, and replaces only what ``overwrite``/``force`` allow (the merge
    target's contents are checked by the caller (``artifact.check_merge_export``)."""
    from ascend_fa.artifact.output import check_output_dir
    from ascend_fa.safe_paths import check_disjoint

    if output is not None:
        check_disjoint(output, {"--model": model, "--merge-into": merge_into})
        check_output_dir(output, overwrite=overwrite, force=force)
    if merge_into is not None:
        if output is None:
            check_output_dir(merge_into, overwrite=True, force=True)


def streaming_plan(
    model: str | Path | None,
    *,
    streaming: bool,
    num_samples: int = 32,
    max_length: int = 512,
    heldout: int = 4,
    target: str | None = None,
    linear: str | None = None,
) -> Any:
    """``calibrate --streaming --dry-run``: the :class:`~ascend_fa.streaming.plan.
    StreamPlan` of that run (layers, shard reads, peak memory, disk), computing
    nothing and writing nothing."""
    from ascend_fa import artifact
    from ascend_fa.streaming import plan_streaming

    if not streaming:
        raise InputError("--dry-run plans a --streaming run; add --streaming")
    check_positive(num_samples=num_samples, max_length=max_length)
    if model is None or not Path(model).is_dir():
        raise InputError(
            "--streaming reads a Hugging Face checkpoint directory's safetensors "
            "shards; pass --model DIR"
        )
    src_config = source_config(model)
    mla = is_mla(src_config.get("model_type")) if src_config else None
    target = artifact.resolve_target(target)
    linear = linear or default_linear(target, mla, src_config.get("model_type"))
    return plan_streaming(
        model,
        num_samples=num_samples,
        max_length=max_length,
        heldout=heldout,
        linear=linear != "none",
    )


def with_carried(ckpt: Any, source_dir: Path, config: Any, dtype: Any) -> Any:
    """``ckpt`` followed by the checkpoint's layers past the decoder stack (the
    DeepSeek-V3 MTP layer, :mod:`ascend_fa.streaming.carry`), typed FLOAT."""
    from ascend_fa.artifact import CheckpointTensors, LazyTensors
    from ascend_fa.streaming.carry import carried_tensors

    carried = carried_tensors(source_dir, int(config.num_hidden_layers), dtype)
    if not len(carried):
        return ckpt
    tensors = (
        ckpt.tensors.then(carried)
        if isinstance(ckpt.tensors, LazyTensors)
        else {**ckpt.tensors, **{n: carried[n] for n in carried}}
    )
    types = {**ckpt.types, **dict.fromkeys(carried, "FLOAT")}
    return CheckpointTensors(tensors, types, ckpt.model_quant_type)


def wrapper_names(net: Any) -> Any:
    """The map from ``net``'s in-memory names to the checkpoint's
    (:func:`ascend_fa.hf_compat.checkpoint_prefix`: a multimodal wrapper's
    language model keeps ``model.language_model.*``); the identity otherwise."""
    from ascend_fa.hf_compat import checkpoint_prefix

    return checkpoint_prefix(net)


def with_wrapper(ckpt: Any, source_dir: Path, source_type: str | None, net: Any) -> Any:
    """``ckpt`` under the checkpoint's own names, followed by the towers of a
    multimodal wrapper (:data:`ascend_fa.families.WRAPPERS`: Qwen3.5's
    ``model.visual.*``) as the checkpoint holds them: same names, dtype and
    values, typed FLOAT. Nothing changes for a model that is not a wrapper."""
    from ascend_fa.artifact import CheckpointTensors, LazyTensors, TensorSpec
    from ascend_fa.families import wrapper
    from ascend_fa.fp8 import CheckpointReader

    rename = wrapper_names(net)
    tensors = ckpt.tensors
    names = {rename(n): n for n in tensors}
    layout = wrapper(source_type)
    if layout is None and all(k == v for k, v in names.items()):
        return ckpt
    if isinstance(tensors, LazyTensors):
        renamed: Any = LazyTensors(
            {k: tensors.specs[v] for k, v in names.items()},
            lambda k: tensors[names[k]],
        )
    else:
        renamed = {k: tensors[v] for k, v in names.items()}
    types = {rename(n): t for n, t in ckpt.types.items()}
    if layout is not None:
        reader = CheckpointReader(source_dir)
        kept = sorted(n for n in reader.names() if n.startswith(layout.kept))
        specs = {}
        for n in kept:
            info = reader.metadata(n)
            specs[n] = TensorSpec(tuple(info.shape), info.dtype)
        towers = LazyTensors(specs, lambda n: reader.tensor(n).contiguous())
        if isinstance(renamed, LazyTensors):
            renamed = renamed.then(towers)
        else:
            renamed = LazyTensors({}, renamed.__getitem__, renamed).then(towers)
        types.update(dict.fromkeys(kept, "FLOAT"))
    return CheckpointTensors(renamed, types, ckpt.model_quant_type)


def check_streaming(
    streaming: bool,
    *,
    merge_into: str | Path | None,
    clip_search: bool,
    criterion: str | None,
    max_memory: str | int | None,
) -> None:
    """What ``--streaming`` cannot do, refused before anything loads."""
    from ascend_fa.artifact import parse_size

    if not streaming:
        raise InputError("--max-memory bounds a --streaming run; add --streaming")
    if merge_into is not None:
        raise InputError("--streaming writes its own artifact; drop --merge-into")
    if clip_search:
        raise InputError("--clip-search keeps whole-model samples; drop --streaming")
    if criterion == "kl":
        raise InputError(
            "--linear-fallback-criterion kl ranks groups by whole-model logits, "
            "which a --streaming run never holds; use the layer criterion"
        )
    if max_memory is not None:
        parse_size(max_memory)


def warn_target(target: str, linear_type: str | None, *, merge: bool) -> None:
    """Log, once (rank 0) and in one line, what
    :func:`~ascend_fa.artifact.target_warning` says of this request (e.g.
    ``--target mindie --linear none``: a research artifact MindIE will not load)."""
    from ascend_fa import artifact, parallel

    warning = artifact.target_warning(target, model_quant_type=linear_type, merge=merge)
    if warning and parallel.rank() == 0:
        logging.getLogger("ascend_fa.calibration").warning(warning)
