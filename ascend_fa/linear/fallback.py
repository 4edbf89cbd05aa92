"""Keep the most sensitive linear groups float, ranked by a measured KL scan.

The scan data are a few calibration samples; the groups scanned are the
``scan_candidates`` with the largest layer-local output error (all when 0). The
reference is the float model's next-token distribution on the scan data (taken
before any linear is quantized). With every
group quantized, each group in turn is put back to float and the mean per-token
``KL(float || quantized)`` is measured; the group's **gain** is how much KL that
removes. Groups are kept float in order of gain:

* ``fallback = N`` — groups while the number of float linears stays ``<= N``;
* ``fallback = "auto"`` — groups until the measured KL of the whole quantized model
  is at most ``budget``, never more than ``max_float_fraction`` of the linears.

This criterion needs whole-model logits; it is the one decision of the W8A8
calibration that is not layer-local.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from ascend_fa.metrics import token_kl

from .engine import GroupRecord, LinearResult, swap_group

__all__ = ["apply_fallback", "mean_kl", "reference_logits"]


@torch.no_grad()
def reference_logits(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """Logits ``[B, S, V]`` (fp32, CPU) of ``model`` on each batch."""
    return [model(**b, use_cache=False).logits.float().cpu() for b in batches]


@torch.no_grad()
def mean_kl(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    reference: list[torch.Tensor],
) -> float:
    """Mean per-token ``KL(reference || model)`` over the real tokens of
    ``batches``."""
    total, count = 0.0, 0
    for batch, ref in zip(batches, reference, strict=True):
        logits = model(**batch, use_cache=False).logits.float().cpu()
        mask = batch.get("attention_mask")
        kl, _, n = token_kl(ref, logits, None if mask is None else mask.cpu())
        total += kl
        count += n
    return total / count if count else 0.0


def _to_float(model: nn.Module, record: GroupRecord) -> None:
    swap_group(model, record.float_modules)


def _to_quant(model: nn.Module, record: GroupRecord) -> None:
    swap_group(model, record.quant_modules)


@torch.no_grad()
def apply_fallback(
    model: nn.Module,
    result: LinearResult,
    batches: list[dict[str, torch.Tensor]],
    reference: list[torch.Tensor],
) -> LinearResult:
    """Rank the quantized groups by KL gain and put the chosen ones back to float
    (see the module doc); updates and returns ``result``."""
    config = result.config
    t0 = time.perf_counter()
    live = [r for r in result.records if r.quant_type != "FLOAT"]
    if config.fallback == 0 or not live:
        return result
    if config.scan_candidates:
        # Preselect by the layer-local output error (cheap, already measured).
        live = sorted(
            live, key=lambda r: -(r.decision.rel_error if r.decision else 0.0)
        )[: config.scan_candidates]
    base = mean_kl(model, batches, reference)
    for record in live:
        _to_float(model, record)
        record.kl_gain = base - mean_kl(model, batches, reference)
        _to_quant(model, record)
    ranked = sorted(live, key=lambda r: -(r.kl_gain or 0.0))
    if config.fallback == "auto":
        cap = int(config.max_float_fraction * result.num_linears)
    else:
        cap = int(config.fallback)
    floats = start = result.num_float
    kl = base
    for record in ranked:
        if config.fallback == "auto" and kl <= config.budget:
            break
        n = len(record.group.linears)
        if floats + n > cap or (record.kl_gain or 0.0) <= 0:
            continue
        _to_float(model, record)
        record.quant_type = "FLOAT"
        record.reason = f"fallback: KL gain {record.kl_gain:.5f} on the scan data"
        floats += n
        if config.fallback == "auto":
            kl = mean_kl(model, batches, reference)
    if config.fallback != "auto" and floats > start:
        kl = mean_kl(model, batches, reference)
    result.scan_kl = kl
    result.seconds["fallback"] = time.perf_counter() - t0
    return result
