"""``calibration_report.json``: what calibration decided and how well it did.

* ``layers[<attn>][fa_x]``: per head ``range_min``/``range_max`` (the calibrated
  range), ``scale``, ``clipped_fraction`` (held-out values outside the INT8 range
  ``[-128, 127] * scale``, real tokens only);
* ``layers[<attn>]``: ``attention_output_cosine`` and ``attention_output_rel_l1``
  of the attention module's output (after ``o_proj``, real tokens, whole model
  fake-quantized so earlier layers' error is included): cosine of the flattened
  outputs, and ``sum|fq - float| / sum|float|``
  (:class:`~ascend_fa.metrics.OutputError`);
* ``heldout``: perplexity float vs fake-quant over the held-out tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ascend_fa.adapters.hf import find_fa_modules
from ascend_fa.atb_ops import saturated
from ascend_fa.metrics import OutputError, token_nll

from .pipeline import Ranges, calibration_batches, float_mode, progress_bar
from .processor import FA3FakeQuant

__all__ = ["heldout_report", "build_report"]


@torch.no_grad()
def heldout_report(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Float vs fake-quant on ``texts`` (model in fake-quant mode).

    Returns ``(heldout, per_layer)``: perplexities, and per attention module the
    output cosine / relative L1 and per-branch clipped fractions per head.
    """
    modules = find_fa_modules(model)
    errors = {n: OutputError() for n in modules}
    clip: dict[str, dict[str, list[torch.Tensor]]] = {}
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def capture(name: str) -> Any:
        def hook(_m: nn.Module, _a: tuple, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            captured[name] = t.detach().float()

        return hook

    def count_clips(name: str, branch: str) -> Any:
        def hook(m: nn.Module, args: tuple) -> None:
            bad = saturated(args[0], m.scale, axis=1).float()
            mask = args[1] if len(args) > 1 and args[1] is not None else None
            if mask is not None:
                w = mask[:, None, :, None].float()
                total = (w.expand_as(bad)).sum(dim=(0, 2, 3))
                bad = (bad * w).sum(dim=(0, 2, 3))
            else:
                total = torch.full(
                    (bad.shape[1],), bad[:, 0].numel(), dtype=torch.float32
                )
                bad = bad.sum(dim=(0, 2, 3))
            slot = clip.setdefault(name, {}).setdefault(
                branch,
                [
                    torch.zeros_like(bad, dtype=torch.float64).cpu(),
                    torch.zeros_like(total, dtype=torch.float64).cpu(),
                ],
            )
            slot[0] += bad.double().cpu()
            slot[1] += total.double().cpu()

        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_hook(capture(name)))
        for branch, child in module.named_children():
            if isinstance(child, FA3FakeQuant):
                handles.append(
                    child.register_forward_pre_hook(count_clips(name, branch))
                )
    nll = {"float": 0.0, "fake_quant": 0.0}
    count = 0
    bar = progress_bar(len(texts), "evaluate") if progress else None
    try:
        for batch in calibration_batches(
            tokenizer,
            texts,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
        ):
            with float_mode(model):
                out = model(**batch, use_cache=False)
            ref = dict(captured)
            n, c = token_nll(out.logits, batch["input_ids"], batch["attention_mask"])
            nll["float"] += n
            del out
            out = model(**batch, use_cache=False)
            nll["fake_quant"] += token_nll(
                out.logits, batch["input_ids"], batch["attention_mask"]
            )[0]
            count += c
            del out
            valid = batch["attention_mask"].bool()
            for name in modules:
                errors[name].add(ref[name][valid], captured[name][valid])
            if bar is not None:
                bar.update(int(batch["input_ids"].shape[0]))
    finally:
        if bar is not None:
            bar.close()
        for h in handles:
            h.remove()
    per_layer: dict[str, Any] = {}
    for name in modules:
        per_layer[name] = {
            "attention_output_cosine": errors[name].cosine(),
            "attention_output_rel_l1": errors[name].rel_l1(),
            "clipped_fraction": {
                br: (v[0] / v[1].clamp(min=1)).tolist()
                for br, v in clip.get(name, {}).items()
            },
        }
    ppl_f = math.exp(nll["float"] / count) if count else None
    ppl_q = math.exp(nll["fake_quant"] / count) if count else None
    heldout = {
        "num_samples": len(texts),
        "tokens": count,
        "perplexity_float": ppl_f,
        "perplexity_fake_quant": ppl_q,
        "perplexity_delta_pct": (
            100.0 * (ppl_q / ppl_f - 1.0) if ppl_f and ppl_q else None
        ),
    }
    return heldout, per_layer


def build_report(
    *,
    scales: dict[str, Any],
    ranges: Ranges,
    per_layer: dict[str, Any],
    heldout: dict[str, Any],
    header: dict[str, Any],
) -> dict[str, Any]:
    """The ``calibration_report.json`` document: ``header`` (model, recipe,
    calibration settings...), ``heldout``, a ``summary`` and per-layer entries."""
    layers = {}
    for name in sorted(scales):
        entry: dict[str, Any] = dict(per_layer.get(name, {}))
        clipped = entry.pop("clipped_fraction", {})
        for branch, (scale, _offset) in scales[name].items():
            lo, hi = ranges.get(name, {}).get(branch, (None, None))
            entry[branch] = {
                "range_min": None if lo is None else lo.tolist(),
                "range_max": None if hi is None else hi.tolist(),
                "scale": scale.tolist(),
                "clipped_fraction": clipped.get(branch),
            }
        layers[name] = entry
    cosines = [
        v["attention_output_cosine"]
        for v in layers.values()
        if v.get("attention_output_cosine") is not None
    ]
    return {
        **header,
        "heldout": heldout,
        "summary": {
            "layers": len(layers),
            "mean_attention_output_cosine": (
                sum(cosines) / len(cosines) if cosines else None
            ),
            "min_attention_output_cosine": min(cosines) if cosines else None,
        },
        "layers": layers,
    }
