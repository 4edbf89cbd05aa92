"""Whole-model emulation of the quantized inference path.

* :mod:`.runtime` — :func:`enable_paged_int8_attention` and
  :class:`QuantizedKVRuntime`: a transformers model's attention through the paged
  (int8) NZ cache, as an Ascend inference engine runs it.
* :mod:`.scales` — the runtime's static scales (FA, C8 ``[Hkv, D]``, FP8 ``[1]`` /
  ``[Hkv]``) read from artifacts or maps, and the dynamic ones from a prompt.
* :mod:`.verb` — :func:`run_emulate`, the ``ascend-fa emulate`` verb: greedy
  generation and perplexity through the paged cache against the plain model.
"""

from __future__ import annotations

from .runtime import (
    EMULATION_MODES,
    PAGED_ATTENTION_IMPL,
    SUPPORTED_MODEL_TYPES,
    QuantizedKVRuntime,
    dynamic_scales,
    enable_paged_int8_attention,
)

__all__ = [
    "EMULATION_MODES",
    "PAGED_ATTENTION_IMPL",
    "SUPPORTED_MODEL_TYPES",
    "QuantizedKVRuntime",
    "dynamic_scales",
    "enable_paged_int8_attention",
]
