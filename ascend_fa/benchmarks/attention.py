"""``ascend-fa bench attention``: paged decode attention against
``torch.nn.functional.scaled_dot_product_attention`` on an equivalent dense fp32 KV
cache, measured alternately in the same run on the same device (``--backend``:
``cpu`` runs the emulation, ``cuda`` the emulation on the GPU, ``npu`` the torch_npu
kernels; a row the device refuses says why).

Default shape: B = 8 sequences, H = 32 query heads, Hkv = 8, D = 128, context 4096,
block 128, blocks handed out in shuffled order (on the NPU the int8 NZ decode takes
only (H, Hkv) in (10, 1), (64, 8), (80, 8), (128, 16): pass e.g. ``--heads 64``).
Each cache uses the backend's preferred layout. Rows: the int8 cache (int8-KV, the
goal row: at most 2x the SDPA time), FAQuant, a bf16 cache, and MLA FAKQuant
decode (H = 16, R = 512, Dr = 64) against the same math as fp32 matmuls on the
equivalent dense latent (SDPA has no fused CPU path for one shared 576-wide head).
The baseline uses ``enable_gqa`` (no ``repeat_kv`` copy), fp32 throughout.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ._device import add_backend_argument, bench_backend, time_pair
from ._util import print_table
from .results import Record, verdict, write_results

NAME = "attention"
HELP = "paged decode attention (int8 / bf16 / MLA caches) vs SDPA on a dense fp32 cache"
#: Devices this benchmark runs on (it resolves ``--backend`` itself).
BACKENDS = ("cpu", "cuda", "npu")

GOAL = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_backend_argument(parser)
    parser.add_argument("--batch", type=int, default=8, help="B (default 8)")
    parser.add_argument("--heads", type=int, default=32, help="H (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="Hkv (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=128, help="BS (default 128)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both sides (default: torch's default)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="sweep batch, context, heads (GQA and MLA), block size, layout and "
        "mode; print each int8/float ratio with its memory-bound limit and the best "
        "point (--quick: a small sweep)",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="with --sweep: draw ratio vs context"
    )


def _paged(b, ctx, bs, gen):
    per = -(-ctx // bs)
    nb = b * per + 1
    table = torch.randperm(nb, generator=gen)[: b * per].view(b, per).to(torch.int32)
    slots = (table.long().unsqueeze(-1) * bs + torch.arange(bs)).view(b, -1)[:, :ctx]
    return nb, table, slots.reshape(-1).to(torch.int32)


def _amax_scale(x: torch.Tensor, axis: int) -> torch.Tensor:
    from ascend_fa.atb_ops import per_head_qparams

    dims = [i for i in range(x.dim()) if i != axis]
    amax = x.float().abs().amax(dim=dims)
    return per_head_qparams(-amax, amax)[0]


def _cache_shape(layout, nb, bs, heads, width, dtype):
    from ascend_fa.atb_ops import nz_cache_shape

    if layout == "nz":
        return nz_cache_shape(nb, bs, heads, width, dtype)
    return (nb, bs, heads, width)


_LABELS = {"int8_kv": "int8 {} (int8-KV)", "faquant": "int8 {} (FAQuant)"}


@dataclass
class _Decode:
    """The decode problem both sides run: B sequences of ``ctx`` tokens in a
    shuffled paged table, their K/V and one bf16 query token each."""

    b: int
    ctx: int
    h: int
    hkv: int
    d: int
    bs: int
    repeats: int
    gen: torch.Generator
    nb: int
    table: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.d)

    @property
    def shape(self) -> dict[str, int]:
        return {
            "B": self.b,
            "H": self.h,
            "Hkv": self.hkv,
            "D": self.d,
            "context": self.ctx,
            "BS": self.bs,
        }


def _setup(args: argparse.Namespace, dev: torch.device) -> _Decode:
    b = 2 if args.quick else args.batch
    ctx = 1024 if args.quick else args.context
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    nb, table, slots = _paged(b, ctx, args.block_size, gen)
    return _Decode(
        b,
        ctx,
        h,
        hkv,
        d,
        args.block_size,
        3 if args.quick else args.repeats,
        gen,
        nb,
        table.to(dev),
        slots.to(dev),
        torch.full((b,), ctx, dtype=torch.int32, device=dev),
        key=torch.randn(b * ctx, hkv, d, generator=gen).to(dev),
        value=torch.randn(b * ctx, hkv, d, generator=gen).to(dev),
        query=torch.randn(b, h, d, generator=gen).bfloat16().to(dev),
    )


def run(args: argparse.Namespace) -> int:
    backend = bench_backend(args.backend)
    dev = backend.device
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        return _sweep(args, backend, dev)
    if args.plot:
        raise UnsupportedError("--plot draws a sweep: add --sweep")
    p = _setup(args, dev)
    rows, results, goal_ratio = _gqa_rows(backend, p)
    row, result = _mla_row(dev, p)
    rows.append(row)
    if result is not None:
        results.append(result)
    _report(args, backend, p, rows, results, goal_ratio)
    return 0


def _refused(label: str, exc: Exception) -> list[Any]:
    return [label, "-", "-", "refused", str(exc).split("\n")[-1][:70]]


def _gqa_rows(backend: Any, p: _Decode) -> tuple[list, list, float | None]:
    """The int8-KV, FAQuant and bf16 paged caches against SDPA on the dense fp32
    cache: table rows, result dicts and the int8-KV ratio (the goal row)."""
    b, ctx, h, hkv, d = p.b, p.ctx, p.h, p.hkv, p.d
    # baseline: SDPA over the same K/V as a dense fp32 cache [B, Hkv, ctx, D]
    k_dense = p.key.view(b, ctx, hkv, d).transpose(1, 2).contiguous()
    v_dense = p.value.view(b, ctx, hkv, d).transpose(1, 2).contiguous()
    q_dense = p.query.float().view(b, h, 1, d)

    def sdpa():
        return F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, scale=p.scale, enable_gqa=True
        )

    ref = sdpa().view(b, h, d)
    rows, results, goal_ratio = [], [], None
    ks, vs = _amax_scale(p.key, 1), _amax_scale(p.value, 1)
    for mode in ("int8_kv", "faquant", "float"):
        layout = backend.preferred_layout(mode)
        label = _LABELS.get(mode, "bf16 {}").format(layout.upper())
        try:
            call = _paged_call(p, mode, layout, ks, vs)
            t_sdpa, t = time_pair(backend.device, sdpa, call, repeats=p.repeats)
        except (UnsupportedError, ValueError) as exc:
            rows.append(_refused(label, exc))
            continue
        cos = float(
            F.cosine_similarity(
                call().double().flatten(), ref.double().flatten(), dim=0
            )
        )
        ratio = t / t_sdpa
        if mode == "int8_kv":
            goal_ratio = ratio
        rows.append([label, t_sdpa * 1e3, t * 1e3, f"{ratio:.2f}x", f"{cos:.5f}"])
        results.append(
            {
                "cache": label,
                "sdpa_s": t_sdpa,
                "paged_s": t,
                "ratio": ratio,
                "cosine_vs_fp32": cos,
            }
        )
    return rows, results, goal_ratio


def _paged_call(
    p: _Decode, mode: str, layout: str, ks: torch.Tensor, vs: torch.Tensor
) -> Any:
    """A cache of ``mode`` in ``layout`` filled with the K/V, and the decode call
    over it."""
    from ascend_fa import paged_attention, reshape_and_cache

    dev = p.query.device
    dtype = torch.bfloat16 if mode == "float" else torch.int8
    shape = _cache_shape(layout, p.nb, p.bs, p.hkv, p.d, dtype)
    kc = torch.zeros(shape, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    sc = (ks, vs) if dtype == torch.int8 else (None, None)
    reshape_and_cache(
        p.key.bfloat16(),
        p.value.bfloat16(),
        kc,
        vc,
        p.slots,
        k_scale=sc[0],
        v_scale=sc[1],
        layout=layout,
    )
    kw: dict[str, Any] = dict(num_kv_heads=p.hkv, scale=p.scale, layout=layout)
    if mode != "float":
        kw.update(k_scale=ks, v_scale=vs)
    if mode == "faquant":
        kw["q_scale"] = _amax_scale(p.query, 1)

    def call():
        return paged_attention(p.query, kc, vc, p.table, p.seq_lens, **kw)

    return call


def _mla_row(dev: torch.device, p: _Decode) -> tuple[list, dict | None]:
    """MLA FAKQuant decode vs the same math on the dense fp32 latent (one KV
    head): the table row and the result (None when the device refuses)."""
    from ascend_fa import mla_paged_attention, reshape_and_cache_mla

    b, ctx, gen = p.b, p.ctx, p.gen
    hm, r, dr = 16, 512, 64
    latent = torch.randn(b * ctx, r, generator=gen).to(dev)
    rope = torch.randn(b * ctx, dr, generator=gen).to(dev)
    lks = _amax_scale(latent.unsqueeze(1), 1)
    qn = torch.randn(b, hm, r, generator=gen).bfloat16().to(dev)
    qr = torch.randn(b, hm, dr, generator=gen).bfloat16().to(dev)
    mscale = 1 / math.sqrt(r + dr)
    kd = torch.cat([latent, rope], -1).view(b, 1, ctx, r + dr)
    vd = latent.view(b, 1, ctx, r)
    qd = torch.cat([qn, qr], -1).float().view(b, hm, 1, r + dr)

    def msdpa():
        # MQA over one 576-wide head: SDPA's CPU kernels would repeat the KV per
        # head (head dim > 256 has no fused path), so the baseline is the same math
        # as two fp32 batched matmuls over the shared dense latent.
        s = torch.matmul(
            qd.view(b, hm, r + dr), kd.view(b, ctx, r + dr).transpose(1, 2)
        )
        return torch.matmul(torch.softmax(s * mscale, dim=-1), vd.view(b, ctx, r))

    label = f"MLA FAKQuant H={hm} R={r}"
    try:
        lc = torch.zeros(
            _cache_shape("nz", p.nb, p.bs, 1, r, torch.int8),
            dtype=torch.int8,
            device=dev,
        )
        rc = torch.zeros(
            _cache_shape("nz", p.nb, p.bs, 1, dr, torch.bfloat16),
            dtype=torch.bfloat16,
            device=dev,
        )
        reshape_and_cache_mla(
            latent.bfloat16(), rope.bfloat16(), lc, rc, p.slots, k_scale=lks
        )

        def mla():
            return mla_paged_attention(
                qn, qr, lc, rc, p.table, p.seq_lens, scale=mscale, k_scale=lks
            )

        t_msdpa, t_mla = time_pair(dev, msdpa, mla, repeats=p.repeats)
        mcos = float(
            F.cosine_similarity(
                mla().double().flatten(), msdpa().double().flatten(), dim=0
            )
        )
    except (UnsupportedError, ValueError) as exc:
        return _refused(label, exc), None
    ratio = t_mla / t_msdpa
    row = [label, t_msdpa * 1e3, t_mla * 1e3, f"{ratio:.2f}x", f"{mcos:.5f}"]
    return row, {
        "cache": "MLA FAKQuant",
        "sdpa_s": t_msdpa,
        "paged_s": t_mla,
        "ratio": ratio,
        "cosine_vs_fp32": mcos,
    }


def _report(
    args: argparse.Namespace,
    backend: Any,
    p: _Decode,
    rows: list,
    results: list[dict],
    goal_ratio: float | None,
) -> None:
    """The table, the goal line and the JSON records."""
    dev = backend.device
    print_table(
        ["paged cache", "dense fp32 ms", "paged ms", "paged / dense", "cos vs fp32"],
        rows,
        title=f"decode on {backend.name} ({dev}) B={p.b} H={p.h} Hkv={p.hkv} "
        f"D={p.d} context={p.ctx} block={p.bs} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
    )
    if goal_ratio is None:
        print(f"goal: int8-KV decode <= {GOAL}x SDPA time -> refused on {backend.name}")
    else:
        word = "ok" if goal_ratio <= GOAL else "above goal"
        print(f"goal: int8-KV decode <= {GOAL}x SDPA time: {word} ({goal_ratio:.2f}x)")
    write_results(
        args.json,
        [_record(backend.name, p, r) for r in results],
        backend=backend.name,
    )


def _record(backend_name: str, p: _Decode, r: dict) -> Record:
    goal_row = "int8-KV" in r["cache"]
    return Record(
        NAME,
        backend_name,
        r["cache"],
        p.shape,
        r["paged_s"],
        repeats=p.repeats,
        ratio=r["ratio"],
        baseline="SDPA dense fp32",
        goal=f"<= {GOAL}" if goal_row else None,
        verdict=verdict(r["ratio"], f"<= {GOAL}") if goal_row else None,
        extra={"baseline_s": r["sdpa_s"], "cosine_vs_fp32": r["cosine_vs_fp32"]},
    )


def _sweep(args: argparse.Namespace, backend, dev) -> int:
    from .attention_sweep import SWEEP_HEADERS, plot_sweep, run_sweep

    repeats = 3 if args.quick else args.repeats
    rows, records, best = run_sweep(
        backend.name, dev, quick=args.quick, repeats=repeats
    )
    title = (
        f"decode sweep on {backend.name} ({dev}), D={128}, int8 mode vs bf16 cache "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print_table(SWEEP_HEADERS, rows, title=title)
    print(
        "limit: bytes moved by the int8 mode / bytes moved by the float cache "
        "(the memory-bound best ratio); closeness = limit / measured ratio"
    )
    if best is None:
        print("best: none (every point was refused)")
    else:
        rec = next(
            r for r in records if r.mode == best.mode and r.params == best.params()
        )
        print(
            f"best: {best.mode} B={best.batch} context={best.context} "
            f"H/Hkv={best.heads}/{best.kv_heads} BS={best.block} "
            f"layout={best.layout.upper()}: {rec.ratio:.3f}x of float "
            f"(limit {rec.extra['limit']:.3f}, closeness {rec.extra['closeness']:.2f})"
        )
    write_results(args.json, records, backend=backend.name)
    if args.plot and records:
        plot_sweep(records, args.plot, title)
        print(f"wrote {args.plot}")
    return 0
