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


_BOTH = "v-rotation + qk-smoothing"


def run(args: argparse.Namespace) -> int:
    from ascend_fa.benchmarks.results import write_results

    setup = accuracy_setup(args)
    plain = _plain_forwards(args, setup)
    with tempfile.TemporaryDirectory(prefix="attention-accuracy-") as tmp:
        specs, models, info = _calibrate_rows(args, setup, plain, Path(tmp))
        results = _evaluate(setup, specs, models)
    _print_table(args, setup, plain, specs, results, info)
    lines = _verdict_lines(results, info)
    for line in lines:
        print(line)
    write_results(
        args.json,
        _records(args, setup, specs, results, info),
        backend="cpu",
        extra={
            "plain_seconds": plain,
            "calibration": info,
            "verdicts": lines,
        },
    )
    return 0


def _batches(args: argparse.Namespace, setup: Any, texts: list[str]) -> list[Any]:
    from ascend_fa.calibration.pipeline import calibration_batches

    return list(
        calibration_batches(
            setup.loaded.tokenizer,
            texts,
            max_length=setup.max_length,
            batch_size=args.batch_size,
        )
    )


def _plain_forwards(args: argparse.Namespace, setup: Any) -> float:
    """Seconds of plain forwards over the calibration batches (the baseline)."""
    from ascend_fa.calibration.pipeline import run_forwards

    net = setup.loaded.model
    with torch.no_grad():
        run_forwards(net, _batches(args, setup, setup.calib)[:1])  # warm-up
        t = time.perf_counter()
        run_forwards(net, _batches(args, setup, setup.calib))
        return time.perf_counter() - t


def _calibrate_rows(
    args: argparse.Namespace, setup: Any, plain: float, tmp: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """Each static row calibrated, written to ``tmp`` and read back: the
    evaluation specs and models by row (with the dynamic bounds), and each row's
    calibration timing."""
    from ascend_fa.calibration.job import default_recipe_path
    from ascend_fa.calibration.recipe import FA3QuantConfig, Recipe, load_recipe

    default_recipe = load_recipe(default_recipe_path())
    union = Recipe(processors=[FA3QuantConfig()])
    rows: dict[str, tuple[str, Any]] = {
        "default": ("", default_recipe),
        "msModelSlim-style recall_window/union": ("", union),
        "v-rotation": ("v-rotation", default_recipe),
        "qk-smoothing": ("qk-smoothing", default_recipe),
        _BOTH: (_ALL, default_recipe),
    }
    specs: dict[str, Any] = {}
    models: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for i, (name, (transforms, recipe)) in enumerate(rows.items()):
        out = tmp / f"artifact{i}"
        secs, fold_secs, folded = _calibrate_one(args, setup, transforms, recipe, out)
        info[name] = {
            "seconds": secs,
            "fold_seconds": fold_secs,
            "ratio": secs / plain,
            "transforms": folded,
        }
        # Read back: the stored weights over the source model, the stored scales.
        specs[name], back = _read_back(setup, out)
        if back is not None:
            models[name] = back
        print(f"calibrated {name}: {secs:.1f} s", file=sys.stderr, flush=True)
    specs["dynamic per-token-head (bound)"] = "dynamic"
    if _BOTH in models:
        specs["dynamic + transforms (bound)"] = "dynamic"
        models["dynamic + transforms (bound)"] = models[_BOTH]
    return specs, models, info


def _calibrate_one(
    args: argparse.Namespace, setup: Any, transforms: str, recipe: Any, out: Path
) -> tuple[float, float, dict[str, Any] | None]:
    """One row calibrated on a copy of the model and written to ``out``: its
    seconds, the seconds of folding and the report of what was folded."""
    from ascend_fa.calibration.pipeline import calibrate_model
    from ascend_fa.transforms.attention import LayerwiseTransforms, parse_transforms

    tok = setup.loaded.tokenizer
    m = copy.deepcopy(setup.loaded.model)
    t = time.perf_counter()
    # As calibrate runs them with float linears: folded inside the layer-major
    # FA pass.
    in_pass = None
    if transforms:
        in_pass = LayerwiseTransforms(m, parse_transforms(transforms), seed=args.seed)
    res = calibrate_model(
        m,
        tok,
        setup.calib,
        recipe=recipe,
        max_length=setup.max_length,
        batch_size=args.batch_size,
        progress=False,
        before_layer=in_pass,
    )
    secs = time.perf_counter() - t
    folded = in_pass.result() if in_pass is not None else None
    scales = res.export_scales(m)
    res.remove(m)
    meta = folded.description_metadata() if folded is not None else None
    _write(m, tok, scales, out, setup.dtype, meta)
    if folded is None:
        return secs, 0.0, None
    return secs, folded.seconds, folded.to_report()


def _read_back(setup: Any, out: Path) -> tuple[Any, Any]:
    from ascend_fa.evaluation import read_artifact_spec
    from ascend_fa.linear import artifact_model

    return read_artifact_spec(out), artifact_model(setup.loaded.model, out)


def _evaluate(
    setup: Any, specs: dict[str, Any], models: dict[str, Any]
) -> dict[str, Any]:
    """Every row evaluated on each held-out domain."""
    from ascend_fa.evaluation import evaluate

    results = {}
    for d, w in setup.windows.items():
        t = time.perf_counter()
        results[d] = evaluate(setup.loaded.model, w, specs, models=models)
        print(f"evaluated {d}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return results


def _values(r: Any) -> dict[str, float]:
    return {
        "cosine": r.mean_cosine,
        "rel_l1": r.mean_rel_l1,
        "kl": r.kl,
        "ppl_delta_pct": r.ppl_delta_pct,
    }


def _records(
    args: argparse.Namespace,
    setup: Any,
    specs: dict[str, Any],
    results: dict[str, Any],
    info: dict[str, dict[str, Any]],
) -> list[Any]:
    from ascend_fa.benchmarks.results import Record, verdict

    records = []
    for name in specs:
        for d, res in results.items():
            r = res[name]
            values = _values(r)
            records.append(
                Record(
                    benchmark=NAME,
                    backend="cpu",
                    mode=name,
                    params={
                        "domain": d,
                        "num_samples": len(setup.calib),
                        "max_length": setup.max_length,
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
                            if name == _BOTH
                            else None
                        ),
                    },
                )
            )
    return records


def _print_table(
    args: argparse.Namespace,
    setup: Any,
    plain: float,
    specs: dict[str, Any],
    results: dict[str, Any],
    info: dict[str, dict[str, Any]],
) -> None:
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
    for name in specs:
        row = [name]
        for res in results.values():
            r = res[name]
            row += [
                f"{r.ppl_delta_pct:+.3f}%",
                f"{r.kl:.5f}",
                f"{r.mean_cosine:.5f}",
                f"{r.min_cosine:.5f}",
                f"{r.mean_rel_l1:.5f}",
            ]
        i = info.get(name)
        row.append(f"{i['ratio']:.2f}x" if i else "-")
        table.append(row)
    loaded, length = setup.loaded, setup.max_length
    print(
        f"model: {loaded.gguf_file or loaded.source_dir} (load {setup.load_s:.1f} "
        f"s); {len(setup.calib)} calibration samples x {length} tokens, batch "
        f"{args.batch_size}; plain forwards {plain:.1f} s; artifact dtype "
        f"{args.dtype}, read back; float linears; held-out tokens "
        + ", ".join(f"{d} {next(iter(r.values())).tokens}" for d, r in results.items())
        + f"; {torch.get_num_threads()} threads"
    )
    print_table(headers, table, title="Static [H,1] FAQuant, all layers, vs float")


def _verdict_lines(
    results: dict[str, Any], info: dict[str, dict[str, Any]]
) -> list[str]:
    from ascend_fa.benchmarks.results import verdict

    lines = []
    for d, res in results.items():
        r = res[_BOTH]
        checks = [
            ("cos", r.mean_cosine, "cosine"),
            ("rel-L1", r.mean_rel_l1, "rel_l1"),
            ("KL", r.kl, "kl"),
            ("ppl Δ%", r.ppl_delta_pct, "ppl_delta_pct"),
        ]
        lines.append(
            f"{d} ({_BOTH}): "
            + ", ".join(
                f"{label} {v:.5f} {GOALS[k]}: {verdict(v, GOALS[k])}"
                for label, v, k in checks
            )
        )
    ratio, goal = info[_BOTH]["ratio"], GOALS["calibration_vs_plain"]
    lines.append(
        f"calibration with transforms {ratio:.2f}x plain forwards "
        f"{goal}: {verdict(ratio, goal)}"
        f" (default {info['default']['ratio']:.2f}x; fold incl. statistics "
        f"{info[_BOTH]['fold_seconds']:.1f} s)"
    )
    return lines
