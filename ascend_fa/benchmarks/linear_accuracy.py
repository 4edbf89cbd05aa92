"""``ascend-fa bench linear-accuracy``: W8A8 / W8A8_DYNAMIC linears + FAQuant vs float.

On SmolLM2-135M-Instruct (loaded once) with the packaged calibration set and the
packaged held-out prose and code texts, one row per recipe:

* **FAQuant only** — float linears, the default FA recipe;
* **W8A8 RTN** — the round-to-nearest baseline: per-tensor min/max activation
  ranges, no smoothing, no fallback;
* **W8A8 default** — what ``calibrate --linear w8a8`` does (layer-sequential,
  smoothing and range searched per group, automatic fallback by the layer-local
  criterion, or the whole-model KL scan with ``--fallback-criterion kl``);
* **W8A8_DYNAMIC** — ``--linear w8a8_dynamic`` with the same machinery.

Every quantized row also has FAQuant attention calibrated after its linears (as
``calibrate`` does). Columns: perplexity change, mean token KL(float || quantized)
and top-1 agreement per domain, linears kept float, and the calibration time as a
ratio of plain forwards over the same calibration batches, measured in the same
run. One line per quantized recipe splits that time: the observing forwards
(float linears) and the W8A8 statistics hooks inside them, the search (with the
weights' quantization), the fallback, the propagation through the quantized
layers, the FA pass. Goals (issue): default KL <= 0.03, top-1 >= 0.90, ppl <= +3
%, <= 10 % float, >= 20x lower KL than RTN; dynamic KL <= 0.02, top-1 >= 0.93.
(The observers' goal, <= 1.35x plain forwards, is timed interleaved with plain
forwards by ``bench calibration-overhead``.) Each goal gets a verdict line;
``--json FILE`` writes the common result schema (:mod:`.results`): one record per
recipe and one per goal.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import torch

from ._util import accuracy_setup, add_accuracy_arguments, print_table
from .results import Record, machine_line, verdict, write_results

NAME = "linear-accuracy"
HELP = "W8A8 / W8A8_DYNAMIC linears + FAQuant: ppl, KL, top-1 vs float; RTN baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_accuracy_arguments(parser)
    parser.add_argument(
        "--fallback-criterion",
        choices=("layer", "kl"),
        default="layer",
        help="the linear fallback's criterion (calibrate's "
        "--linear-fallback-criterion; default layer)",
    )
    parser.add_argument(
        "--calib-domain",
        choices=("all", "prose", "code"),
        default="all",
        help="calibrate on the packaged set (all) or only its prose / code samples "
        "(every one of them), to measure how a static range carries to the other "
        "domain",
    )
    parser.add_argument(
        "--recipes",
        default="",
        help="comma-separated subset of the rows (faquant, w8a8_rtn, w8a8, "
        "w8a8_dynamic; default all)",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.pipeline import (
        calibrate_model,
        calibrate_with_linears,
        calibration_batches,
        run_forwards,
    )
    from ascend_fa.calibration.recipe import load_recipe
    from ascend_fa.evaluation import evaluate
    from ascend_fa.linear import LinearConfig
    from ascend_fa.transforms.residual import supports_rotation

    setup = accuracy_setup(args)
    length, dtype = setup.max_length, setup.dtype
    loaded, t_load, calib, windows = (
        setup.loaded,
        setup.load_s,
        setup.calib,
        setup.windows,
    )
    net, tok = loaded.model, loaded.tokenizer
    recipe = load_recipe(default_recipe_path())

    def batches() -> list[dict[str, torch.Tensor]]:
        return list(
            calibration_batches(
                tok, calib, max_length=length, batch_size=args.batch_size
            )
        )

    with torch.no_grad():
        run_forwards(net, batches()[:1])  # warm-up
        t = time.perf_counter()
        run_forwards(net, batches())
        plain = time.perf_counter() - t

    scan: dict[str, Any] = dict(scan_samples=2, scan_tokens=64) if args.quick else {}
    scan["criterion"] = getattr(args, "fallback_criterion", "layer")
    variants: dict[str, LinearConfig | None] = {
        "FAQuant only (float linears)": None,
        "W8A8 RTN (per-tensor min/max) + FAQuant": LinearConfig.round_to_nearest(
            "W8A8", dtype
        ),
        # as calibrate's default: the residual stream rotated where it applies
        "W8A8 default + FAQuant": LinearConfig(
            "W8A8", dtype, rotate=supports_rotation(net), **scan
        ),
        "W8A8_DYNAMIC + FAQuant": LinearConfig("W8A8_DYNAMIC", dtype, **scan),
    }
    variants = selected(variants, args.recipes)
    models: dict[str, Any] = {}
    specs: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for name, cfg in variants.items():
        m = copy.deepcopy(net)
        t = time.perf_counter()
        lin = None
        kw: dict[str, Any] = dict(
            recipe=recipe, max_length=length, batch_size=args.batch_size
        )
        if cfg is not None:
            # as calibrate runs it: the FA pass rides on the linear pass
            lin, res, t_fa = calibrate_with_linears(m, tok, calib, cfg, **kw)
        else:
            t_fa = time.perf_counter()
            res = calibrate_model(m, tok, calib, progress=False, **kw)
            t_fa = time.perf_counter() - t_fa
        secs = time.perf_counter() - t
        print(f"calibrated {name}: {secs:.1f} s", file=sys.stderr, flush=True)
        specs[name] = res.export_scales(m)
        res.remove(m)
        models[name] = m
        info[name] = {
            "seconds": secs,
            "ratio": secs / plain,
            "float": 0 if lin is None else lin.num_float,
            "linears": 0 if lin is None else lin.num_linears,
            "report": None if lin is None else lin.to_report(),
            "phases": {} if lin is None else dict(lin.seconds),
            "fa_seconds": t_fa,
        }
    results = {d: evaluate(net, w, specs, models=models) for d, w in windows.items()}
    headers = ["recipe"]
    for d in results:
        headers += [f"{d} ppl Δ", f"{d} KL", f"{d} top-1"]
    headers += ["linears float", "calib time vs plain"]
    first = next(iter(specs))
    rows = [["float"]]
    for res in results.values():
        rows[0] += [f"ppl {res[first].perplexity_float:.3f}", "0", "1"]
    rows[0] += ["all", "1.00x"]
    for name in specs:
        row = [name]
        for d in results:
            r = results[d][name]
            row += [f"{r.ppl_delta_pct:+.2f}%", f"{r.kl:.4f}", f"{r.top1:.3f}"]
        i = info[name]
        row += [
            f"{i['float']}/{i['linears']}" if i["linears"] else "all",
            f"{i['ratio']:.2f}x",
        ]
        rows.append(row)
    print(
        f"model: {loaded.gguf_file or loaded.source_dir} (load {t_load:.1f} s); "
        f"{len(calib)} calibration samples ({args.calib_domain}) x {length} tokens, "
        "batch "
        f"{args.batch_size}; plain forwards {plain:.1f} s; artifact dtype "
        f"{args.dtype}; held-out tokens "
        + ", ".join(f"{d} {next(iter(r.values())).tokens}" for d, r in results.items())
        + f"; {torch.get_num_threads()} threads"
    )
    print(machine_line())
    print_table(headers, rows, title="Linear quantization accuracy (all with FAQuant)")
    for line in time_lines(info, plain):
        print(line)
    params = {
        "samples": len(calib),
        "tokens": length,
        "dtype": args.dtype,
        "calib_domain": args.calib_domain,
    }
    records = accuracy_records(results, info, params)
    print_table(
        ["goal", "value", "target", "verdict"],
        [
            [r.mode, f"{r.ratio:.4g}", r.goal, "ok" if r.verdict == "ok" else "MISS"]
            for r in records
            if r.goal is not None
        ],
        title="Goals (issues 13, 27)",
    )
    write_results(
        args.json,
        records,
        backend="cpu",
        extra={"plain_seconds": plain, "model": str(loaded.gguf_file or "")},
    )
    return 0


#: recipe name (as printed) -> record mode.
MODES = {
    "FAQuant only (float linears)": "faquant",
    "W8A8 RTN (per-tensor min/max) + FAQuant": "w8a8_rtn",
    "W8A8 default + FAQuant": "w8a8",
    "W8A8_DYNAMIC + FAQuant": "w8a8_dynamic",
}


def selected(variants: dict[str, Any], recipes: str) -> dict[str, Any]:
    """The rows ``--recipes`` (comma-separated modes of :data:`MODES`) names, in
    order; all of them for an empty value. An unknown name is one line."""
    wanted = {r.strip() for r in recipes.split(",") if r.strip()}
    unknown = wanted - set(MODES.values())
    if unknown:
        raise SystemExit(
            f"bench linear-accuracy: --recipes {sorted(unknown)[0]!r}; choose from "
            f"{', '.join(MODES.values())}"
        )
    return {k: v for k, v in variants.items() if not wanted or MODES[k] in wanted}


def time_lines(info: dict[str, dict[str, Any]], plain: float) -> list[str]:
    """Where each quantized recipe's calibration time went, in plain forwards."""
    out = []
    for name, i in info.items():
        ph = i["phases"]
        if not ph:
            continue
        parts = [
            ("observing forwards", ph.get("observe", 0.0) - ph.get("observers", 0.0)),
            ("W8A8 statistics hooks", ph.get("observers", 0.0)),
            ("search + quantize", ph.get("decide", 0.0)),
            ("fallback", ph.get("fallback", 0.0)),
        ]
        if i["fa_seconds"]:
            parts.append(("quantized propagation", ph.get("propagate", 0.0)))
            parts.append(("FA pass", i["fa_seconds"]))
        else:  # the FA pass rode on the propagation
            parts.append(("quantized propagation + FA pass", ph.get("propagate", 0.0)))
        rest = i["seconds"] - sum(v for _, v in parts)
        parts.append(("other", rest))
        out.append(
            f"{name}: {i['ratio']:.2f}x = "
            + " + ".join(f"{label} {v / plain:.2f}x" for label, v in parts)
        )
    return out


def accuracy_records(
    results: dict[str, dict[str, Any]],
    info: dict[str, dict[str, Any]],
    params: dict[str, Any],
) -> list[Record]:
    """The benchmark's records: one per recipe (calibration seconds, ratio to
    plain forwards, per-domain accuracy in ``extra``; the overhead goal on the
    quantized recipes), then one per accuracy goal (``ratio`` holds the measured
    value, ``median_s`` 0: not a timing). ``results``: domain -> recipe name ->
    :class:`~ascend_fa.evaluation.EvalResult`; ``info``: recipe name ->
    ``seconds``, ``ratio``, ``float``, ``linears``, ``report``, ``phases``
    (:class:`~ascend_fa.linear.LinearResult` seconds), ``fa_seconds``. The whole
    calibration's ratio to plain forwards is in each recipe's record, with no
    goal: the 1.35x goal is on the observers, timed interleaved with plain
    forwards by ``bench calibration-overhead``."""
    records = []
    for name, i in info.items():
        mode = MODES[name]
        records.append(
            Record(
                NAME,
                "cpu",
                mode,
                params,
                i["seconds"],
                ratio=i["ratio"],
                baseline="plain forwards",
                extra={
                    "phases": {k: round(v, 3) for k, v in i["phases"].items()},
                    "fa_seconds": round(i["fa_seconds"], 3),
                    "recipe": name,
                    "linears_float": i["float"],
                    "linears": i["linears"],
                    "accuracy": {d: r[name].to_dict() for d, r in results.items()},
                    "linear_report": i["report"],
                },
            )
        )
    by_mode = {MODES[n]: n for n in info}

    def goal(label: str, value: float, target: str) -> None:
        records.append(
            Record(
                NAME,
                "cpu",
                label,
                params,
                0.0,
                ratio=value,
                goal=target,
                verdict=verdict(value, target),
            )
        )

    # calibrated on one domain: the other one is held to the cross-domain goals
    other = {"prose": "code", "code": "prose"}.get(params.get("calib_domain", ""))
    for d, res in results.items():
        if "w8a8" in by_mode:
            w = res[by_mode["w8a8"]]
            kl, ppl = ("<= 0.035", "<= 4") if d == other else ("<= 0.03", "<= 3")
            goal(f"w8a8 {d} KL", w.kl, kl)
            goal(f"w8a8 {d} top-1", w.top1, ">= 0.90")
            goal(f"w8a8 {d} ppl delta %", w.ppl_delta_pct, ppl)
            if "w8a8_rtn" in by_mode and d != other:
                rtn = res[by_mode["w8a8_rtn"]]
                goal(
                    f"w8a8 {d} RTN KL / default KL",
                    rtn.kl / max(w.kl, 1e-12),
                    ">= 20",
                )
        if "w8a8_dynamic" in by_mode and d != other:
            dyn = res[by_mode["w8a8_dynamic"]]
            goal(f"w8a8_dynamic {d} KL", dyn.kl, "<= 0.02")
            goal(f"w8a8_dynamic {d} top-1", dyn.top1, ">= 0.93")
    if "w8a8" in by_mode:
        w8 = info[by_mode["w8a8"]]
        goal(
            "w8a8 linears float fraction",
            w8["float"] / max(w8["linears"], 1),
            "<= 0.10",
        )

    return records
