"""Shared base of the PyTorch-reference backends (``cpu`` and ``cuda``).

Both run the default kernels of the ``ascend_fa::*`` custom ops, i.e. the pure
PyTorch emulation of the Ascend operators. They accept everything the op contracts
allow: any head dim with ``Hkv*D % C0 == 0``, fp16/bf16/fp32 queries, ND or NZ
caches, block sizes that are multiples of 16 (32 for int8).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..atb_ops import attention as _attention  # noqa: F401  (registers the attention ops)
from ..atb_ops import cache as _cache  # noqa: F401  (registers the cache-write ops)
from .base import Backend, Capabilities

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """PyTorch emulation of the Ascend attention operators."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    description: ClassVar[str] = "pure-PyTorch emulation of the Ascend operators"

    # The ``ascend_fa::*`` ops dispatch on the tensors' device; with no device kernel
    # registered, CPU and CUDA tensors run the default (reference) kernels.
    def reshape_and_cache(
        self,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *,
        k_scale=None,
        v_scale=None,
        layout="nz",
    ) -> None:
        torch.ops.ascend_fa.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, layout
        )

    def reshape_and_cache_mla(
        self,
        latent,
        rope,
        latent_cache,
        rope_cache,
        slot_mapping,
        *,
        k_scale=None,
        layout="nz",
    ) -> None:
        torch.ops.ascend_fa.reshape_and_cache_mla(
            latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
        )

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        *,
        num_kv_heads,
        scale,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        layout="nz",
    ) -> torch.Tensor:
        return torch.ops.ascend_fa.paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            num_kv_heads,
            float(scale),
            k_scale,
            v_scale,
            q_scale,
            layout,
        )

    def prefill_attention(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        *,
        num_kv_heads,
        scale,
        k_scale=None,
        v_scale=None,
        q_scale=None,
        layout="nz",
        query_lens=None,
    ) -> torch.Tensor:
        return torch.ops.ascend_fa.prefill_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_lens,
            num_kv_heads,
            float(scale),
            k_scale,
            v_scale,
            q_scale,
            layout,
        )

    def mla_paged_attention(
        self,
        q_nope,
        q_rope,
        latent_cache,
        rope_cache,
        block_table,
        seq_lens,
        *,
        scale,
        k_scale=None,
        q_scale=None,
        layout="nz",
    ) -> torch.Tensor:
        return torch.ops.ascend_fa.mla_paged_attention(
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            float(scale),
            k_scale,
            q_scale,
            layout,
        )

    def mla_prefill_attention(
        self,
        q_nope,
        q_rope,
        latent_cache,
        rope_cache,
        block_table,
        seq_lens,
        *,
        scale,
        k_scale=None,
        q_scale=None,
        layout="nz",
        query_lens=None,
    ) -> torch.Tensor:
        return torch.ops.ascend_fa.mla_prefill_attention(
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            query_lens,
            float(scale),
            k_scale,
            q_scale,
            layout,
        )
