"""Layer-sequential W8A8 calibration: one decoder layer at a time, all samples kept.

For decoder layer ``i`` (its inputs are the outputs of layers ``0..i-1`` with their
quantized linears active, so each layer is calibrated on what the device feeds it):

1. **observe** — run the layer on every batch with its linears float; a pre-hook on
   the first linear of each group records that group's input
   (:class:`~.search.InputStats`, real tokens only: padding is excluded through the
   attention mask);
2. **decide** — per group, last group first (a group's smoothing may fold into an
   earlier group's weights: ``down`` into ``up_proj``, ``o`` into ``v_proj``), choose
   smoothing and range (:func:`~.search.decide_group`), fold the smoothing into the
   float weights, and put the quantized modules in place (``set_submodule``);
3. **propagate** — run the layer again on every batch: its outputs are the next
   layer's inputs.

Each decision reads only the layer's own statistics and weights, so a streaming
calibration runs the same steps with one layer in memory: :func:`observe_layer`,
:func:`decide_layer` and :func:`place_layer` are the three steps of one layer, and
:func:`quantize_linears` is their loop over an in-memory model. The float modules
(after smoothing) are kept in the records so :mod:`.fallback` can put a group back
to float: per layer before the propagation (``choose_float``, the layer-local
criterion), or after the loop (the whole-model KL scan).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ascend_fa import parallel
from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import moe_layout

from .experts import W8A8DynamicExperts
from .modules import ARTIFACT_DTYPES, QuantizedLinear, W8A8DynamicLinear, W8A8Linear
from .norms import fold_into_norm
from .parallel import StatsSync
from .plan import LayerPlan, LinearGroup, configured_plan
from .search import MAX_DOUBLINGS, GroupDecision, InputStats, decide_group
from .stack import layer_step
from .typed_inputs import (
    LayerInputs,
    capture_layer_inputs,
    decoder_layers,
    layer_kwargs,
)

__all__ = [
    "DEFAULT_ALPHAS",
    "DEFAULT_CLIPS",
    "DEFAULT_HEADROOM_DOUBLINGS",
    "FALLBACK_CRITERIA",
    "GroupRecord",
    "LINEAR_MODES",
    "LayerInputs",
    "LinearCheckpoint",
    "LinearConfig",
    "LinearResult",
    "Propagate",
    "capture_layer_inputs",
    "FloatChooser",
    "decide_layer",
    "observe_layer",
    "place_layer",
    "propagate_layer",
    "quantize_linears",
    "real_rows",
    "swap_group",
]

logger = logging.getLogger(__name__)

#: ``--linear`` values -> description quant type (None: linears stay float).
LINEAR_MODES = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "none": None}
DEFAULT_ALPHAS: tuple[float | None, ...] = (
    None,
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
)
DEFAULT_CLIPS: tuple[float, ...] = (
    1.0,
    0.9,
    0.8,
    0.7,
    0.6,
    0.5,
    0.4,
    0.3,
    1.25,
    1.5,
    2.0,
    3.0,
)
#: A ``down_proj``'s static range times its fold growth to this power: the range
#: extrapolated to 4x the calibration data (:mod:`~ascend_fa.linear.search`).
DEFAULT_HEADROOM_DOUBLINGS = 2.0
#: How the fallback ranks groups: ``layer`` by each group's share of its decoder
#: layer's output error (layer-local: a streaming run can decide it), ``kl`` by a
#: KL scan of whole-model logits (needs the whole model in memory).
FALLBACK_CRITERIA = ("layer", "kl")
#: Phases of :func:`quantize_linears` timed in ``LinearResult.seconds`` (besides
#: ``"quantize"``, the whole call): per layer, loading it (``prepare_layer``), the
#: observing forwards (float linears) and inside them the statistics hooks
#: (``observers``), the decisions (search, fold, quantize), the layer-local
#: fallback, the propagation through the quantized layer (calibration and scan
#: data), the resume checkpoint. The KL criterion's scan replaces ``"fallback"``.
_PHASES = (
    "prepare",
    "observe",
    "observers",
    "decide",
    "fallback",
    "propagate",
    "checkpoint",
)


@dataclass(frozen=True)
class LinearConfig:
    """How linears are quantized.

    ``quant_type`` ``"W8A8"`` / ``"W8A8_DYNAMIC"``; ``dtype`` the model dtype of the
    artifact (scales are representable in it); ``alphas`` / ``clips`` the search
    grids (``(None,)`` / ``(1.0,)``: round-to-nearest with min/max ranges);
    ``search_rows`` rows sampled per group; ``fallback`` a number of linears to keep
    float, ``"auto"`` (``max_float_fraction`` of the linears at most), or 0;
    ``criterion`` how groups are chosen (:data:`FALLBACK_CRITERIA`): ``"layer"``
    (default) keeps groups float while their decoder layer's relative output error
    on the scan data exceeds ``layer_budget``; ``"kl"`` ranks groups by a KL scan
    of whole-model logits and stops at ``budget`` mean KL (``"auto"``);
    ``scan_samples`` / ``scan_tokens`` size the scan data; ``scan_candidates``
    groups (those with the largest sample output error; 0 = all) are KL-scanned;
    ``rotate`` rotates the residual stream before quantizing
    (:mod:`ascend_fa.transforms.residual`, seeded by ``seed``; off here,
    ``calibrate --rotate auto`` turns it on for static W8A8 where the family takes
    it); ``headroom_doublings``: the static range of an MLP's gated product
    (``down_proj``) times its fold growth to this power (0: none).
    """

    quant_type: str = "W8A8"
    dtype: torch.dtype = torch.bfloat16
    alphas: tuple[float | None, ...] = DEFAULT_ALPHAS
    clips: tuple[float, ...] = DEFAULT_CLIPS
    search_rows: int = 256
    fallback: int | str = "auto"
    budget: float = 0.01
    max_float_fraction: float = 0.10
    scan_samples: int = 4
    scan_tokens: int = 256
    scan_candidates: int = 24
    seed: int = 0
    criterion: str = "layer"
    # Relative layer output error allowed before a group goes float. Measured on
    # SmolLM2 (8 x 256 calibration tokens): with static W8A8 every layer's error is
    # 0.0001-0.0022, so 0.02 never kept anything float (held-out KL 0.19 / 0.29
    # prose / code); 0.001 spends the 10 % cap (held-out KL 0.116 / 0.188).
    layer_budget: float = 0.001
    rotate: bool = False
    headroom_doublings: float = DEFAULT_HEADROOM_DOUBLINGS
    shared_dynamic: bool = True  # False: shared experts in quant_type (plan doc)
    mlp_dynamic: bool = False  # True: every group but the attention's per token

    def __post_init__(self) -> None:
        if self.quant_type not in ("W8A8", "W8A8_DYNAMIC"):
            raise InputError(
                "linear quant type must be W8A8 or W8A8_DYNAMIC, got "
                f"{self.quant_type!r}"
            )
        if self.dtype not in ARTIFACT_DTYPES:
            raise InputError(
                f"linear dtype must be bf16, fp16 or fp32, got {self.dtype}"
            )
        fb = self.fallback
        if not (
            fb == "auto"
            or (isinstance(fb, int) and not isinstance(fb, bool) and fb >= 0)
        ):
            raise InputError(
                f"--linear-fallback must be a number >= 0 or 'auto', got {fb!r}"
            )
        if not self.alphas or not self.clips:
            raise InputError("linear search grids must not be empty")
        h = self.headroom_doublings
        number = isinstance(h, (int, float)) and not isinstance(h, bool)
        if not number or not 0 <= h <= MAX_DOUBLINGS:
            raise InputError(
                f"linear headroom_doublings must be in [0, {MAX_DOUBLINGS:g}]: {h!r}"
            )
        if self.criterion not in FALLBACK_CRITERIA:
            raise InputError(
                f"--linear-fallback-criterion {self.criterion!r}; choose one of "
                f"{', '.join(FALLBACK_CRITERIA)}"
            )

    @classmethod
    def round_to_nearest(cls, quant_type: str, dtype: torch.dtype) -> LinearConfig:
        """The baseline: min/max per-tensor ranges, no smoothing, no fallback, no
        rotation, no headroom."""
        return cls(
            quant_type,
            dtype,
            alphas=(None,),
            clips=(1.0,),
            fallback=0,
            rotate=False,
            headroom_doublings=0.0,
        )


@dataclass
class GroupRecord:
    """One group's outcome: ``quant_type`` (``"FLOAT"`` after a fallback or when it
    could not be quantized, with ``reason``), the decision, and both module sets."""

    group: LinearGroup
    quant_type: str
    decision: GroupDecision | None = None
    reason: str = ""
    float_modules: dict[str, nn.Module] = field(default_factory=dict)
    quant_modules: dict[str, nn.Module] = field(default_factory=dict)
    kl_gain: float | None = None
    layer_gain: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "group": self.group.name,
            "linears": list(self.group.linears),
            "quant_type": self.quant_type,
            "reason": self.reason,
            "alpha": None if d is None else d.alpha,
            "clip": None if d is None else d.clip,
            "headroom": None if d is None else d.headroom,
            "range": None if d is None else [d.lo, d.hi],
            "sample_rel_error": None if d is None else d.rel_error,
            "kl_gain": self.kl_gain,
            "layer_gain": self.layer_gain,
        }

    def release(self) -> None:
        """Drop the module sets (a streaming run frees each layer once written)."""
        self.float_modules, self.quant_modules = {}, {}


@dataclass
class LinearResult:
    """What :func:`quantize_linears` (and the fallback) did."""

    config: LinearConfig
    records: list[GroupRecord]
    seconds: dict[str, float] = field(default_factory=dict)
    scan_kl: float | None = None
    #: layer prefix -> relative output error on the scan data (criterion "layer")
    layer_error: dict[str, float] = field(default_factory=dict)
    rotation: dict[str, Any] | None = None

    def counts(self) -> dict[str, int]:
        """Linears per description type (``W8A8`` / ``W8A8_DYNAMIC`` / ``FLOAT``)."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.quant_type] = out.get(r.quant_type, 0) + r.group.size
        return out

    @property
    def num_linears(self) -> int:
        return sum(r.group.size for r in self.records)

    @property
    def num_float(self) -> int:
        return self.counts().get("FLOAT", 0)

    def to_report(self) -> dict[str, Any]:
        return {
            "quant_type": self.config.quant_type,
            "dtype": str(self.config.dtype).removeprefix("torch."),
            "fallback": self.config.fallback,
            "counts": self.counts(),
            "criterion": self.config.criterion,
            "scan_kl": self.scan_kl,
            "layer_error": dict(self.layer_error),
            "rotation": self.rotation,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "groups": [r.to_dict() for r in self.records],
        }


def swap_group(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Put each ``name -> module`` in place (``set_submodule``)."""
    for name, module in modules.items():
        model.set_submodule(name, module)


def real_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``[..., K]`` at real tokens (``mask`` ``[B, S]``): a view
    when every token is real (no copy), else the selected rows."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] != mask.numel() or bool(mask.all()):
        return flat
    if x.shape[:-1] == mask.shape:
        return x[mask]
    return flat[mask.reshape(-1)]


def _apply_smoothing(
    model: nn.Module,
    group: LinearGroup,
    s: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> None:
    """Fold ``s`` ``[K]``: the norm weight (stored in ``dtype``, the artifact's),
    or the producing linear's output rows (and bias), divided by it; the weights'
    columns (the group's float ``readers`` too) times the factor the norm really
    divides out (``s`` itself but for rounding, :func:`~.norms.fold_into_norm`)."""
    if group.norm is not None:
        s = fold_into_norm(model.get_submodule(group.norm), s, group.norm, dtype)
    for name in (*group.linears, *group.readers):
        lin = model.get_submodule(name)
        lin.weight.data.mul_(s.to(lin.weight)[None, :])
    if group.fold is not None:
        src = model.get_submodule(group.fold)
        rows = s
        if group.tie > 1:
            rows = s.view(-1, group.tie, group.head_dim)[:, 0, :].reshape(-1)
        src.weight.data.div_(rows.to(src.weight)[:, None])
        if src.bias is not None:
            src.bias.data.div_(rows.to(src.bias))


def _quantize_group(
    model: nn.Module, group: LinearGroup, decision: GroupDecision, config: LinearConfig
) -> dict[str, QuantizedLinear]:
    out: dict[str, QuantizedLinear] = {}
    for name in group.linears:
        lin = model.get_submodule(name)
        bias = lin.bias.detach() if lin.bias is not None else None
        if group.linear_type(config.quant_type) == "W8A8":
            q: QuantizedLinear = W8A8Linear.from_float(
                lin.weight,
                bias,
                decision.lo,
                decision.hi,
                dtype=config.dtype,
                name=name,
            )
        else:
            q = W8A8DynamicLinear.from_float(
                lin.weight, bias, dtype=config.dtype, name=name
            )
        out[name] = q.to(lin.weight.device)
    return out


@torch.no_grad()
def observe_layer(
    model: nn.Module,
    plan: LayerPlan,
    layer: nn.Module,
    inputs: Iterable[LayerInputs],
    config: LinearConfig,
    *,
    reduce: Callable[[dict[str, InputStats]], None] | None = None,
    sync: StatsSync | None = None,
    seconds: dict[str, float] | None = None,
) -> dict[str, InputStats]:
    """Step 1 of one layer: run ``layer`` (float linears) on every batch of
    ``inputs`` and record each group's input (real tokens only). ``reduce`` (a
    data-parallel run) makes every rank's statistics those of all ranks' data;
    ``sync`` does it exactly for this rank's share of the batches: a counting
    forward first (how many rows each update of each group gets, so every rank
    draws its random picks where one process would), then the observing forward,
    then the union of all ranks' statistics in global batch order. ``seconds``
    (if given) gets the time spent inside the statistics hooks added to its
    ``"observers"`` entry."""
    inputs = list(inputs)
    spent = [0.0]
    # counted before the observing hooks exist (they would see this forward)
    counts = _count_rows(model, plan, layer, inputs) if sync is not None else {}
    stats: dict[str, InputStats] = {}
    current: dict[str, torch.Tensor] = {}
    handles = []
    for gi, group in enumerate(plan.groups):
        first = model.get_submodule(group.linears[0])
        st = InputStats(
            first.in_features, rows=config.search_rows, seed=config.seed + gi
        )
        stats[group.name] = st

        def hook(
            _m: nn.Module,
            args: tuple,
            st: InputStats = st,
            current: dict[str, torch.Tensor] = current,
        ) -> None:
            t = time.perf_counter()
            st.update(real_rows(args[0], current["mask"]))
            spent[0] += time.perf_counter() - t

        handles.append(first.register_forward_pre_hook(hook))
    if sync is not None:
        sync.before(stats, counts)
    try:
        for hidden, kwargs, mask in inputs:
            current["mask"] = mask
            layer(hidden, **layer_kwargs(layer, kwargs))
    finally:
        for h in handles:
            h.remove()
    if sync is not None:
        sync.after(stats)
    if reduce is not None:
        reduce(stats)
    if seconds is not None:
        seconds["observers"] = seconds.get("observers", 0.0) + spent[0]
    return stats


def _count_rows(
    model: nn.Module, plan: LayerPlan, layer: nn.Module, inputs: list[LayerInputs]
) -> dict[str, list[int]]:
    """Per group, the real-token rows of each update :func:`observe_layer` makes
    on ``inputs`` (one forward of ``layer``, nothing recorded)."""
    counts: dict[str, list[int]] = {g.name: [] for g in plan.groups}
    current: dict[str, torch.Tensor] = {}
    handles = []
    for group in plan.groups:
        first = model.get_submodule(group.linears[0])

        def hook(
            _m: nn.Module, args: tuple, rows: list[int] = counts[group.name]
        ) -> None:
            rows.append(int(real_rows(args[0], current["mask"]).shape[0]))

        handles.append(first.register_forward_pre_hook(hook))
    try:
        for hidden, kwargs, mask in inputs:
            current["mask"] = mask
            layer(hidden, **layer_kwargs(layer, kwargs))
    finally:
        for h in handles:
            h.remove()
    return counts


@torch.no_grad()
def decide_layer(
    model: nn.Module,
    plan: LayerPlan,
    stats: dict[str, InputStats],
    config: LinearConfig,
) -> list[GroupRecord]:
    """Step 2 of one layer: per group, last group first, choose smoothing and
    range, fold the smoothing into the float weights and build the quantized
    modules (not put in place yet). Returns the records in plan order."""
    layer_records = []
    for group in reversed(plan.groups):
        dynamic = group.linear_type(config.quant_type) == "W8A8_DYNAMIC"
        weight = torch.cat(
            [model.get_submodule(n).weight.detach() for n in group.linears]
        )
        decision = decide_group(
            weight,
            stats[group.name],
            dynamic=dynamic,
            dtype=config.dtype,
            alphas=config.alphas if group.smoothable else (None,),
            clips=config.clips,
            tie=group.tie,
            head_dim=group.head_dim,
            doublings=config.headroom_doublings if group.gated_input else 0.0,
        )
        if decision.smooth is not None:
            _apply_smoothing(model, group, decision.smooth, config.dtype)
        floats = {n: model.get_submodule(n) for n in group.linears}
        record = GroupRecord(
            group, group.linear_type(config.quant_type), decision, float_modules=floats
        )
        try:
            record.quant_modules = dict(_quantize_group(model, group, decision, config))
        except UnsupportedError as exc:
            record.quant_type, record.reason = "FLOAT", str(exc)
            logger.warning("keeping %s float: %s", group.name, exc)
        layer_records.append(record)
    return list(reversed(layer_records))


def _experts_record(
    model: nn.Module, group: LinearGroup, config: LinearConfig
) -> GroupRecord:
    """The routed experts of one layer as W8A8_DYNAMIC (:mod:`.experts`)."""
    name = group.linears[0]
    float_mod = model.get_submodule(name)
    layout = moe_layout(getattr(model.config, "model_type", None))
    quant = W8A8DynamicExperts.from_float(
        float_mod, dtype=config.dtype, name=name, layout=layout
    )
    params = list(float_mod.parameters())
    quant = quant.to(params[0].device if params else "cpu")
    return GroupRecord(
        group,
        "W8A8_DYNAMIC",
        float_modules={name: float_mod},
        quant_modules={name: quant},
    )


def place_layer(model: nn.Module, records: Iterable[GroupRecord]) -> None:
    """Step 3 of one layer: put every quantized group in place (the float modules
    of ``"FLOAT"`` groups stay). Done only after every decision of the layer: a
    fold changes an earlier group's float weights, which its own quantization
    must see."""
    for record in records:
        if record.quant_type != "FLOAT":
            swap_group(model, record.quant_modules)


#: ``choose_float(model, layer, records, scan inputs)``: marks groups of one layer
#: ``"FLOAT"`` before they are put in place (the layer-local fallback).
FloatChooser = Callable[
    [nn.Module, nn.Module, list[GroupRecord], list[LayerInputs]], None
]


class LinearCheckpoint(Protocol):
    """What a resumable run plugs into :func:`quantize_linears` (the state of the
    layer-local fallback ``choose_float`` included)."""

    def restore_linears(
        self,
        model: nn.Module,
        plans: list[LayerPlan],
        inputs: list[LayerInputs],
        scan: list[LayerInputs],
        choose_float: FloatChooser | None,
    ) -> tuple[int, list[GroupRecord]]:
        """Put back the finished layers (their modules, the fallback's state) and
        the carried activations; returns (first layer to run, their records)."""
        ...

    def save_linears(
        self,
        layer: int,
        records: list[GroupRecord],
        inputs: list[LayerInputs],
        scan: list[LayerInputs],
        choose_float: FloatChooser | None,
    ) -> None:
        """Persist layer ``layer`` (placed, propagated)."""
        ...


def propagate_layer(
    layer: nn.Module,
    inputs: list[LayerInputs],
    scope: Callable[[torch.Tensor], AbstractContextManager[Any]] | None = None,
) -> None:
    """Run ``layer`` on every batch of ``inputs`` and put its outputs there (the
    next layer's inputs); ``scope(token mask)`` (if given) is entered around each
    batch's call (e.g. the padding mask the FA points read)."""
    for i, (hidden, kwargs, mask) in enumerate(inputs):
        with scope(mask) if scope is not None else contextlib.nullcontext():
            out = layer(hidden, **layer_kwargs(layer, kwargs))
        out, kwargs = layer_step(out, kwargs)
        inputs[i] = (out.detach(), kwargs, mask)


#: ``propagate(index, layer, inputs)``: what runs decoder layer ``index`` (its
#: groups in place) on the calibration ``inputs``, as :func:`propagate_layer` does
#: (the FA pass observes there when it rides on the linear pass).
Propagate = Callable[[int, nn.Module, list[LayerInputs]], None]


@torch.no_grad()
def quantize_linears(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    config: LinearConfig,
    *,
    progress: Any = None,
    scan_batches: Iterable[dict[str, torch.Tensor]] = (),
    choose_float: FloatChooser | None = None,
    keep_floats: bool = True,
    checkpoint: LinearCheckpoint | None = None,
    prepare_layer: Callable[[int], None] | None = None,
    propagate: Propagate | None = None,
) -> LinearResult:
    """Quantize every planned linear of ``model`` in place, layer by layer (see the
    module doc). ``batches``: tokenized calibration batches (``input_ids``,
    ``attention_mask``, ``position_ids``). With ``choose_float`` the
    ``scan_batches`` are carried through the layers too and ``choose_float`` picks
    each layer's float groups on them before the layer's outputs are computed.
    ``progress`` (a bar) advances per layer. ``keep_floats=False`` drops each
    layer's module sets from its records once the layer is placed (nothing after
    the loop puts a group back to float; memory then does not grow with depth).
    ``checkpoint`` (a resumable run) is restored before the first layer and saved
    after each one.
    ``prepare_layer(i)`` runs before decoder layer ``i`` is calibrated.
    ``propagate`` replaces :func:`propagate_layer` for the calibration inputs
    (each layer's outputs once its groups are placed; the scan data always goes
    through :func:`propagate_layer`). In a data-parallel run ``batches`` are
    this rank's share (possibly none) and each layer's statistics are reduced
    exactly (:class:`~.parallel.StatsSync`).
    """
    t0 = time.perf_counter()
    plans = configured_plan(model, config)
    done = [
        n
        for p in plans
        for g in p.groups
        for n in g.linears
        if isinstance(model.get_submodule(n), QuantizedLinear)
    ]
    if done:
        raise InputError(f"{done[0]} is already quantized; start from the float model")
    layers = decoder_layers(model)
    batches = list(batches)
    sync = StatsSync() if parallel.is_active() else None
    if not batches and sync is None:
        raise InputError("no calibration batches for the linear calibration")
    inputs = capture_layer_inputs(model, layers[0], batches) if batches else []
    scan = (
        capture_layer_inputs(model, layers[0], scan_batches)
        if choose_float is not None
        else []
    )
    records: list[GroupRecord] = []
    start = 0
    if checkpoint is not None:
        start, records = checkpoint.restore_linears(
            model, plans, inputs, scan, choose_float
        )
        if progress is not None and start and hasattr(progress, "restart"):
            progress.restart(start)
    # Where the time goes: LinearResult.seconds (see _PHASES).
    seconds = dict.fromkeys(_PHASES, 0.0)
    last = [time.perf_counter()]

    def lap(phase: str) -> None:
        now = time.perf_counter()
        seconds[phase] += now - last[0]
        last[0] = now

    for plan in plans:
        if plan.index < start:
            continue
        layer = layers[plan.index]
        if prepare_layer is not None:
            prepare_layer(plan.index)
        lap("prepare")
        stats = observe_layer(
            model, plan, layer, inputs, config, sync=sync, seconds=seconds
        )
        lap("observe")
        layer_records = decide_layer(model, plan, stats, config)
        lap("decide")
        if scan and choose_float is not None:
            choose_float(model, layer, layer_records, scan)
        lap("fallback")
        if plan.experts is not None:
            # Per token under either --linear (msModelSlim's MoE recipes); not
            # a fallback candidate: no activation range to choose, and the cap
            # counts the checkpoint's linears (3 per expert).
            layer_records.append(_experts_record(model, plan.experts, config))
        place_layer(model, layer_records)
        if not keep_floats:
            for record in layer_records:
                record.release()
        records += layer_records
        if propagate is not None:
            propagate(plan.index, layer, inputs)
        else:
            propagate_layer(layer, inputs)
        if scan:
            propagate_layer(layer, scan)
        lap("propagate")
        if checkpoint is not None:
            checkpoint.save_linears(
                plan.index, layer_records, inputs, scan, choose_float
            )
        lap("checkpoint")
        if progress is not None:
            progress.update(1)
    seconds["quantize"] = time.perf_counter() - t0
    return LinearResult(config, records, seconds)
