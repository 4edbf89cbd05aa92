"""``ascend-fa bench streaming``: peak memory and time of ``calibrate --streaming``.

Builds Llama-shaped BF16 checkpoints (hidden 1024, 16 heads, intermediate 2816,
a byte-level tokenizer; 20, 40 and 80 layers, the 80-layer one about 2 GB in 8
shards), written one tensor at a time from a seeded generator, then runs
``ascend-fa calibrate`` on each in a fresh process with 4 short samples (float
linears, C8 KV scales for vllm-ascend, no held-out evaluation), with and without
``--streaming``. Each run reports its peak RSS (``ru_maxrss`` of that process) and
its wall time; the whole-model path runs up to ``--whole-layers`` layers (it needs
the whole model in fp32). Goals (issue "layer-streaming calibration"): streaming
peak <= 900 MiB on the 80-layer checkpoint whatever the depth; streaming time <=
1.3x the whole-model time where both run. Artifacts of both paths are compared
tensor by tensor (they must be bit-equal).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ._util import print_table
from .results import Record, verdict, write_results

NAME = "streaming"
HELP = "peak RSS and time of calibrate --streaming vs the whole-model path"

MEMORY_GOAL_MIB = 900
TIME_GOAL = 1.3

#: The child process: calibrate, then print peak RSS and seconds as JSON.
_CHILD = """
import json, resource, sys, time
from ascend_fa.calibration.job import calibrate
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
calibrate(args.pop("model"), **args)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers",
        default="",
        help="comma-separated depths (default 20,40,80; quick 2,4,8)",
    )
    parser.add_argument(
        "--whole-layers",
        type=int,
        default=-1,
        help="run the whole-model path up to this depth (default 40, quick 8)",
    )
    parser.add_argument(
        "--workdir", default=None, help="where checkpoints go (default: a temp dir)"
    )


def _tokenizer() -> Any:
    """A byte-level tokenizer: 256 byte tokens, ``<pad>`` and ``</s>``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte))}
    vocab["<pad>"], vocab["</s>"] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>"
    )


def build_checkpoint(
    path: Path, layers: int, hidden: int, heads: int, inter: int, shards: int
) -> int:
    """A Llama checkpoint of random BF16 weights (std 0.02, norms 1), ``shards``
    files of whole layers, written one tensor at a time; returns its bytes."""
    from transformers import LlamaConfig

    from ascend_fa.artifact import LazyTensors, TensorSpec, write_safetensors

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=260,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    per_layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    groups: list[dict[str, tuple[int, ...]]] = [{} for _ in range(shards)]
    groups[0]["model.embed_tokens.weight"] = (260, hidden)
    per_shard = math.ceil(layers / shards)
    for i in range(layers):
        for k, shape in per_layer.items():
            groups[min(i // per_shard, shards - 1)][f"model.layers.{i}.{k}"] = shape
    groups[-1]["model.norm.weight"] = (hidden,)
    groups[-1]["lm_head.weight"] = (260, hidden)
    gen = torch.Generator().manual_seed(0)

    def make(name: str) -> torch.Tensor:
        shape = next(g[name] for g in groups if name in g)
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0
    groups = [g for g in groups if g]
    for n, group in enumerate(groups, start=1):
        fname = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        specs = {k: TensorSpec(s, torch.bfloat16) for k, s in group.items()}
        write_safetensors(
            path / fname, LazyTensors(specs, make), list(specs), {"format": "pt"}
        )
        weight_map.update(dict.fromkeys(group, fname))
        total += sum(s.nbytes for s in specs.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def _calibrate(src: Path, out: Path, streaming: bool) -> dict[str, float]:
    args = {
        "model": str(src),
        "output": str(out),
        "num_samples": 4,
        "max_length": 64,
        "batch_size": 4,
        "heldout": 0,
        "target": "vllm-ascend",
        "consumer_version": "0.25.1rc1",  # a Llama: C8 loads from 0.25.1rc1 on
        "linear": "none",
        "picture_report": False,
        "progress": False,
        "streaming": streaming,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"calibrate failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                out.update(dict.fromkeys(sf.keys(), f))
        return out

    ia, ib = index(a), index(b)
    if ia.keys() != ib.keys():
        return False
    for name in ia:
        with safe_open(str(ia[name]), "pt") as fa, safe_open(str(ib[name]), "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.dtype != y.dtype or not torch.equal(
            x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        ):
            return False
    return True


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    depths = [
        int(x) for x in (args.layers or ("2,4,8" if quick else "20,40,80")).split(",")
    ]
    whole_max = args.whole_layers if args.whole_layers >= 0 else (8 if quick else 40)
    hidden, heads, inter = (256, 4, 704) if quick else (1024, 16, 2816)
    records: list[Record] = []
    rows = []
    if args.workdir is not None and not Path(args.workdir).is_dir():
        print(
            f"error: --workdir {args.workdir}: not a directory (create it first)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for depth in depths:
            src = Path(tmp) / f"ckpt-{depth}"
            nbytes = build_checkpoint(src, depth, hidden, heads, inter, 8)
            stream = _calibrate(src, Path(tmp) / f"stream-{depth}", True)
            whole = None
            same = None
            if depth <= whole_max:
                whole = _calibrate(src, Path(tmp) / f"whole-{depth}", False)
                same = _same_tensors(
                    Path(tmp) / f"whole-{depth}", Path(tmp) / f"stream-{depth}"
                )
            import shutil

            shutil.rmtree(src)
            peak = stream["peak_kib"] / 1024
            ratio = stream["seconds"] / whole["seconds"] if whole else None
            params = {
                "layers": depth,
                "hidden": hidden,
                "heads": heads,
                "checkpoint_bytes": nbytes,
            }
            records.append(
                Record(
                    NAME,
                    "cpu",
                    "streaming",
                    params,
                    stream["seconds"],
                    ratio=ratio,
                    baseline="whole-model" if whole else None,
                    goal=f"<= {TIME_GOAL}" if whole else None,
                    verdict=verdict(ratio, f"<= {TIME_GOAL}") if whole else None,
                    extra={
                        "peak_rss_mib": round(peak, 1),
                        "memory_goal": f"<= {MEMORY_GOAL_MIB} MiB",
                        "memory_verdict": "ok" if peak <= MEMORY_GOAL_MIB else "miss",
                        "bit_equal": same,
                    },
                )
            )
            if whole:
                records.append(
                    Record(
                        NAME,
                        "cpu",
                        "whole-model",
                        params,
                        whole["seconds"],
                        extra={"peak_rss_mib": round(whole["peak_kib"] / 1024, 1)},
                    )
                )
            rows.append(
                [
                    depth,
                    f"{nbytes / 2**30:.2f}",
                    f"{peak:.0f}",
                    f"{whole['peak_kib'] / 1024:.0f}" if whole else "-",
                    f"{stream['seconds']:.1f}",
                    f"{whole['seconds']:.1f}" if whole else "-",
                    f"{ratio:.2f}" if ratio else "-",
                    {True: "yes", False: "NO", None: "-"}[same],
                ]
            )
    print_table(
        [
            "layers",
            "ckpt GiB",
            "stream peak MiB",
            "whole peak MiB",
            "stream s",
            "whole s",
            "time ratio",
            "bit-equal",
        ],
        rows,
    )
    print(
        f"goals: streaming peak <= {MEMORY_GOAL_MIB} MiB at every depth; "
        f"streaming time <= {TIME_GOAL}x whole-model"
    )
    write_results(getattr(args, "json", None), records, backend="cpu")
    return 0
