"""What an artifact was made from and for, and the refusal to use it with another
model.

``calibrate`` records in the description's ``metadata`` object (which
msModelSlim's saver writes as ``{}`` and no consumer reads: MindIE and
vllm-ascend look up tensor names and the top-level types only) two keys beside
:data:`~.format.TARGET_METADATA_KEY`:

* :data:`SOURCE_METADATA_KEY` — ``{"model_type", "architectures", "shapes"}``:
  the source's model type and architectures, and :func:`shapes_fingerprint` of
  its checkpoint's tensor shapes (null for a GGUF source);
* :data:`RELEASE_METADATA_KEY` — the consumer release the artifact was written
  for (``inspect`` judges against it when no ``--consumer-version`` is given).

The kept ``config.json`` is the source's and is not touched. A ``--target vllm``
artifact has no description, so it records nothing.

:func:`check_artifact_model` runs before ``eval`` / ``emulate`` load the model: an
artifact of another model (model type, recorded shapes, tensor shapes) is refused
in one line, and its quantized linears are judged (:mod:`.linear_judge`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ascend_fa.errors import InputError
from ascend_fa.safe_files import read_json_object

from .format import DESCRIPTION_FILE
from .linear_judge import check_linears, source_shapes
from .reader import read_artifact_config, read_description, read_tensor_index

__all__ = [
    "SOURCE_METADATA_KEY",
    "RELEASE_METADATA_KEY",
    "shapes_fingerprint",
    "provenance_metadata",
    "recorded_release",
    "check_artifact_model",
]

#: Key of the description's ``metadata``: what the artifact was made from.
SOURCE_METADATA_KEY = "ascend_fa_source"
#: Key of the description's ``metadata``: the consumer release written for.
RELEASE_METADATA_KEY = "ascend_fa_consumer_version"


def _cut(text: Any, limit: int = 80) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:60]}... ({len(text)} characters)"


def shapes_fingerprint(shapes: Mapping[str, list[int]]) -> str | None:
    """sha256 (first 16 hex digits) of ``name:shape`` lines in name order; None
    for no shapes. FP8 block scales (``*_scale_inv``) are storage, not the model:
    they are left out, so an FP8 checkpoint and its ``fp8 dequantize`` copy have
    one fingerprint."""
    names = sorted(n for n in shapes if not n.endswith("_scale_inv"))
    if not names:
        return None
    h = hashlib.sha256()
    for name in names:
        h.update(f"{name}:{list(shapes[name])}\n".encode())
    return h.hexdigest()[:16]


def provenance_metadata(
    config: Mapping[str, Any],
    *,
    source_dir: str | Path | None,
    consumer_version: str | None,
) -> dict[str, Any]:
    """The description ``metadata`` entries of :data:`SOURCE_METADATA_KEY` and
    :data:`RELEASE_METADATA_KEY` for an artifact of the model ``config`` loaded
    from ``source_dir`` (None: a GGUF file) written for ``consumer_version``."""
    shapes = source_shapes(source_dir) if source_dir is not None else {}
    arch = config.get("architectures")
    out: dict[str, Any] = {
        SOURCE_METADATA_KEY: {
            "model_type": config.get("model_type"),
            "architectures": list(arch) if isinstance(arch, list) else None,
            "shapes": shapes_fingerprint(shapes),
        }
    }
    if consumer_version is not None:
        out[RELEASE_METADATA_KEY] = consumer_version
    return out


def _metadata(desc: Mapping[str, Any] | None) -> Mapping[str, Any]:
    meta = (desc or {}).get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def recorded_release(desc: Mapping[str, Any] | None) -> str | None:
    """The consumer release the description records (None when none; a value
    that is not a string comes back as text, for the release table to refuse)."""
    value = _metadata(desc).get(RELEASE_METADATA_KEY)
    return None if value is None else str(value)


def check_artifact_model(artifact: str | Path, model: str | Path | None) -> None:
    """Refuse (one :class:`~ascend_fa.errors.InputError` naming both) the
    artifact directory ``artifact`` for the model directory ``model`` when it was
    made from another model: another model type, other recorded source shapes,
    or a tensor whose shape is not the model's. Its quantized linears are
    judged too (:func:`~.linear_judge.check_linears`). A model that is not a
    local directory (a hub name, the default model) is checked for the linears
    only."""
    artifact = Path(artifact)
    desc = read_description(artifact) if (artifact / DESCRIPTION_FILE).is_file() else {}
    art_config = read_artifact_config(artifact) or {}
    model_dir = Path(model) if model is not None else None
    model_config: dict[str, Any] = {}
    if model_dir is not None and (model_dir / "config.json").is_file():
        model_config = read_json_object(model_dir / "config.json", what="config")
    expected = source_shapes(model_dir) if model_dir is not None else {}
    record = _metadata(desc).get(SOURCE_METADATA_KEY)
    record = record if isinstance(record, Mapping) else {}
    theirs = record.get("model_type") or art_config.get("model_type")
    mine = model_config.get("model_type")
    if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs:
        raise InputError(
            f"artifact {artifact} was made from a {_cut(theirs)!r} model; --model "
            f"{model} is {_cut(mine)!r}"
        )
    recorded = record.get("shapes")
    if (
        isinstance(recorded, str)
        and expected
        and recorded != shapes_fingerprint(expected)
    ):
        raise InputError(
            f"artifact {artifact} was made from a checkpoint with other tensor "
            f"shapes than --model {model} (fingerprint {_cut(recorded)} vs "
            f"{shapes_fingerprint(expected)})"
        )
    where = read_tensor_index(artifact)
    for name, shape in _artifact_shapes(where).items():
        want = expected.get(name)
        if (
            want is not None
            and list(shape) != list(want)
            and name.endswith(("embed_tokens.weight", "_proj.weight", "norm.weight"))
        ):
            raise InputError(
                f"artifact {artifact} belongs to another model: {name} is "
                f"{list(shape)}, --model {model} has {list(want)}"
            )
    check_linears(
        where,
        desc,
        model_config or art_config,
        expected=expected,
        source=artifact,
        what="artifact",
    )


def _artifact_shapes(where: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    from ascend_fa.safe_files import safetensors_header

    out: dict[str, tuple[int, ...]] = {}
    for path in dict.fromkeys(where.values()):
        out.update({n: e.shape for n, e in safetensors_header(path).items()})
    return out
