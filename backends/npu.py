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
* int8 block sizes are multiples of 32;
* prefill is not mapped (the emulation serves it).

Argument mapping (DESIGN 3.4): cache writes -> ``npu_quantize`` (int8) then
``npu_scatter_pa_kv_cache(cache_mode="PA_NZ" | "Norm")``; float / int8-KV decode ->
``npu_fused_infer_attention_score``; FAQuant decode -> ``_npu_paged_attention_quant``;
MLA decode -> ``npu_fused_infer_attention_score_v2``. After ``import torch_npu`` the
same mapping is registered as the ``npu`` kernel of each ``ascend_fa::*`` op.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from typing import ClassVar

import torch

from ..atb_ops import INT8_MAX, INT8_MIN, c0
from ..atb_ops.attention import (
    PagedAttentionInfo,
    check_mla_attention,
    check_paged_attention,
    dynamic_query_scale,
)
from ..atb_ops.params import (
    FusedInferAttentionParams,
    FusedInferAttentionV2Params,
    PagedAttentionQuantParams,
    QuantizeParams,
    ScatterPaKvCacheParams,
)
from .base import (
    AttentionSpec,
    Availability,
    Backend,
    Capabilities,
    attention_spec,
    cache_write_spec,
)

__all__ = [
    "MLA_LATENT_DIM",
    "MLA_ROPE_DIM",
    "NPUBackend",
    "import_torch_npu",
    "npu_mla_paged_attention",
    "npu_paged_attention",
    "npu_quantize_per_head",
    "npu_reshape_and_cache",
    "npu_reshape_and_cache_mla",
]

#: DeepSeek MLA widths the fused v2 kernel supports (kv_lora_rank, qk_rope_head_dim).
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64

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
    # Outside the lock: registration may import torch_npu submodules.
    _register_npu_kernels(module)
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
        extra = dict(spec.extra)
        if spec.op in ("prefill", "mla_prefill"):
            reasons.append(
                "prefill is not mapped to a torch_npu kernel by this backend (use the "
                "cpu/cuda emulation, or decode token by token)"
            )
        if spec.op == "cache_write" and spec.layout == "nz":
            row_bytes = spec.head_dim * _itemsize(spec.cache_dtype)
            if row_bytes % 32:
                reasons.append(
                    "npu_scatter_pa_kv_cache (PA_NZ) needs D * itemsize % 32 == 0, "
                    f"got {spec.head_dim} * {_itemsize(spec.cache_dtype)}"
                )
        if spec.op == "decode" and spec.mode in ("float", "int8_kv"):
            if spec.layout != "nz":
                reasons.append(
                    "int8-KV attention on the NPU needs an NZ cache"
                    if spec.mode == "int8_kv"
                    else "paged attention on the NPU reads NZ caches"
                )
            if spec.block_size not in (128, 512):
                kind = "int8-KV NZ" if spec.mode == "int8_kv" else "NZ paged"
                reasons.append(
                    f"{kind} attention needs block_size 128 or 512, "
                    f"got {spec.block_size}"
                )
        if (
            spec.op == "decode"
            and spec.mode in ("float", "int8_kv")
            and spec.head_dim % c0(spec.cache_dtype)
        ):
            reasons.append(
                f"fused attention reads per-head NZ tiles [NB, Hkv, D // C0, BS, C0]: "
                f"head_dim {spec.head_dim} is not a multiple of C0 = "
                f"{c0(spec.cache_dtype)}"
            )
        if spec.op == "decode" and spec.mode == "int8_kv":
            if spec.query_dtype != torch.bfloat16:
                reasons.append(
                    f"int8-KV NZ attention needs a bf16 query, got {spec.query_dtype}"
                )
            if spec.head_dim != 128:
                reasons.append(
                    f"int8-KV NZ attention needs head_dim 128, got {spec.head_dim}"
                )
        if spec.mode == "faquant" and spec.layout != "nd":
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
            if spec.head_dim != MLA_LATENT_DIM:
                reasons.append(
                    f"MLA on the NPU needs latent width R = {MLA_LATENT_DIM}, got "
                    f"{spec.head_dim}"
                )
            if extra.get("rope_dim", MLA_ROPE_DIM) != MLA_ROPE_DIM:
                reasons.append(
                    f"MLA on the NPU needs rope width Dr = {MLA_ROPE_DIM}, got "
                    f"{extra['rope_dim']}"
                )
            if spec.op == "mla_decode" and spec.query_dtype != torch.bfloat16:
                reasons.append(
                    f"MLA NZ attention needs a bf16 query, got {spec.query_dtype}"
                )
        if spec.has_offsets:
            reasons.append(
                "the NPU kernels take symmetric scales only (offsets must be 0)"
            )
        return reasons

    # -- ops: validated arguments in, torch_npu calls out ----------------------------
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
        self.require(
            cache_write_spec(
                key_dtype=key.dtype,
                cache_dtype=key_cache.dtype,
                num_kv_heads=key.shape[1],
                head_dim=key.shape[2],
                block_size=_block_size(key_cache, layout),
                layout=layout,
                device_type=key.device.type,
            )
        )
        npu_reshape_and_cache(
            import_torch_npu(),
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale,
            v_scale,
            layout,
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
        self.require(
            cache_write_spec(
                key_dtype=latent.dtype,
                cache_dtype=latent_cache.dtype,
                num_kv_heads=1,
                head_dim=latent.shape[1],
                block_size=_block_size(latent_cache, layout),
                layout=layout,
                device_type=latent.device.type,
                mla=True,
                rope_dim=rope.shape[1],
            )
        )
        npu_reshape_and_cache_mla(
            import_torch_npu(),
            latent,
            rope,
            latent_cache,
            rope_cache,
            slot_mapping,
            k_scale,
            layout,
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
        info = check_paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            num_kv_heads=num_kv_heads,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            q_scale=q_scale,
            layout=layout,
        )
        self.require(attention_spec("decode", info, query.device.type))
        return npu_paged_attention(
            import_torch_npu(),
            info,
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            k_scale,
            v_scale,
            q_scale,
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
        info = check_mla_attention(
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            scale=scale,
            k_scale=k_scale,
            q_scale=q_scale,
            layout=layout,
        )
        self.require(attention_spec("mla_decode", info, q_nope.device.type))
        return npu_mla_paged_attention(
            import_torch_npu(),
            info,
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            scale,
            k_scale,
            q_scale,
        )

    # Prefill is refused by unsupported_reasons(), so the base methods (which raise)
    # are never reached through the public API.


# -- argument mapping (module level so the op-level ``npu`` kernels share it) --------
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _block_size(cache: torch.Tensor, layout: str) -> int:
    return int(cache.shape[2] if layout == "nz" else cache.shape[1])


def _nz_heads_view(cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[NB, Hkv*D // C0, BS, C0]`` -> ``[NB, Hkv, D // C0, BS, C0]`` (same bytes): the
    per-head NZ form the fused attention kernels document for paged NZ caches."""
    nb, n1, bs, cols = cache.shape
    return cache.view(nb, num_heads, n1 // num_heads, bs, cols)


def npu_quantize_per_head(tnpu, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` -> int8 codes via ``npu_quantize`` with ``div_mode=True``;
    the per-head scale is expanded over ``D`` (as loaders expand ``[H, 1]`` scales) so
    the device quantizes along the last axis of ``[T, H*D]``."""
    t, h, d = x.shape
    params = QuantizeParams()
    scales = scale.to(torch.float32).repeat_interleave(d)
    codes = tnpu.npu_quantize(
        x.reshape(t, h * d), scales, None, *params.args(), **params.kwargs()
    )
    return codes.view(torch.int8).view(t, h, d)


def npu_reshape_and_cache(
    tnpu, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, layout
) -> None:
    """``npu_quantize`` (int8 caches) then ``npu_scatter_pa_kv_cache`` (a pure copy)."""
    if k_scale is not None:
        key = npu_quantize_per_head(tnpu, key, k_scale)
        value = npu_quantize_per_head(tnpu, value, v_scale)
    params = ScatterPaKvCacheParams(layout)
    tnpu.npu_scatter_pa_kv_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.to(torch.int32),
        **params.kwargs(),
    )


def npu_reshape_and_cache_mla(
    tnpu, latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
) -> None:
    """The latent is the "key" (one head, int8 with ``k_scale``), the RoPE part the
    "value" (never quantized); ``PA_NZ`` allows the two to differ in dtype and width."""
    lat = latent.unsqueeze(1)
    if k_scale is not None:
        lat = npu_quantize_per_head(tnpu, lat, k_scale)
    params = ScatterPaKvCacheParams(layout)
    tnpu.npu_scatter_pa_kv_cache(
        lat,
        rope.unsqueeze(1),
        latent_cache,
        rope_cache,
        slot_mapping.to(torch.int32),
        **params.kwargs(),
    )


def npu_paged_attention(
    tnpu,
    info: PagedAttentionInfo,
    query,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    scale,
    k_scale,
    v_scale,
    q_scale,
) -> torch.Tensor:
    """Float / int8-KV decode -> ``npu_fused_infer_attention_score`` (BNSD, NZ);
    FAQuant -> ATB ``_npu_paged_attention_quant`` (ND int8 caches)."""
    b, h, d = query.shape
    hkv = info.num_kv_heads
    g = h // hkv
    bt = block_table.to(torch.int32)
    if info.mode == "faquant":
        params = PagedAttentionQuantParams(
            num_kv_heads=hkv, num_heads=h, scale=scale, out_dtype=query.dtype
        )
        q_codes = npu_quantize_per_head(tnpu, query, q_scale)
        # ATB folds the per-head scales into two descale vectors over query heads.
        qk_descale = (q_scale * k_scale.repeat_interleave(g)).to(torch.float32)
        v_descale = v_scale.repeat_interleave(g).to(torch.float32)
        out = torch.empty_like(query)
        tnpu._npu_paged_attention_quant(
            q_codes,
            key_cache,
            value_cache,
            params.num_kv_heads,
            params.num_heads,
            params.scale,
            bt,
            seq_lens.to(torch.int32),
            params.quant_type,
            params.outdtype,
            qk_descale,
            v_descale,
            out,
        )
        return out
    params = FusedInferAttentionParams(
        num_heads=h,
        num_key_value_heads=hkv,
        scale=float(scale),
        block_size=info.block_size,
    )
    kwargs = params.kwargs(quantized=k_scale is not None)
    if k_scale is not None:
        # Per-channel antiquant: the per-head scale expanded over D, [Hkv, 1, D].
        kwargs["key_antiquant_scale"] = k_scale.view(hkv, 1, 1).expand(hkv, 1, d)
        kwargs["value_antiquant_scale"] = v_scale.view(hkv, 1, 1).expand(hkv, 1, d)
    out, _ = tnpu.npu_fused_infer_attention_score(
        query.reshape(b, h, 1, d),
        _nz_heads_view(key_cache, hkv),
        _nz_heads_view(value_cache, hkv),
        block_table=bt,
        actual_seq_lengths_kv=[int(n) for n in seq_lens.tolist()],
        **kwargs,
    )
    return out.reshape(b, h, d)


def npu_mla_paged_attention(
    tnpu,
    info: PagedAttentionInfo,
    q_nope,
    q_rope,
    latent_cache,
    rope_cache,
    block_table,
    seq_lens,
    scale,
    k_scale,
    q_scale,
) -> torch.Tensor:
    """MLA decode -> ``npu_fused_infer_attention_score_v2`` (``BSND_NBSD``, NZ caches).

    FAKQuant quantizes ``q_nope`` per token and head on the device with plain tensor
    ops (``rowmax|q| / 127``, or the static ``q_scale`` broadcast over tokens) and
    passes the scales as ``dequant_scale_query`` ``[B, 1, H]``.
    """
    b, h, r = q_nope.shape
    params = FusedInferAttentionV2Params(
        num_query_heads=h, softmax_scale=float(scale), block_size=info.block_size
    )
    kwargs = params.kwargs()
    lat = _nz_heads_view(latent_cache, 1)
    query = q_nope.reshape(b, 1, h, r)
    if k_scale is not None:
        qs = (
            dynamic_query_scale(q_nope)
            if q_scale is None
            else q_scale.to(torch.float32).view(1, h).expand(b, h)
        )
        codes = torch.div(q_nope.float(), qs.unsqueeze(-1)).round_()
        query = codes.clamp_(INT8_MIN, INT8_MAX).to(torch.int8).view(b, 1, h, r)
        kwargs.update(
            dequant_scale_query=qs.reshape(b, 1, h).contiguous(),
            dequant_scale_key=k_scale,
            dequant_scale_value=k_scale,
        )
    else:
        for key in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
            kwargs.pop(key)
    out, _ = tnpu.npu_fused_infer_attention_score_v2(
        query,
        lat,
        lat,
        query_rope=q_rope.reshape(b, 1, h, -1),
        key_rope=_nz_heads_view(rope_cache, 1),
        block_table=block_table.to(torch.int32),
        actual_seq_kvlen=[int(n) for n in seq_lens.tolist()],
        **kwargs,
    )
    # NBSD [H, B, 1, R] -> [B, H, R]
    return out.permute(1, 2, 0, 3).reshape(b, h, r).to(q_nope.dtype)


# -- op-level registration -----------------------------------------------------------
def _register_npu_kernels(tnpu) -> bool:
    """Register ``npu`` kernels for the ``ascend_fa::*`` ops, so calling the op on NPU
    tensors reaches torch_npu. Needs torch's PrivateUse1 backend to be named ``npu``
    (``import torch_npu`` does that); otherwise nothing is registered."""
    if torch._C._get_privateuse1_backend_name() != "npu" or _STATE.get("registered"):
        return bool(_STATE.get("registered"))
    lib = torch.library

    def cache_kernel(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, layout
    ):
        npu_reshape_and_cache(
            tnpu,
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale,
            v_scale,
            layout,
        )

    def mla_cache_kernel(
        latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
    ):
        npu_reshape_and_cache_mla(
            tnpu, latent, rope, latent_cache, rope_cache, slot_mapping, k_scale, layout
        )

    def decode_kernel(
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
        info = check_paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            num_kv_heads=num_kv_heads,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            q_scale=q_scale,
            layout=layout,
        )
        return npu_paged_attention(
            tnpu,
            info,
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            k_scale,
            v_scale,
            q_scale,
        )

    def mla_decode_kernel(
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
        info = check_mla_attention(
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            scale=scale,
            k_scale=k_scale,
            q_scale=q_scale,
            layout=layout,
        )
        return npu_mla_paged_attention(
            tnpu,
            info,
            q_nope,
            q_rope,
            latent_cache,
            rope_cache,
            block_table,
            seq_lens,
            scale,
            k_scale,
            q_scale,
        )

    lib.register_kernel("ascend_fa::reshape_and_cache", "npu", cache_kernel)
    lib.register_kernel("ascend_fa::reshape_and_cache_mla", "npu", mla_cache_kernel)
    lib.register_kernel("ascend_fa::paged_attention", "npu", decode_kernel)
    lib.register_kernel("ascend_fa::mla_paged_attention", "npu", mla_decode_kernel)
    _STATE["registered"] = True
    return True
