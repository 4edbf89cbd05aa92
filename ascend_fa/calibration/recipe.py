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
names the YAML path (``spec.process[0].ratio.q``) and line. Top-level ``apiversion``
and ``metadata`` and the ``spec`` sections ``save`` and ``dataset`` of msModelSlim
recipes are accepted and ignored.
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

from .placeholder import FA_BRANCHES

__all__ = [
    "RecipeError",
    "RatioConfig",
    "BranchOverride",
    "BranchSettings",
    "FA3QuantConfig",
    "Recipe",
    "load_recipe",
    "default_recipe",
    "check_patterns",
    "expand_braces",
    "match_pattern",
    "PROCESSOR_TYPE",
]

logger = logging.getLogger(__name__)

PROCESSOR_TYPE = "fa3_quant"
#: Defaults from the seed: Q and K keep 99.99 % of samples, V keeps all.
DEFAULT_RATIOS = {"q": 0.9999, "k": 0.9999, "v": 1.0}

Method = Literal["recall_window", "minmax", "abs_quantile"]
Accumulate = Literal["union", "pooled"]
# StrictFloat takes ints (1 -> 1.0) but not strings or bools.
Ratio = StrictFloat


class RecipeError(ValueError):
    """A recipe failed to parse or validate; the message names path and line."""


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


@functools.lru_cache(maxsize=4096)
def expand_braces(pattern: str) -> tuple[str, ...]:
    """Shell brace expansion: ``"a.{3,5}.b"`` -> ``("a.3.b", "a.5.b")``.

    Braces nest; a brace group without a top-level comma, or an unbalanced brace,
    stays literal (as in bash).
    """
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
                    return tuple(
                        head + tail for tail in expand_braces(pattern[i + 1 :])
                    )
                parts.append(body[last:])
                prefix, suffix = pattern[:start], pattern[i + 1 :]
                out: list[str] = []
                for part in parts:
                    for exp in expand_braces(prefix + part + suffix):
                        if exp not in out:
                            out.append(exp)
                return tuple(out)
    return (pattern,)


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


class Recipe(_Strict):
    """The FA3 processors of a recipe, in order."""

    processors: list[FA3QuantConfig] = Field(default_factory=list)


class _Spec(_Strict):
    process: list[FA3QuantConfig]
    save: Any = None
    dataset: Any = None


class _RecipeFile(_Strict):
    apiversion: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    spec: _Spec


def default_recipe() -> Recipe:
    """Every attention module, seed defaults (Q/K ratio 0.9999, V 1.0, union)."""
    return Recipe(processors=[FA3QuantConfig()])


def _node_lines(
    node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int]
) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value
            _node_lines(value, path + (k,), out)
            # A key's path points at the key's own line (a block value starts later).
            out[path + (k,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _node_lines(item, path + (i,), out)


def _fmt_path(loc: Iterable[Any]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text or "<root>"


def _format_errors(
    exc: ValidationError, lines: dict[tuple[Any, ...], int], source: str
) -> str:
    msgs = []
    for err in exc.errors():
        # Pydantic puts the failing member of a union or tagged type into loc as a
        # non-key string (e.g. "float"); keep only the parts that exist in the YAML.
        loc = tuple(err["loc"])
        path: tuple[Any, ...] = ()
        line = lines.get((), None)
        for part in loc:
            if path + (part,) in lines:
                path = path + (part,)
                line = lines[path]
            elif err["type"] in ("extra_forbidden", "missing") and part == loc[-1]:
                path = path + (part,)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {str(path[-1])!r}"
        elif err["type"] == "missing":
            msg = f"missing required key {str(path[-1])!r}"
        elif "input" in err and err["type"] not in ("missing", "value_error"):
            msg += f" (got {err['input']!r})"
        where = f"{source}: {_fmt_path(path)}"
        if line is not None:
            where += f" (line {line})"
        if f"{where}: {msg}" not in msgs:  # a scalar ratio fails once per branch
            msgs.append(f"{where}: {msg}")
    return "invalid recipe:\n  " + "\n  ".join(msgs)


def load_recipe(path_or_text: str | os.PathLike[str]) -> Recipe:
    """Parse and validate a recipe from a file path or from YAML text.

    A string containing a newline or a ``:`` that is not an existing file is taken
    as YAML text. Raises :class:`RecipeError` naming the YAML path and line.
    """
    text: str
    source: str
    candidate = os.fspath(path_or_text)
    if isinstance(path_or_text, os.PathLike) or (
        "\n" not in candidate and os.path.isfile(candidate)
    ):
        if not os.path.isfile(candidate):
            raise RecipeError(f"recipe file not found: {candidate}")
        with open(candidate, encoding="utf-8") as f:
            text = f.read()
        source = os.path.basename(candidate)
    elif candidate.strip() and "\n" not in candidate and ":" not in candidate:
        raise RecipeError(f"recipe file not found: {candidate}")
    else:
        text, source = candidate, "<recipe>"
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML: {exc}") from None
    if node is None or not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a mapping with a 'spec' key")
    lines: dict[tuple[Any, ...], int] = {}
    _node_lines(node, (), lines)
    try:
        parsed = _RecipeFile.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_errors(exc, lines, source)) from None
    return Recipe(processors=list(parsed.spec.process))


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
