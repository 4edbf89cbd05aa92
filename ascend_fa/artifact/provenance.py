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

One rule judges what an artifact claims, :func:`provenance_findings`, applied by
``inspect`` (findings), ``eval`` / ``emulate`` (:func:`check_artifact_model`,
before the model loads), ``calibrate --merge-into``
(:func:`~.merge.check_merge_export`) and the vLLM plugin (through ``inspect``):

* a recorded target (``metadata.ascend_fa_target``) is one of
  :data:`~.format.TARGETS` (an unknown one leaves no rules to judge by);
* the recorded source (:data:`SOURCE_METADATA_KEY`) agrees with the artifact's
  ``config.json``: model type and architectures;
* with a model to compare (``--model``): its model type is the recorded one and
  the config.json's, its checkpoint's shapes give the recorded fingerprint, and
  every shared tensor has the model's shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ascend_fa.errors import InputError
from ascend_fa.safe_files import read_json_object

from .format import DESCRIPTION_FILE, TARGET_METADATA_KEY, TARGETS
from .linear_judge import check_linears, source_shapes
from .reader import read_artifact_config, read_description, read_tensor_index

__all__ = [
    "SOURCE_METADATA_KEY",
    "RELEASE_METADATA_KEY",
    "shapes_fingerprint",
    "provenance_metadata",
    "recorded_release",
    "check_artifact_model",
    "provenance_findings",
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


def provenance_findings(
    desc: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None,
    *,
    model_config: Mapping[str, Any] | None = None,
    model_shapes: Mapping[str, list[int]] | None = None,
    artifact_shapes: Mapping[str, Any] | None = None,
    model: str | Path | None = None,
) -> list[str]:
    """What contradicts the artifact's claims (module doc), one line each:
    ``desc`` / ``config`` are its description and config.json; ``model_config``
    / ``model_shapes`` the model it is used with (``--model``'s config.json and
    checkpoint shapes, when there is one); ``artifact_shapes`` its tensors'
    shapes."""
    out: list[str] = []
    meta = _metadata(desc)
    target = meta.get(TARGET_METADATA_KEY)
    if target is not None and target not in TARGETS:
        out.append(
            f"{DESCRIPTION_FILE}: metadata.{TARGET_METADATA_KEY} {_cut(target)!r} is "
            f"not a known target ({', '.join(TARGETS)}); no consumer's rules can be "
            "applied"
        )
    record = meta.get(SOURCE_METADATA_KEY)
    if record is not None and not isinstance(record, Mapping):
        out.append(
            f"{DESCRIPTION_FILE}: metadata.{SOURCE_METADATA_KEY} is not a JSON object"
        )
    record = record if isinstance(record, Mapping) else {}
    recorded = record.get("model_type")
    own = (config or {}).get("model_type")
    if recorded is not None and own is not None and recorded != own:
        out.append(
            f"{DESCRIPTION_FILE}: metadata records a {_cut(recorded)!r} source, "
            f"config.json says model_type {_cut(own)!r}"
        )
    arch, own_arch = record.get("architectures"), (config or {}).get("architectures")
    if isinstance(arch, list) and isinstance(own_arch, list) and arch != own_arch:
        out.append(
            f"{DESCRIPTION_FILE}: metadata records architectures {_cut(arch)}, "
            f"config.json says {_cut(own_arch)}"
        )
    if model_config is None and not model_shapes:
        return out
    theirs = recorded if isinstance(recorded, str) else own
    mine = (model_config or {}).get("model_type")
    if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs:
        out.append(
            f"made from a {_cut(theirs)!r} model; --model {model} is {_cut(mine)!r}"
        )
    fingerprint = record.get("shapes")
    if (
        isinstance(fingerprint, str)
        and model_shapes
        and fingerprint != shapes_fingerprint(model_shapes)
    ):
        out.append(
            f"made from a checkpoint with other tensor shapes than --model {model} "
            f"(fingerprint {_cut(fingerprint)} vs {shapes_fingerprint(model_shapes)})"
        )
    for name, shape in (artifact_shapes or {}).items():
        want = (model_shapes or {}).get(name)
        if (
            want is not None
            and list(shape) != list(want)
            and name.endswith(("embed_tokens.weight", "_proj.weight", "norm.weight"))
        ):
            out.append(
                f"belongs to another model: {name} is {list(shape)}, --model {model} "
                f"has {list(want)}"
            )
            break
    return out


def check_artifact_model(artifact: str | Path, model: str | Path | None) -> None:
    """Refuse (one :class:`~ascend_fa.errors.InputError` naming both) the
    artifact directory ``artifact`` for the model directory ``model`` where
    :func:`provenance_findings` finds anything: an unknown recorded target, a
    record contradicting its config.json, another model type, other recorded
    source shapes, or a tensor whose shape is not the model's. Its quantized
    linears are judged too (:func:`~.linear_judge.check_linears`). A model that
    is not a local directory (a hub name, the default model) is checked against
    the artifact's own claims and for the linears only."""
    artifact = Path(artifact)
    desc = read_description(artifact) if (artifact / DESCRIPTION_FILE).is_file() else {}
    art_config = read_artifact_config(artifact) or {}
    model_dir = Path(model) if model is not None else None
    model_config: dict[str, Any] | None = None
    if model_dir is not None and (model_dir / "config.json").is_file():
        model_config = read_json_object(model_dir / "config.json", what="config")
    expected = source_shapes(model_dir) if model_dir is not None else {}
    where = read_tensor_index(artifact)
    found = provenance_findings(
        desc,
        art_config,
        model_config=model_config,
        model_shapes=expected,
        artifact_shapes=_artifact_shapes(where),
        model=model,
    )
    if found:
        raise InputError(f"artifact {artifact}: {found[0]}")
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
