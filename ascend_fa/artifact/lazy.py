"""Checkpoint tensors produced one at a time, and the shard files they stream into.

A model too large for memory (a streaming calibration) cannot hand the writer a
dict of tensors. :class:`LazyTensors` is a mapping whose names, dtypes and sizes
are known up front and whose values are produced on access, in order;
:func:`write_safetensors` writes one safetensors file from such a mapping, one
tensor in memory at a time. The layout is the safetensors format itself (an
8-byte little-endian header length, a JSON header with every tensor's dtype,
shape and ``data_offsets``, padded with spaces to 8 bytes, then the data), so
``safetensors.safe_open`` and ``load_file`` read it like any other file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["LazyTensors", "TensorSpec", "write_safetensors"]

#: torch dtype -> safetensors dtype name (the names safetensors' own header uses).
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """What one lazily produced tensor will be."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class LazyTensors(Mapping[str, torch.Tensor]):
    """``name -> tensor`` whose tensors come from ``load(name)`` on access.

    ``specs`` fixes the names (in order), shapes and dtypes; a loaded tensor that
    differs from its spec is a bug and raises. ``extra`` tensors (already in
    memory) follow the lazy ones, like ``{**lazy, **extra}`` would; :meth:`then`
    appends another lazy mapping.
    """

    def __init__(
        self,
        specs: Mapping[str, TensorSpec],
        load: Callable[[str], torch.Tensor],
        extra: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.specs: dict[str, TensorSpec] = {}
        self._loader: dict[str, Callable[[str], torch.Tensor]] = {}
        self._add(specs, load)
        if extra:
            self._add(
                {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in extra.items()},
                dict(extra).__getitem__,
            )

    def _add(
        self, specs: Mapping[str, TensorSpec], load: Callable[[str], torch.Tensor]
    ) -> None:
        for name, spec in specs.items():
            if name in self.specs:
                raise ValueError(f"{name}: written twice")
            self.specs[name] = spec
            self._loader[name] = load

    def then(self, other: LazyTensors) -> LazyTensors:
        """These tensors followed by ``other``'s (names must not repeat)."""
        out = LazyTensors({}, self._loader.get)
        out.specs, out._loader = dict(self.specs), dict(self._loader)
        for name, spec in other.specs.items():
            out._add({name: spec}, other._loader[name])
        return out

    def with_extra(self, extra: Mapping[str, torch.Tensor]) -> LazyTensors:
        """These tensors followed by the in-memory ``extra`` ones."""
        return self.then(LazyTensors({}, dict(extra).__getitem__, extra))

    def nbytes(self, name: str) -> int:
        return self.specs[name].nbytes

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        t = self._loader[name](name)
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise RuntimeError(
                f"{name}: produced {tuple(t.shape)} {t.dtype}, planned "
                f"{spec.shape} {spec.dtype}"
            )
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def write_safetensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    names: Sequence[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``names`` of ``tensors`` (a :class:`LazyTensors`) to ``path``, data in
    ``names`` order, one tensor in memory at a time."""
    specs = tensors.specs if isinstance(tensors, LazyTensors) else None
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name in names:
        spec = specs[name] if specs is not None else None
        if spec is None:
            t = tensors[name]
            spec = TensorSpec(tuple(t.shape), t.dtype)
        header[name] = {
            "dtype": _ST_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [pos, pos + spec.nbytes],
        }
        pos += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous()
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
