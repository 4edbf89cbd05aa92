"""Keep the most sensitive linear groups float, by one of two criteria.

**layer** (the default, :class:`LayerFallback`): layer-local, so a streaming
calibration holding one decoder layer decides exactly what the whole-model path
decides. On the scan data (a few calibration samples carried through the layers
like the calibration data), with the layer's groups smoothed and quantized, the
layer's **relative output error** is ``E = Σ ||y_q - y_f||² / Σ ||y_f - x||²``
over real tokens: ``x`` the layer's input, ``y_f`` its output with every group
float (after smoothing, exact in float), ``y_q`` with the groups quantized. It is
the error of what the layer adds to the residual stream, relative to what it adds,
so it compares across layers and models. Each group's **gain** is how much ``E``
drops when that group alone is float. While ``E > layer_budget`` the group with
the largest positive gain per linear (the cap counts linears: q/k/v costs three,
down_proj one) is kept float (and ``E`` measured again), as long as
the float linears of the whole model stay within the cap: ``fallback = N`` at most
``N`` linears, ``"auto"`` at most ``max_float_fraction`` of them. Layers are
decided in order and a layer cannot see the ones after it, so the cap is spent pro
rata over depth: after the ``i``-th of ``L`` layers at most ``ceil(cap · i / L)``
linears are float, and a share a layer does not need passes on to the next. With
the whole cap open to the first layers, SmolLM2's layers 0-14 took all 21 float
linears while layers 15-28, whose errors were 2-8x larger, kept none.

**kl** (an explicit option, :func:`apply_fallback`): needs whole-model logits, so
only the whole-model path can run it. The scan data are a few calibration
samples; the groups scanned are the ``scan_candidates`` with the largest sample
output error (all when 0). The reference is the float model's next-token
distribution on the scan data (taken before any linear is quantized). With every
group quantized, each group in turn is put back to float and the mean per-token
``KL(float || quantized)`` is measured; the group's gain is how much KL that
removes. Groups are kept float in order of gain: ``fallback = N`` while the number
of float linears stays ``<= N``; ``"auto"`` until the measured KL of the whole
quantized model is at most ``budget``, never more than ``max_float_fraction`` of
the linears.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ascend_fa.metrics import token_kl

from .engine import GroupRecord, LayerInputs, LinearConfig, LinearResult, swap_group
from .layer_inputs import layer_kwargs

__all__ = [
    "LayerFallback",
    "apply_fallback",
    "float_cap",
    "layer_error",
    "mean_kl",
    "reference_logits",
]


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
    # the routed experts are no candidate (see quantize_linears)
    live = [
        r
        for r in result.records
        if r.quant_type != "FLOAT" and r.group.kind != "experts"
    ]
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
        planned = sum(r.group.size for r in result.records if r.group.kind != "experts")
        cap = int(config.max_float_fraction * planned)
    else:
        cap = int(config.fallback)
    floats = start = result.num_float
    kl = base
    for record in ranked:
        if config.fallback == "auto" and kl <= config.budget:
            break
        n = record.group.size
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


def float_cap(config: LinearConfig, num_linears: int) -> int:
    """Most linears the fallback may keep float: ``N`` or, for ``"auto"``,
    ``max_float_fraction`` of ``num_linears``."""
    if config.fallback == "auto":
        return int(config.max_float_fraction * num_linears)
    return int(config.fallback)


def _layer_outputs(layer: nn.Module, scan: Sequence[LayerInputs]) -> list[torch.Tensor]:
    outs = []
    for hidden, kwargs, _mask in scan:
        out = layer(hidden, **layer_kwargs(layer, kwargs))
        outs.append((out[0] if isinstance(out, tuple) else out).detach())
    return outs


def layer_error(
    scan: Sequence[LayerInputs],
    ref: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
) -> float:
    """``Σ ||out - ref||² / Σ ||ref - x||²`` over the real tokens of ``scan``
    (``x`` the layer inputs), summed in float64; 0 when the layer adds nothing."""
    num = den = 0.0
    for (hidden, _kwargs, mask), r, o in zip(scan, ref, outs, strict=True):
        m = mask.to(r.device)
        r64 = r[m].double()
        num += float((o[m].double() - r64).square().sum())
        den += float((r64 - hidden[m].double()).square().sum())
    return num / den if den > 0 else 0.0


class LayerFallback:
    """The layer-local criterion (see the module doc), one decoder layer per call.

    ``num_linears`` is the number of planned linears of the whole model (it sizes
    the ``"auto"`` cap); ``floats`` counts the linears kept float so far (a resumed
    run starts from the count of the layers already done). ``errors`` records each
    layer's final relative output error, keyed by its first group's layer prefix.
    """

    def __init__(
        self,
        config: LinearConfig,
        num_linears: int,
        floats: int = 0,
        layers: Sequence[str] = (),
    ):
        self.config = config
        self.cap = float_cap(config, num_linears)
        self.floats = floats
        self.errors: dict[str, float] = {}
        #: the decoder layers' prefixes in order (sizes the pro-rata share; none:
        #: the whole cap is open to every layer)
        self.layers = list(layers)

    def allowance(self, group: str) -> int:
        """How many linears may be float once the layer of ``group`` (a group
        name) is decided: its pro-rata share of the cap (see the module doc)."""
        done = next(
            (i + 1 for i, p in enumerate(self.layers) if group.startswith(p + ".")),
            None,
        )
        if done is None:
            return self.cap
        return min(self.cap, -(-self.cap * done // len(self.layers)))

    @torch.no_grad()
    def __call__(
        self,
        model: nn.Module,
        layer: nn.Module,
        records: list[GroupRecord],
        scan: list[LayerInputs],
    ) -> list[str]:
        """Mark the chosen groups of ``layer`` ``"FLOAT"`` (before they are put in
        place); returns their names. ``scan``: the layer's scan inputs."""
        live = [r for r in records if r.quant_type != "FLOAT"]
        if not scan or not live:
            return []
        for r in records:
            swap_group(model, r.float_modules)
        ref = _layer_outputs(layer, scan)

        def error(floats: set[int]) -> float:
            for i, r in enumerate(live):
                swap_group(model, r.float_modules if i in floats else r.quant_modules)
            return layer_error(scan, ref, _layer_outputs(layer, scan))

        allowed = self.allowance(records[0].group.name)
        chosen: set[int] = set()
        err = error(chosen)
        for i, r in enumerate(live):
            r.layer_gain = err - error({i})
        # The cap counts linears, so the greedy choice is the gain per linear kept
        # float: a single down_proj that removes as much error as the three q/k/v
        # linears is the better spend (on SmolLM2, static down_proj inputs hold
        # nearly all of the static W8A8 error, spread over every layer).
        order = sorted(
            range(len(live)),
            key=lambda i: -(live[i].layer_gain or 0.0) / live[i].group.size,
        )
        for i in order:
            if err <= self.config.layer_budget:
                break
            r = live[i]
            n = r.group.size
            if self.floats + n > allowed or (r.layer_gain or 0.0) <= 0:
                continue
            chosen.add(i)
            self.floats += n
            r.quant_type = "FLOAT"
            r.reason = (
                f"fallback: layer output error {err:.5f} > budget "
                f"{self.config.layer_budget}; group gain {r.layer_gain:.5f}"
            )
            err = error(chosen)
        for r in records:  # leave the layer float; place_layer swaps what stays
            swap_group(model, r.float_modules)
        self.errors[records[0].group.name.rsplit(".", 2)[0]] = err
        return [live[i].group.name for i in sorted(chosen)]
