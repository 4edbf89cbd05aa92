"""Constants of the Ascend contract, defined once.

Every magic number the package relies on (ACL storage formats, the NZ fractal
sizes, INT8 and FP8 limits, ATB dtype codes) lives here so that a reader can check
it against the Ascend documentation in one place.
"""

from __future__ import annotations

import torch

__all__ = [
    "ACL_FORMAT_ND",
    "ACL_FORMAT_FRACTAL_NZ",
    "NZ_ROW_ALIGN",
    "INT8_MIN",
    "INT8_MAX",
    "SCALE_EPS",
    "ROUND_MAGIC",
    "FP8_E4M3_MAX",
    "FP8_KV_DTYPE",
    "FP8_BLOCK",
    "ACL_DTYPE_FLOAT16",
    "ACL_DTYPE_BFLOAT16",
    "c0",
]

#: ACL storage format ids (``torch_npu.npu_format_cast(t, 29)`` makes NZ).
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29

#: Rows of one NZ fractal; the row dimension is padded to a multiple of this.
NZ_ROW_ALIGN = 16

#: Symmetric INT8 code range. -128 is kept as a valid code (the device saturates
#: to it), so quantization clamps to [-128, 127] although scales use 127.
INT8_MIN = -128
INT8_MAX = 127

#: Smallest scale handed out: 2**-23 keeps ``x / scale`` finite for an all-zero
#: head and matches the reference tool's floor.
SCALE_EPS = 2.0**-23

#: ``1.5 * 2**23``: fp32 values in ``[2**23, 2**24)`` are spaced exactly 1 apart, so
#: ``fl32(ROUND_MAGIC + q)`` is ``ROUND_MAGIC + round_half_even(q)`` for
#: ``|q| < 2**22`` (the IEEE add rounds the exact sum to nearest even, and the magic
#: is even), and that integer sits in the low mantissa bits: the bits of the sum are
#: ``bits(ROUND_MAGIC) + n``, whose low byte is ``n`` as a two's-complement int8.
ROUND_MAGIC = 12582912.0

#: Largest finite float8_e4m3fn value (OCP E4M3, as DeepSeek checkpoints use).
FP8_E4M3_MAX = 448.0

#: Cache dtype of an FP8 KV cache (vLLM ``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``).
FP8_KV_DTYPE = torch.float8_e4m3fn

#: How an FP8 KV cache write rounds ``x / scale`` to E4M3 (see :mod:`.quant`):
#: ``"nearest"`` (ties to even: vLLM's CUDA cache write, the default) or ``"trunc"``
#: (toward zero: vLLM's CPU cache write).
FP8_ROUNDINGS = ("nearest", "trunc")

#: DeepSeek-V3 weight block size ``[rows, cols]``.
FP8_BLOCK = (128, 128)

#: ATB ``outdtype`` codes used by ``_npu_paged_attention_quant``.
ACL_DTYPE_FLOAT16 = 1
ACL_DTYPE_BFLOAT16 = 27


def c0(dtype: torch.dtype) -> int:
    """Columns of one NZ fractal for ``dtype``: ``32 // min(itemsize, 2)``.

    One fractal row is 32 bytes for 1-byte types and 16 elements otherwise:
    16 for fp16/bf16/fp32, 32 for int8 (and fp8).

    >>> c0(torch.float16), c0(torch.int8)
    (16, 32)
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"c0: expected a torch.dtype, got {type(dtype).__name__}")
    # dtype.itemsize, not a probe tensor: c0 runs several times per cache write
    return 32 // min(dtype.itemsize, 2)
