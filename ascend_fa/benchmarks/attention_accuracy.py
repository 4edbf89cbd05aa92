"""``ascend-fa bench attention-accuracy``: static per-head FAQuant with and without
folded attention transforms, read back from written artifacts.

On SmolLM2-135M-Instruct (loaded once) with float linears, the packaged
calibration set and the packaged held-out prose and code texts. Every static row
is calibrated, written as an artifact (``--dtype``, bf16 default) and then read
back the way an independent check does: the artifact's STORED weights are loaded
over the source model (:func:`~ascend_fa.linear.artifact_model`; folds count as
the device runs them) and Q/K/V are fake-quantized with the artifact's scales.

=====================================  =============================================
row                                    what
=====================================  =============================================
default                                the packaged recipe (``calibrate`` today)
msModelSlim-style recall_window/union  the seed's method (msModelSlim's FA observer)
v-rotation                             default recipe after the folded V rotation
qk-smoothing                           default recipe after the folded Q/K smoothing
v-rotation + qk-smoothing              both (``calibrate --transforms ...``)
dynamic per-token-head                 bound: per token and head, source weights
dynamic + transforms                   the same bound on the folded weights
=====================================  =============================================

Columns per domain: perplexity change, mean per-token KL(float || quantized),
mean / min attention-output cosine and mean rel-L1 over the attention modules
(whole model fake-quantized). Calibration time is printed as a ratio of plain
forwards over the same batches, measured in the same run. Goals (issue, on the
``transforms`` row): cosine >= 0.999, rel-L1 <= 0.041, KL <= 0.0030, ppl
<= +0.2 %, calibration <= 1.5x plain forwards.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ._util import accuracy_setup, add_accuracy_arguments, print_table

NAME = "attention-accuracy"
HELP = "FAQuant accuracy with folded V rotation / Q-K smoothing, from artifacts"

_ALL = "v-rotation,qk-smoothing"
GOALS = {
    "cosine": ">= 0.999",
    "rel_l1": "<= 0.041",
    "kl": "<= 0.003",
    "ppl_delta_pct": "<= 0.2",
    "calibration_vs_plain": "<= 1.5",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_accuracy_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="transform seed")


def _write(
    net: Any, tok: Any, scales: Any, out: Path, dtype: torch.dtype, meta: Any
) -> None:
    from ascend_fa import artifact

    config = net.config.to_dict()
    config["architectures"] = config.get("architectures") or [type(net).__name__]
    config.pop("_name_or_path", None)
    ckpt = artifact.checkpoint_tensors(net, dtype)
    artifact.export_artifact(
        out,
        state_dict=ckpt.tensors,
        tensor_types=ckpt.types,
        scales=scales,
        fa_quant_type="FAQuant",
        dtype=dtype,
        config=config,
        tokenizer=tok,
        overwrite=True,
        metadata=meta,
    )


def run(args: argparse.Namespace) -> int:
    from ascend_fa.benchmarks.results import Record, verdict, write_results
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.pipeline import (
        calibrate_model,
        calibration_batches,
        run_forwards,
    )
    from ascend_fa.calibration.recipe import FA3QuantConfig, Recipe, load_recipe
    from ascend_fa.evaluation import (
        evaluate,
        read_artifact_spec,
    )
    from ascend_fa.linear import artifact_model
    from ascend_fa.transforms.attention import (
        LayerwiseTransforms,
        parse_transforms,
    )

    setup = accuracy_setup(args)
    length, dtype = setup.max_length, setup.dtype
    loaded, t_load, calib, windows = (
        setup.loaded,
        setup.load_s,
        setup.calib,
        setup.windows,
    )
    net, tok = loaded.model, loaded.tokenizer

    def batches(texts: list[str]) -> list[dict[str, torch.Tensor]]:
        return list(
            calibration_batches(
                tok, texts, max_length=length, batch_size=args.batch_size
            )
        )

    with torch.no_grad():
        run_forwards(net, batches(calib)[:1])  # warm-up
        t = time.perf_counter()
        run_forwards(net, batches(calib))
        plain = time.perf_counter() - t

    default_recipe = load_recipe(default_recipe_path())
    union = Recipe(processors=[FA3QuantConfig()])
    rows: dict[str, tuple[str, Any]] = {
        "default": ("", default_recipe),
        "msModelSlim-style recall_window/union": ("", union),
        "v-rotation": ("v-rotation", default_recipe),
        "qk-smoothing": ("qk-smoothing", default_recipe),
        "v-rotation + qk-smoothing": (_ALL, default_recipe),
    }
    specs: dict[str, Any] = {}
    models: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="attention-accuracy-") as tmp:
        for i, (name, (transforms, recipe)) in enumerate(rows.items()):
            m = copy.deepcopy(net)
            t = time.perf_counter()
            # As calibrate runs them with float linears: folded inside the
            # layer-major FA pass.
            in_pass = None
            if transforms:
                in_pass = LayerwiseTransforms(
                    m, parse_transforms(transforms), seed=args.seed
                )
            res = calibrate_model(
                m,
                tok,
                calib,
                recipe=recipe,
                max_length=length,
                batch_size=args.batch_size,
                progress=False,
                before_layer=in_pass,
            )
            secs = time.perf_counter() - t
            folded = in_pass.result() if in_pass is not None else None
            t_fold = folded.seconds if folded is not None else 0.0
            scales = res.export_scales(m)
            res.remove(m)
            out = Path(tmp) / f"artifact{i}"
            meta = folded.description_metadata() if folded is not None else None
            _write(m, tok, scales, out, dtype, meta)
            del m
            # Read back: the stored weights over the source model, the stored scales.
            specs[name] = read_artifact_spec(out)
            back = artifact_model(net, out)
            if back is not None:
                models[name] = back
            info[name] = {
                "seconds": secs,
                "fold_seconds": t_fold,
                "ratio": secs / plain,
                "transforms": folded.to_report() if folded is not None else None,
            }
            print(f"calibrated {name}: {secs:.1f} s", file=sys.stderr, flush=True)
        specs["dynamic per-token-head (bound)"] = "dynamic"
        both = "v-rotation + qk-smoothing"
        if both in models:
            specs["dynamic + transforms (bound)"] = "dynamic"
            models["dynamic + transforms (bound)"] = models[both]
        results = {}
        for d, w in windows.items():
            t = time.perf_counter()
            results[d] = evaluate(net, w, specs, models=models)
            print(f"evaluated {d}: {time.perf_counter() - t:.1f} s", file=sys.stderr)

    headers = ["method"]
    for d in results:
        headers += [
            f"{d} ppl Δ",
            f"{d} KL",
            f"{d} cos mean",
            f"{d} cos min",
            f"{d} rel-L1",
        ]
    headers += ["calib vs plain"]
    table = []
    records = []
    for name in specs:
        row = [name]
        for d, res in results.items():
            r = res[name]
            row += [
                f"{r.ppl_delta_pct:+.3f}%",
                f"{r.kl:.5f}",
                f"{r.mean_cosine:.5f}",
                f"{r.min_cosine:.5f}",
                f"{r.mean_rel_l1:.5f}",
            ]
            values = {
                "cosine": r.mean_cosine,
                "rel_l1": r.mean_rel_l1,
                "kl": r.kl,
                "ppl_delta_pct": r.ppl_delta_pct,
            }
            checked = name == both
            records.append(
                Record(
                    benchmark=NAME,
                    backend="cpu",
                    mode=name,
                    params={
                        "domain": d,
                        "num_samples": len(calib),
                        "max_length": length,
                        "dtype": args.dtype,
                    },
                    median_s=info.get(name, {}).get("seconds", 0.0),
                    extra={
                        **values,
                        "min_cosine": r.min_cosine,
                        "top1": r.top1,
                        "tokens": r.tokens,
                        "layers": r.to_dict()["layers"],
                        "verdicts": (
                            {k: verdict(v, GOALS[k]) for k, v in values.items()}
                            if checked
                            else None
                        ),
                    },
                )
            )
        i = info.get(name)
        row.append(f"{i['ratio']:.2f}x" if i else "-")
        table.append(row)
    print(
        f"model: {loaded.gguf_file or loaded.source_dir} (load {t_load:.1f} s); "
        f"{len(calib)} calibration samples x {length} tokens, batch "
        f"{args.batch_size}; plain forwards {plain:.1f} s; artifact dtype "
        f"{args.dtype}, read back; float linears; held-out tokens "
        + ", ".join(f"{d} {next(iter(r.values())).tokens}" for d, r in results.items())
        + f"; {torch.get_num_threads()} threads"
    )
    print_table(headers, table, title="Static [H,1] FAQuant, all layers, vs float")
    lines = []
    for d, res in results.items():
        r = res[both]
        checks = [
            ("cos", r.mean_cosine, "cosine"),
            ("rel-L1", r.mean_rel_l1, "rel_l1"),
            ("KL", r.kl, "kl"),
            ("ppl Δ%", r.ppl_delta_pct, "ppl_delta_pct"),
        ]
        lines.append(
            f"{d} ({both}): "
            + ", ".join(
                f"{label} {v:.5f} {GOALS[k]}: {verdict(v, GOALS[k])}"
                for label, v, k in checks
            )
        )
    ratio, goal = info[both]["ratio"], GOALS["calibration_vs_plain"]
    lines.append(
        f"calibration with transforms {ratio:.2f}x plain forwards "
        f"{goal}: {verdict(ratio, goal)}"
        f" (default {info['default']['ratio']:.2f}x; fold incl. statistics "
        f"{info[both]['fold_seconds']:.1f} s)"
    )
    for line in lines:
        print(line)
    write_results(
        args.json,
        records,
        backend="cpu",
        extra={
            "plain_seconds": plain,
            "calibration": info,
            "verdicts": lines,
        },
    )
    return 0
