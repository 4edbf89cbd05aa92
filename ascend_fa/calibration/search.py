"""Clip search: per-head static INT8 scales chosen by the attention-output error.

Fixed-ratio methods (recall window, ``|x|`` quantile, min/max) pick each head's
range from that activation's own distribution, blind to what the error does
downstream: clipping one rare large K value can move a whole softmax row, while a
coarse step on a head whose values are all small costs little. The clip search
starts from any such method's scales and then chooses, for each head, the
multiplier of its starting scale that minimises the error of the *attention output*
on a small retained part of the calibration data.

The result is deployable as is: only the static per-head scales change (exported
``fa_{q,k,v}.scale`` ``[H, 1]``); nothing is asked of the Ascend runtime that the
seed method does not ask.

Algorithm, per attention layer (GQA/MHA, FAQuant):

1. During the calibration forwards keep the real (non-padding) tokens of the first
   ``rows`` rows, at most ``tokens`` each, of Q ``[H, n, D]``, K, V ``[Hkv, n, D]``
   (:class:`SampleKeeper`; memory ``rows · tokens · (H + 2 Hkv) · D`` fp32 per layer).
2. Reference ``O = softmax(Q Kᵀ · scaling + causal) V`` in fp32 on those rows.
3. Coordinate descent over the branches q, k, v (``rounds`` times): for every grid
   multiplier ``g`` set that branch's scales to ``start · g`` for all heads at once,
   fake-quantize Q, K, V and measure the squared error of ``O`` per query head
   (after that head's slice of ``o_proj`` when the module has one, so that the
   error is scored in the space the next layer reads).
   The error is separable: query head ``h`` depends only on q head ``h`` and on KV
   head ``h // group``, so one evaluation per grid point scores every head, and the
   KV branches sum their group's errors. Each head takes the best multiplier only
   if it is strictly better than its current one, so the objective never rises
   above the starting point.

Caveat, measured: the search fits the retained rows, so it follows the domain of
the calibration data. On SmolLM2 with the packaged calibration set (mostly prose
and dialogue) it gave the best static attention-output cosine on held-out prose
and a worse one than the seed on held-out code; calibrate on text like the
deployment's when using it (``ascend-fa eval --compare-methods`` shows both).

``objective="tensor_mse"`` is the cheaper classic: per head and branch, the
multiplier minimising ``||fq(x) - x||²`` of that tensor alone.

======================  =====================================================
function                what it does
======================  =====================================================
:func:`fake_quant`      per-head symmetric INT8 quant -> dequant in fp32
:func:`attention_core`  causal GQA attention of retained rows ``[H, n, D]``
:func:`search_layer`    the search for one layer -> scales + objective values
:func:`search_scales`   the search over every layer of a model
:func:`calibrate_with_search`  drop-in for ``pipeline.calibrate_model``
======================  =====================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascend_fa.adapters.hf import find_fa_modules
from ascend_fa.adapters.placeholder import FA_BRANCHES
from ascend_fa.atb_ops import fake_quant_per_head
from ascend_fa.atb_ops.constants import INT8_MAX, SCALE_EPS

from .pipeline import CalibratedModel, calibrate_model, progress_bar
from .processor import FA3FakeQuant, FA3Observer

__all__ = [
    "OBJECTIVES",
    "DEFAULT_GRID",
    "SearchConfig",
    "SampleKeeper",
    "LayerSearch",
    "fake_quant",
    "attention_core",
    "layer_objective",
    "search_layer",
    "search_scales",
    "KeepingObserver",
    "calibrate_with_search",
]

OBJECTIVES = ("attention", "tensor_mse")

#: Multipliers of the starting scale. Below 1 trades clipping for a finer step;
#: above 1 undoes clipping that hurt (the start already clips 0.01 % of Q and K).
DEFAULT_GRID = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5)


@dataclass(frozen=True)
class SearchConfig:
    """Settings of the clip search.

    ``rows`` calibration rows of at most ``tokens`` real tokens each are kept per
    layer; ``grid`` holds multipliers of the starting scale (1.0 is added when
    absent so the start is always a candidate); ``rounds`` passes of coordinate
    descent over q, k, v.
    """

    objective: str = "attention"
    grid: tuple[float, ...] = DEFAULT_GRID
    rounds: int = 1
    rows: int = 4
    tokens: int = 256

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"SearchConfig: unknown objective {self.objective!r}; expected one "
                f"of {OBJECTIVES}"
            )
        grid = tuple(float(g) for g in self.grid)
        if not grid or not all(math.isfinite(g) and g > 0 for g in grid):
            raise ValueError(
                f"SearchConfig: grid must be non-empty finite multipliers > 0, got "
                f"{self.grid!r}"
            )
        if 1.0 not in grid:
            grid = grid + (1.0,)
        object.__setattr__(self, "grid", tuple(sorted(set(grid))))
        for name in ("rounds", "rows", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SearchConfig: {name} must be a positive int, got {value!r}"
                )


def fake_quant(x: torch.Tensor, scale: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """``clamp(round_half_even(x / scale), -128, 127) * scale`` in fp32, ``x``
    ``[..., H, ...]`` with ``scale`` ``[H]`` along ``axis`` (heads first here):
    :func:`~ascend_fa.atb_ops.fake_quant_per_head`."""
    return fake_quant_per_head(x, scale, axis)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of one row: ``q`` ``[H, n, D]``, ``k``/``v`` ``[Hkv, n, D]``
    (``H`` a multiple of ``Hkv``) -> ``[H, n, D]`` fp32.

    ``sliding_window`` (tokens a query may look back, itself included) restricts the
    causal mask as transformers' sliding-window layers do.
    """
    mask = None
    causal = True
    if sliding_window is not None and sliding_window < q.shape[1]:
        i = torch.arange(q.shape[1], device=q.device)
        d = i[:, None] - i[None, :]
        mask = (d >= 0) & (d < sliding_window)
        causal = False
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0).float(),
        k.unsqueeze(0).float(),
        v.unsqueeze(0).float(),
        attn_mask=mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.squeeze(0)


class SampleKeeper:
    """Keeps the real tokens of the first ``rows`` rows seen, ``tokens`` at most each.

    :meth:`add` takes ``x`` ``[B, H, S, D]`` and ``token_mask`` ``[B, S]`` bool or
    None; the kept rows are ``[H, n, D]`` fp32 on the CPU. Rows keep their order, so
    the q, k and v keepers of one layer hold matching rows.
    """

    def __init__(self, rows: int, tokens: int) -> None:
        self.max_rows = rows
        self.tokens = tokens
        self.rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        if x.dim() != 4:
            raise ValueError(
                f"SampleKeeper: x must be [B, H, S, D], got shape {tuple(x.shape)}"
            )
        for b in range(x.shape[0]):
            if len(self.rows) >= self.max_rows:
                return
            row = x[b]
            if token_mask is not None:
                row = row[:, token_mask[b].to(row.device)]
            self.rows.append(row[:, : self.tokens].detach().float().cpu().clone())


@dataclass
class LayerSearch:
    """Outcome of :func:`search_layer`: the chosen ``scales`` (branch -> ``[H]``),
    the chosen ``multipliers`` of the start, and the objective (summed squared error)
    at the start and at the end (``final <= start`` always)."""

    scales: dict[str, torch.Tensor]
    multipliers: dict[str, torch.Tensor]
    start_objective: float
    final_objective: float
    extra: dict[str, Any] = field(default_factory=dict)


Rows = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _check_rows(rows: Rows, start: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    if not rows:
        raise ValueError("search_layer: no retained rows to search on")
    for branch in FA_BRANCHES:
        if branch not in start:
            raise ValueError(f"search_layer: start scales miss {branch!r}")
    h, hkv = start["fa_q"].shape[0], start["fa_k"].shape[0]
    if start["fa_v"].shape[0] != hkv or h % hkv:
        raise ValueError(
            f"search_layer: {h} query heads and {hkv}/{start['fa_v'].shape[0]} "
            "k/v heads are not a GQA layout"
        )
    for i, (q, k, v) in enumerate(rows):
        if q.shape[0] != h or k.shape[0] != hkv or v.shape[0] != hkv:
            raise ValueError(
                f"search_layer: row {i} has q/k/v heads {q.shape[0]}/{k.shape[0]}/"
                f"{v.shape[0]}, start scales have {h}/{hkv}/{hkv}"
            )
    return h, hkv


def _attention_errors(
    rows: Rows,
    refs: list[torch.Tensor],
    scales: Mapping[str, torch.Tensor],
    scaling: float,
    sliding_window: int | None,
    out_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared attention-output error per query head ``[H]`` (float64).

    With ``out_proj`` ``[hidden, H, D]`` each head's error ``[n, D]`` is measured
    after its slice of the output projection (what the next layer sees); the
    cross terms between heads are left out so that heads stay separable.
    """
    total = None
    for (q, k, v), ref in zip(rows, refs, strict=True):
        out = attention_core(
            fake_quant(q, scales["fa_q"]),
            fake_quant(k, scales["fa_k"]),
            fake_quant(v, scales["fa_v"]),
            scaling,
            sliding_window,
        )
        diff = out - ref
        if out_proj is not None:
            diff = torch.einsum("hnd,ohd->hno", diff, out_proj)
        err = diff.double().pow(2).sum(dim=(1, 2))
        total = err if total is None else total + err
    assert total is not None
    return total


def layer_objective(
    rows: Rows,
    scales: Mapping[str, torch.Tensor],
    scaling: float,
    *,
    objective: str = "attention",
    sliding_window: int | None = None,
    out_proj: torch.Tensor | None = None,
) -> float:
    """The search objective of one layer at ``scales`` (summed squared error):
    attention output vs float for ``"attention"`` (after ``out_proj`` ``[hidden,
    H * D]`` when given), each of Q, K, V vs its float self for ``"tensor_mse"``."""
    if objective == "attention":
        refs = [attention_core(q, k, v, scaling, sliding_window) for q, k, v in rows]
        w = _split_heads(out_proj, rows)
        return float(
            _attention_errors(rows, refs, scales, scaling, sliding_window, w).sum()
        )
    total = 0.0
    for i, branch in enumerate(FA_BRANCHES):
        for row in rows:
            x = row[i]
            total += float((fake_quant(x, scales[branch]) - x).double().pow(2).sum())
    return total


def _split_heads(out_proj: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """``[hidden, H * D]`` -> ``[hidden, H, D]`` fp32 (None stays None)."""
    if out_proj is None:
        return None
    h, _, d = rows[0][0].shape
    if out_proj.dim() != 2 or out_proj.shape[1] != h * d:
        raise ValueError(
            f"search_layer: out_proj must be [hidden, H * D] = [*, {h * d}], got "
            f"shape {tuple(out_proj.shape)}"
        )
    return out_proj.detach().float().cpu().view(out_proj.shape[0], h, d)


@torch.no_grad()
def search_layer(
    rows: Rows,
    start: Mapping[str, torch.Tensor],
    scaling: float,
    config: SearchConfig | None = None,
    *,
    sliding_window: int | None = None,
    out_proj: torch.Tensor | None = None,
) -> LayerSearch:
    """Search one layer's per-head scales.

    ``rows``: retained ``(q [H, n, D], k [Hkv, n, D], v [Hkv, n, D])`` per calibration
    row; ``start``: ``{"fa_q": [H], "fa_k": [Hkv], "fa_v": [Hkv]}`` starting scales;
    ``scaling``: the softmax scale of the layer (``D ** -0.5`` for LLaMA);
    ``out_proj``: the layer's output projection weight ``[hidden, H * D]``, to
    score the error where the model uses it (optional).
    """
    config = config or SearchConfig()
    h, hkv = _check_rows(rows, start)
    w = _split_heads(out_proj, rows)
    group = h // hkv
    start = {b: start[b].detach().float().cpu().clamp(min=SCALE_EPS) for b in start}
    grid = torch.tensor(config.grid, dtype=torch.float32)
    mult = {b: torch.ones_like(start[b]) for b in FA_BRANCHES}

    def scales_for(m: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {b: (start[b] * m[b]).clamp(min=SCALE_EPS) for b in FA_BRANCHES}

    if config.objective == "tensor_mse":
        start_obj = final_obj = 0.0
        for i, branch in enumerate(FA_BRANCHES):
            xs = torch.cat([r[i] for r in rows], dim=1)  # [H, n_total, D]

            def err(s: torch.Tensor, xs: torch.Tensor = xs) -> torch.Tensor:
                return (fake_quant(xs, s) - xs).double().pow(2).sum(dim=(1, 2))

            cur = err(start[branch])
            cand = torch.stack([err(start[branch] * g) for g in grid])  # [G, H]
            best = cand.argmin(dim=0)
            best_err = cand.gather(0, best[None]).squeeze(0)
            better = best_err < cur
            mult[branch] = torch.where(better, grid[best], mult[branch])
            start_obj += float(cur.sum())
            final_obj += float(torch.where(better, best_err, cur).sum())
        return LayerSearch(scales_for(mult), mult, start_obj, final_obj)

    refs = [attention_core(q, k, v, scaling, sliding_window) for q, k, v in rows]

    def errors(m: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _attention_errors(rows, refs, scales_for(m), scaling, sliding_window, w)

    cur = errors(mult)
    start_obj = float(cur.sum())
    for _ in range(config.rounds):
        changed = False
        for branch in FA_BRANCHES:
            per = (
                (lambda e: e)
                if branch == "fa_q"
                else (lambda e: e.view(hkv, group).sum(dim=1))
            )
            cand = []
            for g in grid:
                trial = dict(mult)
                trial[branch] = torch.full_like(mult[branch], float(g))
                cand.append(per(errors(trial)))
            table = torch.stack(cand)  # [G, heads of this branch]
            best = table.argmin(dim=0)
            best_err = table.gather(0, best[None]).squeeze(0)
            better = best_err < per(cur)
            if bool(better.any()):
                mult[branch] = torch.where(better, grid[best], mult[branch])
                cur = errors(mult)
                changed = True
        if not changed:
            break
    return LayerSearch(scales_for(mult), mult, start_obj, float(cur.sum()))


def _layer_geometry(module: nn.Module, head_dim: int) -> tuple[float, int | None]:
    scaling = getattr(module, "scaling", None)
    scaling = float(scaling) if scaling is not None else head_dim**-0.5
    window = getattr(module, "sliding_window", None)
    return scaling, int(window) if window else None


@torch.no_grad()
def search_scales(
    modules: Mapping[str, nn.Module],
    start: Mapping[str, Mapping[str, torch.Tensor]],
    kept: Mapping[str, Mapping[str, SampleKeeper]],
    config: SearchConfig | None = None,
    *,
    progress: bool = False,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, LayerSearch]]:
    """Run :func:`search_layer` on every attention module that has retained rows.

    ``modules``: attention module name -> module (for ``scaling`` and
    ``sliding_window``); ``start[attn][branch]`` ``[H]`` starting scales;
    ``kept[attn][branch]`` the layer's keepers. Returns the searched scales (layers
    without rows keep their start) and each layer's :class:`LayerSearch`.
    """
    config = config or SearchConfig()
    out: dict[str, dict[str, torch.Tensor]] = {}
    info: dict[str, LayerSearch] = {}
    names = list(start)
    bar = progress_bar(len(names), "clip search", "layer") if progress else None
    for name in names:
        keep = kept.get(name, {})
        rows = (
            list(zip(*(keep[b].rows for b in FA_BRANCHES), strict=False))
            if all(b in keep for b in FA_BRANCHES)
            else []
        )
        if not rows:
            out[name] = {b: start[name][b].detach().float().cpu() for b in FA_BRANCHES}
        else:
            scaling, window = _layer_geometry(modules[name], rows[0][0].shape[-1])
            o_proj = getattr(modules[name], "o_proj", None)
            res = search_layer(
                rows,
                start[name],
                scaling,
                config,
                sliding_window=window,
                out_proj=getattr(o_proj, "weight", None),
            )
            out[name] = res.scales
            info[name] = res
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out, info


class KeepingObserver(nn.Module):
    """Wraps an ``FA3Observer``: observes as it does and also feeds a
    :class:`SampleKeeper` (same call contract ``fa_x(x [B, H, S, D], token_mask)``)."""

    def __init__(self, inner: nn.Module, keeper: SampleKeeper) -> None:
        super().__init__()
        self.inner = inner
        self.keeper = keeper
        self.branch = getattr(inner, "branch", "")
        self.num_heads = getattr(inner, "num_heads", None)
        self.head_dim = getattr(inner, "head_dim", None)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.inner(x, token_mask)
        self.keeper.add(x, token_mask)
        return out


@torch.no_grad()
def calibrate_with_search(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    recipe: Any,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    search: SearchConfig | None = None,
    report: dict[str, Any] | None = None,
    progress: bool = True,
) -> CalibratedModel:
    """Same contract as :func:`~ascend_fa.calibration.pipeline.calibrate_model`, with
    the clip search run after the recipe's observers.

    The recipe's method gives the starting scales; the search then replaces each
    fake-quant module's scales. Returns ``(processors, adapter, ranges)`` with the
    model in fake-quant mode; ``ranges`` are the searched ranges ``±127 · scale``.
    ``report``, when given, receives per layer the objective before and after and
    the chosen multipliers. Only GQA/MHA (FAQuant) models are supported.
    """
    from ascend_fa.adapters import get_adapter

    search = search or SearchConfig()
    adapter = get_adapter(model)
    if getattr(adapter, "fa_quant_type", "") != "FAQuant":
        raise ValueError(
            "clip search supports FAQuant (GQA/MHA) models only; "
            f"{getattr(model.config, 'model_type', '?')} uses "
            f"{getattr(adapter, 'fa_quant_type', '?')}"
        )
    kept: dict[str, dict[str, SampleKeeper]] = {}

    def keep(name: str, branch: str, point: nn.Module) -> nn.Module | None:
        if not isinstance(point, FA3Observer):
            return None
        keeper = SampleKeeper(search.rows, search.tokens)
        kept.setdefault(name, {})[branch] = keeper
        return KeepingObserver(point, keeper)

    result = calibrate_model(
        model,
        tokenizer,
        texts,
        recipe=recipe,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        wrap=keep,
        progress=progress,
    )
    selected = find_fa_modules(model)
    start = {
        name: {b: module._modules[b].scale for b in FA_BRANCHES}
        for name, module in selected.items()
        if all(isinstance(module._modules.get(b), FA3FakeQuant) for b in FA_BRANCHES)
    }
    scales, info = search_scales(selected, start, kept, search, progress=progress)
    ranges = {}
    for name, entry in scales.items():
        ranges[name] = {}
        for branch, scale in entry.items():
            fq = selected[name]._modules[branch]
            fq.scale.copy_(scale.to(fq.scale.device))
            ranges[name][branch] = (-INT8_MAX * scale, INT8_MAX * scale)
    if report is not None:
        report.update(
            {
                name: {
                    "start_objective": res.start_objective,
                    "final_objective": res.final_objective,
                    "multipliers": {b: m.tolist() for b, m in res.multipliers.items()},
                }
                for name, res in info.items()
            }
        )
    return CalibratedModel(result.processors, result.adapter, ranges)
