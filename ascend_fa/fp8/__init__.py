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
  ``<output>.partial/`` with a manifest of finished shards (size, sha256) and the
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

from .api import (
    DEFAULT_IGNORE,
    DEFAULT_INCLUDE,
    ConversionResult,
    dequantize_checkpoint,
    ignored_module_names,
    quantize_checkpoint,
    select_for_quantization,
)
from .blocks import SCALE_SUFFIX, dequantize_blockwise, quantize_blockwise
from .checkpoint import INDEX_NAME
from .convert import WORKER_BYTES, plan_workers
from .errors import (
    FP8ConversionError,
    FP8FormatError,
    FP8InputError,
    FP8UnsafePathError,
)
from .output import MANIFEST_NAME
from .reader import CheckpointReader, TensorInfo
from .safetensors_io import ShardHeader, TensorEntry, read_safetensors_header

__all__ = [
    "DEFAULT_IGNORE",
    "DEFAULT_INCLUDE",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "SCALE_SUFFIX",
    "WORKER_BYTES",
    "CheckpointReader",
    "ConversionResult",
    "FP8ConversionError",
    "FP8FormatError",
    "FP8InputError",
    "FP8UnsafePathError",
    "ShardHeader",
    "TensorEntry",
    "TensorInfo",
    "dequantize_blockwise",
    "dequantize_checkpoint",
    "ignored_module_names",
    "plan_workers",
    "quantize_blockwise",
    "quantize_checkpoint",
    "read_safetensors_header",
    "select_for_quantization",
]
