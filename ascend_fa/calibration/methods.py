"""Calibrate several methods in one pass, for the method comparison of
``ascend-fa eval --compare-methods``.

Each FA point feeds one observer per distinct method configuration (and, for the
clip searches, a sample keeper) through :func:`calibrate_methods`; the scales of
every method come out of the same forwards. :func:`default_methods` lists the
comparison, whose ``(default)`` row is the packaged recipe ``ascend-fa calibrate``
uses — one source of truth for the default method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import swapped_points
from ascend_fa.artifact.format import FA_BRANCHES, ScaleMap

from .data import split_calibration
from .observers import PerHeadObserver
from .pipeline import (
    calibration_batches,
    injected_points,
    progress_bar,
    run_forwards,
)
from .search import SampleKeeper, SearchConfig, search_scales

__all__ = [
    "MethodSpec",
    "QuantSpec",
    "V_CLIP_RATIOS",
    "calibrate_methods",
    "calibration_split",
    "default_methods",
    "per_tensor_scales",
]

#: What to fake-quantize: static per-head scales, "dynamic" per token and head, or
#: "float" (nothing).
QuantSpec = ScaleMap | str


def per_tensor_scales(scales: ScaleMap) -> ScaleMap:
    """One scale per tensor: every head of ``attn.fa_x`` gets the largest of its
    per-head scales (the range that covers all heads)."""
    out: ScaleMap = {}
    for attn, branches in scales.items():
        out[attn] = {}
        for branch, (scale, offset) in branches.items():
            s = scale.detach().float().reshape(-1)
            out[attn][branch] = (torch.full_like(s, float(s.max())), offset.clone())
    return out


@dataclass(frozen=True)
class MethodSpec:
    """One row of the method comparison.

    ``config``: the ``fa3_quant`` settings whose observers give the scales (None for
    ``dynamic``); ``per_tensor``: collapse to one scale per tensor; ``search``: run
    the clip search from the config's scales; ``dynamic``: per-token-per-head.
    """

    name: str
    config: Any = None
    per_tensor: bool = False
    search: SearchConfig | None = None
    dynamic: bool = False


#: Recall ratios of the best static method measured on SmolLM2: the seed's Q/K
#: ratio, and V clipped to 99.95 % instead of kept whole (see the module notes).
V_CLIP_RATIOS = {"q": 0.9999, "k": 0.9999, "v": 0.9995}


def default_methods(max_samples: int) -> list[MethodSpec]:
    """The method comparison: the packaged default recipe (what ``ascend-fa
    calibrate`` uses, labelled ``(default)``), the seed's method, the other observer
    methods, the per-tensor baseline, the clip searches, and dynamic
    per-token-per-head (upper bound).

    ``max_samples`` bounds the samples per head for ``pooled`` accumulation (the
    default recipe's bound is tightened to it, as ``calibrate`` does).
    """
    from .job import default_recipe_path
    from .pipeline import tighten_max_samples
    from .recipe import FA3QuantConfig, load_recipe

    (default,) = load_recipe(default_recipe_path()).processors
    default = tighten_max_samples(default, max_samples)
    seed = FA3QuantConfig()
    return [
        MethodSpec(f"{_describe(default)} (default)", default),
        MethodSpec("recall_window/union (seed)", seed),
        MethodSpec(
            "recall_window/union, V ratio 0.9995", FA3QuantConfig(ratio=V_CLIP_RATIOS)
        ),
        MethodSpec("abs_quantile", FA3QuantConfig(method="abs_quantile")),
        MethodSpec("minmax", FA3QuantConfig(method="minmax")),
        MethodSpec("per-tensor (recall_window)", seed, per_tensor=True),
        MethodSpec(
            "clip search: tensor MSE", seed, search=SearchConfig(objective="tensor_mse")
        ),
        MethodSpec("clip search: attention output", seed, search=SearchConfig()),
        MethodSpec("dynamic per-token-per-head", dynamic=True),
    ]


def _describe(config: Any) -> str:
    """``method/accumulate`` of a recipe item, e.g. ``recall_window/pooled``."""
    return f"{config.method}/{config.accumulate}"


def calibration_split(
    texts: list[str], num_samples: int, heldout: int = 4, seed: int = 0
) -> list[str]:
    """The calibration samples ``ascend-fa calibrate`` uses by default: shuffle with
    ``seed``, set the last ``heldout`` aside, take the first ``num_samples``."""
    return split_calibration(texts, num_samples, heldout, seed)[0]


class _FanOut(nn.Module):
    """One FA point feeding several observers (one per method) and, optionally, a
    :class:`SampleKeeper` for the clip search; returns its input."""

    def __init__(self, observers: dict[str, Any], keeper: SampleKeeper | None):
        super().__init__()
        self.observers = observers
        self.keeper = keeper

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # A float64 model (eval --dtype fp64) is observed in fp32, as it quantizes.
        xo = x.detach().float() if x.dtype == torch.float64 else x.detach()
        for obs in self.observers.values():
            obs.update(xo, token_mask)
        if self.keeper is not None:
            self.keeper.add(x, token_mask)
        return x


@torch.no_grad()
def calibrate_methods(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    methods: list[MethodSpec],
    *,
    max_length: int = 512,
    batch_size: int = 4,
    progress: bool = False,
) -> dict[str, QuantSpec]:
    """Scales of every method in ``methods`` from one pass over ``texts``.

    Returns ``{method name: ScaleMap or "dynamic"}``. Each FA point runs one
    :class:`~ascend_fa.calibration.PerHeadObserver` per distinct observer config
    (padding excluded through the attention mask, as in ``ascend-fa calibrate``);
    search methods keep their ``rows`` x ``tokens`` samples in the same pass.
    """
    if not texts:
        raise ValueError("calibrate_methods: no calibration texts")
    device = next(model.parameters()).device
    configs = {m.config.model_dump_json(): m.config for m in methods if m.config}
    searches = [m.search for m in methods if m.search is not None]
    keep_rows = max((s.rows for s in searches), default=0)
    keep_tokens = max((s.tokens for s in searches), default=0)

    def fan_out(name: str, branch: str, point: nn.Module) -> nn.Module:
        observers = {}
        for key, cfg in configs.items():
            if not cfg.matches(name):
                continue
            s = cfg.branch_settings(branch)
            observers[key] = PerHeadObserver(
                int(point.num_heads),
                method=s.method,
                ratio=s.ratio,
                accumulate=s.accumulate,
                max_samples=s.max_samples,
                name=f"{name}.{branch}",
            )
        keeper = SampleKeeper(keep_rows, keep_tokens) if searches else None
        return _FanOut(observers, keeper)

    with injected_points(model) as (_adapter, mods):
        with swapped_points(mods, fan_out) as points:
            bar = progress_bar(len(texts), "calibrate") if progress else None
            try:
                run_forwards(
                    model,
                    calibration_batches(
                        tokenizer,
                        texts,
                        max_length=max_length,
                        batch_size=batch_size,
                        device=device,
                    ),
                    progress=bar,
                )
            finally:
                if bar is not None:
                    bar.close()
        per_config: dict[str, ScaleMap] = {}
        for key in configs:
            smap: ScaleMap = {}
            for (name, branch), point in points.items():
                if key in point.observers:
                    smap.setdefault(name, {})[branch] = point.observers[key].qparams()
            per_config[key] = {n: e for n, e in smap.items() if len(e) == 3}
        kept = (
            {name: {b: points[(name, b)].keeper for b in FA_BRANCHES} for name in mods}
            if searches
            else {}
        )
        out: dict[str, QuantSpec] = {}
        for m in methods:
            if m.dynamic:
                out[m.name] = "dynamic"
                continue
            if m.config is None:
                raise ValueError(f"method {m.name!r} has neither a config nor dynamic")
            smap = per_config[m.config.model_dump_json()]
            if m.search is not None:
                start = {n: {b: e[b][0] for b in FA_BRANCHES} for n, e in smap.items()}
                searched, _ = search_scales(
                    mods, start, kept, m.search, progress=progress
                )
                smap = {
                    n: {b: (s, smap[n][b][1]) for b, s in e.items()}
                    for n, e in searched.items()
                }
            out[m.name] = per_tensor_scales(smap) if m.per_tensor else smap
    return out
