"""The picture report written beside ``calibration_report.json``.

:func:`render_report_png` draws one PNG from the report document:

* per-layer, per-head heatmaps of ``log10(scale)`` for Q, K and V (rows = layers,
  columns = heads) — outlier heads and layers stand out at a glance;
* the attention-output error per layer on the held-out samples (``1 - cosine`` and
  relative L1, log scale), when the report has them;
* the per-linear sensitivity (the measured KL of quantizing that linear alone), when
  the report has a ``linears`` section with ``sensitivity_kl`` entries.

matplotlib draws off-screen (the Agg backend); nothing is shown.
"""

from __future__ import annotations

import io
import math
from typing import Any

__all__ = ["REPORT_PNG", "render_report_png"]

REPORT_PNG = "calibration_report.png"
_BRANCHES = (("fa_q", "Q"), ("fa_k", "K"), ("fa_v", "V"))


def _scale_grid(layers: dict[str, Any], branch: str) -> list[list[float]]:
    rows = []
    for entry in layers.values():
        scales = (entry.get(branch) or {}).get("scale") or []
        rows.append([math.log10(s) if s and s > 0 else math.nan for s in scales])
    width = max((len(r) for r in rows), default=0)
    return [r + [math.nan] * (width - len(r)) for r in rows]


def _short(name: str) -> str:
    parts = name.split(".")
    return next((p for p in parts if p.isdigit()), name)


def render_report_png(report: dict[str, Any], title: str | None = None) -> bytes:
    """The picture report of ``report`` (a ``calibration_report.json`` document) as
    PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers: dict[str, Any] = report.get("layers", {})
    names = list(layers)
    cos = [layers[n].get("attention_output_cosine") for n in names]
    rel = [layers[n].get("attention_output_rel_l1") for n in names]
    has_err = any(c is not None for c in cos)
    linears = {
        k: v.get("sensitivity_kl")
        for k, v in (report.get("linears") or {}).items()
        if isinstance(v, dict) and v.get("sensitivity_kl") is not None
    }
    panels = 3 + int(has_err) + int(bool(linears))
    fig = plt.figure(figsize=(4.2 * min(panels, 3), 3.6 * math.ceil(panels / 3)))
    for i, (branch, label) in enumerate(_BRANCHES):
        ax = fig.add_subplot(math.ceil(panels / 3), min(panels, 3), i + 1)
        grid = _scale_grid(layers, branch)
        if grid and grid[0]:
            im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(im, ax=ax, label="log10(scale)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{label} scale per head")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    k = 4
    if has_err:
        ax = fig.add_subplot(math.ceil(panels / 3), min(panels, 3), k)
        xs = list(range(len(names)))
        one_minus = [max(1 - c, 1e-9) if c is not None else math.nan for c in cos]
        ax.semilogy(xs, one_minus, "o-", label="1 - cosine")
        ax.semilogy(
            xs, [r if r is not None else math.nan for r in rel], "s-", label="rel-L1"
        )
        ax.set_title("attention-output error (held-out)")
        ax.set_xlabel("layer")
        ax.legend()
        k += 1
    if linears:
        ax = fig.add_subplot(math.ceil(panels / 3), min(panels, 3), k)
        ranked = sorted(linears.items(), key=lambda kv: -kv[1])[:20]
        ax.barh([n[-40:] for n, _ in ranked][::-1], [v for _, v in ranked][::-1])
        ax.set_xscale("log")
        ax.set_title("most sensitive linears (KL alone)")
        ax.tick_params(axis="y", labelsize=6)
    heading = title or report.get("model") or "calibration report"
    fig.suptitle(f"{report.get('fa_quant_type', '')} {heading}".strip(), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
