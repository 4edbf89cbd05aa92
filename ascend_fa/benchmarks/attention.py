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

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ._device import add_backend_argument, bench_backend, time_pair
from ._util import print_table, write_json

NAME = "attention"
HELP = "paged decode attention (int8 / bf16 / MLA caches) vs SDPA on a dense fp32 cache"

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


def run(args: argparse.Namespace) -> int:
    from ascend_fa import (
        mla_paged_attention,
        paged_attention,
        reshape_and_cache,
        reshape_and_cache_mla,
    )

    backend = bench_backend(args.backend)
    dev = backend.device
    b = 2 if args.quick else args.batch
    ctx = 1024 if args.quick else args.context
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    repeats = 3 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    nb, table, slots = _paged(b, ctx, bs, gen)
    table, slots = table.to(dev), slots.to(dev)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    key = torch.randn(b * ctx, hkv, d, generator=gen).to(dev)
    value = torch.randn(b * ctx, hkv, d, generator=gen).to(dev)
    query = torch.randn(b, h, d, generator=gen).bfloat16().to(dev)
    scale = 1 / math.sqrt(d)

    # baseline: SDPA over the same K/V as a dense fp32 cache [B, Hkv, ctx, D]
    k_dense = key.view(b, ctx, hkv, d).transpose(1, 2).contiguous()
    v_dense = value.view(b, ctx, hkv, d).transpose(1, 2).contiguous()
    q_dense = query.float().view(b, h, 1, d)

    def sdpa():
        return F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, scale=scale, enable_gqa=True
        )

    ref = sdpa().view(b, h, d)
    rows, results, goal_ratio = [], [], None
    ks, vs = _amax_scale(key, 1), _amax_scale(value, 1)
    for mode in ("int8_kv", "faquant", "float"):
        layout = backend.preferred_layout(mode)
        dtype = torch.bfloat16 if mode == "float" else torch.int8
        label = _LABELS.get(mode, "bf16 {}").format(layout.upper())
        try:
            shape = _cache_shape(layout, nb, bs, hkv, d, dtype)
            kc = torch.zeros(shape, dtype=dtype, device=dev)
            vc = torch.zeros_like(kc)
            sc = (ks, vs) if dtype == torch.int8 else (None, None)
            reshape_and_cache(
                key.bfloat16(), value.bfloat16(), kc, vc, slots, k_scale=sc[0],
                v_scale=sc[1], layout=layout,
            )  # fmt: skip
            kw = dict(num_kv_heads=hkv, scale=scale, layout=layout)
            if mode != "float":
                kw.update(k_scale=ks, v_scale=vs)
            if mode == "faquant":
                kw["q_scale"] = _amax_scale(query, 1)

            def call(kc=kc, vc=vc, kw=kw):
                return paged_attention(query, kc, vc, table, seq_lens, **kw)

            t_sdpa, t = time_pair(dev, sdpa, call, repeats=repeats)
        except (UnsupportedError, ValueError) as exc:
            rows.append([label, "-", "-", "refused", str(exc).split("\n")[-1][:70]])
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

    # MLA FAKQuant decode vs the same math on the dense fp32 latent (one KV head)
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
            _cache_shape("nz", nb, bs, 1, r, torch.int8), dtype=torch.int8, device=dev
        )
        rc = torch.zeros(
            _cache_shape("nz", nb, bs, 1, dr, torch.bfloat16),
            dtype=torch.bfloat16,
            device=dev,
        )
        reshape_and_cache_mla(
            latent.bfloat16(), rope.bfloat16(), lc, rc, slots, k_scale=lks
        )

        def mla():
            return mla_paged_attention(
                qn, qr, lc, rc, table, seq_lens, scale=mscale, k_scale=lks
            )

        t_msdpa, t_mla = time_pair(dev, msdpa, mla, repeats=repeats)
        mcos = float(
            F.cosine_similarity(
                mla().double().flatten(), msdpa().double().flatten(), dim=0
            )
        )
        rows.append(
            [
                label,
                t_msdpa * 1e3,
                t_mla * 1e3,
                f"{t_mla / t_msdpa:.2f}x",
                f"{mcos:.5f}",
            ]
        )
        results.append(
            {
                "cache": "MLA FAKQuant",
                "sdpa_s": t_msdpa,
                "paged_s": t_mla,
                "ratio": t_mla / t_msdpa,
                "cosine_vs_fp32": mcos,
            }
        )
    except (UnsupportedError, ValueError) as exc:
        rows.append([label, "-", "-", "refused", str(exc).split("\n")[-1][:70]])

    print_table(
        ["paged cache", "dense fp32 ms", "paged ms", "paged / dense", "cos vs fp32"],
        rows,
        title=f"decode on {backend.name} ({dev}) B={b} H={h} Hkv={hkv} D={d} "
        f"context={ctx} block={bs} (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
    )
    if goal_ratio is None:
        print(f"goal: int8-KV decode <= {GOAL}x SDPA time -> refused on {backend.name}")
    else:
        verdict = "ok" if goal_ratio <= GOAL else "above goal"
        print(
            f"goal: int8-KV decode <= {GOAL}x SDPA time: {verdict} ({goal_ratio:.2f}x)"
        )
    write_json(
        args.json,
        {
            "backend": backend.name,
            "shape": {"B": b, "H": h, "Hkv": hkv, "D": d, "context": ctx, "block": bs},
            "results": results,
        },
    )
    return 0
