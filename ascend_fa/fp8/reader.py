"""Reading one tensor at a time from a checkpoint, FP8 block weights dequantized on
the fly.

:class:`CheckpointReader` opens a checkpoint directory (an index + shards, or one
``model.safetensors``) with the same validation as the converter and hands out
single tensors, each read from its byte range only. In a DeepSeek FP8 block
checkpoint (``<name>`` ``float8_e4m3fn`` + ``<name>_scale_inv``) a weight comes back
dequantized by exactly the code path of ``ascend-fa fp8 dequantize``
(:func:`~ascend_fa.fp8.blocks.dequantize_blockwise`), so::

    CheckpointReader(fp8_dir).tensor(name)            # bfloat16
    == load(dequantize_checkpoint(fp8_dir, out).output)[name]     # bit for bit

and ``dtype=torch.float16`` equals the ``--dtype float16`` output. The
``*_scale_inv`` tensors are not listed (as in the dequantized checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import NotFoundError
from .blocks import OUT_DTYPES, dequantize_blockwise
from .checkpoint import Checkpoint, open_checkpoint, plan_dequantize
from .errors import FP8FormatError
from .safetensors_io import LOAD_DTYPE, TensorEntry, read_tensor

__all__ = ["CheckpointReader", "TensorInfo"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as :meth:`CheckpointReader.tensor` returns it by default."""

    name: str
    shape: tuple[int, ...]
    #: dtype of ``tensor(name)``: bfloat16 for a dequantized FP8 weight
    dtype: torch.dtype
    #: safetensors dtype in the file (``F8_E4M3`` for an FP8 weight)
    stored_dtype: str
    #: shard file holding it
    shard: str
    #: whether it is an FP8 block weight dequantized on load
    fp8: bool


class CheckpointReader:
    """Tensors of the checkpoint directory ``path``, one at a time.

    ``names()`` lists them (sorted, scales of FP8 weights excluded),
    ``metadata(name)`` describes one without reading it, ``tensor(name, dtype)``
    reads it; ``is_fp8`` says whether the checkpoint holds DeepSeek FP8 block
    weights. Raises the typed errors of :mod:`ascend_fa.fp8.errors` on a malformed
    checkpoint (when opened) or a bad scale (when that tensor is read).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._ckpt: Checkpoint = open_checkpoint(path)
        self._plan = plan_dequantize(self._ckpt)
        self._where = self._ckpt.locate()
        self._entries: dict[str, TensorEntry] = {
            n: t for h in self._ckpt.shards.values() for n, t in h.tensors.items()
        }
        hidden = self._plan.scale_names if self._plan.scales else set()
        self._names = sorted(n for n in self._entries if n not in hidden)

    @property
    def root(self) -> Path:
        return self._ckpt.root

    @property
    def is_fp8(self) -> bool:
        """True when some weight has a ``<name>_scale_inv`` to dequantize with."""
        return bool(self._plan.scales)

    @property
    def block_size(self) -> tuple[int, int]:
        return self._plan.block

    @property
    def config(self) -> dict | None:
        """``config.json`` as read (None without one)."""
        return self._ckpt.config

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def _entry(self, name: str) -> TensorEntry:
        if name not in self._names:
            raise NotFoundError(
                f"tensor {name!r} is not in the checkpoint {self._ckpt.root}",
                path=self._ckpt.root,
            )
        return self._entries[name]

    def metadata(self, name: str) -> TensorInfo:
        """Shape and dtype of ``tensor(name)`` without reading any tensor data."""
        t = self._entry(name)
        fp8 = name in self._plan.scales
        if fp8:
            dtype = torch.bfloat16
        elif t.dtype in LOAD_DTYPE:
            dtype = LOAD_DTYPE[t.dtype]
        else:
            raise FP8FormatError(
                f"tensor {name!r} has dtype {t.dtype}, which cannot be loaded",
                path=self._ckpt.root / self._where[name],
            )
        return TensorInfo(name, t.shape, dtype, t.dtype, self._where[name], fp8)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``name`` as a CPU tensor, reading only its bytes (and its scale's).

        An FP8 block weight is dequantized to bfloat16, or to float16 when
        ``dtype`` is float16, exactly as ``fp8 dequantize`` does; any other
        ``dtype`` is a cast of that bfloat16 result. Other tensors come back as
        stored, cast to ``dtype`` when given. An FP8 tensor without a scale is
        refused (its codes are not values).
        """
        t = self._entry(name)
        path = self._ckpt.root / self._where[name]
        if name in self._plan.scales:
            spath, sentry = self._plan.scales[name]
            out = dtype if dtype in OUT_DTYPES.values() else torch.bfloat16
            try:
                w = dequantize_blockwise(
                    read_tensor(path, t),
                    read_tensor(spath, sentry).float(),
                    out,
                    self._plan.block,
                )
            except FP8FormatError as exc:
                raise FP8FormatError(f"{name!r}: {exc.message}", path=path) from None
            return w if dtype is None or dtype == out else w.to(dtype)
        if t.dtype == "F8_E4M3" and self.is_fp8:
            raise FP8FormatError(
                f"tensor {name!r} is FP8 but has no {name}_scale_inv", path=path
            )
        w = read_tensor(path, t)
        return w if dtype is None else w.to(dtype)
