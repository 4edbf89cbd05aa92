"""DeepSeek FP8 block-scale weights: BF16 <-> FP8 E4M3 with 128x128 block scales.

Format (DeepSeek-V3, as vLLM and SGLang load it):

====================  =================  ===============================
tensor                dtype              shape
====================  =================  ===============================
``<name>`` (``W``)    ``float8_e4m3fn``  ``[out, in]``
``<name>_scale_inv``  ``float32``        ``[ceil(out/BR), ceil(in/BC)]``
====================  =================  ===============================

with the block size ``[BR, BC] = [128, 128]``; edge blocks are partial. Per block,
in fp32: ``scale_inv = max(amax(|W_block|) / 448, tiny)``, ``W_fp8 = (W / scale_inv)
.to(float8_e4m3fn)``; dequantization is ``W = W_fp8.float() * scale_inv`` cast to
bf16 (or fp16). The scale lives in the same shard as its weight.

Two layers:

* :func:`quantize_blockwise` / :func:`dequantize_blockwise` convert one tensor.
* :func:`quantize_checkpoint` / :func:`dequantize_checkpoint` convert a Hugging Face
  checkpoint directory shard by shard. Tensors are streamed from the input file in
  chunks of whole block rows and written straight to the output file, so memory is
  one chunk (a few MiB) per worker, independent of shard and tensor size. Output goes
  to ``<output>.partial/`` with a manifest of finished shards (size, sha256) and the
  conversion parameters; a rerun resumes, a finished run renames it to ``<output>``.
  ``workers`` processes convert shards in parallel; their number is capped by the
  shard count, the CPU count and ``MemAvailable / 2 / WORKER_BYTES``
  (:func:`plan_workers`).

Tensor selection for :func:`quantize_checkpoint`: with ``reference_fp8`` exactly the
weights that have a ``<name>_scale_inv`` in the reference checkpoint's index;
otherwise the 2-D floating weights whose name matches one ``include`` pattern and no
``ignore`` pattern. Patterns use :func:`re.search` (unanchored, like ``grep -E``);
anchor with ``^`` / ``$`` for whole-name matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .atb_ops.constants import FP8_BLOCK, FP8_E4M3_MAX

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_INCLUDE",
    "FAIL_AFTER_ENV",
    "SCALE_SUFFIX",
    "WORKER_BYTES",
    "ConversionResult",
    "FP8ConversionError",
    "ShardHeader",
    "SimulatedInterruption",
    "TensorEntry",
    "dequantize_blockwise",
    "dequantize_checkpoint",
    "plan_workers",
    "quantize_blockwise",
    "quantize_checkpoint",
    "read_safetensors_header",
    "select_for_quantization",
]

log = logging.getLogger(__name__)

#: Suffix of the per-block inverse scales: ``<weight name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"

#: Linear weights of attention and MLP blocks (DeepSeek: q_a/q_b/kv_b/o_proj,
#: kv_a_proj_with_mqa, gate/up/down_proj of dense MLPs, experts and shared experts).
DEFAULT_INCLUDE: tuple[str, ...] = (r"_proj\.weight$", r"_proj_with_mqa\.weight$")

#: Kept in BF16: the LM head (the seed's ``.*lm_head``), embeddings, norms and the
#: MoE router ``mlp.gate.weight`` (its logits pick experts; FP8 would change routing).
DEFAULT_IGNORE: tuple[str, ...] = (
    r".*lm_head",
    r"embed_tokens",
    r"norm\.",
    r"mlp\.gate\.weight$",
)

#: Test hook: raise :class:`SimulatedInterruption` after this many shards were
#: finished (and recorded in the manifest) by the current run.
FAIL_AFTER_ENV = "ASCEND_FA_FP8_FAIL_AFTER_SHARDS"

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
MANIFEST_NAME = ".ascend_fa_fp8_manifest.json"
MANIFEST_FORMAT = "ascend-fa-fp8-manifest/1"

#: Smallest scale: an all-zero (or vanishingly small) block divides by this instead
#: of by 0, so its codes are 0, never NaN.
_TINY = torch.finfo(torch.float32).tiny

#: Elements per working chunk (~2 MiB as fp32), whole block rows at a time: small
#: enough to stay in cache between the convert / divide / cast passes (several times
#: faster than whole-tensor passes on CPU) and to bound memory per worker.
_CHUNK_ELEMS = 1 << 19
#: Raw bytes per read/write when a tensor passes through unchanged.
_COPY_BYTES = 16 << 20
#: Memory one worker process needs: interpreter + torch (~350 MiB) plus its chunk
#: workspace (< 100 MiB); used by :func:`plan_workers`.
WORKER_BYTES = 512 << 20

_HEADER_LIMIT = 100 << 20
#: Rotating result buffers vs the writer queue (maxsize _OUT_SLOTS - 2): when a
#: chunk fills slot k, the other slots may be queued or being written, but k itself
#: has been written.
_OUT_SLOTS = 8

#: safetensors dtype string -> bytes per element (for size checks of any tensor).
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
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
}
#: Dtypes this module computes with.
_TORCH_DTYPE = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}
_ST_NAME = {v: k for k, v in _TORCH_DTYPE.items()}
#: Bits of |x| compared as integers: for IEEE floats, ordering of the non-negative
#: bit patterns equals ordering of the values, and every pattern at or above +inf's
#: is inf or NaN. amax over int16 is ~2x faster than over bf16 and exact.
_INT_VIEW = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}
_OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class FP8ConversionError(ValueError):
    """A bad input or a refused conversion; the message names file, tensor, block."""


class SimulatedInterruption(RuntimeError):
    """Raised by the :data:`FAIL_AFTER_ENV` test hook to simulate a killed run."""


# --------------------------------------------------------------------------------------
# One tensor
# --------------------------------------------------------------------------------------


class _Workspace:
    """Reusable flat buffers: fresh large allocations page-fault on every use, which
    costs more than the arithmetic, so each chunk reuses the same memory."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._turn = 0

    def output(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A chunk-result buffer, one of :data:`_OUT_SLOTS` in rotation, so that the
        :class:`_ShardWriter` thread can still be writing the previous results."""
        self._turn = (self._turn + 1) % _OUT_SLOTS
        return self.get(f"out{self._turn}", shape, dtype)

    def get(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get((key, dtype))
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 1), dtype=dtype)
            self._bufs[(key, dtype)] = buf
        return buf[:n].view(*shape)


def _check_block(block_size: Sequence[int]) -> tuple[int, int]:
    if len(block_size) != 2 or any(int(b) < 1 for b in block_size):
        raise FP8ConversionError(
            f"block size must be two positive integers, got {list(block_size)}"
        )
    return int(block_size[0]), int(block_size[1])


def _chunk_rows(cols: int, br: int) -> int:
    """Rows per chunk: whole block rows, about :data:`_CHUNK_ELEMS` elements."""
    return max(1, _CHUNK_ELEMS // max(cols, 1) // br) * br


def _first_bad_block(mask: torch.Tensor) -> tuple[int, int]:
    idx = torch.nonzero(mask)[0]
    return int(idx[0]), int(idx[1])


def _quantize_chunk(
    w: torch.Tensor, block: tuple[int, int], ws: _Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [r, n]`` (r a multiple of BR unless it is the tensor's last chunk) ->
    ``(codes [r, n] float8_e4m3fn, scale_inv [ceil(r/BR), ceil(n/BC)] float32)``.

    Raises ``_NonFinite(block_row, block_col)`` (chunk-relative) on inf/NaN. The
    returned codes are a workspace view (see :meth:`_Workspace.output`).
    """
    br, bc = block
    r, n = w.shape
    nbr, nbc = -(-r // br), -(-n // bc)
    rows, cols = nbr * br, nbc * bc
    idt, mask, inf_bits = _INT_VIEW[w.dtype]
    # amax(|W|) per block on the integer view of |W| (sign bit cleared). Padding
    # of partial edge blocks is 0, the neutral element of max over |W|.
    bits = ws.get("bits", (rows, cols), idt)
    if cols > n:
        bits[:, n:].zero_()
    if rows > r:
        bits[r:].zero_()
    torch.bitwise_and(w.view(idt), mask, out=bits[:r, :n])
    amax_bits = bits.view(nbr, br, nbc, bc).amax(dim=(1, 3))
    bad = amax_bits >= inf_bits
    if bool(bad.any()):
        raise _NonFinite(*_first_bad_block(bad))
    amax = amax_bits.view(w.dtype).float()
    # fp32 throughout: amax / 448 is the spec's scale; the floor keeps an all-zero
    # block finite (0 / tiny = 0) instead of 0 / 0 = NaN.
    scale_inv = torch.clamp_min(amax / FP8_E4M3_MAX, _TINY)
    x = ws.get("f32", (rows, cols), torch.float32)
    x[:r, :n].copy_(w)
    # Exactly W / scale_inv with the block-broadcast scale (IEEE division is the same
    # in place or not), then round-to-nearest-even into E4M3.
    x.view(nbr, br, nbc, bc).div_(scale_inv.view(nbr, 1, nbc, 1))
    codes = ws.output((r, n), torch.float8_e4m3fn)
    codes.copy_(x[:r, :n])
    return codes, scale_inv


def _dequantize_chunk(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    ws: _Workspace,
) -> torch.Tensor:
    """``codes [r, n] float8_e4m3fn``, ``scale_inv [ceil(r/BR), ceil(n/BC)]`` ->
    ``[r, n] dtype`` equal to ``(codes.float() * scale_inv).to(dtype)``.

    Raises ``_NonFinite`` on NaN codes, inf/NaN scales or (fp16) results out of
    range. The result is a workspace view (see :meth:`_Workspace.output`).
    """
    br, bc = block
    r, n = codes.shape
    nbr, nbc = -(-r // br), -(-n // bc)
    rows, cols = nbr * br, nbc * bc
    bad_scale = ~torch.isfinite(scale_inv)
    if bool(bad_scale.any()):
        raise _NonFinite(*_first_bad_block(bad_scale), "a non-finite scale_inv")
    u8 = codes.view(torch.uint8)
    # E4M3FN has no inf; 0x7F / 0xFF are its NaNs.
    low = ws.get("nan", (r, n), torch.uint8)
    torch.bitwise_and(u8, 0x7F, out=low)
    if int(low.amax()) == 0x7F:
        bad = (low == 0x7F).view(-1)
        pos = int(torch.nonzero(bad)[0])
        raise _NonFinite(pos // n // br, pos % n // bc, "an FP8 NaN code")
    # torch's scalar fp8 -> fp32 conversion is slow on CPU; E4M3 bits shifted into
    # fp16 are exact instead: sign stays in bit 15, exponent+mantissa (7 bits) move
    # to bits 13..7, which is fp16 with exponent bias 15 instead of 7, i.e. the
    # value / 2**8 (subnormals included). The 2**8 is folded into the scale, exact
    # because multiplying by a power of two only changes the exponent.
    half = ws.get("half", (rows, cols), torch.int16)
    if cols > n:
        half[:, n:].zero_()
    if rows > r:
        half[r:].zero_()
    hv = half[:r, :n]
    hv.copy_(codes.view(torch.int8))  # sign-extends: bit 15 = sign, bit 14 = sign too
    hv.bitwise_left_shift_(7)
    hv.bitwise_and_(-16385)  # clear bit 14 (~0x4000 as int16)
    x = ws.get("f32", (rows, cols), torch.float32)
    x.copy_(half.view(torch.float16))
    scale = scale_inv * 256.0
    xb = x.view(nbr, br, nbc, bc)
    if bool(torch.isfinite(scale).all()):
        xb.mul_(scale.view(nbr, 1, nbc, 1))
    else:  # scale_inv * 2**8 overflows fp32: apply the two factors one by one
        xb.mul_(256.0).mul_(scale_inv.view(nbr, 1, nbc, 1))
    out = ws.output((r, n), dtype)
    out.copy_(x[:r, :n])
    if dtype == torch.float16:
        finite = torch.isfinite(out)
        if not bool(finite.all()):
            pos = int(torch.nonzero(~finite.view(-1))[0])
            raise _NonFinite(pos // n // br, pos % n // bc, "a value beyond float16")
    return out


class _NonFinite(Exception):
    def __init__(self, row: int, col: int, what: str = "non-finite values") -> None:
        super().__init__(row, col, what)
        self.row, self.col, self.what = row, col, what


def quantize_blockwise(
    weight: torch.Tensor, block_size: Sequence[int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [out, in]`` (bf16, fp16 or fp32) to FP8 E4M3 block-wise.

    Returns ``(codes [out, in] float8_e4m3fn, scale_inv [ceil(out/BR), ceil(in/BC)]
    float32)`` with, per block, ``scale_inv = max(amax(|W|) / 448, tiny)`` and
    ``codes = (W / scale_inv).to(float8_e4m3fn)`` in fp32. Vectorized over blocks,
    processed in chunks of whole block rows. Raises :class:`FP8ConversionError`
    naming the block on inf/NaN.
    """
    block = _check_block(block_size)
    if weight.dim() != 2 or weight.dtype not in _INT_VIEW:
        raise FP8ConversionError(
            "quantize_blockwise expects a 2-D bf16/fp16/fp32 tensor, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    w = weight.detach().to("cpu").contiguous()
    out, cols = w.shape
    codes = torch.empty((out, cols), dtype=torch.float8_e4m3fn)
    scales = torch.empty((-(-out // block[0]), -(-cols // block[1])))
    ws = _Workspace()
    step = _chunk_rows(cols, block[0])
    for r0 in range(0, out, step):
        try:
            c, s = _quantize_chunk(w[r0 : r0 + step], block, ws)
        except _NonFinite as e:
            raise FP8ConversionError(
                f"tensor has {e.what} in block ({r0 // block[0] + e.row}, {e.col})"
            ) from None
        codes[r0 : r0 + step].copy_(c)
        scales[r0 // block[0] : r0 // block[0] + s.shape[0]] = s
    return codes, scales


def dequantize_blockwise(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block_size: Sequence[int] = FP8_BLOCK,
) -> torch.Tensor:
    """``codes [out, in] float8_e4m3fn`` x ``scale_inv [ceil(out/BR), ceil(in/BC)]``
    -> ``[out, in] dtype``, equal to ``(codes.float() * scale_inv_broadcast)
    .to(dtype)``. Raises :class:`FP8ConversionError` on NaN codes or fp16 overflow.
    """
    block = _check_block(block_size)
    if codes.dim() != 2 or codes.dtype != torch.float8_e4m3fn:
        raise FP8ConversionError(
            f"expected 2-D float8_e4m3fn codes, got {tuple(codes.shape)} {codes.dtype}"
        )
    out, cols = codes.shape
    expect = (-(-out // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expect:
        raise FP8ConversionError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match codes "
            f"{(out, cols)} with block {list(block)}: expected {expect}"
        )
    q = codes.detach().to("cpu").contiguous()
    s = scale_inv.detach().to("cpu", torch.float32).contiguous()
    result = torch.empty((out, cols), dtype=dtype)
    ws = _Workspace()
    step = _chunk_rows(cols, block[0])
    for r0 in range(0, out, step):
        b0 = r0 // block[0]
        sc = s[b0 : b0 + -(-min(step, out - r0) // block[0])]
        try:
            result[r0 : r0 + step].copy_(
                _dequantize_chunk(q[r0 : r0 + step], sc, block, dtype, ws)
            )
        except _NonFinite as e:
            raise FP8ConversionError(
                f"tensor has {e.what} in block ({b0 + e.row}, {e.col})"
            ) from None
    return result


# --------------------------------------------------------------------------------------
# safetensors files, read and written in a streaming way
# --------------------------------------------------------------------------------------


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
    path: Path
    size: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]
    header_sha256: str


def read_safetensors_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Parse and validate the header of a safetensors file (data is not read).

    Checks what a truncated or corrupt file breaks: the header length, the JSON,
    every tensor's byte size against dtype and shape, and that the data offsets
    tile the file exactly. Errors name the file.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FP8ConversionError(
                    f"{p}: corrupt or truncated safetensors file ({size} bytes, "
                    "no header)"
                )
            n = int.from_bytes(head, "little")
            if n > _HEADER_LIMIT or 8 + n > size:
                raise FP8ConversionError(
                    f"{p}: corrupt or truncated safetensors file (header length {n} "
                    f"does not fit in {size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise FP8ConversionError(f"{p}: cannot read: {exc}") from exc
    try:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise TypeError("header is not a JSON object")
        metadata = obj.pop("__metadata__", None)
        entries = []
        for name, spec in obj.items():
            dtype, shape = spec["dtype"], tuple(int(d) for d in spec["shape"])
            b, e = (int(v) for v in spec["data_offsets"])
            entries.append(TensorEntry(name, dtype, shape, 8 + n + b, 8 + n + e))
    except (ValueError, TypeError, KeyError) as exc:
        raise FP8ConversionError(
            f"{p}: corrupt safetensors header ({type(exc).__name__}: {exc})"
        ) from None
    pos = 8 + n
    for t in sorted(entries, key=lambda t: (t.begin, t.end)):
        itemsize = _ITEMSIZE.get(t.dtype)
        if (
            t.begin != pos
            or t.end < t.begin
            or (itemsize is not None and t.nbytes != math.prod(t.shape) * itemsize)
        ):
            raise FP8ConversionError(
                f"{p}: corrupt safetensors file: tensor {t.name!r} has inconsistent "
                f"offsets/size"
            )
        pos = t.end
    if pos != size:
        raise FP8ConversionError(
            f"{p}: corrupt or truncated safetensors file: data ends at byte {pos}, "
            f"file has {size} bytes"
        )
    return ShardHeader(
        p,
        size,
        metadata,
        {t.name: t for t in entries},
        hashlib.sha256(head + raw).hexdigest(),
    )


class _ShardWriter:
    """Writes a safetensors file whose header is fixed up front, data streamed in
    declaration order, hashing as it goes. Written to ``<path>.tmp`` and renamed on
    :meth:`close`, so a file with the final name is always complete.

    Writing and sha256 run on two background threads (both release the GIL), so
    they overlap each other and the next chunk's arithmetic. Each thread's queue
    holds ``_OUT_SLOTS - 2`` items, so a buffer passed to :meth:`write` has been
    consumed by both once ``_OUT_SLOTS - 1`` further writes were queued; the
    :meth:`_Workspace.output` rotation relies on that.
    """

    def __init__(
        self,
        path: Path,
        tensors: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None,
    ) -> None:
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = metadata
        pos = 0
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [pos, pos + nbytes],
            }
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self._f = open(self.tmp, "wb")
        self._hash = hashlib.sha256()
        self._expected = 8 + len(raw) + pos
        self._written = 0
        self._error: BaseException | None = None
        self._queues: list[queue.Queue[memoryview | None]] = []
        self._threads = []
        for sink in (self._f.write, self._hash.update):
            q: queue.Queue[memoryview | None] = queue.Queue(_OUT_SLOTS - 2)
            t = threading.Thread(target=self._drain, args=(q, sink), daemon=True)
            t.start()
            self._queues.append(q)
            self._threads.append(t)
        self.tensor_bytes = pos
        self.write(len(raw).to_bytes(8, "little") + raw)

    def _drain(self, q: queue.Queue[memoryview | None], sink: Callable) -> None:
        while (mv := q.get()) is not None:
            if self._error is None:  # after an error keep consuming: never block
                try:
                    sink(mv)
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc

    def write(self, data: Any) -> None:
        if self._error is not None:
            raise self._error
        mv = memoryview(data).cast("B")
        for q in self._queues:
            q.put(mv)
        self._written += mv.nbytes

    def _stop(self) -> None:
        for q, t in zip(self._queues, self._threads):
            if t.is_alive():
                q.put(None)
        for t in self._threads:
            t.join()
        self._queues, self._threads = [], []
        self._f.close()

    def write_tensor(self, t: torch.Tensor) -> None:
        self.write(t.contiguous().view(-1).view(torch.uint8).numpy())

    def close(self) -> tuple[int, str]:
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
        self._stop()
        self.tmp.unlink(missing_ok=True)


def _read_into(f: Any, offset: int, buf: torch.Tensor, path: Path) -> None:
    f.seek(offset)
    mv = memoryview(buf.view(-1).view(torch.uint8).numpy())
    got = f.readinto(mv)
    if got != mv.nbytes:
        raise FP8ConversionError(f"{path}: truncated while reading (offset {offset})")


def _read_tensor(path: Path, entry: TensorEntry) -> torch.Tensor:
    t = torch.empty(entry.shape, dtype=_TORCH_DTYPE[entry.dtype])
    with open(path, "rb") as f:
        _read_into(f, entry.begin, t, path)
    return t


# --------------------------------------------------------------------------------------
# Converting one shard (runs in the main process or in a worker)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ShardTask:
    mode: str  # "quantize" | "dequantize"
    src: Path
    dst: Path
    block: tuple[int, int]
    #: quantize: weight names to quantize in this shard
    selected: frozenset[str] = frozenset()
    #: dequantize: weight name -> (file, entry) of its scale
    scales: dict[str, tuple[Path, TensorEntry]] = field(default_factory=dict)
    #: dequantize: names dropped from the output (consumed scales, orphans)
    drop: frozenset[str] = frozenset()
    out_dtype: str = "bfloat16"


def _convert_shard(
    task: _ShardTask, progress: Callable[[int], None] | None = None
) -> tuple[str, int, str]:
    """Convert one shard; returns ``(name, size, sha256)`` of the written file.

    Runs with one intra-op thread: each chunk op is a few hundred microseconds, too
    short to amortize an OpenMP fork/join, and on a busy machine a descheduled
    thread stalls every op's barrier (measured 10-50x slower). Parallelism comes
    from ``workers`` processes over shards instead.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _convert_shard_1t(task, progress)
    finally:
        torch.set_num_threads(threads)


def _convert_shard_1t(
    task: _ShardTask, progress: Callable[[int], None] | None
) -> tuple[str, int, str]:
    header = read_safetensors_header(task.src)
    entries = sorted(header.tensors.values(), key=lambda t: t.begin)
    out_dtype = _OUT_DTYPES[task.out_dtype]
    br, bc = task.block
    plan: list[tuple[str, str, tuple[int, ...]]] = []
    for t in entries:
        if task.mode == "quantize" and t.name in task.selected:
            plan.append((t.name, "F8_E4M3", t.shape))
            nb = (-(-t.shape[0] // br), -(-t.shape[1] // bc))
            plan.append((t.name + SCALE_SUFFIX, "F32", nb))
        elif task.mode == "dequantize" and t.name in task.scales:
            plan.append((t.name, _ST_NAME[out_dtype], t.shape))
        elif t.name not in task.drop:
            plan.append((t.name, t.dtype, t.shape))
    writer = _ShardWriter(task.dst, plan, header.metadata)
    ws = _Workspace()
    try:
        with open(task.src, "rb") as f:
            for t in entries:
                if task.mode == "quantize" and t.name in task.selected:
                    scale = _stream_quantize(
                        f, header.path, t, task.block, ws, writer, progress
                    )
                    writer.write_tensor(scale)
                elif task.mode == "dequantize" and t.name in task.scales:
                    spath, sentry = task.scales[t.name]
                    scale = _read_tensor(spath, sentry).float()
                    _stream_dequantize(
                        f,
                        header.path,
                        t,
                        scale,
                        task.block,
                        out_dtype,
                        ws,
                        writer,
                        progress,
                    )
                elif t.name in task.drop:
                    if progress:
                        progress(t.nbytes)
                else:
                    _stream_copy(f, header.path, t, writer, progress)
        return (task.dst.name, *writer.close())
    except BaseException:
        writer.abort()
        raise


def _stream_copy(f, path, t: TensorEntry, writer: _ShardWriter, progress) -> None:
    f.seek(t.begin)
    left = t.nbytes
    while left:
        data = f.read(min(left, _COPY_BYTES))
        if not data:
            raise FP8ConversionError(f"{path}: truncated while reading {t.name!r}")
        writer.write(data)
        left -= len(data)
        if progress:
            progress(len(data))


def _stream_quantize(f, path, t: TensorEntry, block, ws, writer, progress):
    out, cols = t.shape
    dtype = _TORCH_DTYPE[t.dtype]
    scales = torch.empty((-(-out // block[0]), -(-cols // block[1])))
    step = _chunk_rows(cols, block[0])
    itemsize = dtype.itemsize
    for r0 in range(0, out, step):
        r = min(step, out - r0)
        w = ws.get("in", (r, cols), dtype)
        _read_into(f, t.begin + r0 * cols * itemsize, w, path)
        try:
            codes, s = _quantize_chunk(w, block, ws)
        except _NonFinite as e:
            raise FP8ConversionError(
                f"{path.name}: tensor {t.name!r} has {e.what} in block "
                f"({r0 // block[0] + e.row}, {e.col}) (block size {list(block)})"
            ) from None
        b0 = r0 // block[0]
        scales[b0 : b0 + s.shape[0]] = s
        writer.write_tensor(codes)
        if progress:
            progress(w.numel() * itemsize)
    return scales


def _stream_dequantize(
    f, path, t: TensorEntry, scale, block, dtype, ws, writer, progress
) -> None:
    out, cols = t.shape
    step = _chunk_rows(cols, block[0])
    for r0 in range(0, out, step):
        r = min(step, out - r0)
        q = ws.get("in", (r, cols), torch.float8_e4m3fn)
        _read_into(f, t.begin + r0 * cols, q, path)
        b0 = r0 // block[0]
        try:
            w = _dequantize_chunk(
                q, scale[b0 : b0 + -(-r // block[0])], block, dtype, ws
            )
        except _NonFinite as e:
            raise FP8ConversionError(
                f"{path.name}: tensor {t.name!r} has {e.what} in block "
                f"({b0 + e.row}, {e.col})"
            ) from None
        writer.write_tensor(w)
        if progress:
            progress(q.numel())


def _worker_entry(task: _ShardTask) -> tuple[str, int, str]:
    return _convert_shard(task)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    root: Path
    shards: dict[str, ShardHeader]  # file name -> header, sorted by name
    index: dict[str, Any] | None
    config: dict[str, Any] | None

    def locate(self) -> dict[str, str]:
        """tensor name -> shard file name."""
        return {n: s for s, h in self.shards.items() for n in h.tensors}


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FP8ConversionError(f"{path}: cannot read JSON: {exc}") from None


def _open_checkpoint(root: str | os.PathLike[str]) -> _Checkpoint:
    d = Path(root)
    if not d.is_dir():
        what = "is not a directory" if d.exists() else "does not exist"
        raise FileNotFoundError(f"input directory {d} {what}")
    index = None
    if (d / INDEX_NAME).is_file():
        index = _load_json(d / INDEX_NAME)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise FP8ConversionError(f"{d / INDEX_NAME}: no weight_map")
        names = sorted(set(wm.values()))
        for n in names:
            if not (d / n).is_file():
                raise FP8ConversionError(
                    f"{d / INDEX_NAME} lists shard {n}, which is missing from {d}"
                )
    elif (d / SINGLE_NAME).is_file():
        names = [SINGLE_NAME]
    else:
        names = sorted(p.name for p in d.glob("*.safetensors") if p.is_file())
        if not names:
            raise FP8ConversionError(f"no *.safetensors files in {d}")
    shards = {n: read_safetensors_header(d / n) for n in names}
    if index is not None:
        for tname, shard in index["weight_map"].items():
            if tname not in shards[shard].tensors:
                raise FP8ConversionError(
                    f"{d / INDEX_NAME} maps {tname!r} to {shard}, which does not "
                    "contain it"
                )
    seen: dict[str, str] = {}
    for s, h in shards.items():
        for n in h.tensors:
            if n in seen:
                raise FP8ConversionError(
                    f"tensor {n!r} is stored in both {seen[n]} and {s}"
                )
            seen[n] = s
    config = _load_json(d / CONFIG_NAME) if (d / CONFIG_NAME).is_file() else None
    return _Checkpoint(d, shards, index, config)


def _reference_selection(ref: str | os.PathLike[str]) -> tuple[set[str], dict | None]:
    """Weights with a ``*_scale_inv`` in the reference index, and its config."""
    p = Path(ref)
    index_path = p / INDEX_NAME if p.is_dir() else p
    if not index_path.is_file():
        raise FileNotFoundError(
            f"--reference-fp8: {index_path} not found (need the FP8 checkpoint's "
            f"{INDEX_NAME})"
        )
    index = _load_json(index_path)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        raise FP8ConversionError(f"{index_path}: no weight_map")
    selected = {n[: -len(SCALE_SUFFIX)] for n in wm if n.endswith(SCALE_SUFFIX)}
    if not selected:
        raise FP8ConversionError(
            f"{index_path}: no *{SCALE_SUFFIX} tensors; not an FP8 block checkpoint"
        )
    cfg_path = index_path.parent / CONFIG_NAME
    config = _load_json(cfg_path) if cfg_path.is_file() else None
    return selected, config


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise FP8ConversionError(f"invalid {what} regex {p!r}: {exc}") from None
    return out


def select_for_quantization(
    tensors: Iterable[TensorEntry],
    include: Sequence[str] = DEFAULT_INCLUDE,
    ignore: Sequence[str] = DEFAULT_IGNORE,
) -> list[str]:
    """Names of the 2-D floating tensors matching an ``include`` pattern and no
    ``ignore`` pattern (both :func:`re.search`), sorted."""
    inc, ign = _compile(include, "--include"), _compile(ignore, "--ignore")
    return sorted(
        t.name
        for t in tensors
        if len(t.shape) == 2
        and t.dtype in ("BF16", "F16", "F32")
        and any(r.search(t.name) for r in inc)
        and not any(r.search(t.name) for r in ign)
    )


def plan_workers(requested: int, num_shards: int, available: int | None = None) -> int:
    """Worker processes to use: at most ``requested``, the number of shards, the
    CPU count, and ``available // 2 // WORKER_BYTES`` (half of ``MemAvailable``).

    Each worker streams one tensor chunk at a time, so its memory is the
    interpreter plus a few chunk buffers (:data:`WORKER_BYTES`), not a shard.
    """
    if requested < 1:
        raise FP8ConversionError(f"--workers must be >= 1, got {requested}")
    if available is None:
        available = _mem_available()
    n = min(
        requested,
        max(num_shards, 1),
        os.cpu_count() or 1,
        max(1, available // 2 // WORKER_BYTES),
    )
    if n < requested:
        log.info(
            "using %d worker(s) instead of %d (shards, CPUs, memory)", n, requested
        )
    return n


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass
class ConversionResult:
    """What a checkpoint conversion did."""

    output: Path
    shards: list[str]
    converted: list[str]  # tensors quantized / dequantized
    resumed: list[str] = field(default_factory=list)  # shards reused from .partial
    passthrough_without_scale: list[str] = field(default_factory=list)
    input_bytes: int = 0


def _partial_dir(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def _prepare_output(inp: Path, output: Path, overwrite: bool) -> Path:
    out_r, in_r = output.resolve(), inp.resolve()
    if out_r == in_r or in_r in out_r.parents or out_r in in_r.parents:
        raise FP8ConversionError(
            f"output {output} must not be, contain or lie inside the input {inp}"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise FileExistsError(
                f"output {output} already exists; pass --overwrite to replace it"
            )
    partial = _partial_dir(output)
    if overwrite and partial.exists():
        shutil.rmtree(partial)
    return partial


def _load_manifest(partial: Path, params: dict, inputs: dict) -> dict[str, dict]:
    """Finished shards of an interrupted run, or ``{}`` for a fresh start."""
    path = partial / MANIFEST_NAME
    if not partial.exists():
        partial.mkdir(parents=True)
        return {}
    if not path.is_file():
        if any(partial.iterdir()):
            raise FP8ConversionError(
                f"{partial} exists without a manifest; delete it or pass --overwrite"
            )
        return {}
    manifest = _load_json(path)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise FP8ConversionError(f"{path}: unknown manifest format")
    if manifest.get("params") != params:
        diff = sorted(
            k
            for k in set(params) | set(manifest.get("params", {}))
            if params.get(k) != manifest["params"].get(k)
        )
        raise FP8ConversionError(
            f"cannot resume {partial}: the interrupted run used different parameters "
            f"({', '.join(diff)}); rerun it with the same parameters, or pass "
            "--overwrite to start over"
        )
    if manifest.get("inputs") != inputs:
        raise FP8ConversionError(
            f"cannot resume {partial}: the input shards changed since the interrupted "
            "run; pass --overwrite to start over"
        )
    done = {}
    for name, rec in manifest.get("done", {}).items():
        f = partial / name
        if (
            f.is_file()
            and f.stat().st_size == rec["size"]
            and _sha256(f) == rec["sha256"]
        ):
            done[name] = rec
        else:
            log.warning("%s: finished shard failed verification; converting again", f)
    return done


def _write_manifest(partial: Path, params: dict, inputs: dict, done: dict) -> None:
    body = {
        "format": MANIFEST_FORMAT,
        "params": params,
        "inputs": inputs,
        "done": dict(sorted(done.items())),
    }
    tmp = partial / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, partial / MANIFEST_NAME)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(
        json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _copy_other_files(ckpt: _Checkpoint, dest: Path) -> None:
    skip = {INDEX_NAME, CONFIG_NAME, *ckpt.shards}
    for src in sorted(ckpt.root.rglob("*")):
        rel = src.relative_to(ckpt.root)
        if rel.parts[0] in (".git", ".cache") or str(rel) in skip or not src.is_file():
            continue
        if src.suffix == ".safetensors":
            log.warning(
                "%s is not part of the checkpoint's index; copied unchanged", rel
            )
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / rel)


def _run(
    ckpt: _Checkpoint,
    output: Path,
    partial: Path,
    tasks: list[_ShardTask],
    params: dict[str, Any],
    workers: int,
    progress: bool,
    finish: Callable[[Path, dict[str, ShardHeader]], None],
) -> list[str]:
    """Convert the shards (resuming), then ``finish`` writes index/config; rename."""
    # Size, header and mtime identify an input shard without hashing hundreds of GB.
    inputs = {
        n: {
            "size": h.size,
            "header_sha256": h.header_sha256,
            "mtime_ns": h.path.stat().st_mtime_ns,
        }
        for n, h in ckpt.shards.items()
    }
    done = _load_manifest(partial, params, inputs)
    for stale in partial.glob("*.tmp"):
        stale.unlink()
    todo = [t for t in tasks if t.src.name not in done]
    resumed = sorted(done)
    if resumed:
        log.info(
            "resuming %s: %d of %d shards already done",
            partial,
            len(resumed),
            len(tasks),
        )
    _write_manifest(partial, params, inputs, done)
    fail_after = int(os.environ.get(FAIL_AFTER_ENV, "0") or 0)
    total = sum(ckpt.shards[t.src.name].size for t in tasks)
    skipped = sum(ckpt.shards[n].size for n in done)
    bar = _progress_bar(total, skipped, progress)
    finished = 0

    def record(result: tuple[str, int, str]) -> None:
        nonlocal finished
        name, size, digest = result
        done[name] = {"size": size, "sha256": digest}
        _write_manifest(partial, params, inputs, done)
        finished += 1
        if fail_after and finished >= fail_after:
            raise SimulatedInterruption(
                f"{FAIL_AFTER_ENV}={fail_after}: stopping after {finished} shard(s)"
            )

    try:
        n_workers = plan_workers(workers, len(todo)) if todo else 1
        if n_workers <= 1:
            for t in todo:
                before = bar.n if bar is not None else 0
                record(_convert_shard(t, bar.update if bar is not None else None))
                if bar is not None:  # header bytes and rounding: land on the shard
                    bar.update(before + ckpt.shards[t.src.name].size - bar.n)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(n_workers) as pool:
                for result in pool.imap_unordered(_worker_entry, todo):
                    record(result)
                    if bar is not None:
                        bar.update(ckpt.shards[result[0]].size)
    finally:
        if bar is not None:
            bar.close()
    finish(partial, {t.dst.name: read_safetensors_header(t.dst) for t in tasks})
    _copy_other_files(ckpt, partial)
    (partial / MANIFEST_NAME).unlink()
    if output.exists():
        old = output.with_name(output.name + f".old-{os.getpid()}")
        os.replace(output, old)
        os.replace(partial, output)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(partial, output)
    return resumed


def _progress_bar(total: int, initial: int, enabled: bool):
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="fp8",
        dynamic_ncols=True,
    )


def _write_index(
    ckpt: _Checkpoint, dest: Path, headers: dict[str, ShardHeader]
) -> None:
    if ckpt.index is None:
        return
    weight_map = {n: s for s, h in headers.items() for n in h.tensors}
    metadata = dict(ckpt.index.get("metadata") or {})
    metadata["total_size"] = sum(
        t.nbytes for h in headers.values() for t in h.tensors.values()
    )
    body = {k: v for k, v in ckpt.index.items() if k not in ("metadata", "weight_map")}
    _write_json(
        dest / INDEX_NAME,
        {"metadata": metadata, **body, "weight_map": dict(sorted(weight_map.items()))},
    )


def quantize_checkpoint(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    reference_fp8: str | os.PathLike[str] | None = None,
    block_size: Sequence[int] = FP8_BLOCK,
    include: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionResult:
    """BF16 checkpoint directory -> DeepSeek FP8 block-scale checkpoint directory.

    Same shard files as the input; every quantized ``<name>`` becomes
    ``float8_e4m3fn`` with ``<name>_scale_inv`` in the same shard; the index is
    rewritten; ``config.json`` gains ``quantization_config``; all other files are
    copied unchanged. Resumable, see the module docstring.
    """
    block = _check_block(block_size)
    inp, output = Path(input_dir), Path(output_dir)
    ckpt = _open_checkpoint(inp)
    if ckpt.config and ckpt.config.get("quantization_config"):
        qc = ckpt.config["quantization_config"]
        raise FP8ConversionError(
            f"{inp / CONFIG_NAME} already has a quantization_config "
            f"(quant_method={qc.get('quant_method')!r}); quantize expects a BF16 "
            "checkpoint"
        )
    all_tensors = [t for h in ckpt.shards.values() for t in h.tensors.values()]
    ignore_patterns = list(DEFAULT_IGNORE if ignore is None else ignore)
    if reference_fp8 is not None:
        if include is not None or ignore is not None:
            raise FP8ConversionError(
                "--include/--ignore cannot be combined with --reference-fp8 (the "
                "reference decides which tensors are quantized)"
            )
        wanted, ref_config = _reference_selection(reference_fp8)
        ref_qc = (ref_config or {}).get("quantization_config") or {}
        ref_block = ref_qc.get("weight_block_size")
        if ref_block is not None and list(ref_block) != list(block):
            raise FP8ConversionError(
                f"--reference-fp8 uses weight_block_size {list(ref_block)}, but the "
                f"block size is {list(block)}"
            )
        if "ignored_layers" in ref_qc:
            ignore_patterns = list(ref_qc["ignored_layers"])
        present = {t.name: t for t in all_tensors}
        missing = sorted(wanted - set(present))
        if missing:
            log.warning(
                "%d weight(s) with a scale in the reference are not in the "
                "input (e.g. %s)",
                len(missing),
                missing[0],
            )
        selected = sorted(wanted & set(present))
        for n in selected:
            t = present[n]
            if len(t.shape) != 2 or t.dtype not in ("BF16", "F16", "F32"):
                raise FP8ConversionError(
                    f"tensor {n!r} ({t.dtype} {list(t.shape)}) has a scale in the "
                    "reference but is not a 2-D bf16/fp16/fp32 weight"
                )
        selection = {
            "reference_sha256": hashlib.sha256(
                "\n".join(sorted(wanted)).encode()
            ).hexdigest()
        }
    else:
        include_patterns = list(DEFAULT_INCLUDE if include is None else include)
        selected = select_for_quantization(
            all_tensors, include_patterns, ignore_patterns
        )
        selection = {"include": include_patterns, "ignore": ignore_patterns}
    names = {t.name for t in all_tensors}
    for n in sorted(names):
        if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in names:
            raise FP8ConversionError(
                f"input already has {n!r}; is it already quantized?"
            )
    if not selected:
        log.warning("no tensor selected for quantization; the output is a copy")
    partial = _prepare_output(inp, output, overwrite)
    where = ckpt.locate()
    per_shard: dict[str, set[str]] = {s: set() for s in ckpt.shards}
    for n in selected:
        per_shard[where[n]].add(n)
    tasks = [
        _ShardTask(
            "quantize", inp / s, partial / s, block, selected=frozenset(per_shard[s])
        )
        for s in ckpt.shards
    ]
    params = {
        "command": "quantize",
        "block_size": list(block),
        "ignored_layers": ignore_patterns,
        **selection,
    }

    def finish(dest: Path, headers: dict[str, ShardHeader]) -> None:
        _write_index(ckpt, dest, headers)
        if ckpt.config is None:
            log.warning(
                "%s has no %s; no quantization_config written", inp, CONFIG_NAME
            )
            return
        cfg = dict(ckpt.config)
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
            "ignored_layers": ignore_patterns,
        }
        _write_json(dest / CONFIG_NAME, cfg)

    resumed = _run(ckpt, output, partial, tasks, params, workers, progress, finish)
    return ConversionResult(
        output,
        list(ckpt.shards),
        selected,
        resumed,
        input_bytes=sum(h.size for h in ckpt.shards.values()),
    )


def dequantize_checkpoint(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    allow_missing_scale: bool = False,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionResult:
    """DeepSeek FP8 block-scale checkpoint -> ``dtype`` (bfloat16 or float16).

    Every weight with a ``<name>_scale_inv`` becomes ``codes.float() * scale_inv``
    in ``dtype``; scales are dropped; ``quantization_config`` is removed from
    ``config.json`` and ``torch_dtype`` set to ``dtype``. Other tensors pass through
    (one warning lists them); a 1-byte tensor without a scale is an error unless
    ``allow_missing_scale``.
    """
    if dtype not in _OUT_DTYPES:
        raise FP8ConversionError(
            f"--dtype must be one of {sorted(_OUT_DTYPES)}, got {dtype!r}"
        )
    inp, output = Path(input_dir), Path(output_dir)
    ckpt = _open_checkpoint(inp)
    qc = (ckpt.config or {}).get("quantization_config") or {}
    block = _check_block(qc.get("weight_block_size") or FP8_BLOCK)
    where = ckpt.locate()
    entries = {t.name: t for h in ckpt.shards.values() for t in h.tensors.values()}
    scales: dict[str, dict[str, tuple[Path, TensorEntry]]] = {
        s: {} for s in ckpt.shards
    }
    drop: dict[str, set[str]] = {s: set() for s in ckpt.shards}
    converted, passthrough, orphans = [], [], []
    for name, t in sorted(entries.items()):
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            drop[where[name]].add(name)
            if base not in entries:
                orphans.append(name)
            continue
        sname = name + SCALE_SUFFIX
        if sname not in entries:
            # A 1-byte tensor without a scale is most likely a quantized weight
            # whose scale is missing; copying it would hand codes to BF16 code.
            if _ITEMSIZE.get(t.dtype) == 1 and t.dtype != "BOOL":
                if not allow_missing_scale:
                    raise FP8ConversionError(
                        f"tensor {name!r} ({t.dtype}) has no {sname!r}; pass "
                        "--allow-missing-scale to copy it unchanged"
                    )
            passthrough.append(name)
            continue
        s = entries[sname]
        if t.dtype != "F8_E4M3" or len(t.shape) != 2:
            raise FP8ConversionError(
                f"tensor {name!r} has a scale but is {t.dtype} {list(t.shape)}, not "
                "a 2-D F8_E4M3 weight"
            )
        expect = [-(-t.shape[0] // block[0]), -(-t.shape[1] // block[1])]
        if list(s.shape) != expect or s.dtype not in ("F32", "BF16", "F16"):
            raise FP8ConversionError(
                f"{sname!r} is {s.dtype} {list(s.shape)}; expected a float tensor "
                f"{expect} for {name!r} {list(t.shape)} with block {list(block)}"
            )
        scales[where[name]][name] = (inp / where[sname], s)
        converted.append(name)
    if not converted:
        raise FP8ConversionError(
            f"no *{SCALE_SUFFIX} tensors with a matching weight in {inp}; not a "
            "DeepSeek FP8 block-scale checkpoint"
        )
    if orphans:
        log.warning(
            "%d scale(s) without a weight dropped (e.g. %s)", len(orphans), orphans[0]
        )
    if passthrough:
        log.warning(
            "%d tensor(s) without %s passed through unchanged (e.g. %s)",
            len(passthrough),
            SCALE_SUFFIX,
            ", ".join(passthrough[:3]),
        )
    partial = _prepare_output(inp, output, overwrite)
    tasks = [
        _ShardTask(
            "dequantize",
            inp / s,
            partial / s,
            block,
            scales=scales[s],
            drop=frozenset(drop[s]),
            out_dtype=dtype,
        )
        for s in ckpt.shards
    ]
    params = {
        "command": "dequantize",
        "dtype": dtype,
        "block_size": list(block),
        "allow_missing_scale": allow_missing_scale,
    }

    def finish(dest: Path, headers: dict[str, ShardHeader]) -> None:
        _write_index(ckpt, dest, headers)
        if ckpt.config is None:
            return
        cfg = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
        keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
        for k in keys:
            cfg[k] = dtype
        _write_json(dest / CONFIG_NAME, cfg)

    resumed = _run(ckpt, output, partial, tasks, params, workers, progress, finish)
    return ConversionResult(
        output,
        list(ckpt.shards),
        converted,
        resumed,
        passthrough,
        input_bytes=sum(h.size for h in ckpt.shards.values()),
    )
