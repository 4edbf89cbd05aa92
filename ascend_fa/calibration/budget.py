"""``calibrate --error-budget KL``: rank the attention layers by their measured error
and keep the fewest float needed to meet a token-KL budget.

After the FA scales are calibrated (model in fake-quant mode), on the first
:data:`BUDGET_SAMPLES` calibration samples:

1. one float forward (every FA point a placeholder) gives the reference logits and
   attention outputs; one fake-quant forward gives each attention module's output
   cosine and rel-L1 against it (whole model fake-quantized, as deployed) and the
   mean per-token KL(float || fake-quant) over real tokens;
2. layers are ranked worst first by that cosine (ties: larger rel-L1 first);
3. while the KL is above the budget, the worst remaining layer is kept float (its
   FA points become placeholders, its scales are not written) and the KL is
   measured again: one forward per layer kept float.

The ranking, every measured KL and the layers kept float go to
``calibration_report.json`` (``error_budget``). Greedy in ranking order is not a
search over subsets: it keeps the fewest layers of that order, which the
measurement after each step confirms.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import find_fa_modules, swapped_points
from ascend_fa.adapters.placeholder import FA3QuantPlaceHolder
from ascend_fa.errors import InputError
from ascend_fa.metrics import OutputError, token_kl

from .pipeline import float_mode

__all__ = [
    "BUDGET_SAMPLES",
    "BudgetResult",
    "check_error_budget",
    "fit_error_budget",
    "float_layers",
]

#: Calibration samples (the first ones) the budget is measured on.
BUDGET_SAMPLES = 4


def check_error_budget(value: float | str | None) -> float | None:
    """``--error-budget``: a mean token KL >= 0 (None: no budget)."""
    if value is None:
        return None
    try:
        kl = float(value)
    except (TypeError, ValueError):
        kl = -1.0
    if isinstance(value, bool) or not math.isfinite(kl) or kl < 0:
        raise InputError(
            f"--error-budget must be a mean token KL >= 0 (e.g. 0.003), got {value!r}"
        )
    return kl


@dataclass
class BudgetResult:
    """The ranking, the layers kept float and the KL after each step."""

    budget: float
    ranking: list[dict[str, Any]]
    kept_float: list[str] = field(default_factory=list)
    #: KL with 0, 1, 2, ... layers kept float
    kl_steps: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def met(self) -> bool:
        return bool(self.kl_steps) and self.kl_steps[-1] <= self.budget

    def to_report(self) -> dict[str, Any]:
        return {
            "metric": "mean token KL(float || fake-quant), calibration samples",
            "budget": self.budget,
            "met": self.met,
            "tokens": self.tokens,
            "kl_steps": self.kl_steps,
            "kept_float": self.kept_float,
            "ranking": self.ranking,
        }


@contextlib.contextmanager
def float_layers(model: nn.Module, names: list[str]) -> Iterator[None]:
    """The FA points of the attention modules ``names`` as placeholders (float)."""
    mods = {n: m for n, m in find_fa_modules(model).items() if n in names}
    with swapped_points(
        mods,
        lambda _n, branch, child: FA3QuantPlaceHolder(
            branch, getattr(child, "num_heads", 1)
        ),
    ):
        yield


@torch.no_grad()
def _measure(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    refs: list[tuple[torch.Tensor, dict[str, torch.Tensor]]],
    captured: dict[str, torch.Tensor],
    errors: dict[str, OutputError] | None,
) -> tuple[float, int]:
    kl_sum, count = 0.0, 0
    for batch, (ref_logits, ref_out) in zip(batches, refs, strict=True):
        logits = model(**batch, use_cache=False).logits
        mask = batch["attention_mask"][:, 1:]
        kl, _same, n = token_kl(ref_logits[:, :-1], logits[:, :-1], mask)
        kl_sum += kl
        count += n
        if errors is not None:
            valid = batch["attention_mask"].bool()
            for name, err in errors.items():
                err.add(ref_out[name][valid], captured[name][valid])
    return (kl_sum / count if count else 0.0), count


@torch.no_grad()
def fit_error_budget(
    model: nn.Module, batches: list[dict[str, torch.Tensor]], budget: float
) -> BudgetResult:
    """Rank the layers and choose the float ones (see the module doc); ``model`` is
    in fake-quant mode and is left unchanged."""
    modules = find_fa_modules(model)
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str) -> Any:
        def hook(_m: nn.Module, _a: tuple, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            captured[name] = t.detach().double()

        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in modules.items()]
    try:
        refs = []
        with float_mode(model):
            for batch in batches:
                logits = model(**batch, use_cache=False).logits
                refs.append((logits, dict(captured)))
        errors = {n: OutputError() for n in modules}
        kl, tokens = _measure(model, batches, refs, captured, errors)
    finally:
        for h in handles:
            h.remove()
    ranking = sorted(
        (
            {
                "name": n,
                "attention_output_cosine": errors[n].cosine(empty=1.0),
                "attention_output_rel_l1": errors[n].rel_l1(empty=0.0),
            }
            for n in modules
        ),
        key=lambda r: (r["attention_output_cosine"], -r["attention_output_rel_l1"]),
    )
    for rank, entry in enumerate(ranking):
        entry["rank"] = rank
    result = BudgetResult(budget, ranking, kl_steps=[kl], tokens=tokens)
    for entry in ranking:
        if kl <= budget:
            break
        result.kept_float.append(entry["name"])
        with float_layers(model, result.kept_float):
            kl, _ = _measure(model, batches, refs, captured, None)
        result.kl_steps.append(kl)
    for entry in ranking:
        entry["kept_float"] = entry["name"] in result.kept_float
    return result
