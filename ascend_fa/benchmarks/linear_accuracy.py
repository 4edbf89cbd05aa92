"""``ascend-fa bench linear-accuracy``: W8A8 / W8A8_DYNAMIC linears + FAQuant vs float.

On SmolLM2-135M-Instruct (loaded once) with the packaged calibration set and the
packaged held-out prose and code texts, one row per recipe:

* **FAQuant only** — float linears, the default FA recipe;
* **W8A8 RTN** — the round-to-nearest baseline: per-tensor min/max activation
  ranges, no smoothing, no fallback;
* **W8A8 default** — what ``calibrate --linear w8a8`` does (layer-sequential,
  smoothing and range searched per group, automatic fallback by the layer-local
  criterion, or the whole-model KL scan with ``--fallback-criterion kl``);
* **W8A8_DYNAMIC** — ``--linear w8a8_dynamic`` with the same machinery.

Every quantized row also has FAQuant attention calibrated after its linears (as
``calibrate`` does). Columns: perplexity change, mean token KL(float || quantized)
and top-1 agreement per domain, linears kept float, and the calibration time as a
ratio of plain forwards over the same calibration batches, measured in the same
run. Goals (issue): default KL <= 0.03, top-1 >= 0.90, ppl <= +3 %, <= 10 % float,
>= 20x lower KL than RTN; dynamic KL <= 0.02, top-1 >= 0.93; overhead <= 1.35x.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import torch

from ._util import print_table, write_json

NAME = "linear-accuracy"
HELP = "W8A8 / W8A8_DYNAMIC linears + FAQuant: ppl, KL, top-1 vs float; RTN baseline"

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --model")
    parser.add_argument(
        "--num-samples", type=int, default=0, help="calibration samples (32; quick 4)"
    )
    parser.add_argument(
        "--max-length", type=int, default=0, help="tokens per sample (512; quick 64)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--max-eval-tokens",
        type=int,
        default=0,
        help="held-out tokens per domain (all; quick 128)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="bf16", help="artifact dtype"
    )
    parser.add_argument(
        "--fallback-criterion",
        choices=("layer", "kl"),
        default="layer",
        help="the linear fallback's criterion (calibrate's "
        "--linear-fallback-criterion; default layer)",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.calibration.data import load_calib_texts
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.methods import calibration_split
    from ascend_fa.calibration.pipeline import (
        calibrate_linears,
        calibrate_model,
        calibration_batches,
        run_forwards,
    )
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.evaluation import evaluate, load_eval_text, token_windows
    from ascend_fa.linear import LinearConfig
    from ascend_fa.models import load_model

    n = args.num_samples or (4 if args.quick else 32)
    length = args.max_length or (64 if args.quick else 512)
    max_eval = args.max_eval_tokens or (128 if args.quick else None)
    dtype = _DTYPES[args.dtype]
    t0 = time.perf_counter()
    loaded = load_model(args.model, args.gguf_file)
    net, tok = loaded.model, loaded.tokenizer
    t_load = time.perf_counter() - t0
    calib = calibration_split(load_calib_texts(), n)
    windows = {
        d: token_windows(tok, load_eval_text(d), window=512, max_tokens=max_eval)
        for d in ("prose", "code")
    }
    recipe = load_recipe(default_recipe_path())

    def batches() -> list[dict[str, torch.Tensor]]:
        return list(
            calibration_batches(
                tok, calib, max_length=length, batch_size=args.batch_size
            )
        )

    with torch.no_grad():
        run_forwards(net, batches()[:1])  # warm-up
        t = time.perf_counter()
        run_forwards(net, batches())
        plain = time.perf_counter() - t

    scan: dict[str, Any] = dict(scan_samples=2, scan_tokens=64) if args.quick else {}
    scan["criterion"] = getattr(args, "fallback_criterion", "layer")
    variants: dict[str, LinearConfig | None] = {
        "FAQuant only (float linears)": None,
        "W8A8 RTN (per-tensor min/max) + FAQuant": LinearConfig.round_to_nearest(
            "W8A8", dtype
        ),
        "W8A8 default + FAQuant": LinearConfig("W8A8", dtype, **scan),
        "W8A8_DYNAMIC + FAQuant": LinearConfig("W8A8_DYNAMIC", dtype, **scan),
    }
    models: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for name, cfg in variants.items():
        m = copy.deepcopy(net)
        t = time.perf_counter()
        lin = None
        if cfg is not None:
            lin = calibrate_linears(
                m,
                tok,
                calib,
                cfg,
                max_length=length,
                batch_size=args.batch_size,
                progress=False,
            )
        res = calibrate_model(
            m,
            tok,
            calib,
            recipe=recipe,
            max_length=length,
            batch_size=args.batch_size,
            progress=False,
        )
        secs = time.perf_counter() - t
        print(f"calibrated {name}: {secs:.1f} s", file=sys.stderr, flush=True)
        specs[name] = res.export_scales(m)
        res.remove(m)
        models[name] = m
        info[name] = {
            "seconds": secs,
            "ratio": secs / plain,
            "float": 0 if lin is None else lin.num_float,
            "linears": 0 if lin is None else lin.num_linears,
            "report": None if lin is None else lin.to_report(),
        }
    results = {d: evaluate(net, w, specs, models=models) for d, w in windows.items()}
    headers = ["recipe"]
    for d in results:
        headers += [f"{d} ppl Δ", f"{d} KL", f"{d} top-1"]
    headers += ["linears float", "calib time vs plain"]
    first = next(iter(specs))
    rows = [["float"]]
    for res in results.values():
        rows[0] += [f"ppl {res[first].perplexity_float:.3f}", "0", "1"]
    rows[0] += ["all", "1.00x"]
    for name in specs:
        row = [name]
        for d in results:
            r = results[d][name]
            row += [f"{r.ppl_delta_pct:+.2f}%", f"{r.kl:.4f}", f"{r.top1:.3f}"]
        i = info[name]
        row += [
            f"{i['float']}/{i['linears']}" if i["linears"] else "all",
            f"{i['ratio']:.2f}x",
        ]
        rows.append(row)
    print(
        f"model: {loaded.gguf_file or loaded.source_dir} (load {t_load:.1f} s); "
        f"{len(calib)} calibration samples x {length} tokens, batch "
        f"{args.batch_size}; plain forwards {plain:.1f} s; artifact dtype "
        f"{args.dtype}; held-out tokens "
        + ", ".join(f"{d} {next(iter(r.values())).tokens}" for d, r in results.items())
        + f"; {torch.get_num_threads()} threads"
    )
    print_table(headers, rows, title="Linear quantization accuracy (all with FAQuant)")
    names = list(specs)
    rtn, default, dyn = names[1], names[2], names[3]
    verdicts = []
    for d in results:
        r, b, y = results[d][default], results[d][rtn], results[d][dyn]
        ok = r.kl <= 0.03 and r.top1 >= 0.90 and r.ppl_delta_pct <= 3.0
        verdicts.append(
            f"{d}: default KL {r.kl:.4f} <= 0.03, top-1 {r.top1:.3f} >= 0.90, ppl "
            f"{r.ppl_delta_pct:+.2f}% <= +3%: {'met' if ok else 'MISSED'}; "
            f"RTN/default KL {b.kl / max(r.kl, 1e-12):.1f}x (>= 20x: "
            f"{'met' if b.kl >= 20 * r.kl else 'MISSED'}); dynamic KL {y.kl:.4f} "
            f"<= 0.02, top-1 {y.top1:.3f} >= 0.93: "
            f"{'met' if y.kl <= 0.02 and y.top1 >= 0.93 else 'MISSED'}"
        )
    frac = info[default]["float"] / max(info[default]["linears"], 1)
    verdicts.append(
        f"default linears float {frac:.1%} <= 10%: "
        + ("met" if frac <= 0.10 else "MISSED")
    )
    for line in verdicts:
        print(line)
    write_json(
        args.json,
        {
            "benchmark": NAME,
            "plain_seconds": plain,
            "variants": {k: {**info[k]} for k in info},
            "results": {
                d: {k: v.to_dict() for k, v in res.items()}
                for d, res in results.items()
            },
            "verdicts": verdicts,
        },
    )
    return 0
