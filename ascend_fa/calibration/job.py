"""The ``calibrate`` verb: from a checkpoint and calibration text to an artifact.

:func:`calibrate` runs named stages, each with its own inputs and outputs:

* plan (:mod:`.plan`) — every input parsed and checked (recipe, calibration data,
  output location, shard size, target, the pre-flight checks) before the model
  loads; the calibration text shuffled with ``seed`` and ``heldout`` samples split
  off;
* source (:mod:`.source`) — the model (default: SmolLM2-135M-Instruct GGUF),
  whole or streamed one layer at a time, with a streaming run's resume state;
* transforms, linears, attention pass, error budget, held-out report
  (:mod:`.stages`) — FA points injected by the model's adapter observe
  ``num_samples`` samples in padded batches (padding excluded through the
  attention mask), then run as fake-quant on the held-out samples;
* artifact (:mod:`.export`) — the report, and the artifact written (or merged
  into an msModelSlim export) atomically (:mod:`ascend_fa.artifact`).

``target`` picks what is written (:mod:`ascend_fa.artifact.targets`): FAQuant /
FAKQuant scales (``mindie``; ``vllm-ascend`` for MLA), C8 per-channel K/V scales
(``vllm-ascend`` for GQA) or FP8 K/V scales (``vllm``), observed at the same FA
points in the same forwards (:mod:`.kv`); the held-out report then measures that
quantization. ``dtype`` is the artifact's weight dtype (bf16 default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_fa import parallel

from .arguments import streaming_plan
from .export import job_report, write_artifact
from .plan import default_recipe_path, plan_calibration, resolved_recipe
from .recipe import Recipe, dump_recipe
from .source import Source, open_source
from .stages import (
    AttentionPass,
    Folding,
    Heldout,
    attention_on_linears,
    fold_transforms,
    keep_within_budget,
    measure_heldout,
    observe_attention,
    quantize_linears,
    rotates,
)

__all__ = [
    "CalibrationResult",
    "calibrate",
    "default_recipe_path",
    "recipe_header",
    "streaming_plan",
]


def recipe_header() -> str:
    """The comment lines above a stored recipe: what it is, how to rerun it, and
    the versions that wrote it (the same versions write the same bytes)."""
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    from ascend_fa.artifact import RECIPE_FILE

    return (
        "The resolved recipe of this artifact: every choice of the ascend-fa "
        "calibrate run\nthat wrote it. Rerun it (the same versions write the same "
        f"bytes):\n  ascend-fa calibrate --recipe {RECIPE_FILE} --output DIR\n"
        f"ascend-fa {version('ascend-fa')}, torch {version('torch')}, "
        f"transformers {version('transformers')}, safetensors "
        f"{version('safetensors')}"
    )


@dataclass
class CalibrationResult:
    """What :func:`calibrate` did: where the artifact went, its report, timings."""

    output: Path
    fa_quant_type: str
    layers: int
    num_samples: int
    report: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    #: the resolved recipe of the run (stored in the artifact as
    #: :data:`~ascend_fa.artifact.RECIPE_FILE`)
    recipe: Any = None

    @property
    def heldout(self) -> dict[str, Any]:
        return self.report.get("heldout", {})

    def to_dict(self) -> dict[str, Any]:
        """What ``ascend-fa calibrate --json`` writes: the artifact, timings, the
        report's summary, held-out and linear sections (the per-head detail stays
        in ``calibration_report.json``)."""
        rep = self.report
        return {
            "output": str(self.output),
            "fa_quant_type": self.fa_quant_type,
            "layers": self.layers,
            "num_samples": self.num_samples,
            "seconds": dict(self.seconds),
            "target": rep.get("target"),
            "summary": rep.get("summary", {}),
            "heldout": self.heldout,
            "linears": rep.get("linears"),
            "transforms": (rep.get("transforms") or {}).get("folded"),
            "error_budget_kept_float": (rep.get("error_budget") or {}).get(
                "kept_float"
            ),
        }

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
        eb = self.report.get("error_budget")
        if eb:
            lines.append(
                f"error budget KL {eb['budget']:g}: {len(eb['kept_float'])} of "
                f"{len(eb['ranking'])} attention layers kept float, KL "
                f"{eb['kl_steps'][0]:.5f} -> {eb['kl_steps'][-1]:.5f} on "
                f"{eb['tokens']} calibration tokens"
            )
        folded = self.report.get("transforms")
        if folded:
            lines.append(
                f"folded {', '.join(folded['folded'])} into the weights "
                f"({t.get('transforms', 0):.1f} s)"
            )
        lin = self.report.get("linears")
        if lin:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(lin["counts"].items()))
            kl = lin.get("scan_kl")
            tail = f"; scan KL {kl:.5f}" if kl is not None else ""
            lines.append(
                f"linears: {counts} (fallback {lin['fallback']}{tail}; "
                f"{t.get('linears', 0):.1f} s)"
            )
        if self.report.get("research_artifact"):
            lines.append(
                f"{self.report.get('dtype')} weights: a research artifact for exact "
                "evaluation, not deployable (ascend-fa inspect --target says why)"
            )
        lines.append(f"wrote {self.output}")
        return lines


def calibrate(
    model: str | Path | None = None,
    *,
    output: str | Path | None = None,
    gguf_file: str | None = None,
    recipe: str | Path | Recipe | None = None,
    calib_data: str | Path | None = None,
    num_samples: int | None = None,
    max_length: int | None = None,
    batch_size: int | None = None,
    backend: str | None = None,
    overwrite: bool = False,
    force: bool = False,
    merge_into: str | Path | None = None,
    max_shard_size: str | int | None = None,
    seed: int | None = None,
    heldout: int | None = None,
    clip_search: bool | None = None,
    picture_report: bool | None = None,
    cache: bool | None = None,
    progress: bool = True,
    target: str | None = None,
    consumer_version: str | None = None,
    dtype: str | None = None,
    kv_strategy: str | None = None,
    linear: str | None = None,
    linear_fallback: int | str | None = None,
    linear_fallback_criterion: str | None = None,
    rotate: str | None = None,
    linear_headroom: float | str | None = None,
    streaming: bool | None = None,
    max_memory: str | int | None = None,
    transforms: str | list[str] | None = None,
    error_budget: float | str | None = None,
) -> CalibrationResult:
    """Calibrate ``model`` and write the artifact to ``output`` (or merge into
    ``merge_into``). Arguments mirror ``ascend-fa calibrate``'s flags
    (:func:`~.plan.plan_calibration` describes them): an argument left at None
    takes ``recipe``'s value, one given wins over it. The artifact gets the
    resolved recipe of the run (:data:`~ascend_fa.artifact.RECIPE_FILE`; also
    :attr:`CalibrationResult.recipe`), which reruns it byte for byte. Bad input
    raises the typed errors of :mod:`ascend_fa.errors` before any model is
    loaded."""
    plan = plan_calibration(**locals())  # first: locals() are the arguments
    from ascend_fa.backends import get_backend

    torch.manual_seed(plan.seed)
    # Under torchrun: join the ranks (after the plan's checks, which every rank
    # makes alike); each rank calibrates its share, rank 0 writes.
    with parallel.process_group(get_backend(plan.backend).device) as device:
        source = open_source(plan, device)
        folding = fold_transforms(plan, source)
        riding = attention_on_linears(plan, source, folding)
        linears = quantize_linears(plan, source, riding)
        attention = observe_attention(plan, source, folding, riding)
        folded = folding.outcome()
        attention, budget = keep_within_budget(plan, source, attention)
        heldout = measure_heldout(plan, source, attention, budget)
        attention.calibrated.remove(source.net)
        recipe = resolved_recipe(
            plan,
            backend=get_backend(plan.backend).name,
            rotation="on" if rotates(plan, source) else "off",
        )
        report = job_report(
            plan,
            source,
            attention,
            heldout,
            transforms=folded,
            linears=linears,
            budget=budget,
        )
        dest = Path(output or merge_into or ".")  # ranks other than 0 write nothing
        if parallel.rank() == 0:
            dest = write_artifact(
                plan,
                source,
                attention,
                report,
                transforms=folded,
                recipe=dump_recipe(recipe, header=recipe_header()),
            )
        source.close()
    return CalibrationResult(
        output=dest,
        fa_quant_type=attention.quant_kind,
        layers=len(report["layers"]),
        num_samples=len(plan.calib),
        report=report,
        seconds=_seconds(source, folding, folded, attention, heldout, linears),
        recipe=recipe,
    )


def _seconds(
    source: Source,
    folding: Folding,
    folded: Any,
    attention: AttentionPass,
    heldout: Heldout,
    linears: Any,
) -> dict[str, float]:
    """The stages' timings, in the order they ran (transforms folded before the
    FA pass come before it, those folded in the pass after it)."""
    seconds = {"load": source.seconds}
    if linears is not None:
        seconds["linears"] = linears.seconds.get("quantize", 0.0)
    if folding.folded is not None:
        seconds["transforms"] = folded.seconds
    seconds["calibrate"] = attention.seconds
    if folding.in_pass is not None:
        seconds["transforms"] = folded.seconds
    seconds["heldout"] = heldout.seconds
    return seconds
