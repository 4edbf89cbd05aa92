"""safetensors files, read and written in a streaming way, treated as untrusted.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, offsets relative to the end of the header), then the tensor bytes
(format: huggingface/safetensors ``README.md``, "Format").

:func:`read_safetensors_header` validates what a truncated, corrupt or hostile file
breaks before any tensor byte is read: the file kind (a regular file; a pickled
PyTorch checkpoint is refused without unpickling), the header length against a cap
and the file size, the JSON shape, every tensor's dtype, shape and byte size, and
that the data offsets tile the file exactly. Errors are
:class:`~ascend_fa.fp8.errors.FP8FormatError` naming the file.

:class:`ShardWriter` writes a file whose header is fixed up front; tensor bytes are
computed straight into staging buffers, hashed (xxh3-128, :data:`CONTENT_HASH`)
while they are still in cache and written by a background thread, so the output
is never reread.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from ..safe_files import unique_keys
from .errors import FP8FormatError

__all__ = [
    "CONTENT_HASH",
    "HEADER_LIMIT",
    "ITEMSIZE",
    "LOAD_DTYPE",
    "ST_NAME",
    "TORCH_DTYPE",
    "WRITE_BYTES",
    "WRITE_PIECE",
    "PlannedTensor",
    "ShardHeader",
    "ShardWriter",
    "TensorEntry",
    "create_new_file",
    "open_regular",
    "read_into",
    "read_safetensors_header",
    "read_tensor",
]

#: The content hash of written shards (resume manifest): xxh3-128 runs at memory
#: speed (~9 GiB/s on one core here, against 0.4-1.2 GiB/s for SHA-NI sha256), so
#: it costs a few percent of the conversion instead of a quarter. It guards against
#: accidental damage (a torn or flipped file), not an adversary: whoever can write
#: the output directory can rewrite the manifest as well.
CONTENT_HASH = "xxh3_128"
#: Largest header accepted (safetensors itself caps it at 100 MB).
HEADER_LIMIT = 100 << 20
#: Bytes per staging buffer handed to the writer thread (a buffer grows to hold a
#: larger chunk): one chunk of the native kernels' output
#: (:data:`~ascend_fa.fp8.blocks.NATIVE_CHUNK_ELEMS` bf16 values) fits, so a chunk
#: is computed straight into one buffer, hashed and written while it is still in
#: the last-level cache, and each buffer is one ``write`` call.
WRITE_BYTES = 4 << 20
#: Bytes per ``write`` call (and per hash update): a buffer goes to the file in
#: pieces. On Linux 6.x ext4 one 4 MiB ``write`` cost 3-5x the CPU of four 1 MiB
#: ones from the same buffer (the page cache allocates larger folios for larger
#: writes); 256 KiB .. 1 MiB pieces measured alike.
WRITE_PIECE = 1 << 20
#: Staging buffers per writer (in flight: one being filled, the others queued).
_STAGING = 8
#: Largest dimension accepted in a header: no real tensor comes near it, and
#: anything beyond int64 element counts would break tensor allocation.
_MAX_DIM = 1 << 48

#: safetensors dtype string -> bytes per element (for size checks of any tensor).
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
#: Dtypes the converter computes with.
TORCH_DTYPE = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}
ST_NAME = {v: k for k, v in TORCH_DTYPE.items()}
#: Every dtype :func:`read_tensor` can load.
LOAD_DTYPE = {
    **TORCH_DTYPE,
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}

#: First bytes of the two pickled formats ``torch.save`` writes: a zip archive
#: (``PK\x03\x04``, torch >= 1.6) or a bare pickle (protocol 2..5 opcode).
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """A validated safetensors header: ``tensors`` in file order."""

    path: Path
    size: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]
    header_sha256: str


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file :class:`ShardWriter` is about to write."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (following links): a FIFO
    or device would block or never end, so it is refused before it is opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FP8FormatError("file is missing", path=path) from None
    except OSError as exc:
        raise FP8FormatError(f"cannot read: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(st.st_mode):
        raise FP8FormatError("not a regular file", path=path)
    try:
        return open(path, "rb")
    except OSError as exc:
        raise FP8FormatError(f"cannot read: {exc.strerror}", path=path) from None


def _corrupt(p: Path, why: str) -> FP8FormatError:
    return FP8FormatError(f"corrupt safetensors file: {why}", path=p)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_entries(p: Path, raw: bytes, n: int) -> tuple[dict | None, list]:
    try:
        obj = json.loads(raw, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as exc:
        raise FP8FormatError(
            f"corrupt safetensors header ({type(exc).__name__}: {exc})", path=p
        ) from None
    if not isinstance(obj, dict):
        raise _corrupt(p, f"the header is a JSON {type(obj).__name__}, not an object")
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _corrupt(p, "__metadata__ is not a map of strings")
    entries = []
    for name, spec in obj.items():
        if not isinstance(spec, dict):
            raise _corrupt(p, f"tensor {name!r} is not described by an object")
        dtype, shape, offsets = (
            spec.get("dtype"),
            spec.get("shape"),
            spec.get("data_offsets"),
        )
        if not isinstance(dtype, str):
            raise _corrupt(p, f"tensor {name!r} has no dtype string")
        if not isinstance(shape, list) or not all(
            _is_int(d) and 0 <= d <= _MAX_DIM for d in shape
        ):
            raise _corrupt(p, f"tensor {name!r} has an invalid shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_int(v) and v >= 0 for v in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise _corrupt(p, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        b, e = offsets
        entries.append(TensorEntry(name, dtype, tuple(shape), 8 + n + b, 8 + n + e))
    return metadata, entries


def read_safetensors_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Parse and validate the header of a safetensors file (data is not read).

    Checks what a truncated, corrupt or hostile file breaks: the file kind (a
    pickled checkpoint is refused without unpickling it), the header length, the
    JSON, every tensor's dtype, shape and byte size, and that the data offsets
    tile the file exactly. Errors are :class:`FP8FormatError` naming the file.
    """
    p = Path(path)
    with open_regular(p) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            head = f.read(8)
            # A header length of 640 (0x280 ...) also starts with b"\x80\x02":
            # a safetensors header is JSON, so its first byte tells them apart.
            if head.startswith(_PICKLE_MAGIC) and f.read(1) != b"{":
                raise FP8FormatError(
                    "a pickled PyTorch checkpoint, not safetensors; it is not read "
                    "(unpickling can run arbitrary code): convert it to "
                    "safetensors first",
                    path=p,
                )
            if len(head) < 8:
                raise FP8FormatError(
                    f"corrupt or truncated safetensors file ({size} bytes, no header)",
                    path=p,
                )
            n = int.from_bytes(head, "little")
            if n > HEADER_LIMIT or 8 + n > size:
                raise FP8FormatError(
                    f"corrupt or truncated safetensors file (header length {n} does "
                    f"not fit in {size} bytes)",
                    path=p,
                )
            f.seek(8)
            raw = f.read(n)
        except OSError as exc:
            raise FP8FormatError(f"cannot read: {exc.strerror}", path=p) from None
    if len(raw) != n:
        raise FP8FormatError("truncated while reading the header", path=p)
    metadata, entries = _parse_entries(p, raw, n)
    pos = 8 + n
    for t in sorted(entries, key=lambda t: (t.begin, t.end)):
        itemsize = ITEMSIZE.get(t.dtype)
        if t.begin != pos or (
            itemsize is not None and t.nbytes != math.prod(t.shape) * itemsize
        ):
            raise _corrupt(p, f"tensor {t.name!r} has inconsistent offsets/size")
        pos = t.end
    if pos != size:
        raise FP8FormatError(
            f"corrupt or truncated safetensors file: data ends at byte {pos}, file "
            f"has {size} bytes",
            path=p,
        )
    return ShardHeader(
        p,
        size,
        metadata,
        {t.name: t for t in sorted(entries, key=lambda t: (t.begin, t.end))},
        hashlib.sha256(head + raw).hexdigest(),
    )


def read_into(f: BinaryIO, offset: int, buf: torch.Tensor, path: Path) -> None:
    """Fill the contiguous ``buf`` with the file bytes at ``offset``."""
    f.seek(offset)
    mv = memoryview(buf.view(-1).view(torch.uint8).numpy())
    got = f.readinto(mv)
    if got != mv.nbytes:
        raise FP8FormatError(f"truncated while reading (offset {offset})", path=path)


def read_tensor(path: Path, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` of ``path`` (one byte range read, nothing else)."""
    dtype = LOAD_DTYPE.get(entry.dtype)
    if dtype is None:
        raise FP8FormatError(
            f"tensor {entry.name!r} has dtype {entry.dtype}, which cannot be loaded",
            path=path,
        )
    t = torch.empty(entry.shape, dtype=dtype)
    with open_regular(path) as f:
        read_into(f, entry.begin, t, path)
    return t


def create_new_file(path: Path) -> int:
    """A write descriptor for a new ``path``: whatever had that name (a stale file,
    a planted symlink) is unlinked first, and ``O_EXCL | O_NOFOLLOW`` makes sure the
    write never goes through a link. Mode ``0o666`` less the umask, as ``open``."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o666)


class ShardWriter:
    """Writes a safetensors file whose header is fixed up front, data streamed in
    declaration order, hashing as it goes. Written to ``<path>.tmp`` (created
    fresh, see :func:`create_new_file`) and renamed on :meth:`close`, so a file with
    the final name is always complete.

    Callers get views of a staging buffer (:meth:`tensor_out`, :meth:`reserve`) and
    fill them; a full buffer is hashed (:data:`CONTENT_HASH`, while it is still in
    cache) and goes to a background thread that writes it (releasing the GIL),
    overlapping the next chunk's arithmetic. The buffer then returns to the pool.
    ``staging``, a list shared by the writers of one process, lends its buffers
    to this writer and gets them back when it stops: fresh buffers for every
    shard would page-fault again on first use.
    """

    def __init__(
        self,
        path: Path,
        tensors: Sequence[PlannedTensor],
        metadata: dict[str, str] | None,
        staging: list[torch.Tensor] | None = None,
    ) -> None:
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = metadata
        pos = 0
        for t in tensors:
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [pos, pos + t.nbytes],
            }
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.tensor_bytes = pos
        self._expected = 8 + len(raw) + pos
        self._written = 0
        self._error: BaseException | None = None
        self._cancel = False
        self._hash = xxhash.xxh3_128()
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._staging = staging if staging is not None else []
        self._allocated = len(self._staging)
        for buf in self._staging:
            self._free.put(buf)
        self._staging.clear()
        self._fd = create_new_file(self.tmp)
        self._queue: queue.Queue[tuple[torch.Tensor, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._drain, daemon=True
        )
        self._thread.start()
        self._buf = self._take(WRITE_BYTES)
        self._fill = 0
        self.write_bytes(len(raw).to_bytes(8, "little") + raw)

    # -- the background thread -------------------------------------------------------

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            buf, n = item
            # after an error or abort keep consuming (never block the producer)
            if self._error is None and not self._cancel:
                try:
                    data = memoryview(buf.numpy())[:n]
                    for i in range(0, n, WRITE_PIECE):
                        mv = data[i : i + WRITE_PIECE]
                        while mv.nbytes:
                            mv = mv[os.write(self._fd, mv) :]
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc
            self._free.put(buf)

    # -- staging buffers -----------------------------------------------------------

    def _take(self, nbytes: int) -> torch.Tensor:
        if self._free.empty() and self._allocated < _STAGING:
            self._allocated += 1
            return torch.empty(max(nbytes, WRITE_BYTES), dtype=torch.uint8)
        buf = self._free.get()
        if buf.numel() < nbytes:  # one chunk larger than a buffer: grow this one
            buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def _flush(self) -> None:
        if self._fill:
            # hashed here, right after the chunk was computed into the buffer (in
            # cache), which also keeps the writer thread, the longer of the two,
            # to the write alone
            self._hash.update(memoryview(self._buf.numpy())[: self._fill])
            self._queue.put((self._buf, self._fill))
            self._buf, self._fill = self._take(WRITE_BYTES), 0

    def reserve(self, nbytes: int, align: int = 1) -> torch.Tensor:
        """The next ``nbytes`` of the file as a uint8 view to fill before the next
        call; ``align`` its offset in the buffer (for a dtype view of it)."""
        if self._error is not None:
            raise self._error
        if self._fill % align or self._fill + nbytes > self._buf.numel():
            self._flush()
            if nbytes > self._buf.numel():  # one chunk larger than a buffer
                self._buf = torch.empty(nbytes, dtype=torch.uint8)
        view = self._buf[self._fill : self._fill + nbytes]
        self._fill += nbytes
        self._written += nbytes
        return view

    def tensor_out(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next bytes of the file as a contiguous ``shape`` x ``dtype`` tensor."""
        n = math.prod(shape) * dtype.itemsize
        return self.reserve(n, dtype.itemsize).view(dtype).view(*shape)

    def write_bytes(self, data: bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        for i in range(0, len(src), WRITE_BYTES):
            piece = src[i : i + WRITE_BYTES]
            self.reserve(len(piece)).numpy()[:] = piece

    def write_tensor(self, t: torch.Tensor) -> None:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        self.reserve(flat.numel()).copy_(flat)

    def copy_from(self, f: BinaryIO, offset: int, nbytes: int, path: Path) -> None:
        """Append ``nbytes`` of ``f`` from ``offset``, read straight into staging."""
        done = 0
        while done < nbytes:
            k = min(nbytes - done, WRITE_BYTES)
            read_into(f, offset + done, self.reserve(k), path)
            done += k

    # -- end -------------------------------------------------------------------------

    def _stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._buf is not None:  # every buffer is back: lend them on
            self._staging.append(self._buf)
            self._buf = None
            while not self._free.empty():
                self._staging.append(self._free.get())

    def close(self) -> tuple[int, str]:
        """Finish the file, rename it into place; returns ``(size, hex digest)``
        (:data:`CONTENT_HASH` of the whole file)."""
        self._flush()
        self._stop()
        if self._error is not None:
            raise self._error
        if self._written != self._expected:  # a bug, never a user error
            raise RuntimeError(
                f"{self.path}: wrote {self._written} bytes, expected {self._expected}"
            )
        os.replace(self.tmp, self.path)
        return self._written, self._hash.hexdigest()

    def abort(self) -> None:
        """Stop and remove the temporary file (on any error or interruption)."""
        self._cancel = True
        self._stop()
        self.tmp.unlink(missing_ok=True)
