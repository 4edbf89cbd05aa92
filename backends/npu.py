"""``npu`` backend: Ascend NPUs through torch_npu (Atlas 800I A2 / Ascend 910B).

torch_npu is imported lazily, the first time this backend's availability is probed
or it is selected — never by ``import ascend_fa``. Without the CANN libraries
``import torch_npu`` fails; the reason is reported, not raised.

The device kernels have narrower contracts than the emulation; they are encoded in
:meth:`NPUBackend.unsupported_reasons` so a call that does not fit is refused with
every reason listed *before* any device op runs (torch_npu 2.x documentation):

* int8-KV decode over an NZ cache (``npu_fused_infer_attention_score``): bf16 query,
  D = 128, block size 128 or 512, no offsets;
* FAQuant decode (``_npu_paged_attention_quant``, an ATB op): ND int8 caches
  ``[NB, BS, Hkv, D]``, fp16/bf16 output;
* MLA FAKQuant decode (``npu_fused_infer_attention_score_v2``): NZ caches with block
  size 128, latent width 512, rope width 64;
* int8 block sizes are multiples of 32.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from typing import ClassVar

import torch

from .base import AttentionSpec, Availability, Backend, Capabilities

__all__ = ["NPUBackend", "import_torch_npu"]

_STATE: dict[str, object] = {}
_LOCK = threading.Lock()


def import_torch_npu():
    """Import torch_npu once and return the module (raises ImportError when absent)."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        if "error" in _STATE:
            raise ImportError(_STATE["error"])
        try:
            module = importlib.import_module("torch_npu")
        except (
            Exception
        ) as exc:  # missing CANN raises OSError/RuntimeError, not only ImportError
            _STATE["error"] = f"import torch_npu failed: {type(exc).__name__}: {exc}"
            raise ImportError(_STATE["error"]) from exc
        _STATE["module"] = module
        return module


def _reset_torch_npu_state() -> None:
    """Forget the cached import result (tests swap a recording fake in and out)."""
    with _LOCK:
        _STATE.clear()


class NPUBackend(Backend):
    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    priority: ClassVar[int] = 300
    description: ClassVar[str] = "Ascend NPU via torch_npu (fused infer attention, ATB)"
    capabilities: ClassVar[Capabilities] = Capabilities(
        query_dtypes=frozenset({torch.float16, torch.bfloat16}),
        cache_dtypes=frozenset({torch.float16, torch.bfloat16, torch.int8}),
    )

    @classmethod
    def is_available(cls) -> Availability:
        if "module" not in _STATE and "error" not in _STATE:
            if importlib.util.find_spec("torch_npu") is None:
                return Availability(
                    False,
                    "torch_npu is not installed (pip install 'ascend-fa[npu]' on a "
                    "machine with the CANN toolkit)",
                )
        try:
            import_torch_npu()
        except ImportError as exc:
            return Availability(False, str(exc))
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(
                False, "torch_npu imported but no NPU device is visible"
            )
        return Availability(True)

    def preferred_layout(self, mode: str) -> str:
        # The ATB FAQuant op reads ND int8 caches; everything else wants NZ.
        return "nd" if mode == "faquant" else "nz"

    def unsupported_reasons(self, spec: AttentionSpec) -> list[str]:
        reasons = super().unsupported_reasons(spec)
        decode_like = spec.op in ("decode", "prefill", "cache_write")
        if spec.mode == "int8_kv" and decode_like:
            if spec.layout != "nz":
                reasons.append("int8-KV attention on the NPU needs an NZ cache")
            if spec.query_dtype != torch.bfloat16:
                reasons.append(
                    f"int8-KV NZ attention needs a bf16 query, got {spec.query_dtype}"
                )
            if spec.head_dim != 128:
                reasons.append(
                    f"int8-KV NZ attention needs head_dim 128, got {spec.head_dim}"
                )
            if spec.block_size not in (128, 512):
                reasons.append(
                    f"int8-KV NZ attention needs block_size 128 or 512, "
                    f"got {spec.block_size}"
                )
        if spec.mode == "faquant" and decode_like and spec.layout != "nd":
            reasons.append(
                "FAQuant on the NPU (_npu_paged_attention_quant) needs ND int8 "
                "caches [NB, BS, Hkv, D]"
            )
        if spec.mode == "fakquant" or spec.op.startswith("mla"):
            if spec.layout != "nz":
                reasons.append("MLA attention on the NPU needs NZ caches")
            if spec.block_size != 128:
                reasons.append(
                    f"MLA NZ attention needs block_size 128, got {spec.block_size}"
                )
        if spec.has_offsets:
            reasons.append(
                "the NPU kernels take symmetric scales only (offsets must be 0)"
            )
        return reasons
