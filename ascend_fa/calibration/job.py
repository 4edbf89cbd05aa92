"""The ``calibrate`` verb: from a checkpoint and calibration text to an artifact.

Steps: validate every input (recipe, calibration data, output location, shard
size) before the model loads; load the model (default: SmolLM2-135M-Instruct
GGUF); shuffle the calibration text with ``seed`` and split off ``heldout``
samples; inject FA points with the model's adapter and observe ``num_samples``
samples in padded batches (padding excluded through the attention mask); turn the
observers into fake-quant modules; run the held-out samples float and fake-quant for
the report (:mod:`.report`); write the artifact (or ``merge_into`` an msModelSlim
export) atomically (:mod:`ascend_fa.artifact`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ascend_fa.errors import InputError

__all__ = ["CalibrationResult", "calibrate", "default_recipe_path"]


def default_recipe_path() -> Path:
    """The recipe ``calibrate`` uses when none is given (``recipes/default.yaml``)."""
    return Path(str(resources.files("ascend_fa") / "recipes" / "default.yaml"))


@dataclass
class CalibrationResult:
    """What :func:`calibrate` did: where the artifact went, its report, timings."""

    output: Path
    fa_quant_type: str
    layers: int
    num_samples: int
    report: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def heldout(self) -> dict[str, Any]:
        return self.report.get("heldout", {})

    def summary_lines(self) -> list[str]:
        """The lines ``ascend-fa calibrate`` prints."""
        t = self.seconds
        lines = [
            f"calibrated {self.layers} attention modules ({self.fa_quant_type}) on "
            f"{self.num_samples} samples in {t.get('calibrate', 0):.1f} s (load "
            f"{t.get('load', 0):.1f} s, held-out eval {t.get('heldout', 0):.1f} s)"
        ]
        h, s = self.heldout, self.report.get("summary", {})
        if h and not h.get("tokens"):
            lines.append(
                f"held-out ({h['num_samples']} samples): no token to predict at "
                "this --max-length; no perplexity"
            )
        elif h:
            lines.append(
                f"held-out ({h['num_samples']} samples, {h['tokens']} tokens): "
                f"perplexity float {h['perplexity_float']:.4f}, fake-quant "
                f"{h['perplexity_fake_quant']:.4f} ({h['perplexity_delta_pct']:+.3f}%)"
                f"; attention-output cosine mean "
                f"{s['mean_attention_output_cosine']:.5f}, min "
                f"{s['min_attention_output_cosine']:.5f}"
            )
        lines.append(f"wrote {self.output}")
        return lines


def _picture(report: dict[str, Any]) -> dict[str, bytes]:
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


def _check_positive(**values: int) -> None:
    for flag, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"--{flag.replace('_', '-')} must be > 0, got {value!r}")


def _check_locations(
    model: str | Path | None,
    output: str | Path | None,
    merge_into: str | Path | None,
    *,
    overwrite: bool,
    force: bool,
) -> None:
    """Every refusal about where we read and write, before the model loads: the
    output is not the model or the merge target, nor inside or around them; it is
    not a symlink, and replaces only what ``overwrite``/``force`` allow; the merge
    target is a readable msModelSlim export."""
    from ascend_fa.artifact.reader import check_merge_target
    from ascend_fa.artifact.writer import check_output_dir
    from ascend_fa.safe_paths import check_disjoint

    if output is not None:
        check_disjoint(output, {"--model": model, "--merge-into": merge_into})
        check_output_dir(output, overwrite=overwrite, force=force)
    if merge_into is not None:
        check_merge_target(merge_into)
        if output is None:
            check_output_dir(merge_into, overwrite=True, force=True)


def calibrate(
    model: str | Path | None = None,
    *,
    output: str | Path | None = None,
    gguf_file: str | None = None,
    recipe: str | Path | None = None,
    calib_data: str | Path | None = None,
    num_samples: int = 32,
    max_length: int = 512,
    batch_size: int = 4,
    backend: str | None = None,
    overwrite: bool = False,
    force: bool = False,
    merge_into: str | Path | None = None,
    max_shard_size: str | int = "5GB",
    seed: int = 0,
    heldout: int = 4,
    clip_search: bool = False,
    picture_report: bool = True,
    cache: bool = True,
    progress: bool = True,
) -> CalibrationResult:
    """Calibrate ``model`` and write the artifact to ``output`` (or merge into
    ``merge_into``; the result then goes to ``output`` or replaces it).

    Arguments mirror ``ascend-fa calibrate``'s flags. Raises the typed errors of
    :mod:`ascend_fa.errors` for bad input, before any model is loaded.
    """
    from ascend_fa import artifact
    from ascend_fa.backends import get_backend
    from ascend_fa.models import load_model, source_dtype

    from .data import load_calib_texts, split_calibration
    from .pipeline import calibrate_model
    from .recipe import load_recipe
    from .report import build_report, heldout_report

    if output is None and merge_into is None:
        raise InputError("--output is required (or --merge-into DIR)")
    _check_positive(
        num_samples=num_samples, max_length=max_length, batch_size=batch_size
    )
    artifact.parse_size(max_shard_size)
    _check_locations(model, output, merge_into, overwrite=overwrite, force=force)
    recipe_obj = load_recipe(Path(recipe) if recipe else default_recipe_path())
    texts = load_calib_texts(calib_data)
    calib, held = split_calibration(texts, num_samples, heldout, seed)
    torch.manual_seed(seed)
    device = get_backend(backend).device

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    loaded = load_model(model, gguf_file, cache=cache)
    net = loaded.model.to(device)
    seconds["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kwargs = dict(
        recipe=recipe_obj,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        progress=progress,
    )
    if clip_search:
        from .search import calibrate_with_search

        result = calibrate_with_search(net, loaded.tokenizer, calib, **kwargs)
    else:
        result = calibrate_model(net, loaded.tokenizer, calib, **kwargs)
    seconds["calibrate"] = time.perf_counter() - t0
    scales = result.export_scales(net)
    t0 = time.perf_counter()
    held_stats, per_layer = ({}, {})
    if held:
        held_stats, per_layer = heldout_report(
            net,
            loaded.tokenizer,
            held,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
            progress=progress,
        )
    seconds["heldout"] = time.perf_counter() - t0
    result.remove(net)

    fa_quant_type = result.adapter.fa_quant_type
    source = (
        str(loaded.source_dir / loaded.gguf_file)
        if loaded.gguf_file
        else str(loaded.source_dir)
    )
    report = build_report(
        scales=scales,
        ranges=result.ranges,
        per_layer=per_layer,
        heldout=held_stats,
        header={
            "model": source,
            "model_type": net.config.model_type,
            "fa_quant_type": fa_quant_type,
            "recipe": [p.config.model_dump() for p in result.processors],
            "calibration": {
                "num_samples": len(calib),
                "max_length": max_length,
                "batch_size": batch_size,
                "seed": seed,
                "seconds": round(seconds["calibrate"], 3),
            },
        },
    )
    extra_files = _picture(report) if picture_report else {}
    if merge_into:
        dest = artifact.merge_into(
            merge_into,
            scales=scales,
            fa_quant_type=fa_quant_type,
            output=output,
            report=report,
            extra_files=extra_files,
            overwrite=overwrite,
            force=force,
        )
    else:
        assert output is not None
        dtype = source_dtype(loaded.source_dir, loaded.gguf_file)
        config = net.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        # A GGUF-loaded config has no architectures; loaders dispatch on it.
        config["architectures"] = config.get("architectures") or [type(net).__name__]
        config.pop("_name_or_path", None)
        dest = artifact.export_artifact(
            output,
            state_dict=artifact.checkpoint_state_dict(net, dtype),
            scales=scales,
            fa_quant_type=fa_quant_type,
            config=config,
            source_dir=None if loaded.gguf_file else loaded.source_dir,
            tokenizer=loaded.tokenizer,
            report=report,
            extra_files=extra_files,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            force=force,
        )
    return CalibrationResult(
        output=Path(dest),
        fa_quant_type=fa_quant_type,
        layers=len(report["layers"]),
        num_samples=len(calib),
        report=report,
        seconds=seconds,
    )
