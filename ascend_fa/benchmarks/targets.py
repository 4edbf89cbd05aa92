"""``ascend-fa bench targets``: accuracy of what each target deploys, vs float.

One calibration of SmolLM2-135M-Instruct (the packaged calibration set and
recipe, as ``ascend-fa calibrate`` uses them) observes, in the same forwards, the
FAQuant per-head Q/K/V ranges, the C8 per-channel K/V ranges and the FP8 K/V
absolute maxima. The scales are written as artifacts (``mindie``'s FA tensors,
``vllm-ascend``'s C8, ``vllm``'s FP8 per tensor and per head) and read back with
:func:`ascend_fa.evaluation.read_artifact_spec`, so each row measures exactly the
tensors a consumer would load. Each spec is then fake-quantized into the model
and compared with the float model on the packaged held-out prose and code texts:
perplexity change, mean KL(float ‖ quantized) per token and top-1 agreement of
the next-token prediction.

The model runs in fp32 with float linears: the rows isolate the attention /
KV-cache quantization of each target (``mindie`` deploys FAQuant next to W8A8
linears; their error is measured by the linear-quantization benchmark).
``--quick`` uses a tiny random LLaMA and a few hundred tokens (a smoke run).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from ._util import print_table, write_json

NAME = "targets"
HELP = "ppl / KL / top-1 of what each target deploys (mindie, vllm-ascend, vllm)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-samples", type=int, default=0, help="default 32")
    parser.add_argument("--max-length", type=int, default=0, help="default 512")
    parser.add_argument("--window", type=int, default=512, help="eval window tokens")


def _compose(*wraps: Any) -> Any:
    def wrap(attn: str, branch: str, point: Any) -> Any:
        for w in wraps:
            point = w(attn, branch, point) or point
        return point

    return wrap


def _model(quick: bool) -> tuple[Any, Any, str]:
    import torch

    if quick:
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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
            vocab_size=257,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        return transformers.LlamaForCausalLM(cfg).eval(), tokenizer, "tiny random llama"
    from ascend_fa.models import load_model

    loaded = load_model()
    return loaded.model, loaded.tokenizer, str(loaded.gguf_file)


def _maker(spec: Any) -> Any:
    """Points for one spec: float placeholders (None), FAQuant fake-quant (a scale
    map) or the KV round trip of a C8 / FP8 spec."""
    from ascend_fa.calibration import FA3FakeQuant, FA3QuantPlaceHolder

    def make(attn: str, branch: str, point: Any) -> Any:
        heads, dim = int(point.num_heads), getattr(point, "head_dim", None)
        if callable(getattr(spec, "point", None)):
            return spec.point(attn, branch, point)
        if spec is not None and attn in spec:
            scale, offset = spec[attn][branch]
            return FA3FakeQuant(branch, scale.reshape(-1), offset.reshape(-1), dim)
        return FA3QuantPlaceHolder(branch, heads, dim)

    return make


def _evaluate(model: Any, windows: list[Any], specs: dict[str, Any]) -> Any:
    """Float vs each spec on ``windows`` (token ids ``[S]``): perplexity, KL and
    top-1 sums, one window at a time, without gradients."""
    import torch

    with torch.no_grad():
        return _evaluate_sums(model, windows, specs)


def _evaluate_sums(model: Any, windows: list[Any], specs: dict[str, Any]) -> Any:
    from ascend_fa.adapters.hf import swapped_points
    from ascend_fa.calibration.pipeline import injected_points
    from ascend_fa.metrics import token_kl, token_nll

    sums = {k: [0.0, 0.0, 0, 0] for k in ["float", *specs]}  # nll, kl, top1, n
    with injected_points(model) as (_adapter, mods):
        for spec in specs.values():
            if callable(getattr(spec, "check", None)):
                spec.check(mods)
        for w in windows:
            ids = w.view(1, -1)
            with swapped_points(mods, _maker(None)):
                ref = model(input_ids=ids, use_cache=False).logits
            nll, n = token_nll(ref, ids)
            sums["float"][0] += nll
            sums["float"][3] += n
            for key, spec in specs.items():
                with swapped_points(mods, _maker(spec)):
                    out = model(input_ids=ids, use_cache=False).logits
                kl, top1, count = token_kl(ref[:, :-1], out[:, :-1])
                s = sums[key]
                s[0] += token_nll(out, ids)[0]
                s[1] += kl
                s[2] += top1
                s[3] += count
    ppl_f = math.exp(sums["float"][0] / sums["float"][3])
    rows = {}
    for key in specs:
        nll, kl, top1, n = sums[key]
        ppl = math.exp(nll / n)
        rows[key] = {
            "ppl": ppl,
            "ppl_delta_pct": 100 * (ppl / ppl_f - 1),
            "kl": kl / n,
            "top1": top1 / n,
        }
    return ppl_f, sums["float"][3], rows


def run(args: argparse.Namespace) -> int:
    import torch

    from ascend_fa import artifact
    from ascend_fa.calibration.data import load_calib_texts, split_calibration
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.kv import KVCalibration, recipe_settings
    from ascend_fa.calibration.pipeline import calibrate_model
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.evaluation import (
        EVAL_SETS,
        load_eval_text,
        read_artifact_spec,
        token_windows,
    )

    quick = bool(args.quick)
    n = args.num_samples or (4 if quick else 32)
    length = args.max_length or (64 if quick else 512)
    t0 = time.perf_counter()
    model, tok, name = _model(quick)
    load_s = time.perf_counter() - t0
    calib, _ = split_calibration(load_calib_texts(None), n, 4, 0)
    recipe = load_recipe(default_recipe_path())
    c8 = KVCalibration("c8", settings=recipe_settings(recipe), max_tokens=n * length)
    fp8 = KVCalibration("fp8")
    t0 = time.perf_counter()
    result = calibrate_model(
        model,
        tok,
        calib,
        recipe=recipe,
        max_length=length,
        batch_size=4,
        wrap=_compose(c8.wrap, fp8.wrap),
        progress=False,
    )
    fa_scales = result.export_scales(model)
    result.remove(model)
    calib_s = time.perf_counter() - t0
    config = model.config.to_dict()
    ckpt = artifact.checkpoint_tensors(model, torch.bfloat16, tied_copies=True)
    specs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plans = {
            "mindie: FAQuant Q/K/V per head": dict(
                scales=fa_scales, fa_quant_type="FAQuant"
            ),
            "vllm-ascend: C8 K/V per channel, Q float": dict(
                target="vllm-ascend", kv_scales=c8.scales()
            ),
            "vllm: FP8 K/V per tensor, Q float": dict(
                target="vllm", kv_scales=fp8.scales("tensor"), kv_strategy="tensor"
            ),
            "vllm: FP8 K/V per head, Q float": dict(
                target="vllm",
                kv_scales=fp8.scales("attn_head"),
                kv_strategy="attn_head",
            ),
        }
        for i, (label, plan) in enumerate(plans.items()):
            out = artifact.export_artifact(
                Path(tmp) / f"a{i}",
                state_dict=ckpt.tensors,
                tensor_types=ckpt.types,
                config=config,
                dtype=torch.bfloat16,
                **plan,
            )
            target = plan.get("target")
            if target is not None:
                found = artifact.inspect_artifact(out, target=target)
                if not found["valid"]:
                    raise RuntimeError(f"{label}: {found['findings']}")
            specs[label] = read_artifact_spec(out)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for data in EVAL_SETS:
        windows = token_windows(
            tok,
            load_eval_text(data),
            window=min(args.window, length) if quick else args.window,
            max_tokens=256 if quick else None,
        )
        results[data] = _evaluate(model, windows, specs)
    eval_s = time.perf_counter() - t0
    print(
        f"model: {name} (load {load_s:.1f} s); calibration {len(calib)} samples x "
        f"{length} tokens ({calib_s:.1f} s, FA + C8 + FP8 observers in one pass); "
        f"eval {eval_s:.1f} s"
    )
    headers = ["target / deployed quantization"]
    for data in results:
        headers += [f"{data} ppl Δ", f"{data} KL", f"{data} top-1"]
    rows = [["float (reference)"]]
    for ppl_f, tokens, _ in results.values():
        rows[0] += [f"{ppl_f:.3f} ({tokens} tok)", "0", "1"]
    for label in specs:
        row = [label]
        for _ppl, _tokens, r in results.values():
            e = r[label]
            row += [
                f"{e['ppl_delta_pct']:+.3f}%",
                f"{e['kl']:.5f}",
                f"{e['top1']:.4f}",
            ]
        rows.append(row)
    print_table(headers, rows)
    if args.json:
        write_json(
            args.json,
            {
                "model": name,
                "results": {
                    d: {"ppl_float": r[0], "tokens": r[1], "rows": r[2]}
                    for d, r in results.items()
                },
            },
        )
    return 0
