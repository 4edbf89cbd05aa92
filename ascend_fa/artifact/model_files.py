"""The model files of an artifact: the source's ``config.json`` kept, its other
files copied, as msModelSlim does.

msModelSlim's saver copies every ``.json`` / ``.py`` / ``.txt`` / ``.jinja`` file of
the source directory but the weight indexes (``copy_files``) and then only removes
``quantization_config`` from config.json, top level and ``text_config``
(``remove_quantization_config``; msmodelslim 26.1.0
core/quant_service/modelslim_v1/save/ascendv1.py, both called from
``AscendV1Saver.post_run``). Consumers read that config.json with their own
transformers: MindIE's atb_llm and vllm-ascend <= 0.18 run transformers 4.x, which
reads the top-level ``rope_theta`` / ``rope_scaling`` and falls back to theta 10000
without an error when they are missing; transformers 5 re-serializes a config with
both moved into ``rope_parameters``. So an artifact's config.json is:

* a Hugging Face source: the source's config.json as JSON (never a
  ``PretrainedConfig`` round trip), every key with its value, with only
  ``quantization_config`` removed (Ascend targets) or written (``vllm``: the
  compressed-tensors config), ``torch_dtype`` (and ``dtype`` when the source has
  it) set to the artifact dtype, ``tie_word_embeddings`` false when the
  calibration untied the head (a residual rotation), and ``architectures`` (which
  loaders dispatch on) added when the source lacks it;
* a GGUF source (no config.json): the loaded config;
* ``--merge-into``: the export's config.json (msModelSlim's copy of the source's),
  ``quantization_config`` removed, ``torch_dtype`` added from ``dtype`` when only
  transformers 5's spelling is there (:func:`merged_config`).

In each, a config written by transformers 5 (``rope_parameters`` and no top-level
``rope_theta``) gains the transformers-4 keys ``rope_theta`` and, for a
non-default RoPE, ``rope_scaling`` (:func:`with_transformers4_rope`; Gemma 3's
per-layer-type RoPE also ``rope_local_base_freq``); a key the file has is never
changed.

:func:`rope_findings` is the check ``inspect --target`` applies: would a
transformers-4 reader of this config.json use another RoPE than the one
``rope_parameters`` states?
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ascend_fa.errors import UnsafePathError
from ascend_fa.safe_files import MAX_JSON_BYTES, read_json_object
from ascend_fa.safe_paths import resolve_inside

from .format import (
    CONFIG_FILE,
    DESCRIPTION_FILE,
    REPORT_FILE,
    TOKENIZER_FILES,
    dtype_name,
)
from .targets import compressed_tensors_config

__all__ = [
    "COPIED_SUFFIXES",
    "MAX_COPIED_FILE_BYTES",
    "read_source_config",
    "artifact_config",
    "target_config",
    "merged_config",
    "with_transformers4_rope",
    "rope_findings",
    "rope_theta_missing",
    "model_files",
    "copy_model_files",
]

log = logging.getLogger(__name__)

#: Suffixes of the source files an artifact gets (msModelSlim ``copy_files``);
#: ``*index.json`` (weight indexes) excepted, ``tokenizer.model`` (a
#: sentencepiece tokenizer, which ``copy_files`` misses) included.
COPIED_SUFFIXES = (".json", ".py", ".txt", ".jinja")
#: A source file larger than this is not copied (a warning names it).
MAX_COPIED_FILE_BYTES = MAX_JSON_BYTES
#: Files the artifact writes itself (never copied from the source).
_OWN_FILES = frozenset({CONFIG_FILE, DESCRIPTION_FILE, REPORT_FILE})
#: transformers 4.x's ``rope_theta`` default for the supported families
#: (LlamaConfig / Qwen2Config / Qwen3Config / MistralConfig / DeepseekV3Config).
_TF4_DEFAULT_THETA = 10000.0
_NOT_SCALING = frozenset({"rope_theta", "rope_type", "type", "partial_rotary_factor"})


def read_source_config(source_dir: str | Path | None) -> dict[str, Any] | None:
    """The source's ``config.json`` as a JSON object, or None (no directory, or a
    GGUF directory without one)."""
    if source_dir is None:
        return None
    path = Path(source_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return read_json_object(path, what="model config")


def _drop_quantization_config(cfg: dict[str, Any]) -> None:
    cfg.pop("quantization_config", None)
    text = cfg.get("text_config")
    if isinstance(text, dict) and "quantization_config" in text:
        cfg["text_config"] = {
            k: v for k, v in text.items() if k != "quantization_config"
        }


def _rope_scaling(rope: Mapping[str, Any]) -> dict[str, Any] | None:
    """transformers 4's ``rope_scaling`` for transformers 5's ``rope_parameters``
    (None for the default RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    out = {k: v for k, v in rope.items() if k not in _NOT_SCALING}
    out["rope_type"] = kind
    return out


def with_transformers4_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with top-level ``rope_theta`` (and ``rope_scaling`` for a
    non-default RoPE, ``partial_rotary_factor`` when set) taken from
    ``rope_parameters`` where they are missing (null or absent), so that
    transformers 4.x reads the same RoPE as 5.x; a key present is never changed
    (:func:`rope_findings` reports a conflict). A config without flat
    ``rope_parameters`` (a transformers-4 file) is returned unchanged."""
    cfg = dict(config)
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, Mapping):
        return cfg
    if any(isinstance(v, Mapping) for v in rope.values()):
        return _per_type_rope(cfg, rope)
    scaling = _rope_scaling(rope)
    for key, value in (
        ("rope_theta", rope.get("rope_theta")),
        ("rope_scaling", scaling),
        ("partial_rotary_factor", rope.get("partial_rotary_factor")),
    ):
        if value is not None and cfg.get(key) is None:
            cfg[key] = value
    return cfg


def _per_type_rope(cfg: dict[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's one RoPE per layer type in transformers 4's spelling: its
    ``Gemma3TextConfig`` takes ``rope_theta`` / ``rope_scaling`` for the full layers
    and ``rope_local_base_freq`` (always an unscaled RoPE) for the sliding ones;
    transformers 5 moves them into ``rope_parameters[layer type]``
    (``models/gemma3/configuration_gemma3.py`` ``convert_rope_params_to_dict``,
    v5.25.0). Other per-type layouts have no transformers-4 spelling: unchanged
    (Gemma 4's, the same layer types, has no transformers-4 model, and its
    ``proportional`` full-layer RoPE would lose its theta and
    ``partial_rotary_factor`` to a flat ``rope_scaling``)."""
    full, sliding = rope.get("full_attention"), rope.get("sliding_attention")
    if cfg.get("model_type") == "gemma4_text":
        return cfg
    if set(rope) != {"full_attention", "sliding_attention"} or not all(
        isinstance(r, Mapping) for r in (full, sliding)
    ):
        return cfg
    for key, value in (
        ("rope_theta", full.get("rope_theta")),
        ("rope_scaling", _rope_scaling(full)),
        ("rope_local_base_freq", sliding.get("rope_theta")),
    ):
        if value is not None and cfg.get(key) is None:
            cfg[key] = value
    return cfg


def artifact_config(
    model_config: Mapping[str, Any],
    target: str | None,
    dtype: torch.dtype,
    *,
    source: Mapping[str, Any] | None = None,
    kv_strategy: str = "tensor",
) -> dict[str, Any]:
    """The artifact's ``config.json`` (see the module doc): ``source`` (the
    source's config.json) kept, or for a GGUF source ``model_config`` (the loaded
    config's ``to_dict()``) with the transformers-4 RoPE keys."""
    if source is None:
        cfg = with_transformers4_rope(model_config)
        # the loader's path and attention choice, and the rotation's own mark
        # (the report records the rotation; the weights already carry it)
        for key in (
            "_name_or_path",
            "_attn_implementation_internal",
            "ascend_fa_residual_rotation",
        ):
            cfg.pop(key, None)
        cfg["dtype"] = dtype_name(dtype)
    else:
        cfg = with_transformers4_rope(source)
        if "dtype" in cfg:
            cfg["dtype"] = dtype_name(dtype)
        if not cfg.get("architectures") and model_config.get("architectures"):
            cfg["architectures"] = model_config["architectures"]  # loaders need it
        if model_config.get("tie_word_embeddings") is False and (
            cfg.get("tie_word_embeddings", True) is not False
        ):
            cfg["tie_word_embeddings"] = False  # the head was untied (rotation)
    _drop_quantization_config(cfg)
    cfg["torch_dtype"] = dtype_name(dtype)
    if target == "vllm":
        cfg["quantization_config"] = compressed_tensors_config(kv_strategy)
    return cfg


def target_config(
    config: Mapping[str, Any],
    target: str | None,
    dtype: torch.dtype,
    *,
    kv_strategy: str = "tensor",
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``config.json`` for ``target``: :func:`artifact_config` (the source's
    config.json ``source`` kept, or the model's ``config`` for a GGUF source),
    without ``quantization_config`` (vLLM's ``get_quant_config`` would take it as
    the whole description; msModelSlim's saver removes it), ``torch_dtype``
    (MindIE reads it) set to ``dtype``; for ``vllm`` the compressed-tensors
    ``quantization_config``."""
    return artifact_config(
        config, target, dtype, source=source, kv_strategy=kv_strategy
    )


def merged_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """An msModelSlim export's ``config.json`` after ``--merge-into``: kept, with
    ``quantization_config`` removed (as msModelSlim's saver does) and
    ``torch_dtype`` added from ``dtype`` when only transformers 5's spelling is
    there (MindIE reads ``torch_dtype``)."""
    cfg = with_transformers4_rope(config)
    _drop_quantization_config(cfg)
    if "torch_dtype" not in cfg and isinstance(cfg.get("dtype"), str):
        cfg["torch_dtype"] = cfg["dtype"]
    return cfg


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b  # exact between int and float: 1000000 == 1000000.0


def rope_theta_missing(config: Mapping[str, Any]) -> str | None:
    """:func:`rope_findings`' line for a flat ``rope_parameters`` theta other than
    10000 with no top-level ``rope_theta`` (a transformers-4 reader builds 10000:
    vllm-ascend 0.18.0 did, the real loader; 0.23.0.post1, under transformers 5,
    builds the stated theta), or None."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, Mapping) or any(
        isinstance(v, Mapping) for v in rope.values()
    ):
        return None
    theta = rope.get("rope_theta")
    if theta is None or config.get("rope_theta") is not None:
        return None
    if _same(theta, _TF4_DEFAULT_THETA):
        return None
    return (
        f"config.json: rope_theta missing at the top level while rope_parameters "
        f"has {theta}; a transformers-4 reader (MindIE atb_llm, vllm-ascend <= "
        f"0.18) uses 10000"
    )


def rope_findings(config: Mapping[str, Any]) -> list[str]:
    """Where a transformers-4 reader of ``config`` (a config.json as a dict) takes
    another RoPE than its ``rope_parameters`` (transformers 5's) state: top-level
    ``rope_theta`` missing (read as 10000) or different; ``rope_scaling`` missing,
    of another type or with other parameters for a scaled RoPE, or scaling a
    default one. A config without flat ``rope_parameters`` (a transformers-4 file)
    has nothing to disagree with: no finding."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, Mapping) or any(
        isinstance(v, Mapping) for v in rope.values()
    ):
        return []
    out: list[str] = []
    who = "a transformers-4 reader (MindIE atb_llm, vllm-ascend <= 0.18)"
    theta = rope.get("rope_theta")
    top = config.get("rope_theta")
    missing = rope_theta_missing(config)
    if missing:
        out.append(missing)
    elif theta is not None and top is not None and not _same(theta, top):
        out.append(
            f"config.json: rope_theta {top} but rope_parameters has {theta}; {who} "
            f"uses {top}"
        )
    want = _rope_scaling(rope)
    have = config.get("rope_scaling")
    have_kind = (
        have.get("rope_type", have.get("type", "default"))
        if isinstance(have, Mapping)
        else "default"
    )
    if want is None:
        if have_kind != "default":
            out.append(
                f"config.json: rope_scaling is {have_kind!r} but rope_parameters is "
                f"the default RoPE; {who} scales it"
            )
        return out
    if not isinstance(have, Mapping):
        out.append(
            f"config.json: rope_scaling missing while rope_parameters is "
            f"{want['rope_type']!r}; {who} runs an unscaled RoPE"
        )
        return out
    if have_kind != want["rope_type"]:
        out.append(
            f"config.json: rope_scaling is {have_kind!r} but rope_parameters is "
            f"{want['rope_type']!r}; {who} runs the former"
        )
    for key, value in want.items():
        if key != "rope_type" and not _same(have.get(key), value):
            out.append(
                f"config.json: rope_scaling.{key} is {have.get(key)!r} but "
                f"rope_parameters.{key} is {value!r}; {who} runs the former"
            )
    return out


def _blobs_dirs(source_dir: Path) -> list[Path]:
    # A Hugging Face hub cache snapshot links each file to ../../blobs/<hash>
    # (huggingface/huggingface_hub docs/source/en/guides/manage-cache.md @ f7c9b7df).
    if source_dir.parent.name == "snapshots":
        return [source_dir.parent.parent / "blobs"]
    return []


def model_files(source_dir: str | Path) -> list[Path]:
    """The files of ``source_dir`` an artifact gets (sorted): regular files with a
    :data:`COPIED_SUFFIXES` suffix or a :data:`~.format.TOKENIZER_FILES` name, no
    weight index, none the artifact writes itself, no hidden file. A symlink
    leading out of the directory (the hub cache's ``blobs/`` aside) and a file
    over :data:`MAX_COPIED_FILE_BYTES` are left out with a warning."""
    source_dir = Path(source_dir)
    out = []
    for path in sorted(source_dir.iterdir()):
        name = path.name
        if (
            name.startswith(".")
            or name in _OWN_FILES
            or name.endswith("index.json")
            or not (name.endswith(COPIED_SUFFIXES) or name in TOKENIZER_FILES)
        ):
            continue
        try:
            resolve_inside(
                source_dir,
                name,
                source=source_dir,
                what="model file",
                allowed=_blobs_dirs(source_dir),
            )
        except UnsafePathError as exc:
            log.warning("not copied: %s", exc)
            continue
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_COPIED_FILE_BYTES:
            log.warning(
                "not copied: %s is %d bytes, more than the %d copied",
                path,
                size,
                MAX_COPIED_FILE_BYTES,
            )
            continue
        out.append(path)
    return out


def copy_model_files(source_dir: str | Path | None, dest: Path) -> list[str]:
    """Copy :func:`model_files` of ``source_dir`` into ``dest`` (contents only: a
    hub-cache link becomes a plain file); returns the names copied."""
    if source_dir is None:
        return []
    copied = []
    for path in model_files(source_dir):
        shutil.copyfile(path, dest / path.name)
        copied.append(path.name)
    return copied
