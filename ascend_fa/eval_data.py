"""The held-out texts evaluation reads, and their token windows.

* :data:`EVAL_SETS` — the packaged held-out prose and code (never used for
  calibration); :data:`LONG_EVAL_SETS` — the same texts continued past 4096
  tokens, for long-context windows.
* :func:`load_eval_text` — a packaged set by name, or a text / JSONL file.
* :func:`token_windows` — consecutive token windows of a text.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EVAL_SETS",
    "LONG_EVAL_SETS",
    "data_source",
    "eval_text_path",
    "load_eval_text",
    "token_windows",
]

#: Held-out texts shipped with the package (never used for calibration).
EVAL_SETS = {"prose": "eval_prose.txt", "code": "eval_code.txt"}
#: Long held-out texts for long-context windows: each short set followed by a
#: continuation of the same kind (over 4096 tokens each for SmolLM2), so that a
#: 4096-token window reaches positions a 512-token calibration never saw. Neither
#: part is in the calibration set.
LONG_EVAL_SETS = {
    "prose-long": ("eval_prose.txt", "eval_prose_more.txt"),
    "code-long": ("eval_code.txt", "eval_code_more.txt"),
}


def eval_text_path(name: str) -> Path:
    """Path of a packaged held-out text: ``"prose"`` or ``"code"``."""
    if name not in EVAL_SETS:
        raise ValueError(
            f"unknown evaluation set {name!r}; packaged sets: {', '.join(EVAL_SETS)}"
        )
    return Path(str(resources.files("ascend_fa") / "data" / EVAL_SETS[name]))


def data_source(item: str | Path) -> Path | None:
    """``--data`` item: None for a packaged set name (loaded by name), else a file."""
    if isinstance(item, str) and (item in EVAL_SETS or item in LONG_EVAL_SETS):
        return None
    return Path(item)


def load_eval_text(source: str | Path) -> str:
    """The text of a packaged set name or of a file.

    A ``.jsonl`` file (or one whose first line is a JSON object) is read with the
    calibration-data rules and its samples joined by blank lines; any other file is
    taken as one plain text.
    """
    if isinstance(source, str) and source in EVAL_SETS:
        return eval_text_path(source).read_text(encoding="utf-8")
    if isinstance(source, str) and source in LONG_EVAL_SETS:
        data = resources.files("ascend_fa") / "data"
        parts = [(data / f).read_text(encoding="utf-8") for f in LONG_EVAL_SETS[source]]
        return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"
    from ascend_fa.calibration.data import MAX_CALIB_BYTES, load_calib_texts
    from ascend_fa.safe_files import read_text

    path = Path(source)
    text = read_text(path, limit=MAX_CALIB_BYTES, what="evaluation data")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if path.suffix.lower() in (".jsonl", ".json") or first.lstrip().startswith("{"):
        return "\n\n".join(load_calib_texts(path))
    if not text.strip():
        from ascend_fa.errors import FileFormatError

        raise FileFormatError("evaluation file is empty", path=path)
    return text


def token_windows(
    tokenizer: Any,
    text: str,
    *,
    window: int = 512,
    max_tokens: int | None = None,
    min_last: int = 64,
) -> list[torch.Tensor]:
    """Cut ``text``'s tokens into consecutive windows ``[S]`` of ``window`` tokens.

    A shorter last window is kept when it has at least ``min_last`` tokens (or
    when it is the only one). ``max_tokens`` caps the tokens used.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise ValueError("evaluation text has fewer than 2 tokens")
    out = [ids[i : i + window] for i in range(0, ids.numel(), window)]
    if len(out) > 1 and out[-1].numel() < min_last:
        out.pop()
    return out
