"""``ascend-fa bench attention --sweep``: decode time of every quantized mode against
its float cache, over batch, context, heads, block size and layout, with the
memory-bound limit of each ratio.

A decode step reads the whole KV cache once and does little arithmetic per byte, so
its time is bounded by the bytes moved. An int8 cache moves fewer bytes than the
float cache it replaces; the **limit** of ``t(int8 mode) / t(float)`` at a point is

    bytes(int8 mode) / bytes(float)

with ``bytes`` = cache rows read (K and V, or the MLA latent + RoPE part) + query,
output and scales — about 0.5 for GQA K/V-dominated decode and
``(R + 2 Dr) / (2 R + 2 Dr)`` = 0.556 for MLA (the RoPE part stays bf16).
``closeness = limit / ratio`` says how much of the possible saving a point realises
(1.0: at the limit). The float cache is bf16 in the same layout; FAKQuant compares
the int8 latent with a bf16 latent. A point the device refuses (e.g. a float NZ cache
on the NPU, an (H, Hkv) pair outside the int8 NZ table) is listed with the reason.
The ``best`` line names the point with the lowest ratio.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ascend_fa.errors import UnsupportedError

from ._device import time_pair
from .results import Record

__all__ = ["SweepPoint", "sweep_points", "run_sweep", "plot_sweep", "bytes_ratio"]

#: (batch, context, (H, Hkv) GQA pairs, MLA heads, block sizes, layouts)
QUICK = dict(
    batch=(2,),
    context=(256, 1024),
    gqa=((8, 2),),
    mla=(16,),
    block=(128,),
    layout=("nd", "nz"),
)
FULL = dict(
    batch=(1, 8),
    context=(512, 2048, 8192),
    gqa=((32, 8), (64, 8)),
    mla=(16, 128),
    block=(128,),
    layout=("nd", "nz"),
)
D, R, DR = 128, 512, 64


@dataclass(frozen=True)
class SweepPoint:
    """One configuration; ``mode`` is ``int8_kv``/``faquant`` (GQA) or ``fakquant``
    (MLA, ``kv_heads`` 1)."""

    mode: str
    batch: int
    context: int
    heads: int
    kv_heads: int
    block: int
    layout: str

    def params(self) -> dict[str, Any]:
        return {
            "B": self.batch,
            "context": self.context,
            "H": self.heads,
            "Hkv": self.kv_heads,
            "BS": self.block,
            "layout": self.layout,
        }


def sweep_points(grid: dict[str, Any]) -> list[SweepPoint]:
    """Every point of ``grid`` (``QUICK`` or ``FULL``)."""
    out = []
    for b, ctx, bs, layout in itertools.product(
        grid["batch"], grid["context"], grid["block"], grid["layout"]
    ):
        for h, hkv in grid["gqa"]:
            for mode in ("int8_kv", "faquant"):
                out.append(SweepPoint(mode, b, ctx, h, hkv, bs, layout))
        for h in grid["mla"]:
            out.append(SweepPoint("fakquant", b, ctx, h, 1, bs, layout))
    return out


def bytes_ratio(p: SweepPoint) -> float:
    """The memory-bound limit of ``t(p.mode) / t(float)`` (see the module doc)."""
    tokens = p.batch * p.context
    if p.mode == "fakquant":
        q_out = p.batch * p.heads * (R + DR + R) * 2
        return (tokens * (R + 2 * DR) + 4 + q_out) / (tokens * 2 * (R + DR) + q_out)
    cache_elems = tokens * p.kv_heads * D * 2
    q_out = p.batch * p.heads * D * 2 * 2  # bf16 query in, output out
    scales = 2 * p.kv_heads * 4 + (p.heads * 4 if p.mode == "faquant" else 0)
    return (cache_elems + scales + q_out) / (cache_elems * 2 + q_out)


def _cache(layout, nb, bs, heads, width, dtype, dev):
    from ascend_fa.atb_ops import nz_cache_shape

    shape = (
        nz_cache_shape(nb, bs, heads, width, dtype)
        if layout == "nz"
        else (nb, bs, heads, width)
    )
    return torch.zeros(shape, dtype=dtype, device=dev)


def _amax(x: torch.Tensor) -> torch.Tensor:
    from ascend_fa.atb_ops import per_head_qparams

    amax = x.float().abs().amax(dim=[i for i in range(x.dim()) if i != 1])
    return per_head_qparams(-amax, amax)[0]


def _measure(p: SweepPoint, dev: torch.device, repeats: int) -> tuple[float, float]:
    """``(t_float, t_mode)`` seconds, measured alternately."""
    from ascend_fa import (
        mla_paged_attention,
        paged_attention,
        reshape_and_cache,
        reshape_and_cache_mla,
    )

    gen = torch.Generator().manual_seed(0)
    per = -(-p.context // p.block)
    nb = p.batch * per + 1
    table = torch.randperm(nb, generator=gen)[: p.batch * per].view(p.batch, per)
    slots = (table.unsqueeze(-1) * p.block + torch.arange(p.block)).view(p.batch, -1)
    slots = slots[:, : p.context].reshape(-1).to(torch.int32).to(dev)
    table = table.to(torch.int32).to(dev)
    lens = torch.full((p.batch,), p.context, dtype=torch.int32, device=dev)
    t = p.batch * p.context
    if p.mode == "fakquant":
        lat = torch.randn(t, R, generator=gen).bfloat16().to(dev)
        rope = torch.randn(t, DR, generator=gen).bfloat16().to(dev)
        qn = torch.randn(p.batch, p.heads, R, generator=gen).bfloat16().to(dev)
        qr = torch.randn(p.batch, p.heads, DR, generator=gen).bfloat16().to(dev)
        ks = _amax(lat.unsqueeze(1))
        calls = []
        for dtype, scale in ((torch.bfloat16, None), (torch.int8, ks)):
            lc = _cache(p.layout, nb, p.block, 1, R, dtype, dev)
            rc = _cache(p.layout, nb, p.block, 1, DR, torch.bfloat16, dev)
            reshape_and_cache_mla(
                lat, rope, lc, rc, slots, k_scale=scale, layout=p.layout
            )
            calls.append(
                lambda lc=lc, rc=rc, s=scale: mla_paged_attention(
                    qn,
                    qr,
                    lc,
                    rc,
                    table,
                    lens,
                    scale=(R + DR) ** -0.5,
                    k_scale=s,
                    layout=p.layout,
                )
            )
        return time_pair(dev, calls[0], calls[1], repeats=repeats)
    key = torch.randn(t, p.kv_heads, D, generator=gen).bfloat16().to(dev)
    value = torch.randn(t, p.kv_heads, D, generator=gen).bfloat16().to(dev)
    query = torch.randn(p.batch, p.heads, D, generator=gen).bfloat16().to(dev)
    ks, vs = _amax(key), _amax(value)
    calls = []
    for quant in (False, True):
        dtype = torch.int8 if quant else torch.bfloat16
        kc = _cache(p.layout, nb, p.block, p.kv_heads, D, dtype, dev)
        vc = torch.zeros_like(kc)
        reshape_and_cache(
            key,
            value,
            kc,
            vc,
            slots,
            k_scale=ks if quant else None,
            v_scale=vs if quant else None,
            layout=p.layout,
        )
        kw: dict[str, Any] = dict(
            num_kv_heads=p.kv_heads, scale=D**-0.5, layout=p.layout
        )
        if quant:
            kw.update(k_scale=ks, v_scale=vs)
            if p.mode == "faquant":
                kw["q_scale"] = _amax(query)
        calls.append(
            lambda kc=kc, vc=vc, kw=kw: paged_attention(
                query, kc, vc, table, lens, **kw
            )
        )
    return time_pair(dev, calls[0], calls[1], repeats=repeats)


def run_sweep(
    backend_name: str, dev: torch.device, *, quick: bool, repeats: int
) -> tuple[list[list[Any]], list[Record], SweepPoint | None]:
    """Measure every point: ``(table rows, records, best point)``."""
    rows: list[list[Any]] = []
    records: list[Record] = []
    best: tuple[float, SweepPoint] | None = None
    for p in sweep_points(QUICK if quick else FULL):
        limit = bytes_ratio(p)
        head = [
            p.mode,
            p.batch,
            p.context,
            f"{p.heads}/{p.kv_heads}",
            p.block,
            p.layout.upper(),
        ]
        try:
            t_float, t_mode = _measure(p, dev, repeats)
        except (UnsupportedError, ValueError) as exc:
            reason = " ".join(str(exc).split())[:60]
            rows.append([*head, "-", "-", "refused", f"{limit:.3f}", reason])
            continue
        ratio = t_mode / t_float
        closeness = limit / ratio
        rows.append(
            [
                *head,
                f"{t_float * 1e3:.3g}",
                f"{t_mode * 1e3:.3g}",
                f"{ratio:.3f}",
                f"{limit:.3f}",
                f"{closeness:.2f}",
            ]
        )
        records.append(
            Record(
                "attention",
                backend_name,
                p.mode,
                p.params(),
                t_mode,
                repeats=repeats,
                ratio=ratio,
                baseline="float (bf16 cache)",
                extra={"float_s": t_float, "limit": limit, "closeness": closeness},
            )
        )
        if best is None or ratio < best[0]:
            best = (ratio, p)
    return rows, records, None if best is None else best[1]


SWEEP_HEADERS = [
    "mode",
    "B",
    "context",
    "H/Hkv",
    "BS",
    "layout",
    "float ms",
    "int8 ms",
    "int8/float",
    "limit",
    "closeness",
]


def plot_sweep(records: list[Record], path: str, title: str) -> None:
    """Ratio vs context length per mode (median over the other parameters), with the
    memory-bound limit drawn, as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = sorted({r.mode for r in records})
    for i, mode in enumerate(modes):
        rs = [r for r in records if r.mode == mode]
        ctxs = sorted({r.params["context"] for r in rs})
        med = [_median([r.ratio for r in rs if r.params["context"] == c]) for c in ctxs]
        lim = [
            _median([r.extra["limit"] for r in rs if r.params["context"] == c])
            for c in ctxs
        ]
        color = f"C{i}"
        ax.plot(ctxs, med, "o-", color=color, label=f"{mode} measured")
        ax.plot(ctxs, lim, "--", color=color, alpha=0.6, label=f"{mode} limit")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("t(int8) / t(float)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _median(values: list[float]) -> float:
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
