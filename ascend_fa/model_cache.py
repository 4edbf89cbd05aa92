"""A local cache of GGUF models converted to safetensors, so that only the first
load pays for dequantizing the GGUF file.

Layout: ``<cache root>/models/<package version>-tf<transformers major>-<sha256 of
the GGUF, 16 hex>/`` holds the model as ``save_pretrained`` writes it
(``config.json``, fp32 safetensors), the tokenizer files, and
``ascend_fa_cache.json`` (format, package and transformers versions, the GGUF's file
name, size and sha256, and the size and sha256 of every file written). The
transformers major is part of the name because each major writes config.json and
the tokenizer files its own way (transformers 5 moves ``rope_theta`` into
``rope_parameters``, which 4.57 does not read: an entry written by one major would
load into the other with the wrong RoPE base). The cache root is
``$ASCEND_FA_CACHE_DIR``, else ``$XDG_CACHE_HOME/ascend-fa``, else
``~/.cache/ascend-fa``; ``ASCEND_FA_NO_CACHE=1`` (or ``cache=False``) turns it off.

An entry is written into a fresh temporary directory beside it and renamed into
place when complete, so a killed conversion leaves no entry. Before use, every file
of an entry is checked against the manifest (size and sha256); a missing, partial
or corrupt entry is removed and rebuilt, with one line on the log. Loading from the
cache gives the same weights bit for bit as loading the GGUF file (the conversion
stores the dequantized fp32 tensors unchanged).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ascend_fa import settings
from ascend_fa.artifact.writer import checkpoint_state_dict
from ascend_fa.safe_files import unique_keys

__all__ = [
    "CACHE_ENV",
    "NO_CACHE_ENV",
    "MANIFEST_NAME",
    "cache_root",
    "cache_enabled",
    "gguf_cache_dir",
    "valid_entry",
    "ensure_gguf_cache",
    "quiet_unless_terminal",
]

logger = logging.getLogger(__name__)

CACHE_ENV = "ASCEND_FA_CACHE_DIR"
NO_CACHE_ENV = "ASCEND_FA_NO_CACHE"
MANIFEST_NAME = "ascend_fa_cache.json"
_FORMAT = "ascend-fa-gguf-cache/1"
_CHUNK = 8 << 20


def cache_root() -> Path:
    """Where cached models live (see the module doc)."""
    env = settings.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ascend-fa"


def cache_enabled(cache: bool = True) -> bool:
    """``cache`` unless ``$ASCEND_FA_NO_CACHE`` is set to a true value."""
    off = settings.get(NO_CACHE_ENV)
    return cache and not off


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def gguf_cache_dir(gguf_path: Path, digest: str | None = None) -> Path:
    """The cache entry directory of ``gguf_path`` (its sha256 is computed unless
    ``digest`` is given)."""
    from ascend_fa import __version__
    from ascend_fa.hf_compat import files_tag

    digest = digest or _sha256(gguf_path)
    return cache_root() / "models" / f"{__version__}-{files_tag()}-{digest[:16]}"


def valid_entry(entry: Path, digest: str) -> bool:
    """Whether ``entry`` is a complete entry for the GGUF with sha256 ``digest``:
    manifest present and matching, every listed file of the listed size and sha256."""
    from ascend_fa import __version__

    manifest = entry / MANIFEST_NAME
    try:
        meta = json.loads(
            manifest.read_text(encoding="utf-8"), object_pairs_hook=unique_keys
        )
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        return False
    if meta.get("version") != __version__ or meta.get("gguf_sha256") != digest:
        return False
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, info in files.items():
        path = entry / str(name)
        if (
            not isinstance(info, dict)
            or Path(str(name)).name != name
            or path.is_symlink()
            or not path.is_file()
            or path.stat().st_size != info.get("size")
            or _sha256(path) != info.get("sha256")
        ):
            return False
    return True


def _build(gguf_path: Path, entry: Path, digest: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_fa import __version__
    from ascend_fa.hf_compat import transformers_version

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        kwargs: dict[str, Any] = {"gguf_file": gguf_path.name}
        with quiet_unless_terminal():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, dtype="float32", **kwargs
            )
        # A GGUF-loaded model refuses save_pretrained (it counts as quantized):
        # write its dequantized tensors and its config the way save_pretrained
        # would, without the GGUF quantizer.
        save_file(
            checkpoint_state_dict(model),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = model.config.to_dict()
        for key in ("quantization_config", "_name_or_path"):
            config.pop(key, None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.iterdir())
            if p.is_file()
        }
        meta = {
            "format": _FORMAT,
            "version": __version__,
            "transformers": transformers_version(),
            "gguf_file": gguf_path.name,
            "gguf_size": gguf_path.stat().st_size,
            "gguf_sha256": digest,
            "files": files,
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def quiet_unless_terminal() -> Iterator[None]:
    """Silence stray progress bars written straight to ``sys.stderr`` (transformers'
    GGUF conversion draws one with plain tqdm) when stderr is not a terminal, so
    logs stay clean; log records still go to their handlers."""
    if sys.stderr.isatty():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def ensure_gguf_cache(gguf_path: str | os.PathLike[str]) -> Path:
    """A valid cache entry for the GGUF file ``gguf_path``: the existing one, or a
    new one built now (a corrupt or partial one is rebuilt, with one log line)."""
    gguf_path = Path(gguf_path)
    digest = _sha256(gguf_path)
    entry = gguf_cache_dir(gguf_path, digest)
    if entry.is_dir() and valid_entry(entry, digest):
        return entry
    if entry.exists() or entry.is_symlink():
        logger.warning(
            "model cache entry %s is incomplete or corrupt; rebuilding", entry
        )
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        else:
            shutil.rmtree(entry)
    else:
        logger.info("converting %s once into the model cache %s", gguf_path.name, entry)
    _build(gguf_path, entry, digest)
    return entry
