"""Quantized linears: W8A8 and W8A8_DYNAMIC, calibrated here, exact integer emulation.

==================  ============================================================
module              holds
==================  ============================================================
:mod:`.modules`     :class:`W8A8Linear`, :class:`W8A8DynamicLinear` (the
                    ``QuantizedLinear`` protocol: ``quant_type``,
                    ``export_tensors(prefix)``, exact integer ``forward``)
:mod:`.plan`        which linears, grouped by shared input, where smoothing folds
:mod:`.search`      input statistics; smoothing strength and range per group
:mod:`.engine`      the layer-sequential calibration (:func:`quantize_linears`)
:mod:`.fallback`    the KL scan and ``--linear-fallback N | auto``
:mod:`.io`          export to checkpoint tensors; load back from an artifact
==================  ============================================================

:func:`calibrate_linears` is the one call the ``calibrate`` verb makes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ascend_fa.transforms.residual import rotate_residual

from .engine import (
    LINEAR_MODES,
    GroupRecord,
    LinearConfig,
    LinearResult,
    quantize_linears,
    swap_group,
)
from .fallback import apply_fallback, mean_kl, reference_logits
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
    "LINEAR_MODES",
    "QUANT_TYPES",
    "GroupRecord",
    "LayerPlan",
    "LinearConfig",
    "LinearGroup",
    "LinearResult",
    "QuantizedLinear",
    "W8A8DynamicLinear",
    "W8A8Linear",
    "apply_fallback",
    "artifact_model",
    "calibrate_linears",
    "export_state",
    "linear_plan",
    "load_quantized_model",
    "mean_kl",
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
) -> LinearResult:
    """Rotate ``model``'s residual stream when ``config.rotate`` says so, quantize
    its linears in place on the calibration ``batches`` (layer by layer), then keep
    the most sensitive groups float as ``config.fallback`` says, measured on
    ``scan_batches`` (their float logits are taken first; no scan data means no
    fallback). ``progress`` (a bar) advances per layer."""
    rotation = None
    if config.rotate:
        # Exact in float (the reference logits below are unchanged by it); makes
        # the RMSNorm-ed inputs flat enough for one per-tensor activation scale.
        rotation = rotate_residual(model, config.seed).to_dict()
    scan = list(scan_batches) if config.fallback != 0 else []
    reference = reference_logits(model, scan) if scan else []
    result = quantize_linears(model, batches, config, progress=progress)
    result.rotation = rotation
    if scan:
        apply_fallback(model, result, scan, reference)
    return result
