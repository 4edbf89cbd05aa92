"""Calibration text: JSON Lines or plain text, and the set shipped with the package.

Format rule (one per file):

* **JSON Lines** when the file name ends in ``.jsonl``/``.json`` or its first
  non-blank line starts with ``{``. One JSON object per line; blank lines are
  skipped. The sample text of each record is the first of these fields that holds a
  non-empty string, in this order: ``inputs_pretokenized`` (msModelSlim's calibration
  files, e.g. ``boolq.jsonl``), ``text`` (most corpora), ``prompt`` (prompt sets).
  A line that is not a JSON object, or a record with none of the fields, is an error
  that names the line.
* **Plain text** otherwise: one sample per paragraph (blocks separated by one or more
  blank lines), surrounding whitespace stripped.

A file without any sample is an error. The default set
(``ascend_fa/data/calib_default.jsonl``, provenance in ``ascend_fa/data/README.md``)
mixes prose, dialogue, code and numbers.
"""

from __future__ import annotations

import json
import logging
import random
import re
from importlib import resources
from pathlib import Path

from ascend_fa.errors import FileFormatError, InputError
from ascend_fa.safe_files import DuplicateKeyError, read_text, unique_keys

__all__ = [
    "MAX_CALIB_BYTES",
    "TEXT_FIELDS",
    "CALIB_DOMAINS",
    "calib_domain_texts",
    "default_calib_path",
    "load_calib_texts",
    "split_calibration",
]

logger = logging.getLogger(__name__)

#: Largest calibration file read (calibration sets are a few MiB at most).
MAX_CALIB_BYTES = 1 << 30
#: JSONL fields searched for the sample text, in priority order.
TEXT_FIELDS = ("inputs_pretokenized", "text", "prompt")


def default_calib_path() -> Path:
    """Path of the calibration set that ships with the package."""
    return Path(str(resources.files("ascend_fa") / "data" / "calib_default.jsonl"))


def _is_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() in (".jsonl", ".json"):
        return True
    first = next((line for line in text.splitlines() if line.strip()), "")
    return first.lstrip().startswith("{")


def _parse_jsonl(path: Path, text: str) -> list[str]:
    samples = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=unique_keys)
        except DuplicateKeyError as exc:
            raise FileFormatError(f"{path}: line {lineno}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise FileFormatError(
                f"{path}: line {lineno}: malformed JSON line ({exc.msg} at column "
                f"{exc.colno})"
            ) from None
        except RecursionError:
            raise FileFormatError(
                f"{path}: line {lineno}: JSON nested too deeply"
            ) from None
        if not isinstance(record, dict):
            raise FileFormatError(
                f"{path}: line {lineno}: expected a JSON object, got "
                f"{type(record).__name__}"
            )
        value = next(
            (
                record[f]
                for f in TEXT_FIELDS
                if isinstance(record.get(f), str) and record[f].strip()
            ),
            None,
        )
        if value is None:
            raise FileFormatError(
                f"{path}: line {lineno}: no non-empty text field; expected one of "
                f"{', '.join(TEXT_FIELDS)}"
            )
        samples.append(value)
    return samples


def load_calib_texts(path: str | Path | None = None) -> list[str]:
    """The samples of ``path`` (default: the packaged set), in file order.

    Raises :class:`~ascend_fa.errors.NotFoundError` (a ``FileNotFoundError``) for
    a missing file and :class:`~ascend_fa.errors.FileFormatError` (a
    ``ValueError``) for a file that is empty, not UTF-8 text, not a regular file,
    larger than :data:`MAX_CALIB_BYTES`, or has a bad JSONL line (the message names
    the line number).
    """
    path = default_calib_path() if path is None else Path(path)
    text = read_text(path, limit=MAX_CALIB_BYTES, what="calibration data")
    if _is_jsonl(path, text):
        samples = _parse_jsonl(path, text)
    else:
        samples = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not samples:
        raise FileFormatError(f"{path}: calibration file is empty (no samples)")
    return samples


#: The kinds of text the packaged calibration set labels (its ``"domain"`` key).
CALIB_DOMAINS = ("prose", "code", "numbers")


def calib_domain_texts(domain: str) -> list[str]:
    """The packaged samples of one ``domain`` (:data:`CALIB_DOMAINS`), in file
    order: prose (narrative, dialogue, chat), code, or numbers and tables. A
    cross-domain benchmark calibrates on one and evaluates on another."""
    if domain not in CALIB_DOMAINS:
        raise ValueError(
            f"calibration domain {domain!r}; choose one of {', '.join(CALIB_DOMAINS)}"
        )
    path = default_calib_path()
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    return [r["text"] for r in records if r.get("domain") == domain]


def split_calibration(
    texts: list[str], num: int, heldout: int, seed: int
) -> tuple[list[str], list[str]]:
    """Shuffle ``texts`` with ``seed``, set the last ``heldout`` aside for the
    report, and return ``(first num of the rest, held out)``. ``ascend-fa
    calibrate`` and ``ascend-fa eval --compare-methods`` use the same split."""
    if num <= 0:
        raise InputError(f"--num-samples must be > 0, got {num}")
    if heldout < 0:
        raise InputError(f"--heldout must be >= 0, got {heldout}")
    order = list(texts)
    random.Random(seed).shuffle(order)
    held = order[len(order) - heldout :] if heldout else []
    pool = order[: len(order) - len(held)]
    if not pool:
        raise InputError(
            f"--heldout {heldout} leaves no calibration sample "
            f"(the data has {len(texts)})"
        )
    if num > len(pool):
        logger.warning(
            "--num-samples %d but only %d samples remain after the held-out split; "
            "calibrating on %d",
            num,
            len(pool),
            len(pool),
        )
    return pool[:num], held
