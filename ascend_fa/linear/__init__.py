"""Quantized linears: W8A8 and W8A8_DYNAMIC, calibrated here, exact integer emulation.

==================  ============================================================
module              holds
==================  ============================================================
:mod:`.modules`     :class:`W8A8Linear`, :class:`W8A8DynamicLinear` (the
                    ``QuantizedLinear`` protocol: ``quant_type``,
                    ``export_tensors(prefix)``, exact integer ``forward``)
:mod:`.experts`     :class:`W8A8DynamicExperts` (DeepSeek routed experts, fused
                    parameters, W8A8_DYNAMIC per expert)
:mod:`.plan`        which linears, grouped by shared input, where smoothing folds
:mod:`.search`      input statistics; smoothing strength and range per group
:mod:`.engine`      the layer-sequential calibration (:func:`quantize_linears`)
:mod:`.fallback`    ``--linear-fallback N | auto``: the layer-local criterion
                    (default) or the whole-model KL scan
:mod:`.io`          export to checkpoint tensors; load back from an artifact
==================  ============================================================

:func:`calibrate_linears` is the one call the ``calibrate`` verb makes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ascend_fa.transforms.residual import rotate_residual

from .engine import (
    DEFAULT_HEADROOM_DOUBLINGS,
    FALLBACK_CRITERIA,
    LINEAR_MODES,
    GroupRecord,
    LinearCheckpoint,
    LinearConfig,
    LinearResult,
    Propagate,
    decide_layer,
    observe_layer,
    place_layer,
    propagate_layer,
    quantize_linears,
    swap_group,
)
from .experts import W8A8DynamicExperts
from .fallback import LayerFallback, apply_fallback, mean_kl, reference_logits
from .io import (
    artifact_model,
    export_state,
    load_quantized_model,
    quantized_linear_names,
    quantized_modules,
    read_artifact_tensors,
)
from .modules import QUANT_TYPES, QuantizedLinear, W8A8DynamicLinear, W8A8Linear
from .plan import LayerPlan, LinearGroup, linear_plan

__all__ = [
    "DEFAULT_HEADROOM_DOUBLINGS",
    "FALLBACK_CRITERIA",
    "LINEAR_MODES",
    "LayerFallback",
    "QUANT_TYPES",
    "GroupRecord",
    "LayerPlan",
    "LinearCheckpoint",
    "LinearConfig",
    "LinearGroup",
    "LinearResult",
    "Propagate",
    "QuantizedLinear",
    "W8A8DynamicExperts",
    "W8A8DynamicLinear",
    "W8A8Linear",
    "apply_fallback",
    "artifact_model",
    "calibrate_linears",
    "decide_layer",
    "export_state",
    "linear_plan",
    "load_quantized_model",
    "mean_kl",
    "observe_layer",
    "place_layer",
    "propagate_layer",
    "quantize_linears",
    "quantized_linear_names",
    "quantized_modules",
    "read_artifact_tensors",
    "reference_logits",
    "swap_group",
]


def calibrate_linears(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    config: LinearConfig,
    *,
    scan_batches: Iterable[dict[str, torch.Tensor]] = (),
    progress: Any = None,
    keep_floats: bool = True,
    checkpoint: LinearCheckpoint | None = None,
    prepare_layer: Callable[[int], None] | None = None,
    propagate: Propagate | None = None,
) -> LinearResult:
    """Rotate ``model``'s residual stream when ``config.rotate`` says so, quantize
    its linears in place on the calibration ``batches`` (layer by layer) and keep
    the most sensitive groups float as ``config.fallback`` says, measured on
    ``scan_batches`` (no scan data means no fallback): with ``config.criterion ==
    "layer"`` each layer's groups are chosen before the layer's outputs go on
    (:class:`LayerFallback`); with ``"kl"`` the scan data's float logits are taken
    first and the whole quantized model is scanned after (:func:`apply_fallback`).
    ``progress`` (a bar) advances per layer. ``keep_floats=False`` (criterion
    ``"layer"``) drops the records' module copies as each layer is placed: memory
    then does not grow with depth, and the result can no longer put groups back to
    float. ``checkpoint`` (criterion ``"layer"``: a resumable run) is restored
    before the first layer and saved after each one. ``prepare_layer(i)`` runs
    before decoder layer ``i`` is calibrated (a streamed model loads it there).
    ``propagate`` (criterion ``"layer"`` only: the ``"kl"`` scan changes layers
    after they ran) runs each finished layer on the calibration batches
    (:data:`~.engine.Propagate`; the FA pass observes there). In
    a data-parallel run (:mod:`ascend_fa.parallel`) ``batches`` are this rank's
    share; the statistics are reduced per layer (:mod:`.parallel`) and
    ``scan_batches`` must be the same on every rank."""
    rotation = None
    if config.rotate:
        # Exact in float (the reference logits below are unchanged by it); makes
        # the RMSNorm-ed inputs flat enough for one per-tensor activation scale.
        rotation = rotate_residual(model, config.seed).to_dict()
    scan = list(scan_batches) if config.fallback != 0 else []
    if config.criterion == "layer":
        chooser = None
        if scan:
            plans = linear_plan(model, mlp_dynamic=config.mlp_dynamic)
            total = sum(g.size for p in plans for g in p.groups)
            layers = [p.prefix for p in plans]
            chooser = LayerFallback(config, total, layers=layers)
        result = quantize_linears(
            model,
            batches,
            config,
            progress=progress,
            scan_batches=scan,
            choose_float=chooser,
            keep_floats=keep_floats,
            checkpoint=checkpoint,
            prepare_layer=prepare_layer,
            propagate=propagate,
        )
        if chooser is not None:
            result.layer_error = dict(chooser.errors)
        result.rotation = rotation
        return result
    if propagate is not None:
        raise ValueError(
            "calibrate_linears: propagate needs criterion 'layer' (the 'kl' scan "
            "changes layers after their outputs went on)"
        )
    reference = reference_logits(model, scan) if scan else []
    result = quantize_linears(
        model, batches, config, progress=progress, prepare_layer=prepare_layer
    )
    result.rotation = rotation
    if scan:
        apply_fallback(model, result, scan, reference)
    return result
