"""``ascend-fa bench kvcache``: paged NZ cache writes and KV-cache memory per token.

Write throughput is GB/s of *cache bytes written* (K and V) by ``reshape_and_cache``
(the public call: validation, quantize-on-write for int8, scatter) for ``T`` tokens,
next to ``torch.clone`` of the same number of bytes measured in the same run (the
memcpy limit). Goal: >= 0.5x of clone at T = 4096, Hkv = 8, D = 128.

Two slot patterns: ``prefill`` — whole blocks handed out in shuffled order (what a
block allocator gives a new prompt), and ``scattered`` — distinct random slots (the
worst case; a decode step writes like this, one token per sequence).

Memory per token: K + V cache bytes per token and layer (including the per-layer
fp32 scales amortized over the context) for bf16 versus int8 GQA caches (goal:
ratio <= 0.51), and for MLA: bf16 latent + rope versus FAKQuant (int8 latent, bf16
rope).
"""

from __future__ import annotations

import argparse

import torch

from ._util import gbps, print_table, time_fn, write_json

NAME = "kvcache"
HELP = "reshape_and_cache GB/s vs torch.clone (fp16, int8 NZ) and KV bytes per token"

GOAL_WRITE = 0.5
GOAL_BYTES = 0.51


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="T (default 4096)")
    parser.add_argument("--kv-heads", type=int, default=8, help="Hkv (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    parser.add_argument("--block-size", type=int, default=128, help="BS (default 128)")
    parser.add_argument(
        "--context",
        type=int,
        default=4096,
        help="context length the per-layer scales amortize over",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both sides (default: torch's default)",
    )
    parser.add_argument("--repeats", type=int, default=7)


def _slots(
    pattern: str, t: int, bs: int, nb: int, gen: torch.Generator
) -> torch.Tensor:
    if pattern == "prefill":
        blocks = torch.randperm(nb, generator=gen)[: -(-t // bs)]
        slots = (blocks.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:t]
    else:
        slots = torch.randperm(nb * bs, generator=gen)[:t]
    return slots.to(torch.int32)


def _bytes_per_token(hkv: int, d: int, bs: int, context: int) -> list[list[object]]:
    from ascend_fa import PagedKVCache

    nb = -(-context // bs)
    rows = []
    bf = PagedKVCache(1, hkv, d, num_blocks=nb, block_size=bs, dtype=torch.bfloat16)
    i8 = PagedKVCache(1, hkv, d, num_blocks=nb, block_size=bs, mode="int8_kv")
    base = bf.bytes_per_token()
    q8 = i8.bytes_per_token(scale_bytes=2 * hkv * 4)  # fa_k, fa_v scales, fp32 [Hkv]
    rows.append([f"GQA Hkv={hkv} D={d}", "bf16 K+V", base, 1.0, ""])
    rows.append(
        [
            f"GQA Hkv={hkv} D={d}",
            "int8 K+V + scales",
            q8,
            q8 / base,
            "PASS" if q8 / base <= GOAL_BYTES else "FAIL",
        ]
    )
    mbf = PagedKVCache(1, 1, 512, num_blocks=nb, block_size=bs, mla=True, rope_dim=64)
    m8 = PagedKVCache(
        1, 1, 512, num_blocks=nb, block_size=bs, mla=True, rope_dim=64, mode="fakquant"
    )
    mbase = mbf.bytes_per_token()
    mq = m8.bytes_per_token(scale_bytes=4)  # fa_k.scale [1] fp32
    rows.append(["MLA R=512 Dr=64", "bf16 latent+rope", mbase, 1.0, ""])
    rows.append(
        ["MLA R=512 Dr=64", "FAKQuant int8 latent + bf16 rope", mq, mq / mbase, ""]
    )
    return rows


def run(args: argparse.Namespace) -> int:
    from ascend_fa import reshape_and_cache
    from ascend_fa.atb_ops import nz_cache_shape

    t = 1024 if args.quick else args.tokens
    repeats = 3 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    hkv, d, bs = args.kv_heads, args.head_dim, args.block_size
    nb = -(-t // bs) * 2
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(t, hkv, d, generator=gen).half()
    value = torch.randn(t, hkv, d, generator=gen).half()
    rows, results, worst = [], [], float("inf")
    for cache_dtype in (torch.float16, torch.int8):
        quant = cache_dtype == torch.int8
        scales = (
            (torch.full((hkv,), 0.02), torch.full((hkv,), 0.02))
            if quant
            else (None, None)
        )
        shape = nz_cache_shape(nb, bs, hkv, d, cache_dtype)
        kc = torch.zeros(shape, dtype=cache_dtype)
        vc = torch.zeros(shape, dtype=cache_dtype)
        nbytes = 2 * t * hkv * d * kc.element_size()
        same = torch.zeros(2, t, hkv, d, dtype=cache_dtype)
        t_clone = time_fn(lambda same=same: same.clone(), repeats=repeats)
        for pattern in ("prefill", "scattered"):
            slots = _slots(pattern, t, bs, nb, gen)

            def write(kc=kc, vc=vc, slots=slots, scales=scales):
                reshape_and_cache(
                    key, value, kc, vc, slots, k_scale=scales[0], v_scale=scales[1]
                )

            t_write = time_fn(write, repeats=repeats)
            ratio = t_clone / t_write
            if pattern == "prefill":
                worst = min(worst, ratio)
            name = "int8 (quantize-on-write)" if quant else "float16"
            rows.append(
                [
                    name,
                    pattern,
                    t,
                    round(nbytes / 2**20, 2),
                    gbps(nbytes, t_clone),
                    gbps(nbytes, t_write),
                    f"{ratio:.2f}x",
                    t_write * 1e3,
                ]
            )
            results.append(
                {
                    "cache": name,
                    "slots": pattern,
                    "tokens": t,
                    "bytes": nbytes,
                    "clone_s": t_clone,
                    "write_s": t_write,
                    "vs_clone": ratio,
                }
            )
    print_table(
        [
            "cache",
            "slots",
            "T",
            "MiB written",
            "clone GB/s",
            "write GB/s",
            "vs clone",
            "write ms",
        ],
        rows,
        title=f"reshape_and_cache NZ, Hkv={hkv} D={d} BS={bs} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads)",
    )
    print(
        f"goal: prefill writes >= {GOAL_WRITE}x of clone -> worst {worst:.2f}x "
        f"({'PASS' if worst >= GOAL_WRITE else 'below goal'})"
    )
    mem = _bytes_per_token(hkv, d, bs, args.context)
    print()
    print_table(
        ["cache", "contents", "bytes/token/layer", "vs bf16", f"<= {GOAL_BYTES}"],
        mem,
        title=f"KV-cache bytes per token (scales amortized over {args.context} tokens)",
    )
    write_json(
        args.json,
        {
            "writes": results,
            "bytes_per_token": [
                {"cache": r[0], "contents": r[1], "bytes": r[2], "ratio": r[3]}
                for r in mem
            ],
        },
    )
    return 0
