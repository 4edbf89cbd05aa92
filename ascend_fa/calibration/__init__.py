"""Calibration engine: exact per-head ranges, observers, FA3 processor stages, recipes.

* :func:`recall_window` / :func:`abs_quantile` — exact per-head statistics of
  ``[H, N]`` without a full sort (:mod:`.recall`).
* :class:`PerHeadObserver` — running per-head state of one FA point, with
  ``union`` / ``pooled`` accumulation, merge, resume and qparams (:mod:`.observers`).
* :class:`FA3Processor` — preprocess (inject) -> process (observe) -> postprocess
  (fake-quant), export/load of scales, removal (:mod:`.processor`).
* :class:`FA3QuantConfig`, :class:`Recipe`, :func:`load_recipe` — YAML recipes
  (:mod:`.recipe`).
* :func:`all_reduce_observer` — exact multi-process reduction (:mod:`.distributed`).
"""

from __future__ import annotations

from ascend_fa.adapters.placeholder import (
    FA_BRANCHES,
    FA3QuantAdapterInterface,
    FA3QuantPlaceHolder,
)

from .distributed import all_reduce_observer, is_distributed
from .observers import ACCUMULATE_MODES, METHODS, PerHeadObserver
from .processor import (
    FA3FakeQuant,
    FA3Observer,
    FA3Processor,
    ScaleMap,
    find_fa_modules,
)
from .recall import abs_quantile, recall_window, recall_window_sort_ref
from .recipe import (
    BranchOverride,
    BranchSettings,
    FA3QuantConfig,
    RatioConfig,
    Recipe,
    RecipeError,
    check_patterns,
    default_recipe,
    expand_braces,
    load_recipe,
    match_pattern,
)

__all__ = [
    "ACCUMULATE_MODES",
    "BranchOverride",
    "BranchSettings",
    "FA3FakeQuant",
    "FA3Observer",
    "FA3Processor",
    "FA3QuantAdapterInterface",
    "FA3QuantConfig",
    "FA3QuantPlaceHolder",
    "FA_BRANCHES",
    "METHODS",
    "PerHeadObserver",
    "RatioConfig",
    "Recipe",
    "RecipeError",
    "ScaleMap",
    "abs_quantile",
    "all_reduce_observer",
    "check_patterns",
    "default_recipe",
    "expand_braces",
    "find_fa_modules",
    "is_distributed",
    "load_recipe",
    "match_pattern",
    "recall_window",
    "recall_window_sort_ref",
]
