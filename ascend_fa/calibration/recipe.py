"""YAML recipes (msModelSlim-compatible ``fa3_quant`` processor items).

.. code-block:: yaml

    spec:
      process:
        - type: "fa3_quant"
          include: ["*"]                          # attention modules to calibrate
          exclude: ["model.layers.0.self_attn"]   # wins over include
          # ascend-fa extensions (all optional):
          ratio: {q: 0.9999, k: 0.9999, v: 1.0}   # or one number for all three
          method: recall_window                   # | minmax | abs_quantile
          accumulate: union                       # | pooled (needs max_samples)
          max_samples: 100000000                  # samples per head, upper bound
          fa_v: {method: minmax}                  # per-branch overrides

Matching (same as the reference tool): a pattern is matched against the attention
module's full dotted name with shell wildcards — ``*`` matches any run of
characters *including dots*, ``?`` one character, ``[7-8]`` a character class —
after brace expansion (``layers.{3,5}.self_attn`` is two patterns; braces nest).
Matching is case-sensitive and ``exclude`` wins over ``include``.

Validation is strict: an unknown key, a wrong type, a ratio outside ``(0, 1]`` or a
processor type other than ``fa3_quant`` raises :class:`RecipeError`, whose message
names, in one line, the file, the YAML path (``spec.process[0].ratio.q``) and its
line (:mod:`.recipe_yaml`). Top-level ``apiversion``
and ``metadata`` and the ``spec`` sections ``save`` and ``dataset`` of msModelSlim
recipes are accepted and ignored.

A recipe is the whole run: besides ``spec.process`` it holds every choice
``ascend-fa calibrate`` makes (all optional; a missing key takes the schema's
default, :mod:`.recipe_sections`)::

    spec:
      source: {model: null, gguf_file: null, merge_into: null, streaming: false,
               max_memory: null, cache: true}
      data: {path: null, num_samples: 32, max_length: 512, batch_size: 4, seed: 0,
             heldout: 4}
      target: {consumer: mindie, release: null, dtype: bf16, kv_strategy: tensor}
      linears: {scheme: null, fallback: auto, criterion: layer, headroom: null}
      rotation: auto
      transforms: []
      attention: {clip_search: false, error_budget: null}
      export: {max_shard_size: 5GB, picture_report: true}
      backend: null
      process: [...]

:data:`RECIPE_FLAGS` maps each key to its ``calibrate`` flag; a flag given
explicitly wins over the recipe (:meth:`Recipe.flag_values`). Relative paths in a
recipe file are relative to the file's directory. :func:`dump_recipe` writes a
recipe back as YAML (``calibrate`` stores the resolved recipe of a run beside the
weights, :data:`~ascend_fa.artifact.RECIPE_FILE`), and loading that text gives the
same recipe.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ascend_fa.adapters.placeholder import FA_BRANCHES
from ascend_fa.errors import AscendFAError
from ascend_fa.safe_files import read_text

from .recipe_sections import (
    PATH_KEYS,
    RECIPE_FLAGS,
    AttentionSettings,
    DataSettings,
    ExportSettings,
    LinearSettings,
    Rotation,
    SourceSettings,
    TargetSettings,
    Transform,
    folding_order,
    yaml_on_off,
)
from .recipe_yaml import (
    MAX_RECIPE_BYTES,
    MAX_RECIPE_DEPTH,
    RecipeError,
    format_errors,
    node_lines,
    parse_document,
    yaml_path,
)

__all__ = [
    "RecipeError",
    "RatioConfig",
    "BranchOverride",
    "BranchSettings",
    "FA3QuantConfig",
    "Recipe",
    "SourceSettings",
    "DataSettings",
    "TargetSettings",
    "LinearSettings",
    "AttentionSettings",
    "ExportSettings",
    "RECIPE_FLAGS",
    "RECIPE_API_VERSION",
    "PATH_KEYS",
    "load_recipe",
    "dump_recipe",
    "default_recipe",
    "check_patterns",
    "expand_braces",
    "match_pattern",
    "PROCESSOR_TYPE",
    "MAX_RECIPE_BYTES",
    "MAX_RECIPE_DEPTH",
    "MAX_PATTERN_CHARS",
    "MAX_BRACE_GROUPS",
    "MAX_EXPANSIONS",
    "MAX_PATTERNS",
    "MAX_TOTAL_EXPANSIONS",
]

logger = logging.getLogger(__name__)

PROCESSOR_TYPE = "fa3_quant"
#: Longest include/exclude pattern, its brace groups, and the patterns it expands
#: to; patterns per include/exclude list; expanded patterns in the whole recipe.
MAX_PATTERN_CHARS = 1024
MAX_BRACE_GROUPS = 16
MAX_EXPANSIONS = 4096
MAX_PATTERNS = 4096
MAX_TOTAL_EXPANSIONS = 16384
#: Defaults from the seed: Q and K keep 99.99 % of samples, V keeps all.
DEFAULT_RATIOS = {"q": 0.9999, "k": 0.9999, "v": 1.0}

Method = Literal["recall_window", "minmax", "abs_quantile"]
Accumulate = Literal["union", "pooled"]
# StrictFloat takes ints (1 -> 1.0) but not strings or bools.
Ratio = StrictFloat


def _check_ratio_value(v: float | None) -> float | None:
    if v is None:
        return v
    if not (0.0 < float(v) <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {v!r}")
    return float(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RatioConfig(_Strict):
    """Per-branch recall ratio: ``q``/``k`` default 0.9999, ``v`` 1.0."""

    q: Ratio = DEFAULT_RATIOS["q"]
    k: Ratio = DEFAULT_RATIOS["k"]
    v: Ratio = DEFAULT_RATIOS["v"]

    _check = field_validator("q", "k", "v")(_check_ratio_value)


class BranchOverride(_Strict):
    """Settings for one of ``fa_q``/``fa_k``/``fa_v`` that replace the item's."""

    ratio: Ratio | None = None
    method: Method | None = None
    accumulate: Accumulate | None = None
    max_samples: StrictInt | None = Field(default=None, gt=0)

    _check = field_validator("ratio")(_check_ratio_value)


class BranchSettings(_Strict):
    """Resolved observer settings of one branch (what PerHeadObserver takes)."""

    method: Method
    ratio: float
    accumulate: Accumulate
    max_samples: int | None


def _check_pattern(pattern: str) -> None:
    """Bounded work per pattern: a recipe is untrusted input, and brace groups
    multiply (22 two-way groups are 4 million patterns)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(
            f"pattern is {len(pattern)} characters long; at most "
            f"{MAX_PATTERN_CHARS} are allowed"
        )
    groups = pattern.count("{")
    if groups > MAX_BRACE_GROUPS:
        raise ValueError(
            f"pattern has {groups} brace groups; at most {MAX_BRACE_GROUPS} are allowed"
        )


def _expand(pattern: str, budget: list[int]) -> list[str]:
    depth = 0
    start = -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                body = pattern[start + 1 : i]
                parts, level, last = [], 0, 0
                for j, c in enumerate(body):
                    if c == "{":
                        level += 1
                    elif c == "}":
                        level -= 1
                    elif c == "," and level == 0:
                        parts.append(body[last:j])
                        last = j + 1
                if not parts:
                    # "{x}" is literal; keep scanning after it.
                    head = pattern[: i + 1]
                    return [head + tail for tail in _expand(pattern[i + 1 :], budget)]
                parts.append(body[last:])
                prefix, suffix = pattern[:start], pattern[i + 1 :]
                out: dict[str, None] = {}
                for part in parts:
                    out.update(dict.fromkeys(_expand(prefix + part + suffix, budget)))
                return list(out)
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(
            f"brace expansion gives more than {MAX_EXPANSIONS} patterns; at most "
            f"{MAX_EXPANSIONS} are allowed"
        )
    return [pattern]


@functools.lru_cache(maxsize=4096)
def expand_braces(pattern: str) -> tuple[str, ...]:
    """Shell brace expansion: ``"a.{3,5}.b"`` -> ``("a.3.b", "a.5.b")``.

    Braces nest; a brace group without a top-level comma, or an unbalanced brace,
    stays literal (as in bash). ``ValueError`` for a pattern over the limits
    (:data:`MAX_PATTERN_CHARS`, :data:`MAX_BRACE_GROUPS`, :data:`MAX_EXPANSIONS`),
    found before the work is done.
    """
    _check_pattern(pattern)
    return tuple(_expand(pattern, [MAX_EXPANSIONS]))


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(fnmatch.translate(p)) for p in expand_braces(pattern))


def match_pattern(pattern: str, name: str) -> bool:
    """Case-sensitive shell match of ``name`` against ``pattern`` (braces expanded;
    ``*`` also matches dots)."""
    return any(rx.match(name) for rx in _compiled(pattern))


class FA3QuantConfig(_Strict):
    """One ``fa3_quant`` recipe item: which attention modules, and how to observe."""

    type: StrictStr = PROCESSOR_TYPE
    include: list[StrictStr] = Field(default_factory=lambda: ["*"])
    exclude: list[StrictStr] = Field(default_factory=list)
    ratio: RatioConfig = Field(default_factory=RatioConfig)
    method: Method = "recall_window"
    accumulate: Accumulate = "union"
    max_samples: StrictInt | None = Field(default=None, gt=0)
    fa_q: BranchOverride | None = None
    fa_k: BranchOverride | None = None
    fa_v: BranchOverride | None = None

    @field_validator("include", "exclude")
    @classmethod
    def _bounded_patterns(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_PATTERNS:
            raise ValueError(
                f"{len(v)} patterns; at most {MAX_PATTERNS} are allowed per list"
            )
        for pattern in v:
            try:
                expand_braces(pattern)
            except ValueError as exc:
                raise ValueError(f"{pattern[:60]!r}: {exc}") from None
        return v

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v != PROCESSOR_TYPE:
            raise ValueError(
                f"unknown processor type {v!r}; supported: {PROCESSOR_TYPE!r}"
            )
        return v

    @field_validator("ratio", mode="before")
    @classmethod
    def _scalar_ratio(cls, v: Any) -> Any:
        # One number applies to all three branches.
        if isinstance(v, int | float) and not isinstance(v, bool):
            return {"q": v, "k": v, "v": v}
        return v

    @model_validator(mode="after")
    def _pooled_needs_bound(self) -> FA3QuantConfig:
        for branch in FA_BRANCHES:
            s = self.branch_settings(branch)
            if (
                s.accumulate == "pooled"
                and s.method != "minmax"
                and s.max_samples is None
            ):
                raise ValueError(
                    f"{branch}: accumulate 'pooled' needs max_samples (an upper bound "
                    "on samples per head)"
                )
        return self

    def matches(self, module_name: str) -> bool:
        """True when ``module_name`` matches an include and no exclude pattern."""
        if any(match_pattern(p, module_name) for p in self.exclude):
            return False
        return any(match_pattern(p, module_name) for p in self.include)

    def branch_settings(self, branch: str) -> BranchSettings:
        """Resolved settings of ``branch`` (``"fa_q"``, ``"fa_k"`` or ``"fa_v"``)."""
        if branch not in FA_BRANCHES:
            raise ValueError(f"branch must be one of {FA_BRANCHES}, got {branch!r}")
        over = getattr(self, branch) or BranchOverride()
        base_ratio = getattr(self.ratio, branch[-1])
        return BranchSettings(
            method=over.method or self.method,
            ratio=float(over.ratio if over.ratio is not None else base_ratio),
            accumulate=over.accumulate or self.accumulate,
            max_samples=over.max_samples
            if over.max_samples is not None
            else self.max_samples,
        )


class _Sections(_Strict):
    """The run's sections other than the processors, declared once: what a
    :class:`Recipe` holds and what a recipe file's ``spec`` reads, in the order
    :meth:`Recipe.to_document` writes them."""

    source: SourceSettings = Field(default_factory=SourceSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    target: TargetSettings = Field(default_factory=TargetSettings)
    linears: LinearSettings = Field(default_factory=LinearSettings)
    rotation: Rotation = "auto"
    transforms: list[Transform] = Field(default_factory=list)
    attention: AttentionSettings = Field(default_factory=AttentionSettings)
    export: ExportSettings = Field(default_factory=ExportSettings)
    backend: StrictStr | None = None

    _on_off = field_validator("rotation", mode="before")(yaml_on_off)
    _order = field_validator("transforms")(folding_order)


class Recipe(_Sections):
    """A whole ``calibrate`` run: the FA3 processors (``spec.process``), in order,
    and every other choice of the run, one section each (see the module)."""

    processors: list[FA3QuantConfig] = Field(default_factory=list)
    metadata: dict[str, Any] | None = None

    def get(self, key: str) -> Any:
        """The value at a dotted recipe key (``"data.num_samples"``)."""
        value: Any = self
        for part in key.split("."):
            value = getattr(value, part)
        return value

    def flag_values(self) -> dict[str, Any]:
        """``{calibrate argument: value}`` for every key of :data:`RECIPE_FLAGS`
        (what a run takes where no flag is given)."""
        return {flag: self.get(key) for flag, key in RECIPE_FLAGS.items()}

    def with_values(self, values: dict[str, Any]) -> Recipe:
        """A validated copy with ``{dotted key: value}`` set (``ValueError``
        naming the key for a value the schema refuses)."""
        data = self.model_dump()
        for key, value in values.items():
            *parents, last = key.split(".")
            node = data
            for part in parents:
                node = node[part]
            node[last] = value
        try:
            return Recipe.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = yaml_path(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise ValueError(f"recipe key {where}: {msg}") from None

    def to_document(self) -> dict[str, Any]:
        """The recipe as the YAML document :func:`load_recipe` reads."""
        spec: dict[str, Any] = {}
        for name in _Sections.model_fields:
            value = getattr(self, name)
            spec[name] = value.model_dump() if isinstance(value, BaseModel) else value
            if name == "transforms":
                spec[name] = list(value)
        spec["process"] = [_item_document(p) for p in self.processors]
        doc: dict[str, Any] = {"apiversion": RECIPE_API_VERSION}
        if self.metadata is not None:
            doc["metadata"] = self.metadata
        doc["spec"] = spec
        return doc


def _item_document(item: FA3QuantConfig) -> dict[str, Any]:
    """One ``fa3_quant`` item with every setting written (branch overrides only
    where set)."""
    out = item.model_dump()
    for branch in FA_BRANCHES:
        if out[branch] is None:
            del out[branch]
        else:
            out[branch] = {k: v for k, v in out[branch].items() if v is not None}
    return out


#: ``apiversion`` written by :func:`dump_recipe` (any text is read).
RECIPE_API_VERSION = "v1"


def dump_recipe(recipe: Recipe, *, header: str = "") -> str:
    """``recipe`` as YAML text (every key written, in a fixed order: the same
    recipe always gives the same bytes); ``header`` lines go first as comments.
    :func:`load_recipe` of the text gives ``recipe`` back."""
    body = yaml.safe_dump(
        recipe.to_document(),
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=88,
    )
    comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comments + body


class _Spec(_Sections):
    process: list[FA3QuantConfig]
    save: Any = None
    dataset: Any = None

    @field_validator("process")
    @classmethod
    def _bounded_matching(cls, v: list[FA3QuantConfig]) -> list[FA3QuantConfig]:
        # Each attention module is matched against every expanded pattern of
        # every item: bound the total, not only each pattern.
        total = sum(
            len(expand_braces(p)) for item in v for p in (*item.include, *item.exclude)
        )
        if total > MAX_TOTAL_EXPANSIONS:
            raise ValueError(
                f"the include/exclude patterns expand to {total} patterns in all; at "
                f"most {MAX_TOTAL_EXPANSIONS} are allowed"
            )
        return v


class _RecipeFile(_Strict):
    apiversion: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    spec: _Spec


def default_recipe() -> Recipe:
    """Every attention module, seed defaults (Q/K ratio 0.9999, V 1.0, union)."""
    return Recipe(processors=[FA3QuantConfig()])


def load_recipe(path_or_text: str | os.PathLike[str]) -> Recipe:
    """Parse and validate a recipe from a file path or from YAML text.

    A string containing a newline or a ``:`` that is not an existing file is taken
    as YAML text. Raises :class:`RecipeError` naming the YAML path and line.
    Untrusted recipes are bounded: at most :data:`MAX_RECIPE_BYTES`, no YAML
    aliases, nesting and patterns capped (see the module constants), so a bad
    recipe is refused at once instead of expanding.
    """
    text: str
    source: str
    base_dir: str | None = None
    candidate = os.fspath(path_or_text)
    if isinstance(path_or_text, os.PathLike) or (
        "\n" not in candidate and os.path.isfile(candidate)
    ):
        if not os.path.isfile(candidate):
            raise RecipeError(f"recipe file not found: {candidate}")
        try:
            text = read_text(candidate, limit=MAX_RECIPE_BYTES, what="recipe")
        except AscendFAError as exc:
            raise RecipeError(str(exc), path=exc.path) from None
        source = candidate
        base_dir = os.path.dirname(os.path.abspath(candidate))
    elif candidate.strip() and "\n" not in candidate and ":" not in candidate:
        raise RecipeError(f"recipe file not found: {candidate}")
    else:
        text, source = candidate, "<recipe>"
    node, data = parse_document(text, source)
    if node is None or not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a mapping with a 'spec' key")
    lines: dict[tuple[Any, ...], int] = {}
    node_lines(node, (), lines)
    try:
        parsed = _RecipeFile.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_errors(exc, lines, source)) from None
    spec = parsed.spec
    sections = {name: getattr(spec, name) for name in _Sections.model_fields}
    sections["transforms"] = list(spec.transforms)
    recipe = Recipe(processors=list(spec.process), metadata=parsed.metadata, **sections)
    if base_dir is None:
        return recipe
    relative = {
        key: os.path.join(base_dir, value)
        for key in PATH_KEYS
        if isinstance(value := recipe.get(key), str) and not os.path.isabs(value)
    }
    return recipe.with_values(relative) if relative else recipe


def check_patterns(
    config: FA3QuantConfig | Recipe, module_names: Iterable[str], *, warn: bool = True
) -> list[str]:
    """Include/exclude patterns that match none of ``module_names`` (the attention
    modules considered). With ``warn`` each is reported by ``warnings.warn`` and
    logged."""
    names = list(module_names)
    configs = config.processors if isinstance(config, Recipe) else [config]
    unmatched: list[str] = []
    for cfg in configs:
        for kind, patterns in (("include", cfg.include), ("exclude", cfg.exclude)):
            for p in patterns:
                if not any(match_pattern(p, n) for n in names) and p not in unmatched:
                    unmatched.append(p)
                    if warn:
                        msg = (
                            f"fa3_quant {kind} pattern {p!r} matches no attention "
                            f"module (of {len(names)} considered)"
                        )
                        logger.warning(msg)
                        warnings.warn(msg, UserWarning, stacklevel=2)
    return unmatched
