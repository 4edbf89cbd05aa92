"""A small paged KV-cache manager: per-layer caches, a block allocator, and the
``slot_mapping`` / ``block_table`` / ``seq_lens`` tensors one engine step needs.

Typical decode loop (GQA, int8 NZ cache)::

    cache = PagedKVCache(num_layers=L, num_kv_heads=Hkv, head_dim=D, num_blocks=NB,
                         block_size=128, mode="int8_kv")
    batch = cache.append([seq_a, seq_b], 1)          # one new token each
    for layer in range(L):
        reshape_and_cache(k, v, *cache.layer(layer), batch.slot_mapping,
                          k_scale=..., v_scale=..., layout=cache.layout)
        out = paged_attention(q, *cache.layer(layer), batch.block_table,
                              batch.seq_lens, num_kv_heads=Hkv, scale=D**-0.5, ...)

The cache layout comes from the backend (:meth:`Backend.preferred_layout`): NZ on
the emulation backends; on the NPU, NZ for int8-KV and MLA, ND for float KV (the
documented paged layout of the fused attention) and FAQuant (the ATB kernel reads
ND int8 caches).
For MLA (``mla=True``) the "key" cache is the one-head latent ``[.., R]`` (int8 in
``fakquant`` mode) and the "value" cache the RoPE part ``[.., Dr]`` in ``dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .atb_ops import FP8_KV_DTYPE
from .backends import Backend, get_backend
from .backends.base import ATTENTION_MODES, KV_LAYOUTS

__all__ = ["CacheBatch", "PagedKVCache"]


@dataclass(frozen=True)
class CacheBatch:
    """Metadata of one step for sequences ``seq_ids`` (in that order).

    ``slot_mapping`` ``[T]`` int32 — slots of the new tokens, sequence by sequence;
    ``block_table`` ``[B, max_blocks]`` int32 (unused entries 0);
    ``seq_lens`` ``[B]`` int32 — tokens in the cache after this step;
    ``query_lens`` ``[B]`` int32 — new tokens per sequence (for prefill).
    """

    seq_ids: tuple[int, ...]
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor


class PagedKVCache:
    """Per-layer paged K/V caches plus a block allocator shared by all layers.

    Args:
        num_layers: attention layers; each gets its own K and V cache.
        num_kv_heads: ``Hkv`` (1 for MLA).
        head_dim: ``D`` (``R`` for MLA).
        num_blocks: ``NB`` blocks per cache; ``block_size``: ``BS`` tokens per block.
        dtype: the model's activation dtype (float caches, and the MLA rope cache).
        mode: ``"float"``, ``"int8_kv"``, ``"faquant"`` (int8 caches),
            ``"fakquant"`` (MLA, int8 latent) or ``"fp8_kv"`` (float8_e4m3fn
            caches).
        backend: name or instance; default :func:`~ascend_fa.backends.get_backend`.
        layout: override the backend's preferred layout (``"nz"`` or ``"nd"``).
        mla: allocate MLA caches (latent + rope) instead of K + V.
        rope_dim: ``Dr`` for MLA.
        device: where to allocate (default: the backend's device).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        mode: str = "float",
        backend: str | Backend | None = None,
        layout: str | None = None,
        mla: bool = False,
        rope_dim: int = 64,
        device: torch.device | str | None = None,
    ) -> None:
        for name, val in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("rope_dim", rope_dim),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(
                    f"PagedKVCache: {name} must be a positive int, got {val!r}"
                )
        if mode not in ATTENTION_MODES:
            raise ValueError(
                f"PagedKVCache: mode must be one of {ATTENTION_MODES}, got {mode!r}"
            )
        if mla and mode in ("int8_kv", "faquant", "fp8_kv"):
            raise ValueError(
                f"PagedKVCache: MLA caches take mode 'float' or 'fakquant', "
                f"got {mode!r}"
            )
        if not mla and mode == "fakquant":
            raise ValueError(
                "PagedKVCache: mode 'fakquant' is for MLA caches (mla=True)"
            )
        if mla and num_kv_heads != 1:
            raise ValueError(
                f"PagedKVCache: MLA caches have one latent head, got "
                f"num_kv_heads={num_kv_heads}"
            )
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"PagedKVCache: dtype must be float16, bfloat16 or float32, got {dtype}"
            )
        self.backend = (
            get_backend(backend) if not isinstance(backend, Backend) else backend
        )
        self.layout = (
            layout
            if layout is not None
            else self.backend.preferred_layout(mode, mla=mla)
        )
        if self.layout not in KV_LAYOUTS:
            raise ValueError(
                f"PagedKVCache: layout must be one of {KV_LAYOUTS}, got {self.layout!r}"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.mode = mode
        self.mla = mla
        self.rope_dim = rope_dim if mla else 0
        self.dtype = dtype
        self.cache_dtype = (
            dtype
            if mode == "float"
            else (FP8_KV_DTYPE if mode == "fp8_kv" else torch.int8)
        )
        self.device = (
            torch.device(device) if device is not None else self.backend.device
        )
        k_shape = self.backend.kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_dim, self.cache_dtype,
            layout=self.layout, mode=mode,
        )  # fmt: skip
        if mla:
            v_dtype = dtype
            v_shape = self.backend.kv_cache_shape(
                num_blocks,
                block_size,
                1,
                rope_dim,
                dtype,
                layout=self.layout,
                mode=mode,
            )
        else:
            v_dtype, v_shape = self.cache_dtype, k_shape
        self.key_caches = [
            torch.zeros(k_shape, dtype=self.cache_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.value_caches = [
            torch.zeros(v_shape, dtype=v_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # Hand out low block ids first (pop from the end of a descending list).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}

    # -- allocator ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return sorted(self._lens)

    def seq_len(self, seq_id: int) -> int:
        """Tokens held for ``seq_id`` (0 for an unknown sequence)."""
        return self._lens.get(seq_id, 0)

    def blocks_of(self, seq_id: int) -> list[int]:
        return list(self._blocks.get(seq_id, ()))

    def append(
        self, seq_ids: Sequence[int], num_tokens: int | Sequence[int]
    ) -> CacheBatch:
        """Reserve cache space for ``num_tokens`` new tokens of each sequence (a new
        ``seq_id`` starts empty) and return the step's :class:`CacheBatch`.

        Tokens are laid out sequence by sequence in ``slot_mapping``. Raises
        ``ValueError`` (changing nothing) when the free blocks do not suffice.
        """
        ids = tuple(int(s) for s in seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedKVCache.append: seq_ids has duplicates: {ids}")
        counts = (
            [int(num_tokens)] * len(ids)
            if isinstance(num_tokens, int)
            else [int(n) for n in num_tokens]
        )
        if len(counts) != len(ids):
            raise ValueError(
                f"PagedKVCache.append: num_tokens has {len(counts)} entries "
                f"for {len(ids)} sequences"
            )
        if any(n < 0 for n in counts):
            raise ValueError(
                f"PagedKVCache.append: num_tokens must be >= 0, got {counts}"
            )
        bs = self.block_size
        need = []
        for sid, n in zip(ids, counts):
            have = len(self._blocks.get(sid, ()))
            need.append(max(0, -(-(self.seq_len(sid) + n) // bs) - have))
        if sum(need) > len(self._free):
            raise ValueError(
                f"PagedKVCache.append: out of blocks: need {sum(need)}, "
                f"{len(self._free)} free of {self.num_blocks}"
            )
        slots: list[int] = []
        for sid, n, extra in zip(ids, counts, need):
            blocks = self._blocks.setdefault(sid, [])
            blocks.extend(self._free.pop() for _ in range(extra))
            start = self._lens.get(sid, 0)
            self._lens[sid] = start + n
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        dev = self.device
        return CacheBatch(
            seq_ids=ids,
            slot_mapping=torch.tensor(slots, dtype=torch.int32, device=dev),
            block_table=self.block_table(ids),
            seq_lens=self.seq_lens(ids),
            query_lens=torch.tensor(counts, dtype=torch.int32, device=dev),
        )

    def block_table(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """``[B, max_blocks]`` int32 block ids of ``seq_ids``; unused entries are 0."""
        rows = [self._blocks.get(int(s), []) for s in seq_ids]
        width = max((len(r) for r in rows), default=0) or 1
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            if r:
                table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """``[B]`` int32 tokens held per sequence."""
        return torch.tensor(
            [self.seq_len(int(s)) for s in seq_ids],
            dtype=torch.int32,
            device=self.device,
        )

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks to the pool (unknown ids are ignored)."""
        blocks = self._blocks.pop(int(seq_id), [])
        self._lens.pop(int(seq_id), None)
        self._free.extend(reversed(blocks))

    # -- caches ---------------------------------------------------------------------
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` of one layer (MLA: ``(latent, rope)``)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(
                f"PagedKVCache.layer: index {index} out of range [0, {self.num_layers})"
            )
        return self.key_caches[index], self.value_caches[index]

    def bytes_per_token(self, scale_bytes: int = 0) -> float:
        """Cache bytes per token summed over layers, K and V (plus ``scale_bytes`` of
        per-layer scales amortized over the capacity ``NB * BS``)."""
        total = sum(t.numel() * t.element_size() for t in self.key_caches)
        total += sum(t.numel() * t.element_size() for t in self.value_caches)
        return (total + scale_bytes * self.num_layers) / (
            self.num_blocks * self.block_size
        )

    def __repr__(self) -> str:
        kind = "MLA " if self.mla else ""
        return (
            f"PagedKVCache({kind}layers={self.num_layers}, Hkv={self.num_kv_heads}, "
            f"D={self.head_dim}, NB={self.num_blocks}, BS={self.block_size}, "
            f"mode={self.mode!r}, layout={self.layout!r}, "
            f"cache_dtype={self.cache_dtype}, "
            f"backend={self.backend.name!r})"
        )
