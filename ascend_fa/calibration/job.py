"""The ``calibrate`` verb: from a checkpoint and calibration text to an artifact.

Steps: validate every input (recipe, calibration data, output location, shard
size) before the model loads; load the model (default: SmolLM2-135M-Instruct
GGUF); shuffle the calibration text with ``seed`` and split off ``heldout``
samples; inject FA points with the model's adapter and observe ``num_samples``
samples in padded batches (padding excluded through the attention mask); turn the
observers into fake-quant modules; run the held-out samples float and fake-quant for
the report (:mod:`.report`); write the artifact (or ``merge_into`` an msModelSlim
export) atomically (:mod:`ascend_fa.artifact`).

``target`` picks what is written (:mod:`ascend_fa.artifact.targets`): FAQuant /
FAKQuant scales (``mindie``; ``vllm-ascend`` for MLA), C8 per-channel K/V scales
(``vllm-ascend`` for GQA) or FP8 K/V scales (``vllm``), observed at the same FA
points in the same forwards (:mod:`.kv`); the held-out report then measures that
quantization. ``dtype`` is the artifact's weight dtype (bf16 default).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ascend_fa import parallel
from ascend_fa.errors import InputError

from .arguments import (
    LINEAR_TYPES,
    check_locations,
    check_positive,
    check_streaming,
    default_linear,
    parse_fallback,
    picture_files,
    source_config,
    streaming_plan,
    warn_target,
    with_carried,
)

__all__ = [
    "CalibrationResult",
    "calibrate",
    "default_recipe_path",
    "streaming_plan",
]


def default_recipe_path() -> Path:
    """The recipe ``calibrate`` uses when none is given (``recipes/default.yaml``)."""
    return Path(str(resources.files("ascend_fa") / "recipes" / "default.yaml"))


@dataclass
class CalibrationResult:
    """What :func:`calibrate` did: where the artifact went, its report, timings."""

    output: Path
    fa_quant_type: str
    layers: int
    num_samples: int
    report: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def heldout(self) -> dict[str, Any]:
        return self.report.get("heldout", {})

    def to_dict(self) -> dict[str, Any]:
        """What ``ascend-fa calibrate --json`` writes: the artifact, timings, the
        report's summary, held-out and linear sections (the per-head detail stays
        in ``calibration_report.json``)."""
        rep = self.report
        return {
            "output": str(self.output),
            "fa_quant_type": self.fa_quant_type,
            "layers": self.layers,
            "num_samples": self.num_samples,
            "seconds": dict(self.seconds),
            "target": rep.get("target"),
            "summary": rep.get("summary", {}),
            "heldout": self.heldout,
            "linears": rep.get("linears"),
            "transforms": (rep.get("transforms") or {}).get("folded"),
            "error_budget_kept_float": (rep.get("error_budget") or {}).get(
                "kept_float"
            ),
        }

    def summary_lines(self) -> list[str]:
        """The lines ``ascend-fa calibrate`` prints."""
        t = self.seconds
        lines = [
            f"calibrated {self.layers} attention modules ({self.fa_quant_type}) on "
            f"{self.num_samples} samples in {t.get('calibrate', 0):.1f} s (load "
            f"{t.get('load', 0):.1f} s, held-out eval {t.get('heldout', 0):.1f} s)"
        ]
        h, s = self.heldout, self.report.get("summary", {})
        if h and not h.get("tokens"):
            lines.append(
                f"held-out ({h['num_samples']} samples): no token to predict at "
                "this --max-length; no perplexity"
            )
        elif h:
            lines.append(
                f"held-out ({h['num_samples']} samples, {h['tokens']} tokens): "
                f"perplexity float {h['perplexity_float']:.4f}, fake-quant "
                f"{h['perplexity_fake_quant']:.4f} ({h['perplexity_delta_pct']:+.3f}%)"
                f"; attention-output cosine mean "
                f"{s['mean_attention_output_cosine']:.5f}, min "
                f"{s['min_attention_output_cosine']:.5f}"
            )
        eb = self.report.get("error_budget")
        if eb:
            lines.append(
                f"error budget KL {eb['budget']:g}: {len(eb['kept_float'])} of "
                f"{len(eb['ranking'])} attention layers kept float, KL "
                f"{eb['kl_steps'][0]:.5f} -> {eb['kl_steps'][-1]:.5f} on "
                f"{eb['tokens']} calibration tokens"
            )
        folded = self.report.get("transforms")
        if folded:
            lines.append(
                f"folded {', '.join(folded['folded'])} into the weights "
                f"({folded['seconds']:.1f} s)"
            )
        lin = self.report.get("linears")
        if lin:
            counts = ", ".join(f"{n} {k}" for k, n in sorted(lin["counts"].items()))
            kl = lin.get("scan_kl")
            tail = f"; scan KL {kl:.5f}" if kl is not None else ""
            lines.append(
                f"linears: {counts} (fallback {lin['fallback']}{tail}; "
                f"{lin['seconds'].get('quantize', 0):.1f} s)"
            )
        if self.report.get("research_artifact"):
            lines.append(
                f"{self.report.get('dtype')} weights: a research artifact for exact "
                "evaluation, not deployable (ascend-fa inspect --target says why)"
            )
        lines.append(f"wrote {self.output}")
        return lines


def _open_resume(
    work: Path,
    source: Path,
    texts: list[str],
    num_layers: int,
    arguments: dict[str, Any],
) -> Any:
    """The resume state of a streaming run in ``work`` (:mod:`.resume`); prints
    the one line saying it resumes or why an earlier state was discarded."""
    import sys

    from .resume import open_resume, run_fingerprint

    state, note = open_resume(
        work, run_fingerprint(source, texts, arguments), num_layers
    )
    if note:
        print(note, file=sys.stderr, flush=True)
    return state


def _resumable(state: Any, streamed: Any, dtype: torch.dtype) -> Any:
    """``state`` bound to the streamed model: spill files of layers the state
    does not count as done (an earlier run's) are dropped."""
    state.streamed, state.dtype = streamed, dtype
    streamed.drop_spills(state.linear_done)
    return state


def calibrate(
    model: str | Path | None = None,
    *,
    output: str | Path | None = None,
    gguf_file: str | None = None,
    recipe: str | Path | None = None,
    calib_data: str | Path | None = None,
    num_samples: int = 32,
    max_length: int = 512,
    batch_size: int = 4,
    backend: str | None = None,
    overwrite: bool = False,
    force: bool = False,
    merge_into: str | Path | None = None,
    max_shard_size: str | int = "5GB",
    seed: int = 0,
    heldout: int = 4,
    clip_search: bool = False,
    picture_report: bool = True,
    cache: bool = True,
    progress: bool = True,
    target: str | None = None,
    consumer_version: str | None = None,
    dtype: str | None = None,
    kv_strategy: str = "tensor",
    linear: str | None = None,
    linear_fallback: int | str = "auto",
    linear_fallback_criterion: str = "layer",
    streaming: bool = False,
    max_memory: str | int | None = None,
    transforms: str | list[str] | None = None,
    error_budget: float | str | None = None,
) -> CalibrationResult:
    """Calibrate ``model`` and write the artifact to ``output`` (or merge into
    ``merge_into``; the result then goes to ``output`` or replaces it).

    Arguments mirror ``ascend-fa calibrate``'s flags. Raises the typed errors of
    :mod:`ascend_fa.errors` for bad input, before any model is loaded.
    ``linear``: ``"w8a8"``, ``"w8a8_dynamic"`` or ``"none"`` (None: the target's
    default — W8A8 for mindie, W8A8_DYNAMIC for MLA on vllm-ascend, float
    otherwise): the linears are quantized first (:mod:`ascend_fa.linear`), so the
    FA / KV scales are calibrated with the quantized linears active;
    ``linear_fallback`` keeps that many linears float (``"auto"``: by an error
    budget). ``linear_fallback_criterion``: ``"layer"`` (default: layer-local,
    what a streaming run can decide) or ``"kl"`` (whole-model logits). With
    ``merge_into`` the export's own linears are kept. ``streaming`` keeps one
    decoder layer in memory, loaded from the checkpoint's shards
    (:mod:`ascend_fa.streaming`; the same artifact); ``max_memory`` (bytes or
    ``"64GB"``) refuses a streaming run whose estimated peak exceeds it.
    ``transforms``: exact attention transforms folded into the weights first
    (:mod:`ascend_fa.transforms.attention`; ``"v-rotation,qk-smoothing"``).
    ``error_budget``: a mean token KL; the fewest FA layers needed to meet it are
    kept float (:mod:`.budget`; FA targets only).
    """
    from ascend_fa import artifact
    from ascend_fa.adapters.hf import find_fa_modules, swapped_points
    from ascend_fa.backends import get_backend
    from ascend_fa.models import load_model

    from .data import load_calib_texts, split_calibration
    from .kv import KVCalibration, KVQuantSpec, recipe_settings
    from .layerwise import layerwise_supported
    from .pipeline import calibrate_model, calibration_batches
    from .recipe import load_recipe
    from .report import build_report, heldout_report

    if output is None and merge_into is None:
        raise InputError("--output is required (or --merge-into DIR)")
    check_positive(
        num_samples=num_samples, max_length=max_length, batch_size=batch_size
    )
    artifact.parse_size(max_shard_size)
    check_locations(model, output, merge_into, overwrite=overwrite, force=force)
    target = artifact.check_release(target, consumer_version, model, gguf_file)
    art_dtype = artifact.resolve_dtype(dtype, research=True)
    research = artifact.is_research_dtype(art_dtype)
    if kv_strategy not in artifact.KV_STRATEGIES:
        raise InputError(
            f"--kv-strategy {kv_strategy!r}; choose one of "
            f"{', '.join(artifact.KV_STRATEGIES)}"
        )
    src_config = source_config(model)
    mla = src_config.get("model_type") == "deepseek_v3" if src_config else None
    if merge_into is not None and linear not in (None, "none"):
        raise InputError(
            "--merge-into keeps the export's own quantized linears; drop --linear"
        )
    if merge_into is not None:
        linear = "none"
    elif linear is None:
        linear = default_linear(target, mla)
    linear_type = LINEAR_TYPES.get(str(linear).lower())
    if linear_type is None:
        raise InputError(f"--linear {linear!r}; choose w8a8, w8a8_dynamic or none")
    linear_fallback = parse_fallback(linear_fallback)
    from ascend_fa.transforms.attention import parse_transforms

    transform_names = parse_transforms(transforms)
    from .budget import check_error_budget

    budget = check_error_budget(error_budget)
    if transform_names and merge_into is not None:
        raise InputError(
            "--transforms changes the model's weights; --merge-into keeps the "
            "export's weights: use one or the other"
        )
    artifact.check_target(
        target,
        mla=mla,
        model_quant_type=linear_type,
        merge=merge_into is not None,
        model_type=src_config.get("model_type") if src_config else None,
    )
    warn_target(target, linear_type, merge=merge_into is not None)
    if clip_search and target != "mindie":
        raise InputError(
            f"--clip-search tunes FAQuant scales, which --target {target} does not "
            "write for GQA models; use it with --target mindie"
        )
    if merge_into is not None:
        artifact.check_merge_export(merge_into, src_config)
    if clip_search and (parallel.launched() or parallel.is_active()):
        # The clip search keeps each rank's own calibration rows per head and
        # scores clips on them: no exact reduction, so no data-parallel run.
        raise InputError(
            "--clip-search is not data-parallel (it scores clips on the rows one "
            "process keeps); run it in one process"
        )
    if streaming or max_memory is not None:
        check_streaming(
            streaming,
            merge_into=merge_into,
            clip_search=clip_search,
            criterion=linear_fallback_criterion if linear_type != "FLOAT" else None,
            max_memory=max_memory,
        )
    if streaming and (transform_names or budget is not None):
        # Both change the in-memory model as a whole (folded weights, a KL
        # measured over all layers); the streamed skeleton holds one layer.
        raise InputError(
            "--streaming does not apply --transforms or --error-budget: run "
            "without --streaming, or without those options"
        )
    if budget is not None and target != "mindie" and mla is False:
        raise InputError(
            f"--error-budget keeps FAQuant layers float; --target {target} writes "
            "KV-cache scales for GQA models: use --target mindie"
        )
    recipe_obj = load_recipe(Path(recipe) if recipe else default_recipe_path())
    texts = load_calib_texts(calib_data)
    calib, held = split_calibration(texts, num_samples, heldout, seed)
    torch.manual_seed(seed)
    device = get_backend(backend).device
    # Under torchrun: join the ranks (after the checks above, which every rank
    # makes alike); each rank calibrates its share, rank 0 writes.
    with parallel.process_group(device) as device:
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        streamed = resume = None
        if streaming:
            from ascend_fa.streaming import open_streamed

            assert output is not None
            # Each rank spills its own changed layers (a rank's own work dir).
            me = parallel.rank()
            tag = f".rank{me}" if me else ""
            work = Path(output).parent / f".{Path(output).name}.streaming{tag}"
            loaded, streamed = open_streamed(model, work, device=device)
            if max_memory is not None:
                streamed.check_memory(
                    artifact.parse_size(max_memory), len(calib), max_length
                )
            net = loaded.model
            if parallel.world_size() > 1:
                # Ranks hold different activations and may stop at different
                # layers: a data-parallel run keeps no resume state (a rerun
                # starts over) and drops an earlier run's spills.
                streamed.drop_spills()
            else:
                resume = _open_resume(
                    work,
                    Path(model),  # type: ignore[arg-type]
                    calib + held,
                    len(streamed.layers),
                    {
                        "target": target,
                        "dtype": str(art_dtype),
                        "kv_strategy": kv_strategy,
                        "linear": linear_type,
                        "linear_fallback": linear_fallback,
                        "criterion": linear_fallback_criterion,
                        "num_samples": num_samples,
                        "max_length": max_length,
                        "batch_size": batch_size,
                        "seed": seed,
                        "heldout": heldout,
                        "device": str(device),
                        "recipe": recipe_obj.model_dump(),
                    },
                )
                resume = _resumable(resume, streamed, art_dtype)
        else:
            with parallel.rank_zero_first():  # a model cache is written once
                loaded = load_model(model, gguf_file, cache=cache)
            net = loaded.model.to(device)
        seconds["load"] = time.perf_counter() - t0

        def batches_of(texts: list[str]) -> Any:
            # The unsplit samples of the transforms and the error budget (every
            # rank runs them whole).
            return calibration_batches(
                loaded.tokenizer,
                texts,
                max_length=max_length,
                batch_size=batch_size,
                device=device,
            )

        mla = net.config.model_type == "deepseek_v3"
        artifact.check_target(
            target,
            mla=mla,
            model_quant_type=linear_type,
            merge=merge_into is not None,
            model_type=net.config.model_type,
        )
        if merge_into is not None:
            artifact.check_merge_export(merge_into, net.config.to_dict())
        transform_result = None
        # With float linears and one process the transforms fold inside the
        # layer-major FA pass (no statistics forward of their own); quantized
        # linears must see the folded weights, so they are folded first there, as
        # they are for a data-parallel run (whose ranks see different rows) and
        # for the clip search's batch-major pass.
        in_pass = None
        if transform_names:
            from ascend_fa.transforms.attention import (
                STATS_SAMPLES,
                LayerwiseTransforms,
                apply_attention_transforms,
            )

            if (
                linear_type == "FLOAT"
                and not clip_search
                and parallel.world_size() == 1
                and layerwise_supported(net)
            ):
                in_pass = LayerwiseTransforms(net, transform_names, seed=seed)
            else:
                # Folded before the linears and the FA scales, so both see the
                # folded weights; the statistics forward runs on the float model.
                transform_result = apply_attention_transforms(
                    net,
                    batches_of(calib[:STATS_SAMPLES]),
                    transform_names,
                    seed=seed,
                )
                seconds["transforms"] = transform_result.seconds
        linear_result = None
        if linear_type != "FLOAT":
            from ascend_fa.linear import LinearConfig

            from .pipeline import calibrate_linears

            # Linears first, so the FA / KV scales are calibrated with them active;
            # scales are made representable in the artifact dtype.
            spill = streamed.spilling() if streamed else contextlib.nullcontext()
            with spill:
                linear_result = calibrate_linears(
                    net,
                    loaded.tokenizer,
                    calib,
                    LinearConfig(
                        linear_type,
                        art_dtype,
                        fallback=linear_fallback,
                        seed=seed,
                        criterion=linear_fallback_criterion,
                    ),
                    max_length=max_length,
                    batch_size=batch_size,
                    device=device,
                    progress=progress,
                    prepare_layer=streamed.ensure if streamed else None,
                    checkpoint=resume,
                )
        kv_mode = {"vllm-ascend": "c8", "vllm": "fp8"}.get(target) if not mla else None
        kv = None
        if kv_mode is not None:
            kv = KVCalibration(
                kv_mode,
                settings=recipe_settings(recipe_obj),
                max_tokens=len(calib) * max_length,
            )
        t0 = time.perf_counter()
        kwargs = dict(
            recipe=recipe_obj,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
            progress=progress,
        )
        if kv is not None:
            kwargs["wrap"] = kv.wrap
        if clip_search:
            from .search import calibrate_with_search

            result = calibrate_with_search(net, loaded.tokenizer, calib, **kwargs)
        else:
            # Streaming: layer-major, so each layer is read once for this pass,
            # and resumable after each layer.
            result = calibrate_model(
                net,
                loaded.tokenizer,
                calib,
                layerwise=streaming,
                checkpoint=resume,
                before_layer=in_pass,
                **kwargs,
            )
        seconds["calibrate"] = time.perf_counter() - t0
        if in_pass is not None:
            transform_result = in_pass.result()
            seconds["transforms"] = transform_result.seconds
        scales = result.export_scales(net)
        kv_scales = kv.scales(kv_strategy) if kv is not None else None
        budget_result = None
        if budget is not None:
            if kv is not None:
                raise InputError(
                    f"--error-budget keeps FAQuant layers float; --target {target} "
                    "writes KV-cache scales for this model: use --target mindie"
                )
            from .budget import BUDGET_SAMPLES, fit_error_budget

            budget_result = fit_error_budget(
                net, list(batches_of(calib[:BUDGET_SAMPLES])), budget
            )
            scales = {
                k: v for k, v in scales.items() if k not in budget_result.kept_float
            }
            if not scales:
                raise InputError(
                    f"--error-budget {budget} keeps every attention layer float "
                    "(nothing left to quantize); raise the budget"
                )
        t0 = time.perf_counter()
        held_stats, per_layer = ({}, {})
        if held and parallel.rank() == 0:  # the report is rank 0's
            # The held-out numbers measure what the target deploys: for C8 / FP8 the
            # FA points run the KV cache round trip (Q float) instead of FAQuant.
            deployed = (
                swapped_points(
                    find_fa_modules(net),
                    KVQuantSpec(
                        kv_mode, kv_scales, art_dtype if kv_mode == "c8" else None
                    ).point,
                )
                if kv is not None and kv_mode is not None and kv_scales is not None
                else contextlib.nullcontext()
            )
            if budget_result is not None:
                from .budget import float_layers

                deployed = float_layers(net, budget_result.kept_float)
            with deployed:
                held_stats, per_layer = heldout_report(
                    net,
                    loaded.tokenizer,
                    held,
                    max_length=max_length,
                    batch_size=batch_size,
                    device=device,
                    progress=progress,
                )
        seconds["heldout"] = time.perf_counter() - t0
        result.remove(net)

        fa_quant_type = result.adapter.fa_quant_type
        quant_kind = {"c8": "C8", "fp8": "FP8 KV"}.get(kv_mode or "", fa_quant_type)
        source = (
            str(loaded.source_dir / loaded.gguf_file)
            if loaded.gguf_file
            else str(loaded.source_dir)
        )
        report = build_report(
            scales=scales,
            ranges=result.ranges,
            per_layer=per_layer,
            heldout=held_stats,
            header={
                "model": source,
                "model_type": net.config.model_type,
                "fa_quant_type": fa_quant_type,
                "target": target,
                "deployed": quant_kind,
                "dtype": artifact.dtype_name(art_dtype),
                "research_artifact": research,
                "kv_cache_scales": (
                    {
                        a: {k: v.tolist() for k, v in sides.items()}
                        for a, sides in kv_scales.items()
                    }
                    if kv_scales
                    else None
                ),
                **(
                    {"error_budget": budget_result.to_report()}
                    if budget_result is not None
                    else {}
                ),
                **(
                    {"transforms": transform_result.to_report()}
                    if transform_result is not None
                    else {}
                ),
                **(
                    {"linears": linear_result.to_report()}
                    if linear_result is not None
                    else {}
                ),
                "recipe": [p.config.model_dump() for p in result.processors],
                "calibration": {
                    "num_samples": len(calib),
                    "max_length": max_length,
                    "batch_size": batch_size,
                    "seed": seed,
                    "ranks": parallel.world_size(),
                    "seconds": round(seconds["calibrate"], 3),
                },
            },
        )
        if parallel.rank() != 0:
            # Rank 0 writes the artifact; this rank's share is in its statistics.
            if streamed is not None:
                streamed.close()
            return CalibrationResult(
                output=Path(output or merge_into or "."),
                fa_quant_type=quant_kind,
                layers=len(report["layers"]),
                num_samples=len(calib),
                report=report,
                seconds=seconds,
            )
        fa_written = kv_scales is None
        extra_files = picture_files(report) if picture_report else {}
        if merge_into:
            dest = artifact.merge_into(
                merge_into,
                scales=scales if fa_written else None,
                fa_quant_type=fa_quant_type,
                output=output,
                report=report,
                extra_files=extra_files,
                overwrite=overwrite,
                force=force,
                consumer=target,
                kv_scales=kv_scales,
                model_config=net.config.to_dict(),
            )
        else:
            assert output is not None
            config = net.config.to_dict()
            # A GGUF-loaded config has no architectures; loaders dispatch on it.
            config["architectures"] = config.get("architectures") or [
                type(net).__name__
            ]
            config.pop("_name_or_path", None)
            tied_copies = target in artifact.ASCEND_TARGETS
            ckpt = (
                streamed.checkpoint_tensors(art_dtype, tied_copies=tied_copies)
                if streamed is not None
                else artifact.checkpoint_tensors(
                    net, art_dtype, tied_copies=tied_copies
                )
            )
            if mla and not loaded.gguf_file:
                ckpt = with_carried(ckpt, loaded.source_dir, net.config, art_dtype)
            dest = artifact.export_artifact(
                output,
                state_dict=ckpt.tensors,
                tensor_types=ckpt.types,
                scales=scales if fa_written else None,
                fa_quant_type=fa_quant_type,
                kv_scales=kv_scales,
                kv_strategy=kv_strategy,
                target=target,
                dtype=art_dtype,
                config=config,
                source_dir=None if loaded.gguf_file else loaded.source_dir,
                tokenizer=loaded.tokenizer,
                report=report,
                extra_files=extra_files,
                max_shard_size=max_shard_size,
                overwrite=overwrite,
                force=force,
                metadata={
                    **(
                        transform_result.description_metadata()
                        if transform_result is not None
                        else {}
                    ),
                    **(
                        {artifact.RESEARCH_METADATA_KEY: artifact.dtype_name(art_dtype)}
                        if research
                        else {}
                    ),
                }
                or None,
            )
        if streamed is not None:
            streamed.close()
        return CalibrationResult(
            output=Path(dest),
            fa_quant_type=quant_kind,
            layers=len(report["layers"]),
            num_samples=len(calib),
            report=report,
            seconds=seconds,
        )
