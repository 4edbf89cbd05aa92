"""A RECORDING FAKE of ``torch_npu`` for tests. It is not torch_npu and runs no device
code.

What it does:

* exposes the five torch_npu functions the ``npu`` backend maps to
  (``npu_quantize``, ``npu_scatter_pa_kv_cache``, ``npu_fused_infer_attention_score``,
  ``_npu_paged_attention_quant``, ``npu_fused_infer_attention_score_v2``);
* records every call (:class:`Call`: function name plus each argument's name and
  shape/dtype or value) in :attr:`FakeTorchNPU.calls`;
* checks each call against the documented signature (torch_npu 2.x docs, as listed
  in the project's design notes): unknown or missing argument names, tensor ranks,
  dtypes, the NZ layouts and the scalar arguments; a violation raises
  :class:`FakeSignatureError` naming the argument;
* computes the result from the *dequantized* inputs with the golden references of
  :mod:`ascend_fa.atb_ops` (fp32), so a test can compare the backend's round trip
  with the CPU emulation.

How it is honest about the device: torch has no ``npu`` device without the real
torch_npu, so the tests exercise :class:`~ascend_fa.backends.npu.NPUBackend`'s
argument mapping with CPU tensors (through a subclass whose ``device_type`` is
``"cpu"``) while this fake stands in for ``sys.modules["torch_npu"]``. The op-level
``register_kernel("npu")`` path is only exercised in a subprocess, where
:func:`install` may rename torch's PrivateUse1 backend to ``"npu"`` the way the real
torch_npu does on import (that rename cannot be undone, hence the subprocess).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from ascend_fa.atb_ops.attention import gather_tokens_ref
from ascend_fa.atb_ops.constants import c0

__all__ = ["Call", "FakeSignatureError", "FakeTorchNPU", "install", "uninstall"]


class FakeSignatureError(AssertionError):
    """A call did not match the documented torch_npu signature."""


@dataclass
class Call:
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.args[key]


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return value


def _fail(fn: str, msg: str) -> None:
    raise FakeSignatureError(f"{fn}: {msg}")


def _tensor(
    fn: str,
    name: str,
    t: Any,
    dtypes: tuple[torch.dtype, ...],
    rank: int | tuple[int, ...],
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(fn, f"{name} must be a tensor, got {type(t).__name__}")
    ranks = (rank,) if isinstance(rank, int) else rank
    if t.dim() not in ranks:
        _fail(fn, f"{name} must have rank {ranks}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(fn, f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    return t


def _check_names(
    fn: str, kwargs: dict[str, Any], allowed: set[str], required: set[str] = frozenset()
) -> None:
    unknown = set(kwargs) - allowed
    if unknown:
        _fail(fn, f"unknown keyword argument(s) {sorted(unknown)}")
    missing = set(required) - set(kwargs)
    if missing:
        _fail(fn, f"missing keyword argument(s) {sorted(missing)}")


def _nz5(fn: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Paged NZ cache in the per-head form ``[NB, N, D // C0, BS, C0]``."""
    _tensor(fn, name, t, (dtype,), 5)
    if t.shape[-1] != c0(t.dtype):
        _fail(fn, f"{name} last dim must be C0 = {c0(t.dtype)}, got {tuple(t.shape)}")


def _seq_list(fn: str, name: str, value: Any, batch: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        _fail(
            fn, f"{name} must be a list of ints (SymInt[]), got {type(value).__name__}"
        )
    if len(value) != batch:
        _fail(fn, f"{name} has {len(value)} entries for batch {batch}")
    return value


def _nz4(cache5: torch.Tensor) -> torch.Tensor:
    nb, n, d1, bs, cols = cache5.shape
    return cache5.reshape(nb, n * d1, bs, cols)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` ``[H, D]`` fp32, ``k``/``v`` ``[L, H, D]`` fp32 (already expanded)."""
    s = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)


class FakeTorchNPU(types.ModuleType):
    """The fake module object installed as ``sys.modules["torch_npu"]``."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__file__ = __file__
        self.calls: list[Call] = []

    def _record(self, name: str, **args: Any) -> Call:
        call = Call(name, {k: _describe(v) for k, v in args.items()})
        self.calls.append(call)
        return call

    def calls_to(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # -- npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True) -------
    def npu_quantize(self, input, scales, zero_points, dtype, axis=1, div_mode=True):
        fn = "npu_quantize"
        self._record(
            fn,
            input=input,
            scales=scales,
            zero_points=zero_points,
            dtype=dtype,
            axis=axis,
            div_mode=div_mode,
        )
        _tensor(
            fn, "input", input, (torch.float16, torch.bfloat16, torch.float32), (2, 3)
        )
        _tensor(fn, "scales", scales, (torch.float32, torch.bfloat16), 1)
        if zero_points is not None:
            _fail(fn, "symmetric quantization passes zero_points=None")
        if dtype is not torch.qint8:
            _fail(fn, f"dtype must be torch.qint8, got {dtype}")
        if div_mode is not True:
            _fail(
                fn, "div_mode must be True (divide by the scale, as the contract says)"
            )
        if scales.shape[0] != input.shape[axis]:
            _fail(
                fn,
                f"scales has {scales.shape[0]} entries but input.shape[{axis}] = "
                f"{input.shape[axis]}",
            )
        shape = [1] * input.dim()
        shape[axis] = -1
        q = torch.round(input.float() / scales.float().view(shape))
        return q.clamp(-128, 127).to(torch.int8)

    # -- npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
    #                           *, cache_mode) --------------------------------------
    def npu_scatter_pa_kv_cache(
        self, key, value, key_cache, value_cache, slot_mapping, **kwargs
    ):
        fn = "npu_scatter_pa_kv_cache"
        self._record(
            fn,
            key=key,
            value=value,
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slot_mapping,
            **kwargs,
        )
        _check_names(
            fn,
            kwargs,
            {"cache_mode", "compress_lens", "compress_seq_offsets", "seq_lens"},
            {"cache_mode"},
        )
        mode = kwargs["cache_mode"]
        if mode not in ("PA_NZ", "Norm"):
            _fail(fn, f"cache_mode must be 'PA_NZ' or 'Norm', got {mode!r}")
        kinds = (torch.float16, torch.bfloat16, torch.int8)
        for name, x, cache in (("key", key, key_cache), ("value", value, value_cache)):
            _tensor(fn, name, x, kinds, 3)
            _tensor(fn, f"{name}_cache", cache, (x.dtype,), 4)
            t, n, d = x.shape
            if mode == "PA_NZ":
                cols = 32 // x.element_size()
                if (d * x.element_size()) % 32:
                    _fail(
                        fn, f"{name} head size {d} * itemsize must be a multiple of 32"
                    )
                if cache.shape[-1] != cols or cache.shape[1] * cols != n * d:
                    _fail(
                        fn,
                        f"{name}_cache must be [NB, N*D // {cols}, BS, {cols}], got "
                        f"{tuple(cache.shape)}",
                    )
            elif tuple(cache.shape[2:]) != (n, d):
                _fail(
                    fn,
                    f"{name}_cache must be [NB, BS, {n}, {d}], got "
                    f"{tuple(cache.shape)}",
                )
        _tensor(fn, "slot_mapping", slot_mapping, (torch.int32,), 1)
        if slot_mapping.shape[0] != key.shape[0]:
            _fail(fn, "slot_mapping must have one entry per token")
        layout = "nz" if mode == "PA_NZ" else "nd"
        torch.ops.ascend_fa.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, None, None, layout
        )

    # -- npu_fused_infer_attention_score(query, key, value, *, ...) ------------------
    _FIA_KWARGS = {
        "block_table",
        "actual_seq_lengths_kv",
        "num_heads",
        "num_key_value_heads",
        "input_layout",
        "scale",
        "block_size",
        "inner_precise",
        "key_antiquant_scale",
        "value_antiquant_scale",
        "key_antiquant_mode",
        "value_antiquant_mode",
    }

    def npu_fused_infer_attention_score(self, query, key, value, **kwargs):
        fn = "npu_fused_infer_attention_score"
        self._record(fn, query=query, key=key, value=value, **kwargs)
        _check_names(
            fn,
            kwargs,
            self._FIA_KWARGS,
            {
                "block_table",
                "actual_seq_lengths_kv",
                "num_heads",
                "num_key_value_heads",
                "input_layout",
                "scale",
                "block_size",
            },
        )
        if kwargs["input_layout"] != "BNSD":
            _fail(
                fn, f"input_layout must be 'BNSD' here, got {kwargs['input_layout']!r}"
            )
        _tensor(fn, "query", query, (torch.float16, torch.bfloat16), 4)
        b, n, s, d = query.shape
        if s != 1:
            _fail(fn, f"paged decode has S = 1, got query {tuple(query.shape)}")
        if kwargs["num_heads"] != n:
            _fail(fn, f"num_heads {kwargs['num_heads']} != query N {n}")
        hkv = kwargs["num_key_value_heads"]
        quant = "key_antiquant_scale" in kwargs
        cache_dtype = torch.int8 if quant else query.dtype
        for name, t in (("key", key), ("value", value)):
            _nz5(fn, name, t, cache_dtype)
            if t.shape[1] != hkv or t.shape[2] * t.shape[4] != d:
                _fail(
                    fn,
                    f"{name} must be [NB, {hkv}, {d} // C0, BS, C0], got "
                    f"{tuple(t.shape)}",
                )
            if t.shape[3] != kwargs["block_size"]:
                _fail(
                    fn, f"block_size {kwargs['block_size']} != {name} BS {t.shape[3]}"
                )
        bt = _tensor(fn, "block_table", kwargs["block_table"], (torch.int32,), 2)
        lens = _seq_list(
            fn, "actual_seq_lengths_kv", kwargs["actual_seq_lengths_kv"], b
        )
        if not isinstance(kwargs["scale"], float):
            _fail(fn, "scale must be a Python float")
        scales = []
        if quant:
            for name in ("key", "value"):
                sc = _tensor(
                    fn,
                    f"{name}_antiquant_scale",
                    kwargs[f"{name}_antiquant_scale"],
                    (torch.float32,),
                    3,
                )
                if tuple(sc.shape) != (hkv, 1, d):
                    _fail(
                        fn,
                        f"{name}_antiquant_scale must be per-channel [{hkv}, 1, {d}],"
                        f" got {tuple(sc.shape)}",
                    )
                if kwargs.get(f"{name}_antiquant_mode") != 0:
                    _fail(fn, f"{name}_antiquant_mode must be 0 (per-channel)")
                scales.append(sc.reshape(hkv, d).float())
        g = n // hkv
        out = torch.zeros(b, n, 1, d, dtype=torch.float32)
        for i in range(b):
            k = (
                gather_tokens_ref(_nz4(key), bt[i], lens[i], "nz")
                .float()
                .view(-1, hkv, d)
            )
            v = (
                gather_tokens_ref(_nz4(value), bt[i], lens[i], "nz")
                .float()
                .view(-1, hkv, d)
            )
            if quant:
                k, v = k * scales[0], v * scales[1]
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
            out[i, :, 0] = _attend(query[i, :, 0].float(), k, v, kwargs["scale"])
        return out.to(query.dtype), torch.empty(0)

    # -- _npu_paged_attention_quant (ATB), positional ---------------------------------
    def _npu_paged_attention_quant(
        self,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        num_heads,
        scale_value,
        block_table,
        context_lens,
        quant_type,
        outdatatype,
        qk_descale,
        v_descale,
        out,
    ):
        fn = "_npu_paged_attention_quant"
        self._record(
            fn,
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            num_kv_heads=num_kv_heads,
            num_heads=num_heads,
            scale_value=scale_value,
            block_table=block_table,
            context_lens=context_lens,
            quant_type=quant_type,
            outdatatype=outdatatype,
            qk_descale=qk_descale,
            v_descale=v_descale,
            out=out,
        )
        _tensor(fn, "query", query, (torch.int8,), 3)
        b, n, d = query.shape
        if num_heads != n:
            _fail(fn, f"num_heads {num_heads} != query heads {n}")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            _tensor(fn, name, t, (torch.int8,), 4)
            if tuple(t.shape[2:]) != (num_kv_heads, d):
                _fail(
                    fn,
                    f"{name} must be ND [NB, BS, {num_kv_heads}, {d}], got "
                    f"{tuple(t.shape)}",
                )
        bt = _tensor(fn, "block_table", block_table, (torch.int32,), 2)
        lens = _tensor(fn, "context_lens", context_lens, (torch.int32,), 1).tolist()
        if quant_type != 3:
            _fail(fn, f"quant_type must be 3 (int8 Q, K, V), got {quant_type}")
        codes = {1: torch.float16, 27: torch.bfloat16}
        if outdatatype not in codes:
            _fail(fn, f"outdatatype must be 1 (fp16) or 27 (bf16), got {outdatatype}")
        for name, t in (("qk_descale", qk_descale), ("v_descale", v_descale)):
            _tensor(fn, name, t, (torch.float32,), 1)
            if t.shape[0] != n:
                _fail(
                    fn, f"{name} must be [{n}] (per query head), got {tuple(t.shape)}"
                )
        _tensor(fn, "out", out, (codes[outdatatype],), 3)
        if tuple(out.shape) != (b, n, d):
            _fail(fn, f"out must be [{b}, {n}, {d}], got {tuple(out.shape)}")
        if not isinstance(scale_value, float):
            _fail(fn, "scale_value must be a Python float")
        g = n // num_kv_heads
        for i in range(b):
            k = gather_tokens_ref(key_cache, bt[i], lens[i], "nd").float()
            v = gather_tokens_ref(value_cache, bt[i], lens[i], "nd").float()
            k = k.view(-1, num_kv_heads, d).repeat_interleave(g, dim=1)
            v = v.view(-1, num_kv_heads, d).repeat_interleave(g, dim=1)
            # scores = (q_codes . k_codes) * qk_descale * scale; out = P . v * v_descale
            s = torch.einsum("hd,lhd->hl", query[i].float(), k)
            s = s * qk_descale.view(n, 1) * scale_value
            o = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)
            out[i] = (o * v_descale.view(n, 1)).to(out.dtype)

    # -- npu_fused_infer_attention_score_v2(query, key, value, *, ...) ---------------
    _FIA2_KWARGS = {
        "query_rope",
        "key_rope",
        "block_table",
        "actual_seq_kvlen",
        "num_query_heads",
        "num_key_value_heads",
        "softmax_scale",
        "input_layout",
        "block_size",
        "query_quant_mode",
        "key_quant_mode",
        "value_quant_mode",
        "dequant_scale_query",
        "dequant_scale_key",
        "dequant_scale_value",
    }

    def npu_fused_infer_attention_score_v2(self, query, key, value, **kwargs):
        fn = "npu_fused_infer_attention_score_v2"
        self._record(fn, query=query, key=key, value=value, **kwargs)
        _check_names(
            fn,
            kwargs,
            self._FIA2_KWARGS,
            {
                "query_rope",
                "key_rope",
                "block_table",
                "actual_seq_kvlen",
                "num_query_heads",
                "softmax_scale",
                "input_layout",
                "block_size",
            },
        )
        if kwargs["input_layout"] != "BSND_NBSD":
            _fail(
                fn, f"input_layout must be 'BSND_NBSD', got {kwargs['input_layout']!r}"
            )
        quant = "dequant_scale_query" in kwargs
        _tensor(fn, "query", query, (torch.int8,) if quant else (torch.bfloat16,), 4)
        b, s, n, r = query.shape
        if s != 1 or kwargs["num_query_heads"] != n:
            _fail(
                fn,
                f"query must be [B, 1, num_query_heads, R], got {tuple(query.shape)}",
            )
        if key is not value:
            _fail(fn, "MLA passes the same latent cache as key and value")
        _nz5(fn, "key", key, torch.int8 if quant else torch.bfloat16)
        if key.shape[1] != 1 or key.shape[2] * key.shape[4] != r:
            _fail(fn, f"key must be the one-head latent [NB, 1, {r} // C0, BS, C0]")
        qr = _tensor(fn, "query_rope", kwargs["query_rope"], (torch.bfloat16,), 4)
        kr = kwargs["key_rope"]
        _nz5(fn, "key_rope", kr, torch.bfloat16)
        if tuple(qr.shape[:3]) != (b, 1, n):
            _fail(fn, f"query_rope must be [B, 1, N, Dr], got {tuple(qr.shape)}")
        bt = _tensor(fn, "block_table", kwargs["block_table"], (torch.int32,), 2)
        lens = _seq_list(fn, "actual_seq_kvlen", kwargs["actual_seq_kvlen"], b)
        scale = kwargs["softmax_scale"]
        if not isinstance(scale, float):
            _fail(fn, "softmax_scale must be a Python float")
        if quant:
            if (
                kwargs.get("query_quant_mode"),
                kwargs.get("key_quant_mode"),
                kwargs.get("value_quant_mode"),
            ) != (3, 0, 0):
                _fail(fn, "FAKQuant needs query_quant_mode=3, key/value_quant_mode=0")
            qs = _tensor(
                fn,
                "dequant_scale_query",
                kwargs["dequant_scale_query"],
                (torch.float32,),
                3,
            )
            if tuple(qs.shape) != (b, 1, n):
                _fail(
                    fn, f"dequant_scale_query must be per token and head [{b}, 1, {n}]"
                )
            for name in ("dequant_scale_key", "dequant_scale_value"):
                t = _tensor(fn, name, kwargs[name], (torch.float32,), 1)
                if t.shape[0] != 1:
                    _fail(fn, f"{name} must be fa_k.scale [1]")
            q = query.float() * qs.unsqueeze(-1)
            kscale = float(kwargs["dequant_scale_key"][0])
        else:
            q, kscale = query.float(), 1.0
        out = torch.zeros(n, b, 1, r, dtype=torch.float32)
        for i in range(b):
            lat = gather_tokens_ref(_nz4(key), bt[i], lens[i], "nz").float() * kscale
            rope = gather_tokens_ref(_nz4(kr), bt[i], lens[i], "nz").float()
            sc = (q[i, 0] @ lat.T + qr[i, 0].float() @ rope.T) * scale
            out[:, i, 0] = torch.softmax(sc, dim=-1) @ lat
        return out.to(torch.bfloat16), torch.empty(0)


def install(*, rename_privateuse1: bool = False) -> FakeTorchNPU:
    """Put a fresh fake in ``sys.modules["torch_npu"]`` and reset the backend's cached
    import. ``rename_privateuse1`` (subprocess tests only) names torch's PrivateUse1
    backend ``"npu"`` as the real torch_npu does, so ``register_kernel("npu")`` works.
    """
    from ascend_fa.backends import npu as npu_backend

    fake = FakeTorchNPU()
    if rename_privateuse1:
        torch.utils.rename_privateuse1_backend("npu")
    sys.modules["torch_npu"] = fake
    npu_backend._reset_torch_npu_state()
    return fake


def uninstall() -> None:
    """Remove the fake and reset the backend's cached import."""
    from ascend_fa.backends import npu as npu_backend

    sys.modules.pop("torch_npu", None)
    npu_backend._reset_torch_npu_state()
