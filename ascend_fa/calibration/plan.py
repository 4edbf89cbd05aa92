"""The first stage of ``calibrate``: the plan.

:func:`plan_calibration` turns ``calibrate``'s arguments into a
:class:`CalibrationPlan` — every argument parsed into its value (target, dtype,
linear type, fallback, transforms, error budget), the combinations refused by the
checks of :data:`PREFLIGHT_CHECKS`, then the recipe and the calibration text read
and split — all before any model loads or anything is written. The later stages
(:mod:`.source`, :mod:`.stages`, :mod:`.export`) read only the plan.

A new refusal that needs no model is one more function in
:data:`PREFLIGHT_CHECKS` (it receives the plan, raises
:class:`~ascend_fa.errors.InputError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ascend_fa import parallel
from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.families import family_refusal, is_mla

from .arguments import (
    LINEAR_TYPES,
    check_locations,
    check_positive,
    check_streaming,
    default_linear,
    parse_fallback,
    source_config,
    warn_target,
)

if TYPE_CHECKING:
    from .recipe import Recipe

__all__ = [
    "PREFLIGHT_CHECKS",
    "CalibrationPlan",
    "default_recipe_path",
    "plan_calibration",
    "resolved_recipe",
    "with_recipe",
]


def default_recipe_path() -> Path:
    """The recipe ``calibrate`` uses when none is given (``recipes/default.yaml``)."""
    return Path(str(resources.files("ascend_fa") / "recipes" / "default.yaml"))


@dataclass(frozen=True)
class CalibrationPlan:
    """What one ``calibrate`` run will do, decided before any work.

    ``linear_type`` is the description's ``model_quant_type`` (``FLOAT`` keeps the
    linears float); ``mla`` is what the source ``config.json`` says (None when there
    is none: GGUF or the default model; the loaded model decides then).
    ``recipe``, ``calib`` and ``held`` are filled once the checks pass.
    """

    model: str | Path | None
    output: str | Path | None
    merge_into: str | Path | None
    gguf_file: str | None
    source_config: dict[str, Any] | None
    mla: bool | None
    target: str
    consumer_version: str | None
    dtype: torch.dtype
    research: bool
    kv_strategy: str
    linear_type: str
    linear_fallback: int | str
    criterion: str
    rotate: str
    linear_headroom: float | None
    transforms: tuple[str, ...]
    error_budget: float | None
    clip_search: bool
    streaming: bool
    max_memory: str | int | None
    max_shard_size: str | int
    num_samples: int
    max_length: int
    batch_size: int
    seed: int
    heldout: int
    recipe_path: Path | None
    calib_data: str | Path | None
    backend: str | None
    overwrite: bool
    force: bool
    picture_report: bool
    cache: bool
    progress: bool
    recipe: Any = None
    calib: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)

    @property
    def merge(self) -> bool:
        return self.merge_into is not None

    def fingerprint_arguments(self, device: torch.device) -> dict[str, Any]:
        """The arguments a streaming run's resume state must match
        (:func:`~.resume.run_fingerprint`): a change to any of them starts over."""
        return {
            "target": self.target,
            "dtype": str(self.dtype),
            "kv_strategy": self.kv_strategy,
            "linear": self.linear_type,
            "linear_fallback": self.linear_fallback,
            "criterion": self.criterion,
            "rotate": self.rotate,
            "linear_headroom": self.linear_headroom,
            "num_samples": self.num_samples,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "heldout": self.heldout,
            "device": str(device),
            "recipe": {"processors": [p.model_dump() for p in self.recipe.processors]},
        }

    def lines(self) -> list[str]:
        """The plan in a few readable lines."""
        from ascend_fa.artifact import dtype_name

        where = (
            f"merge into {self.merge_into}"
            + (f" -> {self.output}" if self.output is not None else "")
            if self.merge
            else f"write {self.output}"
        )
        extras = ["streaming"] if self.streaming else []
        if self.clip_search:
            extras.append("clip search")
        if self.transforms:
            extras.append(f"transforms {','.join(self.transforms)}")
        if self.error_budget is not None:
            extras.append(f"error budget KL {self.error_budget:g}")
        if self.linear_headroom is not None:
            extras.append(f"linear headroom {self.linear_headroom:g} doublings")
        return [
            f"model: {self.model if self.model is not None else 'default demo model'}",
            f"target: {self.target} ({dtype_name(self.dtype)} weights"
            + (", research artifact" if self.research else "")
            + f"), linears {self.linear_type} (fallback {self.linear_fallback}, "
            f"criterion {self.criterion})",
            f"samples: {len(self.calib) or self.num_samples} calibration + "
            f"{len(self.held) or self.heldout} held-out, max length "
            f"{self.max_length}, batch {self.batch_size}, seed {self.seed}",
            f"recipe: {self.recipe_path or 'given as text or a Recipe'}",
            "options: " + (", ".join(extras) if extras else "none"),
            f"output: {where}",
        ]


def _resolved_linear(
    linear: str | None,
    merge_into: Any,
    target: str,
    mla: bool | None,
    model_type: str | None = None,
) -> str:
    """``--linear`` as the description's ``model_quant_type``: an export merged
    into keeps its own linears; None means what the target deploys."""
    if merge_into is not None and linear not in (None, "none"):
        raise InputError(
            "--merge-into keeps the export's own quantized linears; drop --linear"
        )
    if merge_into is not None:
        linear = "none"
    elif linear is None:
        linear = default_linear(target, mla, model_type)
    linear_type = LINEAR_TYPES.get(str(linear).lower())
    if linear_type is None:
        raise InputError(f"--linear {linear!r}; choose w8a8, w8a8_dynamic or none")
    return linear_type


def _read_recipe(recipe: str | Path | Recipe | None) -> tuple[Recipe, Path | None]:
    """The run's recipe (a :class:`~.recipe.Recipe`, a file, YAML text, or None
    for the packaged default) and its file (None for text or an object)."""
    from .recipe import Recipe, load_recipe

    if isinstance(recipe, Recipe):
        return recipe, None
    if recipe is None:
        recipe = default_recipe_path()
    loaded = load_recipe(recipe)
    text = str(recipe)
    is_file = isinstance(recipe, Path) or ("\n" not in text and os.path.isfile(text))
    return loaded, Path(text) if is_file else None


def _absolute(path: str | Path | None) -> str | None:
    """A path as an absolute one (the resolved recipe records it so; a rerun
    from another directory reads the same files)."""
    return None if path is None else str(Path(path).absolute())


def with_recipe(args: dict[str, Any]) -> tuple[dict[str, Any], Recipe, Path | None]:
    """``calibrate``'s arguments with the recipe's values where an argument is
    not given (None): an argument given explicitly wins, the recipe comes next,
    and a key the recipe leaves out has the schema's default
    (:data:`~.recipe.RECIPE_FLAGS`)."""
    from .recipe import RECIPE_FLAGS

    recipe, path = _read_recipe(args.get("recipe"))
    given = {k: v for k, v in args.items() if k in RECIPE_FLAGS and v is not None}
    merged = {**args, **recipe.flag_values(), **given}
    for key in ("model", "merge_into", "calib_data"):
        merged[key] = _absolute(merged[key])
    return merged, recipe, path


def _parsed(args: dict[str, Any]) -> CalibrationPlan:
    """Every argument parsed on its own (one clear error for a bad value)."""
    from ascend_fa import artifact
    from ascend_fa.transforms.attention import parse_transforms

    from .budget import check_error_budget

    args, recipe, recipe_path = with_recipe(args)
    if args["output"] is None and args["merge_into"] is None:
        raise InputError("--output is required (or --merge-into DIR)")
    check_positive(
        num_samples=args["num_samples"],
        max_length=args["max_length"],
        batch_size=args["batch_size"],
    )
    artifact.parse_size(args["max_shard_size"])
    target = artifact.resolve_target(args["target"])
    dtype = artifact.resolve_dtype(args["dtype"], research=True)
    if args["kv_strategy"] not in artifact.KV_STRATEGIES:
        raise InputError(
            f"--kv-strategy {args['kv_strategy']!r}; choose one of "
            f"{', '.join(artifact.KV_STRATEGIES)}"
        )
    src_config = source_config(args["model"])
    mla = is_mla(src_config.get("model_type")) if src_config else None
    linear_type = _resolved_linear(
        args["linear"],
        args["merge_into"],
        target,
        mla,
        src_config.get("model_type") if src_config else None,
    )
    return CalibrationPlan(
        model=args["model"],
        output=args["output"],
        merge_into=args["merge_into"],
        gguf_file=args["gguf_file"],
        source_config=src_config,
        mla=mla,
        target=target,
        consumer_version=args["consumer_version"],
        dtype=dtype,
        research=artifact.is_research_dtype(dtype),
        kv_strategy=args["kv_strategy"],
        linear_type=linear_type,
        linear_fallback=parse_fallback(args["linear_fallback"]),
        criterion=args["linear_fallback_criterion"],
        rotate=_parsed_rotate(args["rotate"]),
        linear_headroom=_parsed_headroom(args["linear_headroom"]),
        transforms=parse_transforms(args["transforms"]),
        error_budget=check_error_budget(args["error_budget"]),
        clip_search=args["clip_search"],
        streaming=args["streaming"],
        max_memory=args["max_memory"],
        max_shard_size=args["max_shard_size"],
        num_samples=args["num_samples"],
        max_length=args["max_length"],
        batch_size=args["batch_size"],
        seed=args["seed"],
        heldout=args["heldout"],
        recipe_path=recipe_path,
        calib_data=args["calib_data"],
        backend=args["backend"],
        overwrite=args["overwrite"],
        force=args["force"],
        picture_report=args["picture_report"],
        cache=args["cache"],
        progress=args["progress"],
        recipe=recipe,
    )


# -- pre-flight checks: each receives the plan and raises InputError ---------


def check_output_locations(plan: CalibrationPlan) -> None:
    """Where the run writes: not the model, not inside it, only what
    ``--overwrite`` / ``--force`` allow."""
    check_locations(
        plan.model,
        plan.output,
        plan.merge_into,
        overwrite=plan.overwrite,
        force=plan.force,
    )


def check_consumer_release(plan: CalibrationPlan) -> None:
    """The consumer release (``--consumer-version``, default the newest stable one
    in :mod:`ascend_fa.artifact.releases`) loads what the target writes for this
    model; otherwise one line naming the first release that does."""
    from ascend_fa import artifact

    # the model is built (its experts' quant methods) before any weight loads
    check_expert_linears(plan)
    artifact.check_release(
        plan.target, plan.consumer_version, plan.model, plan.gguf_file
    )


def check_family(plan: CalibrationPlan) -> None:
    """A family transformers builds but ascend-fa writes no artifact of
    (:data:`ascend_fa.families.NOT_CALIBRATED`): one line, before it loads."""
    model_type = (plan.source_config or {}).get("model_type")
    line = family_refusal(model_type, plan.target)
    if line:
        raise UnsupportedError(line)


def check_mindie_family(plan: CalibrationPlan) -> None:
    """``--target mindie``: MindIE 3.0.0 has a model for this family and loads
    these linears there (:func:`~ascend_fa.artifact.mindie_refusal`). A family
    without a MindIE model is refused whatever the linears (``--linear none``
    included); only a research run (``--dtype fp32``, which no MindIE loads)
    writes its layout, and ``inspect --target mindie`` refuses that artifact."""
    from ascend_fa import artifact

    if plan.target != "mindie" or not plan.source_config:
        return
    if plan.research:
        return
    line = artifact.mindie_refusal(
        plan.source_config.get("model_type"),
        linear_type=plan.linear_type,
        merge=plan.merge,
    )
    if line:
        raise UnsupportedError(line)


def check_expert_linears(plan: CalibrationPlan) -> None:
    """Quantized linears quantize the routed experts too; a vllm-ascend release
    that cannot load them for this architecture is refused in one line
    (:func:`ascend_fa.artifact.release_loader.expert_linear_refusal`)."""
    from ascend_fa.artifact.release_loader import expert_linear_refusal
    from ascend_fa.artifact.releases import architecture, resolve_release
    from ascend_fa.families import moe_layout

    if plan.linear_type == "FLOAT" or plan.merge or not plan.source_config:
        return
    release = resolve_release(plan.target, plan.consumer_version)
    if release is None:
        return
    layout = moe_layout(plan.source_config.get("model_type"))
    block = layout.checkpoint_block if layout is not None else None
    arch = architecture(plan.source_config)
    line = expert_linear_refusal(release.target, release.name, arch, block)
    if line:
        raise UnsupportedError(f"--consumer-version {release.name}: {line}")


def check_transforms_merge(plan: CalibrationPlan) -> None:
    if plan.transforms and plan.merge:
        raise InputError(
            "--transforms changes the model's weights; --merge-into keeps the "
            "export's weights: use one or the other"
        )


def check_consumer_target(plan: CalibrationPlan) -> None:
    """What the target loads for this model and these linears
    (:func:`~ascend_fa.artifact.check_target`), and its one-line warning."""
    from ascend_fa import artifact

    artifact.check_target(
        plan.target,
        mla=plan.mla,
        model_quant_type=plan.linear_type,
        merge=plan.merge,
        model_type=plan.source_config.get("model_type") if plan.source_config else None,
    )
    warn_target(plan.target, plan.linear_type, merge=plan.merge)


def check_clip_search_target(plan: CalibrationPlan) -> None:
    if plan.clip_search and plan.target != "mindie":
        raise InputError(
            f"--clip-search tunes FAQuant scales, which --target {plan.target} does "
            "not write for GQA models; use it with --target mindie"
        )


def check_merge_export(plan: CalibrationPlan) -> None:
    from ascend_fa import artifact

    if plan.merge:
        artifact.check_merge_export(
            plan.merge_into, plan.source_config, source=plan.model
        )


def check_clip_search_processes(plan: CalibrationPlan) -> None:
    if plan.clip_search and (parallel.launched() or parallel.is_active()):
        # The clip search keeps each rank's own calibration rows per head and
        # scores clips on them: no exact reduction, so no data-parallel run.
        raise InputError(
            "--clip-search is not data-parallel (it scores clips on the rows one "
            "process keeps); run it in one process"
        )


def check_streaming_options(plan: CalibrationPlan) -> None:
    if plan.streaming or plan.max_memory is not None:
        check_streaming(
            plan.streaming,
            merge_into=plan.merge_into,
            clip_search=plan.clip_search,
            criterion=plan.criterion if plan.linear_type != "FLOAT" else None,
            max_memory=plan.max_memory,
        )
    if plan.streaming and (plan.transforms or plan.error_budget is not None):
        # Both change the in-memory model as a whole (folded weights, a KL
        # measured over all layers); the streamed skeleton holds one layer.
        raise InputError(
            "--streaming does not apply --transforms or --error-budget: run "
            "without --streaming, or without those options"
        )


def check_error_budget_target(plan: CalibrationPlan) -> None:
    if plan.error_budget is not None and plan.target != "mindie" and plan.mla is False:
        raise InputError(
            f"--error-budget keeps FAQuant layers float; --target {plan.target} "
            "writes KV-cache scales for GQA models: use --target mindie"
        )


#: ``--rotate`` values (:func:`plan_calibration`).
ROTATE_MODES = ("auto", "on", "off")


def _parsed_rotate(value: str) -> str:
    if value not in ROTATE_MODES:
        raise InputError(f"--rotate {value!r}; choose one of {', '.join(ROTATE_MODES)}")
    return value


def check_rotate(plan: CalibrationPlan) -> None:
    """``--rotate on`` needs quantized linears and the whole model in memory (the
    rotation touches the embedding, every layer and the head)."""
    if plan.rotate != "on":
        return
    if plan.linear_type == "FLOAT":
        raise InputError(
            "--rotate on rotates the residual stream for quantized linears; this "
            "run keeps them float (use --linear w8a8 or w8a8_dynamic)"
        )
    if plan.streaming:
        raise InputError(
            "--rotate on does not apply with --streaming (one layer in memory): "
            "drop one of them"
        )


def _parsed_headroom(value: float | str | None) -> float | None:
    from ascend_fa.linear.search import MAX_DOUBLINGS

    if value is None:
        return None
    try:
        doublings = float(value)
    except (TypeError, ValueError):
        doublings = float("nan")
    if isinstance(value, bool) or not 0.0 <= doublings <= MAX_DOUBLINGS:
        raise InputError(
            f"--linear-headroom {value!r}: a number of doublings in "
            f"[0, {MAX_DOUBLINGS:g}] (0: no "
            "headroom)"
        )
    return doublings


def check_headroom(plan: CalibrationPlan) -> None:
    """``--linear-headroom`` sizes static W8A8 ranges: refused where no linear is
    static W8A8 (it would change nothing)."""
    if plan.linear_headroom is not None and plan.linear_type != "W8A8":
        raise InputError(
            "--linear-headroom widens static W8A8 ranges; this run's linears are "
            f"{plan.linear_type} (use --linear w8a8 or drop it)"
        )


#: The checks :func:`plan_calibration` makes, in order, once every argument is
#: parsed and before anything is read, loaded or written.
PREFLIGHT_CHECKS: list[Callable[[CalibrationPlan], None]] = [
    check_output_locations,
    check_family,
    check_mindie_family,
    check_consumer_release,
    check_transforms_merge,
    check_consumer_target,
    check_clip_search_target,
    check_merge_export,
    check_clip_search_processes,
    check_streaming_options,
    check_error_budget_target,
    check_rotate,
    check_headroom,
]


def _with_inputs(plan: CalibrationPlan) -> CalibrationPlan:
    """The plan with its resolved recipe and its calibration / held-out texts
    read."""
    from .data import load_calib_texts, split_calibration

    texts = load_calib_texts(plan.calib_data)
    calib, held = split_calibration(texts, plan.num_samples, plan.heldout, plan.seed)
    return replace(plan, recipe=resolved_recipe(plan), calib=calib, held=held)


def resolved_recipe(
    plan: CalibrationPlan, *, backend: str | None = None, rotation: str | None = None
) -> Recipe:
    """The recipe of this run, fully resolved: every value the run uses, after the
    flags, with the defaults that depend on the target decided (linear scheme,
    consumer release, headroom); ``backend`` and ``rotation`` once known (the
    selected backend; ``on`` / ``off`` for ``auto`` once the model is loaded).
    What ``calibrate`` stores beside the weights (:data:`~ascend_fa.artifact.
    RECIPE_FILE`); a run of it writes the same artifact."""
    from ascend_fa.artifact import dtype_name, resolve_release
    from ascend_fa.linear import DEFAULT_HEADROOM_DOUBLINGS

    release = resolve_release(plan.target, plan.consumer_version)
    scheme = {v: k for k, v in LINEAR_TYPES.items()}[plan.linear_type]
    headroom = plan.linear_headroom
    if plan.linear_type == "W8A8" and headroom is None:
        headroom = DEFAULT_HEADROOM_DOUBLINGS
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    values = {
        "source.model": None if plan.model is None else str(plan.model),
        "source.gguf_file": plan.gguf_file,
        "source.merge_into": (
            None if plan.merge_into is None else str(plan.merge_into)
        ),
        "source.streaming": plan.streaming,
        "source.max_memory": plan.max_memory,
        "source.cache": plan.cache,
        "data.path": None if plan.calib_data is None else str(plan.calib_data),
        "data.num_samples": plan.num_samples,
        "data.max_length": plan.max_length,
        "data.batch_size": plan.batch_size,
        "data.seed": plan.seed,
        "data.heldout": plan.heldout,
        "target.consumer": plan.target,
        "target.release": None if release is None else release.name,
        "target.dtype": dtype[dtype_name(plan.dtype)],
        "target.kv_strategy": plan.kv_strategy,
        "linears.scheme": scheme,
        "linears.fallback": plan.linear_fallback,
        "linears.criterion": plan.criterion,
        "linears.headroom": None if headroom is None else float(headroom),
        "rotation": rotation or plan.rotate,
        "transforms": list(plan.transforms),
        "attention.clip_search": plan.clip_search,
        "attention.error_budget": plan.error_budget,
        "export.max_shard_size": plan.max_shard_size,
        "export.picture_report": plan.picture_report,
        "backend": backend or plan.backend,
    }
    try:
        return plan.recipe.with_values(values)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def plan_calibration(
    model: str | Path | None = None,
    *,
    output: str | Path | None = None,
    gguf_file: str | None = None,
    recipe: str | Path | Recipe | None = None,
    calib_data: str | Path | None = None,
    num_samples: int | None = None,
    max_length: int | None = None,
    batch_size: int | None = None,
    backend: str | None = None,
    overwrite: bool = False,
    force: bool = False,
    merge_into: str | Path | None = None,
    max_shard_size: str | int | None = None,
    seed: int | None = None,
    heldout: int | None = None,
    clip_search: bool | None = None,
    picture_report: bool | None = None,
    cache: bool | None = None,
    progress: bool = True,
    target: str | None = None,
    consumer_version: str | None = None,
    dtype: str | None = None,
    kv_strategy: str | None = None,
    linear: str | None = None,
    linear_fallback: int | str | None = None,
    linear_fallback_criterion: str | None = None,
    rotate: str | None = None,
    linear_headroom: float | str | None = None,
    streaming: bool | None = None,
    max_memory: str | int | None = None,
    transforms: str | list[str] | None = None,
    error_budget: float | str | None = None,
) -> CalibrationPlan:
    """The plan of ``calibrate(...)`` with these arguments (the same names and
    defaults): each argument parsed, :data:`PREFLIGHT_CHECKS` passed, the recipe
    and calibration text read. ``recipe`` (a file, YAML text or a
    :class:`~.recipe.Recipe`; None: the packaged default) holds every other
    argument too: an argument given (not None) wins over the recipe's value, and
    a key the recipe leaves out takes the schema's default (:func:`with_recipe`).
    Raises the typed errors of :mod:`ascend_fa.errors`; loads no model and writes
    nothing.

    ``linear``: ``"w8a8"``, ``"w8a8_dynamic"`` or ``"none"`` (None: the target's
    default — W8A8 for mindie, W8A8_DYNAMIC for MLA on vllm-ascend, float
    otherwise); ``linear_fallback`` keeps that many linears float (``"auto"``: by
    an error budget); ``linear_fallback_criterion``: ``"layer"`` (layer-local, what
    a streaming run can decide) or ``"kl"`` (whole-model logits). ``rotate``:
    the residual-stream rotation before the linears (:mod:`ascend_fa.transforms.
    residual`): ``"auto"`` (static W8A8 on a model family that takes it, not
    streaming), ``"on"`` or ``"off"``. ``linear_headroom``: the doublings of
    a static ``down_proj`` range's headroom (None: the default,
    :data:`~ascend_fa.linear.DEFAULT_HEADROOM_DOUBLINGS`; 0: none;
    static W8A8 only). With
    ``merge_into`` the export's own linears are kept. ``streaming`` keeps one
    decoder layer in memory (:mod:`ascend_fa.streaming`); ``max_memory`` (bytes or
    ``"64GB"``) refuses a streaming run whose estimated peak exceeds it.
    ``transforms``: exact attention transforms folded into the weights first
    (:mod:`ascend_fa.transforms.attention`; ``"v-rotation,qk-smoothing"``).
    ``error_budget``: a mean token KL; the fewest FA layers needed to meet it are
    kept float (:mod:`.budget`; FA targets only).
    """
    plan = _parsed(dict(locals()))
    for check in PREFLIGHT_CHECKS:
        check(plan)
    return _with_inputs(plan)
