"""The working stages of ``calibrate``, in the order it runs them on the
:class:`~.source.Source` of a :class:`~.plan.CalibrationPlan`:

1. :func:`fold_transforms` — exact attention transforms folded into the weights
   before the linears, or (float linears, one process) inside the FA pass;
2. :func:`quantize_linears` — the linears quantized first, so the FA / KV scales
   are calibrated with them active (:mod:`ascend_fa.linear`); where it gives the
   same scales the FA observers ride on this pass (:func:`attention_on_linears`)
   and the next stage only reads them;
3. :func:`observe_attention` — the FA points observed (FAQuant / FAKQuant scales,
   or C8 / FP8 KV-cache scales at the same points, :mod:`.kv`);
4. :func:`keep_within_budget` — the fewest FA layers kept float that meet an error
   budget (:mod:`.budget`);
5. :func:`measure_heldout` — the held-out samples float and as deployed
   (:mod:`.report`).

The artifact stage is :mod:`.export`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

from ascend_fa import parallel
from ascend_fa.artifact.mindie_models import mlp_per_token, shared_in_model_type
from ascend_fa.errors import InputError
from ascend_fa.families import reads_fa

from .plan import CalibrationPlan
from .source import Source

__all__ = [
    "AttentionPass",
    "Folding",
    "Heldout",
    "RidingAttention",
    "attention_on_linears",
    "fold_transforms",
    "keep_within_budget",
    "measure_heldout",
    "observe_attention",
    "quantize_linears",
    "rotates",
]


@dataclass(frozen=True)
class Folding:
    """How the transforms fold: ``folded`` already (before the linears), or
    ``in_pass`` (a per-layer folder the FA pass runs before each layer); neither
    without transforms."""

    folded: Any = None
    in_pass: Any = None

    def outcome(self) -> Any:
        """What was folded (after the FA pass), or None."""
        return self.in_pass.result() if self.in_pass is not None else self.folded


def fold_transforms(plan: CalibrationPlan, source: Source) -> Folding:
    """With float linears and one process the transforms fold inside the
    layer-major FA pass (no statistics forward of their own); quantized linears
    must see the folded weights, so they are folded first there, as they are for a
    data-parallel run (whose ranks see different rows) and for the clip search's
    batch-major pass."""
    if not plan.transforms:
        return Folding()
    from ascend_fa.transforms.attention import (
        STATS_SAMPLES,
        LayerwiseTransforms,
        apply_attention_transforms,
    )

    from .layerwise import layerwise_supported

    net = source.net
    if (
        plan.linear_type == "FLOAT"
        and not plan.clip_search
        and parallel.world_size() == 1
        and layerwise_supported(net)
    ):
        return Folding(
            in_pass=LayerwiseTransforms(net, plan.transforms, seed=plan.seed)
        )
    # Folded before the linears and the FA scales, so both see the folded
    # weights; the statistics forward runs on the float model.
    folded = apply_attention_transforms(
        net,
        source.batches(plan, plan.calib[:STATS_SAMPLES]),
        plan.transforms,
        seed=plan.seed,
    )
    return Folding(folded=folded)


@dataclass(frozen=True)
class RidingAttention:
    """The FA pass run inside the linear pass (:class:`~.pipeline.
    AttentionObserving`) and the KV-cache calibration (``kv_mode``, ``kv``) its
    points feed."""

    observing: Any
    kv_mode: str | None
    kv: Any


def attention_on_linears(
    plan: CalibrationPlan, source: Source, folding: Folding
) -> RidingAttention | None:
    """The FA observers installed to ride on the linear pass, where they see
    there exactly what the FA pass of their own would show them (the same
    scales, bit for bit, one forward of the whole model fewer); None where the
    FA pass runs on its own: float linears, the clip search (batch-major),
    transforms folded inside the pass, a resumable run (the observers of finished
    layers are not checkpointed), the ``kl`` fallback criterion (it changes
    layers after they ran), a model whose layers get different masks."""
    from .layerwise import layerwise_supported
    from .pipeline import AttentionObserving

    if (
        plan.linear_type == "FLOAT"
        or plan.clip_search
        or folding.in_pass is not None
        or source.resume is not None
        or plan.criterion != "layer"
        or not layerwise_supported(source.net)
    ):
        return None
    kv_mode, kv = _kv_calibration(plan, source)
    observing = AttentionObserving(
        source.net,
        plan.recipe,
        len(plan.calib),
        plan.max_length,
        wrap=kv.wrap if kv is not None else None,
    )
    return RidingAttention(observing, kv_mode, kv)


def _kv_calibration(plan: CalibrationPlan, source: Source) -> tuple[str | None, Any]:
    """``(kv_mode, KVCalibration)`` of a C8 / FP8 KV-cache target, else
    ``(None, None)``."""
    from ascend_fa.hf_compat import rotary_dim

    from .kv import KVCalibration, recipe_settings

    kv_mode = source.kv_mode(plan.target)
    if kv_mode is None:
        return None, None
    kv = KVCalibration(
        kv_mode,
        settings=recipe_settings(plan.recipe),
        max_tokens=len(plan.calib) * plan.max_length,
        rotary_dim=rotary_dim(source.net.config),  # partial RoPE: only those pairs
    )
    return kv_mode, kv


def quantize_linears(
    plan: CalibrationPlan, source: Source, riding: RidingAttention | None = None
) -> Any:
    """The linears quantized in place (scales representable in the artifact
    dtype); their :class:`~ascend_fa.linear.LinearResult`, or None for float
    linears. A streaming run saves each changed layer and records it as done.
    ``riding`` (:func:`attention_on_linears`): the FA points observe in this
    pass."""
    if plan.linear_type == "FLOAT":
        return None
    from ascend_fa.linear import DEFAULT_HEADROOM_DOUBLINGS, LinearConfig

    from .pipeline import calibrate_linears

    config = LinearConfig(
        plan.linear_type,
        plan.dtype,
        fallback=plan.linear_fallback,
        seed=plan.seed,
        criterion=plan.criterion,
        rotate=rotates(plan, source),
        headroom_doublings=(
            DEFAULT_HEADROOM_DOUBLINGS
            if plan.linear_headroom is None
            else plan.linear_headroom
        ),
        shared_dynamic=not (
            plan.target == "mindie" and shared_in_model_type(source.model_type)
        ),
        mlp_dynamic=plan.target == "mindie" and mlp_per_token(source.model_type),
    )
    with source.spilling():
        return calibrate_linears(
            source.net,
            source.tokenizer,
            plan.calib,
            config,
            max_length=plan.max_length,
            batch_size=plan.batch_size,
            device=source.device,
            progress=plan.progress,
            prepare_layer=source.streamed.ensure if source.streamed else None,
            checkpoint=source.resume,
            attention=riding.observing if riding is not None else None,
        )


def rotates(plan: CalibrationPlan, source: Source) -> bool:
    """Whether the residual stream is rotated before the linears
    (:mod:`ascend_fa.transforms.residual`): ``--rotate on``, or by default for
    static W8A8 on a family that takes it with the whole model in memory. On
    SmolLM2 calibrated on prose only, the rotation took code KL from 0.131 to
    0.046 and prose KL from 0.0163 to 0.0134 (static per-tensor ranges hold
    across domains once no outlier channel sets them)."""
    if plan.rotate != "auto":
        return plan.rotate == "on"
    from ascend_fa.transforms.residual import supports_rotation

    return (
        plan.linear_type == "W8A8"
        and source.streamed is None
        and supports_rotation(source.net)
    )


@dataclass(frozen=True)
class AttentionPass:
    """The FA pass: the calibrated model (processors and ranges), the FA
    ``scales`` to write, the KV-cache ``kv_scales`` of a C8 / FP8 target
    (``kv_mode``; then no FA scales are written), and its ``seconds``."""

    calibrated: Any
    scales: dict[str, Any]
    kv_mode: str | None
    kv_scales: dict[str, Any] | None
    seconds: float
    #: False when the target's consumer reads no FA scale for this model
    #: (DeepSeek Sparse Attention: :attr:`~ascend_fa.families.AttentionKind.
    #: fa_targets`): the artifact carries the quantized linears only
    fa_written: bool = True

    @property
    def fa_quant_type(self) -> str:
        return self.calibrated.adapter.fa_quant_type

    @property
    def quant_kind(self) -> str:
        """What the target deploys: FAQuant / FAKQuant, C8 or FP8 KV, or
        ``"none"`` (no attention scales)."""
        if not self.fa_written:
            return "none"
        return {"c8": "C8", "fp8": "FP8 KV"}.get(self.kv_mode or "", self.fa_quant_type)

    @property
    def fa_scales(self) -> dict[str, Any] | None:
        """The FA scales the artifact carries (none for a KV-cache target, nor
        where the consumer reads none)."""
        return self.scales if self.kv_scales is None and self.fa_written else None


def observe_attention(
    plan: CalibrationPlan,
    source: Source,
    folding: Folding,
    riding: RidingAttention | None = None,
) -> AttentionPass:
    """Observe ``plan.calib`` at the FA points (the clip search's batch-major
    pass, or the layer-major one: streaming reads each layer once and is
    resumable after each layer); KV-cache scales at the same points in the same
    forwards. With ``riding`` the points observed inside the linear pass: only
    their ranges are read here."""
    from .pipeline import calibrate_model

    net = source.net
    t0 = time.perf_counter()
    if riding is not None:
        calibrated = riding.observing.result()
        return AttentionPass(
            calibrated=calibrated,
            scales=calibrated.export_scales(net),
            kv_mode=riding.kv_mode,
            kv_scales=riding.kv.scales(plan.kv_strategy) if riding.kv else None,
            seconds=time.perf_counter() - t0,
            fa_written=reads_fa(source.model_type, plan.target),
        )
    kv_mode, kv = _kv_calibration(plan, source)
    kwargs: dict[str, Any] = dict(
        recipe=plan.recipe,
        max_length=plan.max_length,
        batch_size=plan.batch_size,
        device=source.device,
        progress=plan.progress,
    )
    if kv is not None:
        kwargs["wrap"] = kv.wrap
    if plan.clip_search:
        from .search import calibrate_with_search

        calibrated = calibrate_with_search(net, source.tokenizer, plan.calib, **kwargs)
    else:
        calibrated = calibrate_model(
            net,
            source.tokenizer,
            plan.calib,
            layerwise=plan.streaming,
            checkpoint=source.resume,
            before_layer=folding.in_pass,
            **kwargs,
        )
    seconds = time.perf_counter() - t0
    return AttentionPass(
        calibrated=calibrated,
        scales=calibrated.export_scales(net),
        kv_mode=kv_mode,
        kv_scales=kv.scales(plan.kv_strategy) if kv is not None else None,
        seconds=seconds,
        fa_written=reads_fa(source.model_type, plan.target),
    )


def keep_within_budget(
    plan: CalibrationPlan, source: Source, attention: AttentionPass
) -> tuple[AttentionPass, Any]:
    """With an error budget: the pass without the FA layers kept float, and the
    :class:`~.budget.BudgetResult`; otherwise ``attention`` and None."""
    if plan.error_budget is None:
        return attention, None
    if not attention.fa_written:
        raise InputError(
            f"--error-budget keeps FA layers float; --target {plan.target} writes "
            f"no attention scales for model type {source.model_type!r} (its "
            "sparse attention reads none)"
        )
    if attention.kv_mode is not None:
        raise InputError(
            f"--error-budget keeps FAQuant layers float; --target {plan.target} "
            "writes KV-cache scales for this model: use --target mindie"
        )
    from .budget import BUDGET_SAMPLES, fit_error_budget

    batches = list(source.batches(plan, plan.calib[:BUDGET_SAMPLES]))
    budget = fit_error_budget(source.net, batches, plan.error_budget)
    scales = {k: v for k, v in attention.scales.items() if k not in budget.kept_float}
    if not scales:
        raise InputError(
            f"--error-budget {plan.error_budget} keeps every attention layer float "
            "(nothing left to quantize); raise the budget"
        )
    return replace(attention, scales=scales), budget


@dataclass(frozen=True)
class Heldout:
    """The held-out measurement: ``stats`` (perplexities, cosines) and
    ``per_layer`` detail (both empty without held-out samples, or off rank 0)."""

    stats: dict[str, Any]
    per_layer: dict[str, Any]
    seconds: float


def measure_heldout(
    plan: CalibrationPlan, source: Source, attention: AttentionPass, budget: Any
) -> Heldout:
    """The held-out samples float and fake-quant, measuring what the target
    deploys: for C8 / FP8 the FA points run the KV cache round trip (Q float)
    instead of FAQuant; layers an error budget keeps float run float."""
    from .report import heldout_report

    t0 = time.perf_counter()
    stats: dict[str, Any] = {}
    per_layer: dict[str, Any] = {}
    if plan.held and parallel.rank() == 0:  # the report is rank 0's
        with _deployed(plan, source, attention, budget):
            stats, per_layer = heldout_report(
                source.net,
                source.tokenizer,
                plan.held,
                max_length=plan.max_length,
                batch_size=plan.batch_size,
                device=source.device,
                progress=plan.progress,
            )
    return Heldout(stats, per_layer, time.perf_counter() - t0)


def _deployed(
    plan: CalibrationPlan, source: Source, attention: AttentionPass, budget: Any
) -> Any:
    """The context in which the model runs as the target deploys it."""
    if budget is not None or not attention.fa_written:
        from .budget import float_layers

        kept = budget.kept_float if budget is not None else list(attention.scales)
        return float_layers(source.net, kept)
    if attention.kv_mode is not None and attention.kv_scales is not None:
        from ascend_fa.adapters.hf import find_fa_modules, swapped_points

        from .kv import KVQuantSpec

        kv_dtype = plan.dtype if attention.kv_mode == "c8" else None
        spec = KVQuantSpec(attention.kv_mode, attention.kv_scales, kv_dtype)
        return swapped_points(find_fa_modules(source.net), spec.point)
    return contextlib.nullcontext()
