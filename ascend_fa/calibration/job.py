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

from ascend_fa.errors import InputError, OutputExistsError

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
        if h:
            lines.append(
                f"held-out ({h['num_samples']} samples, {h['tokens']} tokens): "
                f"perplexity float {h['perplexity_float']:.4f}, fake-quant "
                f"{h['perplexity_fake_quant']:.4f} ({h['perplexity_delta_pct']:+.3f}%)"
                f"; attention-output cosine mean "
                f"{s['mean_attention_output_cosine']:.5f}, min "
                f"{s['min_attention_output_cosine']:.5f}"
            )
        lin = self.report.get("linears")
        if lin:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(lin["counts"].items()))
            kl = lin.get("scan_kl")
            tail = f"; scan KL {kl:.5f}" if kl is not None else ""
            lines.append(
                f"linears: {counts} (fallback {lin['fallback']}{tail}; "
                f"{lin['seconds'].get('quantize', 0):.1f} s)"
            )
        lines.append(f"wrote {self.output}")
        return lines


def _check_positive(**values: int) -> None:
    for flag, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"--{flag.replace('_', '-')} must be > 0, got {value!r}")


def _linear_type(linear: str | None) -> str | None:
    """``--linear`` -> description type (None: linears stay float)."""
    from ascend_fa.linear import LINEAR_MODES

    key = "w8a8" if linear is None else linear
    if key not in LINEAR_MODES:
        raise InputError(
            f"--linear must be one of {', '.join(LINEAR_MODES)}, got {linear!r}"
        )
    return LINEAR_MODES[key]


def _fallback(value: int | str) -> int | str:
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


def _linear_config(
    quant_type: str | None, dtype: torch.dtype, fallback: int | str, seed: int
) -> Any:
    if quant_type is None:
        return None
    from ascend_fa.linear import LinearConfig

    # GGUF sources load dequantized in fp32; scales are made representable in the
    # artifact's dtype (bf16 unless the checkpoint says fp16/fp32).
    return LinearConfig(quant_type, dtype, fallback=fallback, seed=seed)


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
    merge_into: str | Path | None = None,
    max_shard_size: str | int = "5GB",
    seed: int = 0,
    heldout: int = 4,
    clip_search: bool = False,
    progress: bool = True,
    linear: str | None = None,
    linear_fallback: int | str = "auto",
) -> CalibrationResult:
    """Calibrate ``model`` and write the artifact to ``output`` (or merge into
    ``merge_into``; the result then goes to ``output`` or replaces it).

    Arguments mirror ``ascend-fa calibrate``'s flags. Raises the typed errors of
    :mod:`ascend_fa.errors` for bad input, before any model is loaded.

    ``linear``: ``"w8a8"`` (default, the MindIE target's), ``"w8a8_dynamic"`` or
    ``"none"``: quantize the linears first (:mod:`ascend_fa.linear`), so the FA
    scales are calibrated with the quantized linears active; ``linear_fallback``
    keeps that many linears float (or ``"auto"``: up to 10 %, by a KL budget).
    With ``merge_into`` the export's linears are kept (``linear`` must be unset
    or ``"none"``).
    """
    from ascend_fa import artifact
    from ascend_fa.backends import get_backend
    from ascend_fa.linear import export_state
    from ascend_fa.models import load_model, source_dtype

    from .data import load_calib_texts, split_calibration
    from .pipeline import calibrate_linears, calibrate_model
    from .recipe import load_recipe
    from .report import build_report, heldout_report

    if output is None and merge_into is None:
        raise InputError("--output is required (or --merge-into DIR)")
    _check_positive(
        num_samples=num_samples, max_length=max_length, batch_size=batch_size
    )
    artifact.parse_size(max_shard_size)
    if output is not None and merge_into is None:
        out = Path(output)
        if (
            out.exists()
            and (not out.is_dir() or any(out.iterdir()))
            and (not overwrite)
        ):
            raise OutputExistsError(
                "output directory exists and is not empty; pass --overwrite to "
                "replace it",
                path=out,
            )
    if merge_into is not None and linear not in (None, "none"):
        raise InputError(
            "--merge-into keeps the export's own quantized linears; drop --linear"
        )
    linear_type = _linear_type("none" if merge_into is not None else linear)
    linear_fallback = _fallback(linear_fallback)
    recipe_obj = load_recipe(Path(recipe) if recipe else default_recipe_path())
    texts = load_calib_texts(calib_data)
    calib, held = split_calibration(texts, num_samples, heldout, seed)
    torch.manual_seed(seed)
    device = get_backend(backend).device

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    loaded = load_model(model, gguf_file)
    net = loaded.model.to(device)
    seconds["load"] = time.perf_counter() - t0
    dtype = source_dtype(loaded.source_dir, loaded.gguf_file)
    t0 = time.perf_counter()
    kwargs = dict(
        recipe=recipe_obj,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        progress=progress,
    )
    linear_cfg = _linear_config(linear_type, dtype, linear_fallback, seed)
    linear_result = None
    if linear_cfg is not None:
        # Linears first, so the FA scales are calibrated with them active.
        linear_result = calibrate_linears(
            net,
            loaded.tokenizer,
            calib,
            linear_cfg,
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
    if linear_result is not None:
        report_extra = {"linears": linear_result.to_report()}
    else:
        report_extra = {}
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
            **report_extra,
        },
    )
    if merge_into:
        dest = artifact.merge_into(
            merge_into,
            scales=scales,
            fa_quant_type=fa_quant_type,
            output=output,
            report=report,
            overwrite=overwrite,
        )
    else:
        assert output is not None
        config = net.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        # A GGUF-loaded config has no architectures; loaders dispatch on it.
        config["architectures"] = config.get("architectures") or [type(net).__name__]
        config.pop("_name_or_path", None)
        dest = artifact.export_artifact(
            output,
            state_dict=export_state(net, artifact.checkpoint_state_dict(net, dtype)),
            scales=scales,
            fa_quant_type=fa_quant_type,
            config=config,
            source_dir=None if loaded.gguf_file else loaded.source_dir,
            tokenizer=loaded.tokenizer,
            report=report,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
        )
    return CalibrationResult(
        output=Path(dest),
        fa_quant_type=fa_quant_type,
        layers=len(report["layers"]),
        num_samples=len(calib),
        report=report,
        seconds=seconds,
    )
