"""The run sections of a recipe: every choice of ``calibrate`` besides the FA
observers (``spec.process``, :mod:`.recipe`), one pydantic model per section, and
:data:`RECIPE_FLAGS`, the flag that overrides each key. The reference tables of
``docs/guides/recipes.md`` are generated from these models
(:mod:`ascend_fa.cli.recipe_doc`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

__all__ = [
    "SourceSettings",
    "DataSettings",
    "TargetSettings",
    "LinearSettings",
    "AttentionSettings",
    "ExportSettings",
    "Rotation",
    "Transform",
    "RECIPE_FLAGS",
    "PATH_KEYS",
    "yaml_on_off",
    "folding_order",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_size(v: str | int | None) -> str | int | None:
    """A byte size as ``calibrate`` takes it: ``5GB``, ``500MiB`` or bytes."""
    if v is None:
        return v
    from ascend_fa.artifact.writer import parse_size

    try:
        parse_size(v)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    return v


class SourceSettings(_Strict):
    """What is calibrated, and how it is read (``spec.source``)."""

    model: StrictStr | None = None
    gguf_file: StrictStr | None = None
    merge_into: StrictStr | None = None
    streaming: StrictBool = False
    max_memory: StrictStr | StrictInt | None = None
    cache: StrictBool = True

    _size = field_validator("max_memory")(_check_size)


class DataSettings(_Strict):
    """The calibration text and how it is split and batched (``spec.data``)."""

    path: StrictStr | None = None
    num_samples: StrictInt = Field(default=32, gt=0)
    max_length: StrictInt = Field(default=512, gt=0)
    batch_size: StrictInt = Field(default=4, gt=0)
    seed: StrictInt = 0
    heldout: StrictInt = Field(default=4, ge=0)


class TargetSettings(_Strict):
    """The consumer written for (``spec.target``)."""

    consumer: Literal["mindie", "vllm-ascend", "vllm"] = "mindie"
    release: StrictStr | None = None
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    kv_strategy: Literal["tensor", "attn_head"] = "tensor"

    @field_validator("release", mode="before")
    @classmethod
    def _release_text(cls, v: Any) -> Any:
        # YAML reads an unquoted 3.0 as a number: a release is its text
        if isinstance(v, int | float) and not isinstance(v, bool):
            return str(v)
        return v


class LinearSettings(_Strict):
    """How the linears are quantized (``spec.linears``)."""

    scheme: Literal["w8a8", "w8a8_dynamic", "none"] | None = None
    fallback: Literal["auto"] | Annotated[StrictInt, Field(ge=0)] = "auto"
    criterion: Literal["layer", "kl"] = "layer"
    headroom: StrictFloat | None = None

    @field_validator("headroom")
    @classmethod
    def _doublings(cls, v: float | None) -> float | None:
        from ascend_fa.linear.search import MAX_DOUBLINGS

        if v is not None and not 0.0 <= v <= MAX_DOUBLINGS:
            raise ValueError(
                f"headroom must be a number of doublings in [0, {MAX_DOUBLINGS:g}], "
                f"got {v!r}"
            )
        return None if v is None else float(v)


class AttentionSettings(_Strict):
    """What the attention pass does besides ``spec.process`` (``spec.attention``)."""

    clip_search: StrictBool = False
    error_budget: StrictFloat | None = None

    @field_validator("error_budget")
    @classmethod
    def _kl(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"error_budget must be a mean token KL >= 0, got {v!r}")
        return None if v is None else float(v)


class ExportSettings(_Strict):
    """How the artifact is written (``spec.export``)."""

    max_shard_size: StrictStr | StrictInt = "5GB"
    picture_report: StrictBool = True

    _size = field_validator("max_shard_size")(_check_size)


def yaml_on_off(v: Any) -> Any:
    # YAML 1.1 reads a bare on / off as a boolean
    return {True: "on", False: "off"}[v] if isinstance(v, bool) else v


def folding_order(v: list[str]) -> list[str]:
    from ascend_fa.transforms.attention import ATTENTION_TRANSFORMS

    if len(set(v)) != len(v):
        raise ValueError(f"a transform is listed twice: {v}")
    return [t for t in ATTENTION_TRANSFORMS if t in v]


Rotation = Literal["auto", "on", "off"]
Transform = Literal["v-rotation", "qk-smoothing"]

#: ``calibrate`` argument -> the recipe key it overrides (dotted under ``spec``).
#: A flag given explicitly wins over the recipe; a flag not given takes the
#: recipe's value, and a key the recipe leaves out takes the default above.
RECIPE_FLAGS: dict[str, str] = {
    "model": "source.model",
    "gguf_file": "source.gguf_file",
    "merge_into": "source.merge_into",
    "streaming": "source.streaming",
    "max_memory": "source.max_memory",
    "cache": "source.cache",
    "calib_data": "data.path",
    "num_samples": "data.num_samples",
    "max_length": "data.max_length",
    "batch_size": "data.batch_size",
    "seed": "data.seed",
    "heldout": "data.heldout",
    "target": "target.consumer",
    "consumer_version": "target.release",
    "dtype": "target.dtype",
    "kv_strategy": "target.kv_strategy",
    "linear": "linears.scheme",
    "linear_fallback": "linears.fallback",
    "linear_fallback_criterion": "linears.criterion",
    "linear_headroom": "linears.headroom",
    "rotate": "rotation",
    "transforms": "transforms",
    "clip_search": "attention.clip_search",
    "error_budget": "attention.error_budget",
    "max_shard_size": "export.max_shard_size",
    "picture_report": "export.picture_report",
    "backend": "backend",
}
#: Recipe keys holding paths: relative ones are relative to the recipe file.
PATH_KEYS = ("source.model", "source.merge_into", "data.path")
