"""``npu`` backend: Ascend NPUs through torch_npu (Atlas 800I A2 / Ascend 910B).

One dispatch route: the public API validates its arguments once and calls
``torch.ops.ascend_fa.<op>``; tensors on the NPU dispatch to the PrivateUse1 key,
for which this module registers one kernel per op (:func:`register_npu_kernels`)
the first time torch_npu is imported through it. Each kernel describes its call
from shapes and dtypes (an :class:`~ascend_fa.backends.base.AttentionSpec`), checks
the device contract from the capability table (a cached lookup, refusing before any
torch_npu call) and maps the arguments (:mod:`ascend_fa.backends.npu_kernels`).

torch_npu is imported lazily, the first time this backend's availability is probed
or a kernel needs it, never by ``import ascend_fa``. Without the CANN libraries
``import torch_npu`` fails; the reason is reported, not raised.

Which release is loaded decides the table rows that apply
(:mod:`ascend_fa.backends.npu_capabilities`): ``$ASCEND_FA_TORCH_NPU_RELEASE`` when
set, else a ``__version__`` that names a release (``7.3.0``, ``2.7.1-7.3.0``), else
what the module offers: no
``npu_fused_infer_attention_score_v2`` means 7.1.0, a ``cache_mode`` keyword on
``npu_scatter_pa_kv_cache`` means 26.0.0, anything between is 7.2.0 (7.2.0 and
7.3.0 bind identically; 7.2.0's rules are the stricter, so set the variable to
7.3.0 on a 7.3.0 install to use its wider MLA block sizes).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import threading
from typing import ClassVar

import torch

from ..atb_ops import linear as linear_ops  # defines the ascend_fa:: linear ops
from ..atb_ops import settings
from ..atb_ops.attention import mla_attention_info, paged_attention_info
from . import npu_kernels
from .base import (
    AttentionSpec,
    Availability,
    Backend,
    Capabilities,
    CapabilityError,
    attention_spec,
    cache_write_spec,
    linear_spec,
)
from .npu_capabilities import (
    DEFAULT_RELEASE,
    RELEASE_ENV_VAR,
    RELEASES,
    release_index,
)
from .npu_capabilities import unsupported_reasons as table_reasons

__all__ = [
    "MLA_LATENT_DIM",
    "MLA_ROPE_DIM",
    "NPUBackend",
    "call_keywords",
    "current_release",
    "detect_release",
    "import_torch_npu",
    "kernels_registered",
    "register_npu_kernels",
    "reset_torch_npu",
]

#: DeepSeek MLA widths the fused v2 kernel supports (kv_lora_rank, qk_rope_head_dim).
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64

_STATE: dict[str, object] = {}
_LOCK = threading.Lock()
_REGISTERED: dict[str, object] = {}


def call_keywords(module, name: str) -> set[str] | None:
    """Argument names of ``module.<name>``: from the operator schemas torch_npu
    registers (``npu::<name>``), else from the Python signature; None when the
    call is missing or says nothing."""
    fn = getattr(module, name, None)
    if fn is None:
        return None
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"npu::{name}")
    except RuntimeError:
        schemas = []
    if schemas:
        return {a.name for s in schemas for a in s.arguments}
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def detect_release(module) -> str:
    """The table release of the loaded torch_npu ``module`` (see the module doc)."""
    forced = settings.get(RELEASE_ENV_VAR)
    if forced:
        release_index(forced)
        return forced
    version = str(getattr(module, "__version__", ""))
    for release in RELEASES:
        # a version string that names the release ("7.3.0", "2.7.1-7.3.0")
        if version == release or version.endswith(("-" + release, "+" + release)):
            return release
    if not hasattr(module, "npu_fused_infer_attention_score_v2"):
        return "7.1.0"
    keywords = call_keywords(module, "npu_scatter_pa_kv_cache") or set()
    if "cache_mode" in keywords:
        return "26.0.0"
    return "7.2.0"


def import_torch_npu():
    """Import torch_npu once, detect its release, register the NPU kernels, and
    return the module (raises ImportError when it cannot be imported)."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        if "error" in _STATE:
            raise ImportError(_STATE["error"])
        try:
            module = importlib.import_module("torch_npu")
        except Exception as exc:  # missing CANN raises OSError/RuntimeError too
            _STATE["error"] = f"import torch_npu failed: {type(exc).__name__}: {exc}"
            raise ImportError(_STATE["error"]) from exc
        _STATE["release"] = detect_release(module)
        _STATE["module"] = module
    register_npu_kernels()
    return module


def reset_torch_npu() -> None:
    """Forget the imported module and its release (the next use imports again).
    The kernels stay registered: they look the module up on every call."""
    with _LOCK:
        _STATE.clear()


def current_release() -> str:
    """The release the table is read for: the loaded torch_npu's, else
    ``$ASCEND_FA_TORCH_NPU_RELEASE``, else the newest known."""
    release = _STATE.get("release")
    if release is None:
        release = settings.get(RELEASE_ENV_VAR) or DEFAULT_RELEASE
        release_index(release)
    return str(release)


class NPUBackend(Backend):
    """Ascend NPU via torch_npu. ``release`` pins the table release (what-if
    questions, tests); by default the loaded torch_npu's is used."""

    name: ClassVar[str] = "npu"
    device_type: ClassVar[str] = "npu"
    priority: ClassVar[int] = 300
    description: ClassVar[str] = "Ascend NPU via torch_npu (fused infer attention, ATB)"
    # Offsets, and every other device constraint, are judged per call by the
    # capability table (rule npu.offsets), which names the rule and the release.
    capabilities: ClassVar[Capabilities] = Capabilities(
        query_dtypes=frozenset({torch.float16, torch.bfloat16}),
        cache_dtypes=frozenset({torch.float16, torch.bfloat16, torch.int8}),
        supports_offsets=True,
    )

    def __init__(self, release: str | None = None) -> None:
        if release is not None:
            release_index(release)
        self._release = release

    @property
    def release(self) -> str:
        return self._release or current_release()

    @classmethod
    def is_available(cls) -> Availability:
        if "module" not in _STATE and "error" not in _STATE:
            if "torch_npu" not in sys.modules and (
                importlib.util.find_spec("torch_npu") is None
            ):
                return Availability(
                    False,
                    "torch_npu is not installed (pip install 'ascend-fa[npu]' on a "
                    "machine with the CANN toolkit)",
                )
        try:
            import_torch_npu()
        except ImportError as exc:
            return Availability(False, str(exc))
        if "error" in _REGISTERED:
            return Availability(False, str(_REGISTERED["error"]))
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return Availability(
                False, "torch_npu imported but no NPU device is visible"
            )
        return Availability(True)

    def preferred_layout(self, mode: str, *, mla: bool = False) -> str:
        # int8-KV decode reads NZ int8 caches and MLA the NZ latent; FAQuant (ATB)
        # reads ND int8 caches and float decode the documented ND paged layout.
        if mla or mode in ("int8_kv", "fakquant"):
            return "nz"
        return "nd"

    def unsupported_reasons(self, spec: AttentionSpec) -> list[str]:
        return super().unsupported_reasons(spec) + table_reasons(spec, self.release)


# -- the PrivateUse1 kernels ----------------------------------------------------------
_KERNEL = NPUBackend()


def _device():
    """The torch_npu module and its release, for a kernel about to map a call."""
    module = import_torch_npu()
    return module, current_release()


def _cache_spec(key, key_cache, layout, *, mla=False, rope_dim=0) -> AttentionSpec:
    bs = int(key_cache.shape[2] if layout == "nz" else key_cache.shape[1])
    return cache_write_spec(
        key_dtype=key.dtype,
        cache_dtype=key_cache.dtype,
        num_kv_heads=1 if mla else int(key.shape[1]),
        head_dim=int(key.shape[-1]),
        block_size=bs,
        layout=layout,
        device_type="npu",
        mla=mla,
        rope_dim=rope_dim,
    )


def _cache_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    layout,
    fp8_rounding="nearest",
):
    # fp8_rounding only applies to float8_e4m3fn caches, which the capability
    # table refuses on the NPU (npu.fp8_kv) before this runs
    _KERNEL.require(_cache_spec(key, key_cache, layout))
    npu_kernels.reshape_and_cache(
        *_device(), key, value, key_cache, value_cache, slot_mapping, k_scale,
        v_scale, layout,
    )  # fmt: skip


def _mla_cache_kernel(
    latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
):
    spec = _cache_spec(latent, latent_cache, layout, mla=True, rope_dim=rope.shape[1])
    _KERNEL.require(spec)
    npu_kernels.reshape_and_cache_mla(
        *_device(), latent, rope, latent_cache, rope_cache, slot_mapping, k_scale,
        layout,
    )  # fmt: skip


def _decode_kernel(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    num_kv_heads,
    scale,
    k_scale,
    v_scale,
    q_scale,
    layout,
):
    info = paged_attention_info(
        query, key_cache, block_table, num_kv_heads, q_scale, layout
    )
    _KERNEL.require(attention_spec("decode", info, "npu"))
    return npu_kernels.paged_attention(
        *_device(), info, query, key_cache, value_cache, block_table, seq_lens,
        scale, k_scale, v_scale, q_scale,
    )  # fmt: skip


def _mla_decode_kernel(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    scale,
    k_scale,
    q_scale,
    layout,
):
    info = mla_attention_info(
        q_nope, q_rope, latent_cache, block_table, q_scale, layout
    )
    _KERNEL.require(attention_spec("mla_decode", info, "npu"))
    return npu_kernels.mla_paged_attention(
        *_device(), info, q_nope, q_rope, latent_cache, rope_cache, block_table,
        seq_lens, scale, k_scale, q_scale,
    )  # fmt: skip


def _refuse(spec: AttentionSpec) -> None:
    """Prefill has no torch_npu route in the table: refuse with its reasons."""
    reasons = _KERNEL.unsupported_reasons(spec) or [
        f"{spec.op} is not mapped to a torch_npu kernel by the npu backend"
    ]
    raise CapabilityError(_KERNEL.name, spec, reasons)


def _prefill_kernel(
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_lens,
    num_kv_heads,
    scale,
    k_scale,
    v_scale,
    q_scale,
    layout,
):
    info = paged_attention_info(
        query, key_cache, block_table, num_kv_heads, q_scale, layout, prefill=True
    )
    _refuse(attention_spec("prefill", info, "npu"))


def _mla_prefill_kernel(
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    query_lens,
    scale,
    k_scale,
    q_scale,
    layout,
):
    info = mla_attention_info(
        q_nope, q_rope, latent_cache, block_table, q_scale, layout, prefill=True
    )
    _refuse(attention_spec("mla_prefill", info, "npu"))


def _linear_require(spec) -> None:
    """Refuse a linear op call the loaded release cannot run, before any call."""
    reasons = table_reasons(spec, _KERNEL.release)
    if reasons:
        raise CapabilityError(_KERNEL.name, spec, reasons)


def _exact_in(values: torch.Tensor, dtype: torch.dtype) -> bool:
    v = values.detach().float()
    return bool(torch.equal(v.to(dtype).float(), v))


def _quantize_static_kernel(x, scale, offset, div_mode):
    if div_mode:  # float32 scales; the offset travels as int32 zero points
        exact = _exact_in(offset, torch.int32)
    else:  # scales and zero points in the input's dtype
        exact = _exact_in(scale, x.dtype) and _exact_in(offset, x.dtype)
    _linear_require(
        linear_spec(
            "quantize_static", "npu", input_dtype=x.dtype, k=int(x.shape[1]),
            scale_exact=exact,
        )
    )  # fmt: skip
    return npu_kernels.quantize_static(*_device(), x, scale, offset, div_mode)


def _dynamic_quant_kernel(x):
    _linear_require(
        linear_spec("dynamic_quant", "npu", input_dtype=x.dtype, k=int(x.shape[1]))
    )
    return npu_kernels.dynamic_quant(*_device(), x)


def _matmul_spec(op, x_q, weight, scale, out_dtype):
    return linear_spec(
        op,
        "npu",
        out_dtype=linear_ops.OUT_DTYPES[out_dtype],
        scale_dtype=scale.dtype,
        k=int(x_q.shape[1]),
        n=int(weight.shape[0]),
    )


def _quant_matmul_kernel(x_q, weight, deq_scale, quant_bias, out_dtype):
    _linear_require(_matmul_spec("quant_matmul", x_q, weight, deq_scale, out_dtype))
    return npu_kernels.quant_matmul(
        *_device(), x_q, weight, deq_scale, quant_bias, out_dtype
    )


def _quant_matmul_dynamic_kernel(
    x_q, weight, weight_scale, pertoken_scale, bias, out_dtype
):
    _linear_require(
        _matmul_spec("quant_matmul_dynamic", x_q, weight, weight_scale, out_dtype)
    )
    return npu_kernels.quant_matmul_dynamic(
        *_device(), x_q, weight, weight_scale, pertoken_scale, bias, out_dtype
    )


_KERNELS = {
    "ascend_fa::reshape_and_cache": _cache_kernel,
    "ascend_fa::reshape_and_cache_mla": _mla_cache_kernel,
    "ascend_fa::paged_attention": _decode_kernel,
    "ascend_fa::mla_paged_attention": _mla_decode_kernel,
    "ascend_fa::prefill_attention": _prefill_kernel,
    "ascend_fa::mla_prefill_attention": _mla_prefill_kernel,
    "ascend_fa::quantize_static": _quantize_static_kernel,
    "ascend_fa::dynamic_quant": _dynamic_quant_kernel,
    "ascend_fa::quant_matmul": _quant_matmul_kernel,
    "ascend_fa::quant_matmul_dynamic": _quant_matmul_dynamic_kernel,
}


def register_npu_kernels() -> bool:
    """Register the NPU kernel of every ``ascend_fa`` attention / cache / linear op
    for the PrivateUse1 dispatch key (once per process). torch_npu names that key
    ``npu`` on import; an unrenamed key (``privateuseone``, e.g. a test process
    with a fake torch_npu) is used as is. Returns whether the kernels are
    registered."""
    with _LOCK:
        if "done" in _REGISTERED:
            return True
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("npu", "privateuseone"):
            _REGISTERED["error"] = (
                f"torch's PrivateUse1 backend is named {name!r}, not 'npu': another "
                "device extension owns it"
            )
            return False
        for op, kernel in _KERNELS.items():
            torch.library.register_kernel(op, name, kernel)
        _REGISTERED["done"] = name
        return True


def kernels_registered() -> bool:
    """Whether :func:`register_npu_kernels` has registered the kernels."""
    return "done" in _REGISTERED
