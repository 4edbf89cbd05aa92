"""The ``ascend-fa emulate`` verb: the quantized inference path end to end on CPU/CUDA.

The model's attention goes through the paged cache (:mod:`ascend_fa.emulation`):
``reshape_and_cache`` + ``prefill_attention`` for the prompt, ``paged_attention``
for every generated token. For each mode the command reports

* **teacher-forced fidelity** over the held-out text in windows of ``--window``
  tokens, each window one prefill through the paged cache: the per-token KL
  divergence ``KL(float || mode)`` of the next-token distributions and the top-1
  agreement with the plain float model on the same tokens — the figures that say
  whether the int8 path is faithful;
* **perplexity** over the same windows, and its change vs the plain model;
* **greedy match**: the same prompt decoded greedily for ``--max-new-tokens``
  tokens, compared position by position with the plain float model's tokens:
  matching positions, and the common prefix (tokens before the first divergence —
  after it the two continuations condition on different text). With ``--chat`` the
  prompt goes through the tokenizer's chat template and decoding stops at its
  end-of-turn token (otherwise EOS is not special).

``float-paged`` (float cache) is always run: it must reproduce the plain model,
which shows that the plumbing is exact before the int8 rows are read.

With ``--artifact`` the modes follow what the artifact deploys (or ``--mode``,
which must fit it): FA scales (MindIE) run ``int8_kv`` and ``faquant``, C8 scales
(vllm-ascend) run ``c8`` -- the int8 cache with per-channel scales and a float
query, quantized on write as vllm-ascend does -- and vLLM FP8 KV scales run
``fp8_kv``, written as vLLM on CUDA writes its cache (round to nearest) or, with
``--fp8-rounding trunc``, as vLLM on CPU does (toward zero, one scale per layer).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_fa.artifact.provenance import check_artifact_model
from ascend_fa.calibration.kv import fp8_rounding_flag
from ascend_fa.errors import FileFormatError, InputError, NotFoundError
from ascend_fa.linear import artifact_model
from ascend_fa.metrics import token_kl, token_nll

from .runtime import enable_paged_int8_attention

__all__ = [
    "DEFAULT_PROMPT",
    "EmulateReport",
    "compare",
    "fidelity",
    "greedy_plain",
    "window_logits",
    "perplexity_plain",
    "run_emulate",
    "ARTIFACT_MODES",
    "artifact_scales",
]

DEFAULT_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs at dusk, as she had done every "
    "evening for thirty years. She"
)


@torch.no_grad()
def greedy_plain(
    model: Any,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy decoding with the unmodified model and its own KV cache: ``ids``
    ``[B, S]`` -> ``[B, S + N]``, ``N <= max_new_tokens`` (stops when every row has
    produced ``eos_token_id``, finished rows repeat it — the rule of
    :meth:`QuantizedKVRuntime.generate`)."""
    from ascend_fa.hf_compat import cache_kwargs, output_cache

    out = model(input_ids=ids, use_cache=True)
    cache, tokens = output_cache(out), [ids]
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(dim=-1)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        tokens.append(nxt[:, None])
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], **cache_kwargs(cache), use_cache=True)
        cache = output_cache(out)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def window_logits(model: Any, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The unmodified model's logits ``[1, S, V]`` (fp32, CPU) of each window."""
    device = next(model.parameters()).device
    return [
        model(input_ids=w.view(1, -1).to(device)).logits.float().cpu() for w in windows
    ]


@torch.no_grad()
def perplexity_plain(model: Any, windows: list[torch.Tensor]) -> float:
    """``exp(mean next-token NLL)`` of the unmodified model over ``windows``."""
    total, count = 0.0, 0
    for w, logits in zip(windows, window_logits(model, windows), strict=True):
        n, c = token_nll(logits, w.view(1, -1))
        total += n
        count += c
    return math.exp(total / count)


def fidelity(
    logits: list[torch.Tensor],
    ref_logits: list[torch.Tensor],
    windows: list[torch.Tensor],
) -> dict[str, float]:
    """Teacher-forced figures of ``logits`` against the float model's
    ``ref_logits`` on the same ``windows``: ``ppl``, mean per-token ``kl``
    (KL(float || quantized)) and ``top1`` agreement."""
    nll = kl = 0.0
    agree = count = positions = 0
    for w, lg, ref in zip(windows, logits, ref_logits, strict=True):
        n, c = token_nll(lg, w.view(1, -1))
        nll += n
        count += c
        k, a, p = token_kl(ref, lg)
        kl += k
        agree += a
        positions += p
    return {
        "ppl": math.exp(nll / count),
        "kl": kl / positions,
        "top1": agree / positions,
    }


def compare(reference: torch.Tensor, tokens: torch.Tensor, start: int) -> dict:
    """Position-wise comparison of two ``[S + N]`` generations after ``start``:
    ``matched`` positions, ``prefix`` (tokens before the first difference), ``n``."""
    a, b = reference[start:], tokens[start:]
    n = min(a.numel(), b.numel())
    same = (a[:n] == b[:n]).tolist()
    prefix = same.index(False) if False in same else n
    return {"matched": int(sum(same)), "prefix": prefix, "n": n}


#: Modes an artifact's scales can run, by what it deploys (the first are the
#: default).
ARTIFACT_MODES = {"fa": ("int8_kv", "faquant"), "c8": ("c8",), "fp8": ("fp8_kv",)}


def artifact_scales(directory: str | Path) -> tuple[str, Any]:
    """``(kind, scales)`` of an artifact: ``"fa"`` with its FA scale map, or
    ``"c8"`` / ``"fp8"`` with its KV-cache scales ``{attn: {"k", "v"}}``.

    C8 scales are rounded to the artifact's ``torch_dtype`` (float16 / bfloat16),
    the dtype vllm-ascend holds them in (``kv_c8.py`` casts them to the parameter
    dtype), as ``eval`` does; the runtime rounds them to the model's dtype too.
    """
    from ascend_fa.artifact.reader import (
        read_artifact_config,
        read_fa_scales,
        read_kv_scales,
    )

    fa = read_fa_scales(directory)
    if fa:
        return "fa", fa
    kv = read_kv_scales(directory)
    if kv is None:
        raise FileFormatError(
            f"artifact {directory} has no FA or KV-cache scales (no "
            "<attn>.fa_{q,k,v}.scale, <attn>.{k,v}_proj.kv_cache_scale or "
            "<attn>.{k,v}_scale tensors)",
            path=directory,
        )
    kind, scales = kv
    name = (read_artifact_config(directory) or {}).get("torch_dtype")
    held = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        name if isinstance(name, str) else ""
    )
    if kind == "c8" and held is not None:
        scales = {
            attn: {side: t.to(held).float() for side, t in sides.items()}
            for attn, sides in scales.items()
        }
    return kind, scales


def _artifact_modes(kind: str, modes: list[str] | None) -> list[str]:
    fits = ARTIFACT_MODES[kind]
    if not modes:
        return list(fits)
    bad = [m for m in modes if m not in fits]
    if bad:
        raise InputError(
            f"--mode {bad[0]} does not fit the artifact: its {kind.upper()} scales "
            f"run {' / '.join(fits)}"
        )
    return modes


def _end_of_turn(tokenizer: Any) -> int | None:
    """The token that ends the assistant's turn in the chat template: the template's
    own end-of-turn marker when the tokenizer knows one (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``), else EOS."""
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if marker in vocab:
            return int(vocab[marker])
    return tokenizer.eos_token_id


@dataclass
class EmulateReport:
    """What :func:`run_emulate` measured: one row per mode (the plain model first),
    each with ``mode``, ``scales``, greedy ``matched``/``prefix``/``n``, ``ppl``,
    ``seconds`` and the generated ``text``."""

    model: str
    prompt: str
    chat: bool
    prompt_tokens: int
    eval_data: str
    eval_windows: int
    eval_tokens: int
    artifact: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "chat": self.chat,
            "prompt_tokens": self.prompt_tokens,
            "eval_tokens": self.eval_tokens,
            "artifact": self.artifact,
            "rows": self.rows,
        }


def run_emulate(
    model: str | Path | None = None,
    *,
    gguf_file: str | None = None,
    artifact: str | Path | None = None,
    modes: list[str] | None = None,
    prompt: str = DEFAULT_PROMPT,
    chat: bool = False,
    max_new_tokens: int = 64,
    eval_data: str = "prose",
    window: int = 512,
    max_eval_tokens: int | None = 2048,
    block_size: int = 128,
    backend: str | None = None,
    fp8_rounding: str = "nearest",
) -> EmulateReport:
    """Run the plain model, ``float`` through the paged cache, and each of
    ``modes`` (default: ``int8_kv`` and ``faquant``, or what ``artifact`` deploys)
    on the same prompt and text. ``fp8_rounding`` is the ``fp8_kv`` cache write's
    rounding: ``"nearest"`` (vLLM on CUDA) or ``"trunc"`` (vLLM on CPU)."""
    from ascend_fa.evaluation import load_eval_text, token_windows
    from ascend_fa.models import load_model

    if max_new_tokens <= 0:
        raise InputError("--max-new-tokens must be > 0")
    if window < 2:
        raise InputError("--window must be >= 2")
    if max_eval_tokens is not None and max_eval_tokens < 0:
        raise InputError(
            f"--max-eval-tokens must be >= 0 (0 = all), got {max_eval_tokens}"
        )
    if block_size <= 0:
        raise InputError(f"--block-size must be > 0, got {block_size}")
    fp8_rounding_flag(fp8_rounding)
    if artifact is not None and not Path(artifact).is_dir():
        raise NotFoundError("artifact not found", path=artifact)
    # Read (and so check) the artifact and the text before the model loads.
    kind, scale_map = artifact_scales(artifact) if artifact is not None else ("", None)
    if artifact is not None:  # another model's artifact, broken linears: refused
        check_artifact_model(artifact, model)
    eval_text = load_eval_text(eval_data)
    modes = _artifact_modes(kind, modes) if kind else modes or ["int8_kv", "faquant"]
    if fp8_rounding != "nearest" and "fp8_kv" not in modes:
        raise InputError(
            f"--fp8-rounding {fp8_rounding} applies to the fp8_kv mode only (an FP8 "
            f"KV artifact, --target vllm); this run has {', '.join(modes)}"
        )
    loaded = load_model(model, gguf_file)
    net, tok = loaded.model, loaded.tokenizer
    device = next(net.parameters()).device
    text = prompt
    if chat:
        if not getattr(tok, "chat_template", None):
            raise InputError("--chat: the tokenizer has no chat template")
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
    ids = tok(text, return_tensors="pt", add_special_tokens=not chat)["input_ids"].to(
        device
    )
    start = ids.shape[1]
    windows = token_windows(
        tok,
        eval_text,
        window=window,
        max_tokens=max_eval_tokens or None,
    )
    report = EmulateReport(
        model=str(loaded.source_dir / (loaded.gguf_file or "")),
        prompt=prompt,
        chat=chat,
        prompt_tokens=start,
        eval_data=str(eval_data),
        eval_windows=len(windows),
        eval_tokens=sum(w.numel() for w in windows),
        artifact=None if artifact is None else str(artifact),
    )
    eos = _end_of_turn(tok) if chat else None
    t0 = time.perf_counter()
    ref = greedy_plain(net, ids, max_new_tokens, eos_token_id=eos)[0]
    ref_logits = window_logits(net, windows)
    report.rows.append(
        {
            "mode": "float (plain model)",
            "scales": "-",
            "matched": None,
            "prefix": None,
            "n": int(ref.numel() - start),
            **fidelity(ref_logits, ref_logits, windows),
            "seconds": time.perf_counter() - t0,
            "text": tok.decode(ref[start:]),
        }
    )
    source = "artifact" if artifact else "dynamic"
    # An artifact with quantized linears runs them (and its smoothed weights)
    # through the integer path in the quantized modes; float-paged stays the plain
    # model's plumbing check.
    qnet = artifact_model(net, artifact) if artifact is not None else None
    if qnet is not None:
        source = "artifact + W8A8 linears"
    for mode in ["float", *modes]:
        t0 = time.perf_counter()
        scales = scale_map if mode != "float" else None
        with enable_paged_int8_attention(
            net if mode == "float" or qnet is None else qnet,
            mode=mode,
            scales=scales,
            block_size=block_size,
            backend=backend,
            fp8_rounding=fp8_rounding,
        ) as rt:
            gen = rt.generate(ids, max_new_tokens, eos_token_id=eos)[0]
            logits = []
            for w in windows:
                logits.append(rt.forward(w, new_sequence=True).float().cpu())
            rt.reset()
        report.rows.append(
            {
                "mode": "float-paged" if mode == "float" else mode,
                **({"fp8_rounding": fp8_rounding} if mode == "fp8_kv" else {}),
                "scales": "-" if mode == "float" else source,
                **compare(ref, gen, start),
                **fidelity(logits, ref_logits, windows),
                "seconds": time.perf_counter() - t0,
                "text": tok.decode(gen[start:]),
            }
        )
    return report
