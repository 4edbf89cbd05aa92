"""``ascend-fa fp8 quantize|dequantize``: DeepSeek FP8 block-scale weight conversion."""

from __future__ import annotations

import argparse

__all__ = ["COMMAND", "HELP", "add_arguments", "run"]

COMMAND = "fp8"
HELP = "convert DeepSeek weights between BF16 and FP8 E4M3 with 128x128 block scales"

_REGEX_NOTE = (
    "Patterns are Python regexes matched with re.search against the full tensor name "
    "(unanchored, like grep -E): '.*lm_head' and 'lm_head' both match "
    "'lm_head.weight'; anchor with ^ and $ for whole-name matches."
)

_ROBUST_NOTE = (
    "The output is written to OUTPUT.partial/ with a manifest of finished shards "
    "(size, xxh3-128 hash) and the conversion parameters, and renamed to OUTPUT when "
    "complete; OUTPUT keeps the manifest. Rerunning the same command after an "
    "interruption resumes it (finished shards are verified and skipped); a rerun "
    "with different parameters is refused. An existing non-empty OUTPUT is refused "
    "unless --overwrite, which replaces only an output of this command (one with "
    "the manifest) unless --force is given too; OUTPUT must not be a symbolic link "
    "nor overlap the input. Memory: each worker "
    "streams one chunk of whole block rows at a time (about 0.5 GiB per worker "
    "with the interpreter); --workers is capped by the number of shards, the CPU "
    "count and half of the available memory."
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        metavar="DIR",
        help="checkpoint directory (model.safetensors.index.json + shards, "
        "or a single model.safetensors)",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="shards converted in parallel processes (default 1)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT written by this command (only once the "
        "new one is complete) and discard an interrupted OUTPUT.partial/",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --overwrite: replace OUTPUT even if it is not an output of this "
        "command",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a TTY)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ascend_fa.fp8.selection import DEFAULT_IGNORE, DEFAULT_INCLUDE

    sub = parser.add_subparsers(dest="fp8_command", metavar="ACTION", required=True)
    q = sub.add_parser(
        "quantize",
        help="BF16 -> FP8 E4M3 weights with per-block float32 *_scale_inv",
        description="Quantize the selected 2-D weights of a BF16 checkpoint per "
        "BR x BC block: scale_inv = max(amax|W| / 448, tiny), W_fp8 = W / scale_inv "
        "in fp32, stored as <name> (float8_e4m3fn) and <name>_scale_inv (float32 "
        "[ceil(out/BR), ceil(in/BC)]) in the same shard. " + _ROBUST_NOTE,
        epilog=_REGEX_NOTE,
    )
    _common(q)
    q.add_argument(
        "--reference-fp8",
        metavar="FP8_DIR",
        help="quantize exactly the weights that have a *_scale_inv in this "
        "FP8 checkpoint's model.safetensors.index.json (only the index is "
        "needed; its config.json, if present, supplies ignored_layers); "
        "excludes --include/--ignore",
    )
    q.add_argument(
        "--block-size",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("BR", "BC"),
        help="block rows and columns (default 128 128)",
    )
    q.add_argument(
        "--include",
        nargs="+",
        metavar="REGEX",
        help="quantize 2-D weights whose name matches one of these "
        f"(default: {' '.join(DEFAULT_INCLUDE)})",
    )
    q.add_argument(
        "--ignore",
        nargs="+",
        metavar="REGEX",
        help="keep weights matching one of these in BF16 "
        f"(default: {' '.join(DEFAULT_IGNORE)}); quantization_config.ignored_layers "
        "lists the module names kept in BF16 (e.g. lm_head), the form vLLM matches",
    )
    q.set_defaults(_fp8_run=_quantize)

    d = sub.add_parser(
        "dequantize",
        help="FP8 block-scale weights -> BF16/FP16 (for chips without FP8)",
        description="W = W_fp8.float() * scale_inv (block broadcast) cast to --dtype; "
        "*_scale_inv tensors are dropped, quantization_config is removed from "
        "config.json and torch_dtype set to --dtype. Tensors without a scale pass "
        "through with a warning. " + _ROBUST_NOTE,
    )
    _common(d)
    d.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default="bfloat16",
        help="output dtype (default bfloat16)",
    )
    d.add_argument(
        "--allow-missing-scale",
        action="store_true",
        help="copy FP8 tensors that have no *_scale_inv unchanged instead of failing",
    )
    d.set_defaults(_fp8_run=_dequantize)


def _report(result, verb: str) -> int:
    extra = f", {len(result.resumed)} shard(s) resumed" if result.resumed else ""
    print(
        f"{verb} {len(result.converted)} tensor(s) in {len(result.shards)} "
        f"shard(s){extra} -> {result.output}"
    )
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from ascend_fa.fp8 import quantize_checkpoint

    result = quantize_checkpoint(
        args.input,
        args.output,
        reference_fp8=args.reference_fp8,
        block_size=args.block_size,
        include=args.include,
        ignore=args.ignore,
        workers=args.workers,
        overwrite=args.overwrite,
        force=args.force,
        progress=not args.quiet,
    )
    return _report(result, "quantized")


def _dequantize(args: argparse.Namespace) -> int:
    from ascend_fa.fp8 import dequantize_checkpoint

    result = dequantize_checkpoint(
        args.input,
        args.output,
        dtype=args.dtype,
        allow_missing_scale=args.allow_missing_scale,
        workers=args.workers,
        overwrite=args.overwrite,
        force=args.force,
        progress=not args.quiet,
    )
    return _report(result, "dequantized")


def run(args: argparse.Namespace) -> int:
    from ascend_fa.errors import AscendFAError

    from . import CLIError

    try:
        return int(args._fp8_run(args))
    except AscendFAError as exc:  # one line, exit 2 (no traceback)
        raise CLIError(str(exc)) from exc
