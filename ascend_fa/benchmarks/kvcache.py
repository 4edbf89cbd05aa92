"""``ascend-fa bench kvcache``: paged cache writes and KV-cache memory per token.

Write throughput is GB/s of *cache bytes written* by ``reshape_and_cache`` /
``reshape_and_cache_mla`` (the public calls: validation, quantize-on-write for
int8, scatter) for ``T`` tokens, next to ``torch.clone`` of the same number of
bytes measured alternately with it on the same device (the memcpy limit,
allocation included). Goals at T = 4096, Hkv = 8, D = 128, block 128: prefill writes
>= 0.5x of clone for the int8 NZ cache (quantize-on-write) and the float ND cache,
GQA and MLA (R = 512, Dr = 64).

Two slot patterns: ``prefill`` (whole blocks handed out in shuffled order, what a
block allocator gives a new prompt) and ``scattered`` (distinct random slots: a
decode step writes like this, one token per sequence).

Memory per token: K + V cache bytes per token and layer (with the per-layer fp32
scales amortized over the context) for bf16 versus int8 GQA caches (goal <= 0.51),
and MLA bf16 latent + rope versus FAKQuant (int8 latent, bf16 rope).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from ..errors import UnsupportedError
from ._device import add_backend_argument, bench_backend, time_pair
from ._util import gbps, print_table
from .results import Record, verdict, write_results

NAME = "kvcache"
HELP = "reshape_and_cache GB/s vs torch.clone (float/int8, NZ/ND, GQA/MLA), KV bytes"
#: Devices this benchmark runs on (it resolves ``--backend`` itself).
BACKENDS = ("cpu", "cuda", "npu")

GOAL_WRITE = 0.5
GOAL_BYTES = 0.51
#: (label, cache dtype, layout, MLA?) of each write row; goal rows are marked.
WRITES = [
    ("float16 NZ", torch.float16, "nz", False, False),
    ("float16 ND", torch.float16, "nd", False, True),
    ("int8 NZ (quantize-on-write)", torch.int8, "nz", False, True),
    ("int8 ND (quantize-on-write)", torch.int8, "nd", False, False),
    ("MLA FAKQuant int8 NZ + bf16 rope", torch.int8, "nz", True, True),
    ("MLA bf16 ND latent + rope", torch.bfloat16, "nd", True, True),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_backend_argument(parser)
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
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or (cpu backend) the process's CPU time, which a shared "
        "machine's load moves much less",
    )
    parser.add_argument(
        "--kernel",
        choices=("auto", "eager"),
        default="auto",
        help="CPU cache-write path: auto (the native C kernel when it builds) or "
        "eager (torch ops only)",
    )


def _slots(
    pattern: str, t: int, bs: int, nb: int, gen: torch.Generator
) -> torch.Tensor:
    if pattern == "prefill":
        blocks = torch.randperm(nb, generator=gen)[: -(-t // bs)]
        slots = (blocks.view(-1, 1) * bs + torch.arange(bs)).view(-1)[:t]
    else:
        slots = torch.randperm(nb * bs, generator=gen)[:t]
    return slots.to(torch.int32)


def _kernel_path() -> dict[str, object]:
    """Select the CPU cache-write path for this run and describe it: which path
    runs, and the cold compile time of the native kernels (built once into a
    temporary directory, so a warm disk cache does not hide the first-call cost)."""
    from ascend_fa.atb_ops.native import build_library, native_status

    status = native_status()
    cold = None
    if status.available:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            build_library(tmp)
            cold = time.perf_counter() - start
    return {
        "path": status.describe(),
        "native": status.available,
        "cold_compile_s": cold,
    }


def _bytes_per_token(hkv: int, d: int, bs: int, context: int) -> list[list[object]]:
    from ascend_fa import PagedKVCache

    nb = -(-context // bs)
    rows = []
    bf = PagedKVCache(
        1, hkv, d, num_blocks=nb, block_size=bs, dtype=torch.bfloat16, backend="cpu"
    )
    i8 = PagedKVCache(
        1, hkv, d, num_blocks=nb, block_size=bs, mode="int8_kv", backend="cpu"
    )
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
    kw = dict(num_blocks=nb, block_size=bs, mla=True, rope_dim=64, backend="cpu")
    mbf = PagedKVCache(1, 1, 512, **kw)
    m8 = PagedKVCache(1, 1, 512, mode="fakquant", **kw)
    mbase = mbf.bytes_per_token()
    mq = m8.bytes_per_token(scale_bytes=4)  # fa_k.scale [1] fp32
    rows.append(["MLA R=512 Dr=64", "bf16 latent+rope", mbase, 1.0, ""])
    rows.append(
        ["MLA R=512 Dr=64", "FAKQuant int8 latent + bf16 rope", mq, mq / mbase, ""]
    )
    return rows


def _cache(shape, dtype, dev):
    return torch.zeros(shape, dtype=dtype, device=dev)


def _writer(args, dev, t, hkv, d, bs, nb, dtype, layout, mla, slots, gen):
    """``(write fn, bytes written per call)`` of one row."""
    from ascend_fa import reshape_and_cache, reshape_and_cache_mla
    from ascend_fa.atb_ops import nz_cache_shape

    quant = dtype == torch.int8
    if mla:
        r, dr = 512, 64
        latent = torch.randn(t, r, generator=gen).bfloat16().to(dev)
        rope = torch.randn(t, dr, generator=gen).bfloat16().to(dev)
        shapes = [
            nz_cache_shape(nb, bs, 1, w, dt) if layout == "nz" else (nb, bs, 1, w)
            for w, dt in ((r, dtype), (dr, torch.bfloat16))
        ]
        lc, rc = _cache(shapes[0], dtype, dev), _cache(shapes[1], torch.bfloat16, dev)
        ks = torch.full((1,), 0.02, device=dev) if quant else None
        nbytes = t * (r * lc.element_size() + dr * rc.element_size())

        def write():
            reshape_and_cache_mla(
                latent, rope, lc, rc, slots, k_scale=ks, layout=layout
            )

        return write, nbytes
    key = torch.randn(t, hkv, d, generator=gen).half().to(dev)
    value = torch.randn(t, hkv, d, generator=gen).half().to(dev)
    shape = (
        nz_cache_shape(nb, bs, hkv, d, dtype) if layout == "nz" else (nb, bs, hkv, d)
    )
    kc, vc = _cache(shape, dtype, dev), _cache(shape, dtype, dev)
    scale = torch.full((hkv,), 0.02, device=dev) if quant else None
    nbytes = 2 * t * hkv * d * kc.element_size()

    def write():
        reshape_and_cache(
            key, value, kc, vc, slots, k_scale=scale, v_scale=scale, layout=layout
        )

    return write, nbytes


def run(args: argparse.Namespace) -> int:
    if args.kernel == "eager":
        from ascend_fa.atb_ops.native import native_disabled

        with native_disabled():
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    backend = bench_backend(args.backend)
    dev = backend.device
    t = 1024 if args.quick else args.tokens
    repeats = 3 if args.quick else args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    path = _kernel_path() if dev.type == "cpu" else None
    hkv, d, bs = args.kv_heads, args.head_dim, args.block_size
    nb = -(-t // bs) * 2
    gen = torch.Generator().manual_seed(0)
    rows, results, goals = [], [], []
    for label, dtype, layout, mla, is_goal in WRITES:
        for pattern in ("prefill", "scattered"):
            slots = _slots(pattern, t, bs, nb, gen).to(dev)
            write, nbytes = _writer(
                args, dev, t, hkv, d, bs, nb, dtype, layout, mla, slots, gen
            )
            same = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            try:
                t_clone, t_write = time_pair(
                    dev, same.clone, write, repeats=repeats, clock=args.clock
                )
            except UnsupportedError as exc:
                rows.append(
                    [label, pattern, t, "-", "-", "-", "refused", str(exc)[:60]]
                )
                break
            ratio = t_clone / t_write
            if is_goal and pattern == "prefill":
                goals.append((label, ratio))
            rows.append(
                [
                    label,
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
                    "cache": label,
                    "slots": pattern,
                    "tokens": t,
                    "bytes": nbytes,
                    "clone_s": t_clone,
                    "write_s": t_write,
                    "vs_clone": ratio,
                }
            )
    title = (
        f"reshape_and_cache on {backend.name} ({dev}), T={t} Hkv={hkv} D={d} BS={bs},"
        f" MLA R=512 Dr=64 (torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, {args.clock} clock)"
    )
    headers = [
        "cache",
        "slots",
        "T",
        "MiB written",
        "clone GB/s",
        "write GB/s",
        "vs clone",
        "write ms",
    ]
    print_table(headers, rows, title=title)
    if path is not None:
        print(f"cpu write path: {path['path']}")
        if path.get("cold_compile_s") is not None:
            print(
                f"first-call cost: a cold compile of the native kernels takes "
                f"{path['cold_compile_s']:.2f} s (once; then loaded from the disk "
                "cache)"
            )
    for label, ratio in goals:
        word = "ok" if ratio >= GOAL_WRITE else "below goal"
        print(f"goal {label} prefill >= {GOAL_WRITE}x clone: {word} ({ratio:.2f}x)")
    mem = _bytes_per_token(hkv, d, bs, args.context)
    ratio8 = mem[1][3]
    word = "ok" if ratio8 <= GOAL_BYTES else "above goal"
    print(f"goal int8 K+V bytes/token <= {GOAL_BYTES}x bf16: {word} ({ratio8:.3f}x)")
    print()
    print_table(
        ["cache", "contents", "bytes/token/layer", "vs bf16", f"<= {GOAL_BYTES}"],
        mem,
        title=f"KV-cache bytes per token (scales amortized over {args.context} tokens)",
    )
    goal_labels = {g for g, _ in goals}
    records = []
    for r in results:
        goal = (
            f">= {GOAL_WRITE}"
            if r["cache"] in goal_labels and r["slots"] == "prefill"
            else None
        )
        records.append(
            Record(
                NAME,
                backend.name,
                r["cache"],
                {
                    "slots": r["slots"],
                    "T": r["tokens"],
                    "Hkv": hkv,
                    "D": d,
                    "BS": bs,
                    "bytes": r["bytes"],
                },
                r["write_s"],
                ratio=r["vs_clone"],
                baseline="clone",
                goal=goal,
                verdict=verdict(r["vs_clone"], goal),
                extra={"baseline_s": r["clone_s"]},
            )
        )
    write_results(
        args.json,
        records,
        backend=backend.name,
        extra={
            "clock": args.clock,
            "cpu_write_path": path,
            "bytes_per_token": [
                {"cache": m[0], "contents": m[1], "bytes": m[2], "ratio": m[3]}
                for m in mem
            ],
        },
    )
    return 0
