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

Three layers, one module each:

* :mod:`~ascend_fa.fp8.blocks` -- one tensor: :func:`quantize_blockwise` /
  :func:`dequantize_blockwise` and the chunk kernels behind them;
* :mod:`~ascend_fa.fp8.api` -- a checkpoint directory, shard by shard:
  :func:`quantize_checkpoint` / :func:`dequantize_checkpoint`. Tensors are streamed
  from the input in chunks of whole block rows and written straight to the output
  file (:mod:`~ascend_fa.fp8.safetensors_io`), so memory is a few chunks per
  worker, independent of shard and tensor size. Output goes to
  ``<output>.partial/`` with a manifest of finished shards (size, xxh3-128) and the
  conversion parameters (:mod:`~ascend_fa.fp8.output`); a rerun resumes, a
  finished run renames it to ``<output>``, which keeps the manifest.
  ``workers`` processes convert shards in parallel (:func:`plan_workers`);
* :class:`CheckpointReader` -- one named tensor of a checkpoint, FP8 weights
  dequantized on the fly, bit-equal to the ``dequantize_checkpoint`` output.

Every input is treated as untrusted (:mod:`~ascend_fa.fp8.checkpoint`): shard names
from the index stay inside the input directory, headers and JSON are validated and
size-capped, pickled checkpoints are refused unread; errors are the typed
exceptions of :mod:`~ascend_fa.fp8.errors`.

Tensor selection for :func:`quantize_checkpoint`: with ``reference_fp8`` exactly the
weights that have a ``<name>_scale_inv`` in the reference checkpoint's index;
otherwise the 2-D floating weights whose name matches one ``include`` pattern and no
``ignore`` pattern. Patterns use :func:`re.search` (unanchored, like ``grep -E``);
anchor with ``^`` / ``$`` for whole-name matches.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names -> the module that owns them, loaded on first access so that the
# torch-free parts (errors, selection rules) import without torch (the CLI builds
# its --help from them).
_OWNER: dict[str, str] = {
    "DEFAULT_IGNORE": "selection",
    "DEFAULT_INCLUDE": "selection",
    "ignored_module_names": "selection",
    "select_for_quantization": "selection",
    "ConversionResult": "api",
    "dequantize_checkpoint": "api",
    "quantize_checkpoint": "api",
    "SCALE_SUFFIX": "blocks",
    "dequantize_blockwise": "blocks",
    "quantize_blockwise": "blocks",
    "INDEX_NAME": "checkpoint",
    "WORKER_BYTES": "convert",
    "plan_workers": "convert",
    "FP8ConversionError": "errors",
    "FP8FormatError": "errors",
    "FP8InputError": "errors",
    "FP8UnsafePathError": "errors",
    "MANIFEST_NAME": "output",
    "CheckpointReader": "reader",
    "TensorInfo": "reader",
    "ShardHeader": "safetensors_io",
    "TensorEntry": "safetensors_io",
    "read_safetensors_header": "safetensors_io",
}

__all__ = sorted(_OWNER)


def __getattr__(name: str) -> Any:
    owner = _OWNER.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{owner}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNER))
