"""``ascend-fa bench layout``: NZ pack/unpack throughput against ``torch.clone``.

``torch.clone`` of the same tensor, measured in the same run, is the memcpy limit
(one read, one write, one fresh allocation — exactly what ``nd_to_nz`` does).
Goal: ``nd_to_nz`` and ``nz_to_nd`` reach at least 0.5x of clone at 64 MiB and above.
"""

from __future__ import annotations

import argparse

import torch

from ._util import MiB, gbps, print_table, time_fn
from .results import Record, verdict, write_results

NAME = "layout"
HELP = "nd_to_nz / nz_to_nd throughput (GB/s) vs torch.clone, fp16 and int8"

GOAL = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        metavar="MIB",
        help="tensor sizes in MiB (default 4 16 64 256; --quick: 1 4)",
    )
    parser.add_argument("--repeats", type=int, default=5)


def _matrix(size_mib: int, dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    cols = 4096
    rows = size_mib * MiB // (cols * itemsize)
    # rows deliberately not a multiple of 16 so row padding is exercised
    rows = max(rows - 3, 1)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (rows, cols), dtype=dtype)
    return torch.randn(rows, cols).to(dtype)


def run(args: argparse.Namespace) -> int:
    from ascend_fa import nd_to_nz, nz_to_nd

    sizes = args.sizes or ([1, 4] if args.quick else [4, 16, 64, 256])
    repeats = 2 if args.quick else args.repeats
    rows_out = []
    results = []
    worst = float("inf")
    for dtype in (torch.float16, torch.int8):
        for size in sizes:
            x = _matrix(size, dtype)
            m, n = x.shape
            nbytes = x.numel() * x.element_size()
            z = nd_to_nz(x)
            assert torch.equal(nz_to_nd(z, m, n), x), "round trip mismatch"
            t_clone = time_fn(lambda x=x: x.clone(), repeats=repeats)
            t_pack = time_fn(lambda x=x: nd_to_nz(x), repeats=repeats)
            t_unpack = time_fn(lambda z=z, m=m, n=n: nz_to_nd(z, m, n), repeats=repeats)
            r_pack, r_unpack = t_clone / t_pack, t_clone / t_unpack
            if size >= 64:
                worst = min(worst, r_pack, r_unpack)
            label = str(dtype).removeprefix("torch.")
            rows_out.append(
                [
                    label,
                    size,
                    gbps(nbytes, t_clone),
                    gbps(nbytes, t_pack),
                    f"{r_pack:.2f}x",
                    gbps(nbytes, t_unpack),
                    f"{r_unpack:.2f}x",
                ]
            )
            results.append(
                {
                    "dtype": label,
                    "size_mib": size,
                    "clone_s": t_clone,
                    "nd_to_nz_s": t_pack,
                    "nz_to_nd_s": t_unpack,
                }
            )
            del x, z
    print_table(
        [
            "dtype",
            "MiB",
            "clone GB/s",
            "nd_to_nz GB/s",
            "vs clone",
            "nz_to_nd GB/s",
            "vs clone",
        ],
        rows_out,
        title=f"NZ layout throughput (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
    )
    if worst != float("inf"):
        status = "met" if worst >= GOAL else "NOT met"
        print(f"goal >= {GOAL}x of clone at >= 64 MiB: {status} (worst {worst:.2f}x)")
    records = []
    for r in results:
        params = {"dtype": r["dtype"], "MiB": r["size_mib"]}
        goal = f">= {GOAL}" if r["size_mib"] >= 64 else None
        for op in ("nd_to_nz", "nz_to_nd"):
            ratio = r["clone_s"] / r[f"{op}_s"]
            records.append(
                Record(
                    NAME,
                    "cpu",
                    op,
                    params,
                    r[f"{op}_s"],
                    repeats=repeats,
                    ratio=ratio,
                    baseline="clone",
                    goal=goal,
                    verdict=verdict(ratio, goal),
                    extra={"baseline_s": r["clone_s"]},
                )
            )
    write_results(args.json, records, backend="cpu")
    return 0
