"""Content rules for untrusted files: bounded reads, JSON of the right shape,
safetensors headers checked before any tensor is read, pickles refused unopened.

Every function raises :class:`~ascend_fa.errors.FileFormatError` (or
:class:`~ascend_fa.errors.NotFoundError`) naming the file, never a parser's own
exception, so each reader built on them either returns a valid result or the typed
error.

=============================  ====================================================
function                       checks
=============================  ====================================================
:func:`read_bytes`             a regular file (not a FIFO or device), at most
                               ``limit`` bytes
:func:`read_text`              the same, UTF-8
:func:`read_json`              the same, JSON (nesting too deep is malformed too,
                               and so is a key twice in one object)
:func:`read_json_object`       a JSON object (not a list, string or number)
:func:`check_string_map`       an object whose values are strings (``weight_map``,
                               a description's tensor entries)
:func:`safetensors_header`     the safetensors layout, from the header alone
:func:`looks_pickled`          the magic bytes of ``torch.save`` / pickle files
=============================  ====================================================

The safetensors layout (huggingface/safetensors ``safetensors/src/tensor.rs`` @
45c8c2cb, ``SafeTensors::read_metadata`` and ``Metadata::validate``): 8 bytes
little-endian header length ``N`` (at most 100,000,000), ``N`` bytes of UTF-8 JSON
— an object mapping each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` plus an optional ``"__metadata__"`` object of strings — then the
data; the offsets are relative to the end of the header, each tensor's bytes are
``numel * itemsize``, and together they cover the data exactly (a truncated file
fails this).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_fa.errors import FileFormatError, NotFoundError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_SAFETENSORS_HEADER",
    "PICKLE_SUFFIXES",
    "TensorEntry",
    "read_bytes",
    "read_text",
    "read_json",
    "read_json_object",
    "DuplicateKeyError",
    "unique_keys",
    "loads_json",
    "check_string_map",
    "looks_pickled",
    "safetensors_header",
]

#: Largest JSON document read (configs, indexes, descriptions, manifests).
MAX_JSON_BYTES = 256 * 2**20
#: safetensors' own cap on the header (``MAX_HEADER_SIZE`` in tensor.rs).
MAX_SAFETENSORS_HEADER = 100_000_000
#: Weight files that are pickles (``torch.save``): never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Bits per element of each safetensors dtype (sub-byte types pack whole bytes).
_DTYPE_BITS = {
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def _kind(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "number")


def read_bytes(
    path: str | os.PathLike[str], *, limit: int, what: str = "file"
) -> bytes:
    """The bytes of the regular file ``path``, refused when larger than ``limit``."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise NotFoundError(f"{what} not found", path=path) from None
    except OSError as exc:
        raise FileFormatError(
            f"cannot read {what}: {exc.strerror}", path=path
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise FileFormatError(f"{what} is not a regular file", path=path)
    if st.st_size > limit:
        raise FileFormatError(
            f"{what} is {st.st_size} bytes, more than the {limit} allowed", path=path
        )
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise FileFormatError(
            f"cannot read {what}: {exc.strerror}", path=path
        ) from None
    if len(data) > limit:
        raise FileFormatError(f"{what} is more than {limit} bytes", path=path)
    return data


def read_text(
    path: str | os.PathLike[str], *, limit: int = MAX_JSON_BYTES, what: str = "file"
) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a BOM is dropped)."""
    data = read_bytes(path, limit=limit, what=what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileFormatError(
            f"{what} is not UTF-8 text (byte {exc.start})", path=path
        ) from None


class DuplicateKeyError(ValueError):
    """A JSON object holds one key twice (``json.loads`` keeps the last silently;
    which one the writer meant is unknowable, so every reader refuses it)."""

    def __init__(self, key: str) -> None:
        self.key = key
        shown = key if len(key) <= 80 else f"{key[:60]}... ({len(key)} characters)"
        super().__init__(f"the key {shown!r} appears twice in one JSON object")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads`: the object, or
    :class:`DuplicateKeyError` when a key appears twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def loads_json(
    text: str | bytes, *, path: str | os.PathLike[str], what: str = "JSON file"
) -> Any:
    """``text`` parsed as JSON (duplicate keys refused); any failure is one
    :class:`~ascend_fa.errors.FileFormatError` naming ``path``."""
    return _loads(text, path, what)


def _loads(text: str | bytes, path: str | os.PathLike[str], what: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise FileFormatError(f"{what}: {exc}", path=path) from None
    except UnicodeDecodeError as exc:
        raise FileFormatError(
            f"{what} is not UTF-8 text (byte {exc.start})", path=path
        ) from None
    except json.JSONDecodeError as exc:
        raise FileFormatError(
            f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno})",
            path=path,
        ) from None
    except RecursionError:
        raise FileFormatError(f"{what}: JSON nested too deeply", path=path) from None


def read_json(
    path: str | os.PathLike[str],
    *,
    what: str = "JSON file",
    limit: int = MAX_JSON_BYTES,
) -> Any:
    """The JSON document in ``path`` (any type)."""
    return _loads(read_text(path, limit=limit, what=what), path, what)


def read_json_object(
    path: str | os.PathLike[str],
    *,
    what: str = "JSON file",
    limit: int = MAX_JSON_BYTES,
) -> dict[str, Any]:
    """The JSON object in ``path``; a list, string, number or null is refused."""
    data = read_json(path, what=what, limit=limit)
    if not isinstance(data, dict):
        raise FileFormatError(
            f"{what} must be a JSON object, got a JSON {_kind(data)}", path=path
        )
    return data


def check_string_map(
    mapping: Any,
    *,
    path: str | os.PathLike[str],
    what: str,
    skip: frozenset[str] | set[str] = frozenset(),
) -> dict[str, str]:
    """``mapping`` when it is an object whose every value (keys in ``skip``
    aside) is a string; the message names the first offending key."""
    if not isinstance(mapping, Mapping):
        raise FileFormatError(
            f"{what} must be a JSON object, got a JSON {_kind(mapping)}", path=path
        )
    for key, value in mapping.items():
        if key in skip:
            continue
        if not isinstance(value, str):
            raise FileFormatError(
                f"{what}: {key!r} maps to a JSON {_kind(value)}, expected a string",
                path=path,
            )
    return dict(mapping)


def looks_pickled(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts like a pickle (protocol 2+)
    or a ``torch.save`` zip archive."""
    return head.startswith(b"PK\x03\x04") or (
        len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header; ``begin``/``end`` are byte offsets in
    the file (header included)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _bad(path: Path, problem: str) -> FileFormatError:
    return FileFormatError(f"not a valid safetensors file: {problem}", path=path)


def _entry(path: Path, name: str, info: Any, data_len: int, base: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise _bad(path, f"tensor {name!r} is described by a JSON {_kind(info)}")
    dtype, shape, offsets = (
        info.get("dtype"),
        info.get("shape"),
        info.get("data_offsets"),
    )
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise _bad(
            path,
            f"tensor {name!r} has data offsets {offsets!r} outside the "
            f"{data_len} data bytes (truncated?)",
        )
    numel = 1
    for d in shape:
        numel *= d
    width = _DTYPE_BITS[dtype]
    bits = numel * width
    if bits % 8 or (width < 8 and shape and shape[-1] * width % 8):
        # sub-byte types pack each row into whole bytes
        raise _bad(path, f"tensor {name!r} ({dtype} {shape}) does not fill whole bytes")
    if offsets[1] - offsets[0] != bits // 8:
        raise _bad(
            path,
            f"tensor {name!r} ({dtype} {shape}) needs {bits // 8} bytes, its offsets "
            f"give {offsets[1] - offsets[0]}",
        )
    return TensorEntry(dtype, tuple(shape), base + offsets[0], base + offsets[1])


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """tensor name -> :class:`TensorEntry`, from the header of the safetensors
    file ``path`` (no tensor data is read), after checking the whole layout (see
    the module doc). A pickle or ``torch.save`` file is named as such and never
    unpickled."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise FileFormatError("weights file is not a regular file", path=path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            ok = 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8)
            raw = f.read(n) if ok else b""
    except FileNotFoundError:
        raise NotFoundError("weights file not found", path=path) from None
    except OSError as exc:
        raise FileFormatError(
            f"cannot read weights file: {exc.strerror}", path=path
        ) from None
    if looks_pickled(head) and not (ok and raw[:1] == b"{"):
        raise FileFormatError(
            "is a pickled checkpoint (torch.save), not safetensors; it is refused "
            "without being unpickled: convert it to safetensors",
            path=path,
        )
    if len(head) < 8:
        raise _bad(path, f"only {size} bytes")
    if not ok:
        raise _bad(
            path,
            f"header length {n} does not fit the file of {size} bytes (truncated "
            "or not safetensors)",
        )
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKeyError as exc:
        raise _bad(path, f"the header: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _bad(path, "the header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the header is a JSON {_kind(header)}, not an object")
    base = 8 + n
    data_len = size - base
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            check_string_map(info, path=path, what="safetensors __metadata__")
            continue
        entries[name] = _entry(path, name, info, data_len, base)
    covered = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin - base != covered:
            raise _bad(path, "tensor data overlaps or leaves gaps")
        covered = e.end - base
    if covered != data_len:
        raise _bad(
            path,
            f"the tensors cover {covered} of the {data_len} data bytes (truncated "
            "or trailing bytes)",
        )
    return entries
