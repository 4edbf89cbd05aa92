"""The last stage of ``calibrate``: the report, and the artifact written (or
merged into an msModelSlim export) atomically by :mod:`ascend_fa.artifact`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ascend_fa import parallel
from ascend_fa.families import built_as

from .arguments import picture_files, with_carried, with_wrapper, wrapper_names
from .plan import CalibrationPlan
from .source import Source
from .stages import AttentionPass, Heldout

__all__ = ["job_report", "write_artifact"]


def _sections(**results: Any) -> dict[str, Any]:
    """``{name: result.to_report()}`` for the stage results that ran, without
    their timings: the report is part of the artifact, which a rerun of its
    recipe writes again byte for byte (the timings are in
    :attr:`~.job.CalibrationResult.seconds`)."""
    out = {}
    for k, r in results.items():
        if r is not None:
            section = r.to_report()
            section.pop("seconds", None)
            out[k] = section
    return out


def job_report(
    plan: CalibrationPlan,
    source: Source,
    attention: AttentionPass,
    heldout: Heldout,
    *,
    transforms: Any,
    linears: Any,
    budget: Any,
) -> dict[str, Any]:
    """``calibration_report.json``: the report of :func:`.report.build_report`
    with the run's header (model, target, what is deployed, the stages' own
    sections, the recipe and the calibration settings). It holds no timing, so
    that a rerun writes the same bytes."""
    from ascend_fa import artifact

    from .report import build_report

    kv_scales = attention.kv_scales
    header = {
        "model": source.name,
        "model_type": source.model_type,
        "fa_quant_type": attention.fa_quant_type,
        "target": plan.target,
        "deployed": attention.quant_kind,
        "dtype": artifact.dtype_name(plan.dtype),
        "research_artifact": plan.research,
        "kv_cache_scales": (
            {
                a: {k: v.tolist() for k, v in sides.items()}
                for a, sides in kv_scales.items()
            }
            if kv_scales
            else None
        ),
        **_sections(error_budget=budget, transforms=transforms, linears=linears),
        "recipe": [p.config.model_dump() for p in attention.calibrated.processors],
        "calibration": {
            "num_samples": len(plan.calib),
            "max_length": plan.max_length,
            "batch_size": plan.batch_size,
            "seed": plan.seed,
            "ranks": parallel.world_size(),
        },
    }
    return build_report(
        scales=attention.scales,
        ranges=attention.calibrated.ranges,
        per_layer=heldout.per_layer,
        heldout=heldout.stats,
        header=header,
    )


def write_artifact(
    plan: CalibrationPlan,
    source: Source,
    attention: AttentionPass,
    report: dict[str, Any],
    *,
    transforms: Any,
    recipe: str | None = None,
) -> Path:
    """Write the artifact of the run (rank 0), or merge the FA / KV tensors into
    ``plan.merge_into``; returns where it went. ``recipe``: the resolved recipe's
    YAML text, stored as :data:`~ascend_fa.artifact.RECIPE_FILE`."""
    from ascend_fa import artifact

    extra_files = picture_files(report) if plan.picture_report else {}
    if recipe is not None:
        extra_files[artifact.RECIPE_FILE] = recipe.encode("utf-8")
    if not plan.merge:
        return _export(plan, source, attention, report, extra_files, transforms)
    return Path(
        artifact.merge_into(
            plan.merge_into,
            scales=_renamed(attention.fa_scales, wrapper_names(source.net)),
            fa_quant_type=attention.fa_quant_type,
            output=plan.output,
            report=report,
            extra_files=extra_files,
            overwrite=plan.overwrite,
            force=plan.force,
            consumer=plan.target,
            kv_scales=_renamed(attention.kv_scales, wrapper_names(source.net)),
            model_config=_model_config(plan, source),
            metadata=_provenance(plan, source),
        )
    )


def _model_config(plan: CalibrationPlan, source: Source) -> dict[str, Any]:
    """The model's config with the ``model_type`` its checkpoint states: a family
    transformers builds through another's classes (Kimi-K2's ``kimi_k2``,
    :data:`ascend_fa.families.BUILT_AS`) is that family in memory only."""
    config = source.net.config.to_dict()
    stated = (plan.source_config or {}).get("model_type")
    if stated is not None and built_as(stated) == config.get("model_type"):
        config["model_type"] = stated
    return config


def _provenance(plan: CalibrationPlan, source: Source) -> dict[str, Any]:
    """What the artifact is made from and for (:mod:`ascend_fa.artifact.provenance`)."""
    from ascend_fa.artifact import resolve_release
    from ascend_fa.artifact.provenance import provenance_metadata
    from ascend_fa.families import wrapper

    release = resolve_release(plan.target, plan.consumer_version)
    loaded = source.loaded
    config = _model_config(plan, source)
    if not loaded.gguf_file and wrapper(_source_type(loaded)) is not None:
        # a wrapper's language model: the source is the wrapper config.json states
        from ascend_fa.artifact.model_files import read_source_config

        config = read_source_config(loaded.source_dir) or config
    return provenance_metadata(
        config,
        source_dir=None if loaded.gguf_file else loaded.source_dir,
        consumer_version=None if release is None else release.name,
    )


def _export(
    plan: CalibrationPlan,
    source: Source,
    attention: AttentionPass,
    report: dict[str, Any],
    extra_files: dict[str, bytes],
    transforms: Any,
) -> Path:
    from ascend_fa import artifact

    assert plan.output is not None
    net, loaded, dtype = source.net, source.loaded, plan.dtype
    config = _artifact_config(net)
    tied_copies = plan.target in artifact.ASCEND_TARGETS
    ckpt = (
        source.streamed.checkpoint_tensors(dtype, tied_copies=tied_copies)
        if source.streamed is not None
        else artifact.checkpoint_tensors(net, dtype, tied_copies=tied_copies)
    )
    if source.kind is not None and source.kind.carried_layers and not loaded.gguf_file:
        ckpt = with_carried(ckpt, loaded.source_dir, net.config, dtype)
    rename = wrapper_names(net)
    if not loaded.gguf_file:
        ckpt = with_wrapper(ckpt, loaded.source_dir, _source_type(loaded), net)
    metadata = {
        **_provenance(plan, source),
        **(transforms.description_metadata() if transforms is not None else {}),
        **(
            {artifact.RESEARCH_METADATA_KEY: artifact.dtype_name(dtype)}
            if plan.research
            else {}
        ),
    }
    return Path(
        artifact.export_artifact(
            plan.output,
            state_dict=ckpt.tensors,
            tensor_types=ckpt.types,
            scales=_renamed(attention.fa_scales, rename),
            fa_quant_type=attention.fa_quant_type,
            kv_scales=_renamed(attention.kv_scales, rename),
            kv_strategy=plan.kv_strategy,
            target=plan.target,
            dtype=dtype,
            config=config,
            source_dir=None if loaded.gguf_file else loaded.source_dir,
            tokenizer=loaded.tokenizer,
            report=report,
            extra_files=extra_files,
            max_shard_size=plan.max_shard_size,
            overwrite=plan.overwrite,
            force=plan.force,
            metadata=metadata or None,
        )
    )


def _renamed(scales: Any, rename: Any) -> Any:
    """``{attention module: ...}`` under the checkpoint's module names."""
    return {rename(a): v for a, v in scales.items()} if scales else scales


def _source_type(loaded: Any) -> str | None:
    """The ``model_type`` of the source's own config.json (a wrapper's, where
    the loaded model is its language model)."""
    from ascend_fa.artifact.model_files import read_source_config

    config = read_source_config(loaded.source_dir)
    return None if config is None else config.get("model_type")


def _artifact_config(net: Any) -> dict[str, Any]:
    """The model's config as the artifact's ``config.json``: a GGUF-loaded config
    has no architectures (loaders dispatch on it); no local name or path."""
    config = net.config.to_dict()
    config["architectures"] = config.get("architectures") or [type(net).__name__]
    config.pop("_name_or_path", None)
    return config
