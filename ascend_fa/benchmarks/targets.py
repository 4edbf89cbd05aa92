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

The model runs in fp32 with float linears: the first rows isolate the attention /
KV-cache quantization of each target. ``mindie`` deploys FAQuant next to W8A8
linears: the last row is that whole deployment, the linears quantized as
``ascend-fa calibrate`` does by default (static W8A8, layer fallback, in memory,
as ``bench linear-accuracy`` measures them) and FAQuant calibrated on the
quantized model, its FA tensors written and read back as the others'.
``--quick`` uses a tiny random LLaMA and a few hundred tokens (a smoke run).

``--json`` writes the one result schema (:mod:`.results`): per evaluation text, a
``float`` record and one per target (``mode`` ``mindie_faquant``,
``vllm_ascend_c8``, ``vllm_fp8_tensor``, ``vllm_fp8_head``,
``mindie_w8a8_faquant``) whose ``median_s`` is
the time of that spec's forwards over the windows, ``ratio`` its perplexity over
the float model's, and ``extra`` the ppl, ppl change, KL and top-1. The FAQuant
row carries the accuracy goal (ppl ratio <= 1.002 and KL <= 0.003, both must hold).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._util import print_table
from .results import Record, verdict, write_results

NAME = "targets"
HELP = "ppl / KL / top-1 of what each target deploys (mindie, vllm-ascend, vllm)"

#: The whole mindie deployment: default static W8A8 linears and FAQuant.
W8A8_LABEL = "mindie: W8A8 linears + FAQuant"
#: Table label of each deployed spec -> its record ``mode``.
SPEC_MODES = {
    "mindie: FAQuant Q/K/V per head": "mindie_faquant",
    "vllm-ascend: C8 K/V per channel, Q float": "vllm_ascend_c8",
    "vllm: FP8 K/V per tensor, Q float": "vllm_fp8_tensor",
    "vllm: FP8 K/V per head, Q float": "vllm_fp8_head",
    W8A8_LABEL: "mindie_w8a8_faquant",
}
#: Goals (ppl ratio vs float, KL per token) where an issue sets one: FAQuant with
#: float linears, perplexity change <= +0.2 % and KL <= 0.0030 on prose and code.
#: Not applied at ``--quick`` (a tiny random model).
GOALS = {"mindie_faquant": ("<= 1.002", "<= 0.003")}


def _verdict(ratio: float, kl: float, goal: tuple[str, str] | None) -> str | None:
    """``ok`` when both the ppl ratio and the KL meet ``goal``; None without one."""
    if goal is None:
        return None
    both = (verdict(ratio, goal[0]), verdict(kl, goal[1]))
    return "ok" if both == ("ok", "ok") else "miss"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-samples", type=int, default=0, help="default 32")
    parser.add_argument("--max-length", type=int, default=0, help="default 512")
    parser.add_argument("--window", type=int, default=512, help="eval window tokens")
    parser.add_argument(
        "--long-window",
        type=int,
        default=4096,
        help="long-context rows: the long held-out sets (prose-long, code-long) at "
        "--window and at this many tokens per window (0 skips them)",
    )


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


@dataclass(frozen=True)
class OnModel:
    """A spec evaluated on its own model (the float one's quantized copy) against
    the float model's reference."""

    model: Any
    spec: Any


def _evaluate_sums(model: Any, windows: list[Any], specs: dict[str, Any]) -> Any:
    from ascend_fa.adapters.hf import swapped_points
    from ascend_fa.calibration.pipeline import injected_points
    from ascend_fa.metrics import token_kl, token_nll

    sums = {k: [0.0, 0.0, 0, 0] for k in ["float", *specs]}  # nll, kl, top1, n
    seconds = dict.fromkeys(["float", *specs], 0.0)  # forwards only
    with contextlib.ExitStack() as stack:
        _adapter, mods = stack.enter_context(injected_points(model))
        runs = {}  # label -> (model, its FA points, spec)
        for key, spec in specs.items():
            own, points = model, mods
            if isinstance(spec, OnModel):
                own, spec = spec.model, spec.spec
                points = stack.enter_context(injected_points(own))[1]
            if callable(getattr(spec, "check", None)):
                spec.check(points)
            runs[key] = (own, points, spec)
        for w in windows:
            ids = w.view(1, -1)
            t0 = time.perf_counter()
            with swapped_points(mods, _maker(None)):
                ref = model(input_ids=ids, use_cache=False).logits
            seconds["float"] += time.perf_counter() - t0
            nll, n = token_nll(ref, ids)
            sums["float"][0] += nll
            sums["float"][3] += n
            for key, (own, points, spec) in runs.items():
                t0 = time.perf_counter()
                with swapped_points(points, _maker(spec)):
                    out = own(input_ids=ids, use_cache=False).logits
                seconds[key] += time.perf_counter() - t0
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
            "seconds": seconds[key],
        }
    return ppl_f, sums["float"][3], rows, seconds["float"]


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    n = args.num_samples or (4 if quick else 32)
    length = args.max_length or (64 if quick else 512)
    t0 = time.perf_counter()
    model, tok, name = _model(quick)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    calib, plans = _calibrate(model, tok, n, length)
    calib_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    quantized, plans[W8A8_LABEL] = _w8a8_deployment(model, tok, calib, length)
    linear_s = time.perf_counter() - t0
    specs = _written_specs(model, plans)
    specs[W8A8_LABEL] = OnModel(quantized, specs[W8A8_LABEL])
    t0 = time.perf_counter()
    results = _evaluate_sets(args, model, tok, specs, length)
    long_results = _evaluate_long(args, model, tok, specs, length)
    eval_s = time.perf_counter() - t0
    print(
        f"model: {name} (load {load_s:.1f} s); calibration {len(calib)} samples x "
        f"{length} tokens ({calib_s:.1f} s, FA + C8 + FP8 observers in one pass; "
        f"W8A8 linears + FAQuant {linear_s:.1f} s); eval {eval_s:.1f} s"
    )
    _print_table(results, specs)
    params = {"model": name, "num_samples": n, "max_length": length}
    if long_results:
        _print_long_table(long_results, specs)
    write_results(
        args.json,
        _records(results, params, quick) + _long_records(long_results, params),
        backend="cpu",
        extra={
            "load_seconds": load_s,
            "calibration_seconds": calib_s,
            "w8a8_calibration_seconds": linear_s,
        },
    )
    return 0


def _calibrate(
    model: Any, tok: Any, n: int, length: int
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """FA, C8 and FP8 observers in one calibration pass: the calibration
    samples, and each target's export arguments by table label."""
    from ascend_fa.calibration.data import load_calib_texts, split_calibration
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.kv import KVCalibration, recipe_settings
    from ascend_fa.calibration.pipeline import calibrate_model
    from ascend_fa.calibration.recipe import load_recipe

    calib, _ = split_calibration(load_calib_texts(None), n, 4, 0)
    recipe = load_recipe(default_recipe_path())
    c8 = KVCalibration("c8", settings=recipe_settings(recipe), max_tokens=n * length)
    fp8 = KVCalibration("fp8")
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
    return calib, plans


def _w8a8_deployment(
    model: Any, tok: Any, calib: list[str], length: int
) -> tuple[Any, dict[str, Any]]:
    """A copy of ``model`` with its linears quantized as ``ascend-fa calibrate``
    quantizes them by default (static W8A8, bf16 scales, layer fallback), and the
    export arguments of the FAQuant scales calibrated on it (the mindie
    deployment: FA observes what the quantized linears feed it)."""
    import torch

    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.pipeline import calibrate_with_linears
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.linear import LinearConfig
    from ascend_fa.transforms.residual import supports_rotation

    quantized = copy.deepcopy(model)
    # calibrate's default: the residual stream rotated where the family takes it
    config = LinearConfig("W8A8", torch.bfloat16, rotate=supports_rotation(quantized))
    recipe = load_recipe(default_recipe_path())
    _lin, result, _t = calibrate_with_linears(
        quantized, tok, calib, config, recipe=recipe, max_length=length
    )
    scales = result.export_scales(quantized)
    result.remove(quantized)
    return quantized, dict(scales=scales, fa_quant_type="FAQuant")


def _written_specs(model: Any, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target's artifact written (and checked against its consumer), then
    read back as an evaluation spec."""
    import torch

    from ascend_fa import artifact
    from ascend_fa.evaluation import read_artifact_spec

    config = model.config.to_dict()
    ckpt = artifact.checkpoint_tensors(model, torch.bfloat16, tied_copies=True)
    specs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
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
                # the demo model is a Llama: its C8 loads from vllm-ascend
                # 0.25.1rc1 on (artifact.releases)
                version = "0.25.1rc1" if target == "vllm-ascend" else None
                found = artifact.inspect_artifact(out, target, version)
                if not found["valid"]:
                    raise RuntimeError(f"{label}: {found['findings']}")
            specs[label] = read_artifact_spec(out)
    return specs


def _evaluate_sets(
    args: argparse.Namespace, model: Any, tok: Any, specs: dict, length: int
) -> dict[str, Any]:
    from ascend_fa.evaluation import EVAL_SETS, load_eval_text, token_windows

    quick = bool(args.quick)
    results: dict[str, Any] = {}
    for data in EVAL_SETS:
        windows = token_windows(
            tok,
            load_eval_text(data),
            window=min(args.window, length) if quick else args.window,
            max_tokens=256 if quick else None,
        )
        results[data] = _evaluate(model, windows, specs)
    return results


def _long_windows(args: argparse.Namespace, length: int) -> tuple[int, int]:
    """(short, long) window tokens of the long-context rows (``--quick``: a tiny
    model's lengths)."""
    if args.quick:
        return min(args.window, length), min(args.long_window, 4 * length)
    return args.window, args.long_window


def _evaluate_long(
    args: argparse.Namespace, model: Any, tok: Any, specs: dict, length: int
) -> dict[str, dict[int, Any]]:
    """``{set: {window: _evaluate(...)}}``: each long held-out set at the short and
    the long window, after the same short-sample calibration."""
    from ascend_fa.eval_data import LONG_EVAL_SETS, load_eval_text, token_windows

    if args.long_window <= 0:
        return {}
    out: dict[str, dict[int, Any]] = {}
    for data in LONG_EVAL_SETS:
        text = load_eval_text(data)
        out[data] = {}
        for w in _long_windows(args, length):
            cap = 4 * length if args.quick else None
            windows = token_windows(tok, text, window=w, max_tokens=cap)
            out[data][w] = _evaluate(model, windows, specs)
    return out


#: Long-context goal: a mode's KL at the long window <= 1.25x its short-window KL.
LONG_KL_GOAL = "<= 1.25"


def _print_long_table(long_results: dict[str, Any], specs: dict[str, Any]) -> None:
    """KL per mode at the short and the long window of each long set, and their
    ratio (the long-context goal)."""
    headers = ["target / deployed quantization"]
    for data, by_window in long_results.items():
        short, long = list(by_window)
        headers += [f"{data} KL @{short}", f"KL @{long}", "ratio"]
    rows = []
    for label in specs:
        row = [label]
        for by_window in long_results.values():
            kls = [r[2][label]["kl"] for r in by_window.values()]
            row += [f"{kls[0]:.5f}", f"{kls[1]:.5f}", f"{kls[1] / kls[0]:.2f}x"]
        rows.append(row)
    print(f"long context (KL at the long window / at the short one, {LONG_KL_GOAL}):")
    print_table(headers, rows)


def _long_records(long_results: dict[str, Any], base: dict[str, Any]) -> list[Record]:
    """One record per mode, long set and window; the long window's carries the KL
    ratio against the short one with the goal."""
    records = []
    for data, by_window in long_results.items():
        short = next(iter(by_window))
        for window, (ppl_f, tokens, found, _float_s) in by_window.items():
            params = {**base, "eval": data, "tokens": tokens, "window": window}
            for label, e in found.items():
                kl_ratio = None
                if window != short:
                    base_kl = by_window[short][2][label]["kl"]
                    kl_ratio = e["kl"] / base_kl if base_kl > 0 else float("inf")
                ok = kl_ratio is None or verdict(kl_ratio, LONG_KL_GOAL) == "ok"
                records.append(
                    Record(
                        NAME,
                        "cpu",
                        SPEC_MODES[label],
                        params,
                        e["seconds"],
                        ratio=e["ppl"] / ppl_f,
                        baseline="float",
                        goal=None if kl_ratio is None else LONG_KL_GOAL,
                        verdict=None if kl_ratio is None else ("ok" if ok else "miss"),
                        extra={
                            "label": label,
                            "ppl": e["ppl"],
                            "ppl_delta_pct": e["ppl_delta_pct"],
                            "kl": e["kl"],
                            "top1": e["top1"],
                            "kl_vs_short_window": kl_ratio,
                        },
                    )
                )
    return records


def _print_table(results: dict[str, Any], specs: dict[str, Any]) -> None:
    headers = ["target / deployed quantization"]
    for data in results:
        headers += [f"{data} ppl Δ", f"{data} KL", f"{data} top-1"]
    rows = [["float (reference)"]]
    for ppl_f, tokens, _, _ in results.values():
        rows[0] += [f"{ppl_f:.3f} ({tokens} tok)", "0", "1"]
    for label in specs:
        row = [label]
        for _ppl, _tokens, r, _ in results.values():
            e = r[label]
            row += [
                f"{e['ppl_delta_pct']:+.3f}%",
                f"{e['kl']:.5f}",
                f"{e['top1']:.4f}",
            ]
        rows.append(row)
    print_table(headers, rows)


def _records(
    results: dict[str, Any], base_params: dict[str, Any], quick: bool
) -> list[Record]:
    """The float record and one per target and eval set; prints each goal's
    verdict (not with ``--quick``)."""
    records = []
    for data, (ppl_f, tokens, found, float_s) in results.items():
        params = {
            "model": base_params["model"],
            "eval": data,
            "tokens": tokens,
            "num_samples": base_params["num_samples"],
            "max_length": base_params["max_length"],
        }
        records.append(
            Record(
                NAME,
                "cpu",
                "float",
                params,
                float_s,
                ratio=1.0,
                baseline="float",
                extra={"ppl": ppl_f, "kl": 0.0, "top1": 1.0},
            )
        )
        for label, e in found.items():
            records.append(_target_record(label, e, ppl_f, params, quick, data))
    return records


def _target_record(
    label: str, e: dict, ppl_f: float, params: dict, quick: bool, data: str
) -> Record:
    mode = SPEC_MODES[label]
    ratio = e["ppl"] / ppl_f
    goal = None if quick else GOALS.get(mode)
    record = Record(
        NAME,
        "cpu",
        mode,
        params,
        e["seconds"],
        ratio=ratio,
        baseline="float",
        goal=goal and goal[0],
        verdict=_verdict(ratio, e["kl"], goal),
        extra={
            "label": label,
            "ppl": e["ppl"],
            "ppl_delta_pct": e["ppl_delta_pct"],
            "kl": e["kl"],
            "kl_goal": goal and goal[1],
            "top1": e["top1"],
        },
    )
    if goal is not None:
        word = "ok" if record.verdict == "ok" else "NOT MET"
        print(
            f"{mode} on {data}: ppl x{ratio:.4f} ({goal[0]}), KL "
            f"{e['kl']:.5f} ({goal[1]}): {word}"
        )
    return record
