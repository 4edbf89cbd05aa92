"""The FAKE device ops: each checks the documented rules of its call, then writes
the bytes (or returns the values) the real op would. Not torch_npu; no device code.

Every check raises :class:`FakeRuleViolation` naming the capability table's rule id,
so a test can show that the counter-example of each rule is refused. The rules are
written here from the pages themselves (not read from the table): a wrong table row
is then caught by a disagreement. Numerics follow the pages and op-plugin's own
golden references (e.g. ``_npu_paged_attention_quant`` requantizes the softmax to
int8 with ``rowmax / 127``, as ``test_atb_paged_attention_quant.py`` does).

The ops use torch operations only, so they run on CPU tensors and on the tests'
fake NPU device tensors alike.
"""

from __future__ import annotations

import torch

__all__ = ["FakeRuleViolation", "OPS", "ENFORCED_RULES"]

#: Every table rule id (and route id) some fake op enforces.
ENFORCED_RULES = frozenset(
    {
        "npu.cache_dtype",
        "npu.fp8_kv",
        "npu.offsets",
        "route.cache_write.nz",
        "route.decode.int8_kv.nz",
        "route.mla_decode.nz",
        "fia.int8nz.query_dtype",
        "fia.int8nz.head_dim",
        "fia.int8nz.block_size",
        "fia.int8nz.heads",
        "fia.int8nz.antiquant_scale",
        "fia.int8nz.kv_layout",
        "fia.int8nz.inner_precise",
        "fia.pa.query_dtype",
        "fia.pa.dtypes_match",
        "fia.pa.block_size",
        "fia.pa.kv_width",
        "fia.pa.head_dim",
        "fia.pa.kv_layout",
        "fia.heads",
        "fia.group",
        "fia.inner_precise",
        "fia.paged_args",
        "atb.pa_quant.out_dtype",
        "atb.pa_quant.context_lens",
        "atb.pa_quant.args",
        "scatter.dtypes",
        "scatter.nz_shape",
        "scatter.cache_mode",
        "cache.slots",
        "atb.reshape_and_cache.nd",
        "cache.mla_no_mixed_dtypes",
        "quantize.args",
        "quantize.static.input_dtype",
        "quantize.mul_mode.scale_dtype",
        "quantize.mul_mode",
        "dynamic_quant.input_dtype",
        "dynamic_quant.args",
        "qmm.out_dtype",
        "qmm.k",
        "qmm.n",
        "qmm.deq_scale",
        "qmm.args",
        "fia2.mla.heads",
        "fia2.mla.latent_dim",
        "fia2.mla.rope_dim",
        "fia2.mla.block_size",
        "fia2.mla.query_dtype",
        "fia2.mla.float_dtype",
        "fia2.mla.quant_args",
        "fia2.mla.layout",
    }
)

INT8_NZ_HEAD_PAIRS = {(10, 1), (64, 8), (80, 8), (128, 16)}
QINT8_ENUM = 12  # c10::ScalarType::QInt8


class FakeRuleViolation(RuntimeError):
    """A call broke a documented rule (the real device would fail or compute
    garbage)."""


def _need(ok: bool, rule: str, release: str, message: str) -> None:
    if not ok:
        raise FakeRuleViolation(
            f"[{rule}] {message} (strict fake of torch_npu {release})"
        )


def _at_least(release: str, since: str) -> bool:
    order = ("7.1.0", "7.2.0", "7.3.0", "26.0.0")
    return order.index(release) >= order.index(since)


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.data_ptr() == b.data_ptr()
    except RuntimeError:  # fake-device tensors carry no storage of their own
        return False


def _check_slots(slots, n_tokens, num_slots, release, rule="cache.slots"):
    _need(
        slots.dtype in (torch.int32, torch.int64) and slots.dim() == 1,
        rule,
        release,
        f"slot_mapping must be 1-D int32/int64, got {slots.dtype} {tuple(slots.shape)}",
    )
    _need(slots.shape[0] == n_tokens, rule, release, "one slot per token")
    if n_tokens:
        lo, hi = int(slots.min()), int(slots.max())
        _need(
            lo >= 0 and hi < num_slots,
            rule,
            release,
            f"slots must lie in [0, {num_slots - 1}], got [{lo}, {hi}] (padding "
            "slots never reach the device)",
        )
        _need(
            torch.unique(slots).numel() == n_tokens,
            rule,
            release,
            "slots must not repeat",
        )


# -- npu_quantize -------------------------------------------------------------------
def npu_quantize(release: str, a: dict) -> torch.Tensor:
    x, scales, zero = a["self"], a["scales"], a["zero_points"]
    dtype, div = a["dtype"], a["div_mode"]
    if div:
        r = "quantize.args"
        _need(
            x.dtype in (torch.float16, torch.bfloat16, torch.float32),
            r,
            release,
            f"input must be float16/bfloat16/float32, got {x.dtype}",
        )
        _need(
            zero is None or (zero.dtype == torch.int32 and zero.shape == scales.shape),
            r,
            release,
            "divide mode: zero_points None or int32 of the scales' shape",
        )
        _need(
            dtype in (torch.qint8, QINT8_ENUM),
            r,
            release,
            f"dtype must be torch.qint8, got {dtype}",
        )
        _need(
            scales.dim() == 1 and scales.dtype in (torch.float32, torch.bfloat16),
            r,
            release,
            f"scales must be 1-D float32/bfloat16, got {scales.dtype} "
            f"{tuple(scales.shape)}",
        )
        axis = a["axis"] % x.dim()
        _need(
            scales.shape[0] == x.shape[axis],
            r,
            release,
            f"scales has {scales.shape[0]} entries for input.shape[{axis}] = "
            f"{x.shape[axis]}",
        )
        shape = [1] * x.dim()
        shape[axis] = -1
        q = torch.round(x.float() / scales.float().view(shape))
        if zero is not None:
            q = q + zero.float().view(shape)
        return q.clamp(-128, 127).to(torch.int8)
    _need(
        x.dtype in (torch.float16, torch.bfloat16, torch.float32),
        "quantize.static.input_dtype",
        release,
        f"input must be float16/bfloat16/float32, got {x.dtype}",
    )
    _need(
        scales.dtype == x.dtype and (zero is None or zero.dtype == scales.dtype),
        "quantize.mul_mode.scale_dtype",
        release,
        f"div_mode=False: scales ({scales.dtype}) and zero_points "
        f"({None if zero is None else zero.dtype}) must have the input's dtype "
        f"{x.dtype}",
    )
    r = "quantize.mul_mode"
    _need(
        dtype in (torch.qint8, QINT8_ENUM),
        r,
        release,
        f"dtype must be torch.qint8, got {dtype}",
    )
    _need(a["axis"] >= -2, r, release, f"axis must be >= -2, got {a['axis']}")
    axis = x.dim() - 2 if a["axis"] == -2 else x.dim() - 1
    _need(
        scales.dim() == 1 and scales.shape[0] in (1, x.shape[axis]),
        r,
        release,
        f"scales must be 1-D with 1 or {x.shape[axis]} entries, got "
        f"{tuple(scales.shape)}",
    )
    _need(
        zero is None or zero.shape == scales.shape,
        r,
        release,
        "zero_points must have the scales' shape",
    )
    shape = [1] * x.dim()
    shape[axis] = -1
    # the page's formula in float32: input * scales + zero_points, then rounded
    # to the nearest integer (ties to even) and saturated to int8
    q = x.float() * scales.float().view(shape)
    if zero is not None:
        q = q + zero.float().view(shape)
    return torch.round(q).clamp(-128, 127).to(torch.int8)


# -- W8A8 linears ----------------------------------------------------------------------
INT8_ENUM = 1  # c10::ScalarType::Char
OUT_ENUMS = {5: torch.float16, 15: torch.bfloat16, 1: torch.int8, 3: torch.int32}


def npu_dynamic_quant(release: str, a: dict):
    x = a["input"]
    _need(
        x.dtype in (torch.float16, torch.bfloat16),
        "dynamic_quant.input_dtype",
        release,
        f"x must be float16/bfloat16, got {x.dtype}",
    )
    r = "dynamic_quant.args"
    _need(x.dim() >= 2, r, release, f"x must be at least 2-D, got {x.dim()}-D")
    _need(
        a["smooth_scales"] is None and a["group_index"] is None,
        r,
        release,
        "no smooth_scales / group_index for a plain per-token quantize",
    )
    _need(
        a["dst_type"] in (None, torch.int8, INT8_ENUM),
        r,
        release,
        f"dst_type must be None or int8, got {a['dst_type']}",
    )
    _need(
        a.get("quant_mode", "pertoken") == "pertoken",
        r,
        release,
        f"quant_mode must be 'pertoken', got {a.get('quant_mode')!r}",
    )
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    y = torch.round(xf / scale.unsqueeze(-1)).clamp(-128, 127)
    # 0 / 0 on an all-zero row is undefined on the device: write codes that a
    # mapping relying on them would notice
    y = torch.where(scale.unsqueeze(-1) > 0, y, torch.full_like(y, 127.0))
    return y.to(torch.int8), scale


def _fp19(scale: torch.Tensor) -> torch.Tensor:
    """An int64 (npu_trans_quant_param) scale as the device reads it: the fp32
    pattern of the low 32 bits, keeping its top 19 bits."""
    low = scale.long() & 0xFFFFE000
    low = torch.where(low >= 2**31, low - 2**32, low)
    return low.to(torch.int32).view(torch.float32)


def npu_quant_matmul(release: str, a: dict) -> torch.Tensor:
    x1, x2, scale = a["x1"], a["x2"], a["scale"]
    pts, bias = a["pertoken_scale"], a["bias"]
    r = "qmm.args"
    _need(
        x1.dtype == torch.int8 and x2.dtype == torch.int8,
        r,
        release,
        f"x1 / x2 must be int8, got {x1.dtype}, {x2.dtype}",
    )
    _need(x1.dim() == 2 and x2.dim() == 2, r, release, "x1 [M, K] and x2 [K, N]")
    m, k = x1.shape
    _need(
        x2.shape[0] == k and x2.is_contiguous(),
        r,
        release,
        f"x2 must be a contiguous [K, N] = [{k}, N], got {tuple(x2.shape)}"
        + ("" if x2.is_contiguous() else " (non-contiguous)"),
    )
    n = x2.shape[1]
    _need(k <= 65535, "qmm.k", release, f"x1's last dim K = {k} > 65535")
    _need(n <= 65535, "qmm.n", release, f"x2's last dim N = {n} > 65535")
    out = a["output_dtype"]
    out = OUT_ENUMS.get(out, out) if isinstance(out, int) else out
    _need(
        out in (torch.float16, torch.bfloat16),
        "qmm.out_dtype",
        release,
        f"output_dtype must be float16 or bfloat16, got {out}",
    )
    _need(
        a["offset"] is None and a["group_sizes"] is None,
        r,
        release,
        "no offset / group_sizes",
    )
    _need(
        scale.dim() == 1 and scale.shape[0] in (1, n),
        r,
        release,
        f"scale must be 1-D [1] or [{n}], got {tuple(scale.shape)}",
    )
    acc = x1.long() @ x2.long()  # exact: the device's int32 accumulator
    if pts is None:
        _need(
            (scale.dtype, out)
            in (
                (torch.int64, torch.float16),
                (torch.float32, torch.float16),
                (torch.float32, torch.bfloat16),
            ),
            "qmm.deq_scale",
            release,
            f"scale {scale.dtype} with output {out} is not in the page's table",
        )
        _need(
            bias is None or (bias.dtype == torch.int32 and tuple(bias.shape) == (n,)),
            r,
            release,
            "static: bias must be int32 [N] or None",
        )
        if bias is not None:
            acc = acc + bias.long()
        s = _fp19(scale) if scale.dtype == torch.int64 else scale.float()
        # (x1 @ x2 + bias) * scale: the int32 sum in float32, times the scale
        return (acc.float() * s).to(out)
    _need(
        pts.dtype == torch.float32 and tuple(pts.shape) == (m,),
        r,
        release,
        f"pertoken_scale must be float32 [{m}], got {pts.dtype} {tuple(pts.shape)}",
    )
    _need(scale.dtype == torch.float32, r, release, "dynamic: float32 scale")
    _need(
        bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) == (n,)),
        r,
        release,
        "dynamic: bias must be float32 [N] or None",
    )
    y = acc.float() * scale.float()
    y = y * pts.unsqueeze(-1)
    if bias is not None:
        y = y + bias
    return y.to(out)


# -- cache writes ----------------------------------------------------------------------
def _write_nz(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    nb, n1, bs, cols = cache.shape
    blk = torch.div(slots.long(), bs, rounding_mode="floor")
    row = slots.long() - blk * bs
    cache[blk, :, row, :] = x.reshape(x.shape[0], n1, cols)


def _write_nd(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    nb, bs = cache.shape[:2]
    blk = torch.div(slots.long(), bs, rounding_mode="floor")
    row = slots.long() - blk * bs
    cache[blk, row] = x.reshape(x.shape[0], *cache.shape[2:])


def npu_scatter_pa_kv_cache(release: str, a: dict) -> None:
    _need(
        _at_least(release, "7.2.0"),
        "route.cache_write.nz",
        release,
        "npu_scatter_pa_kv_cache does not exist",
    )
    key, value, kc, vc = a["key"], a["value"], a["key_cache"], a["value_cache"]
    slots = a["slot_mapping"]
    _need(
        key.dtype == value.dtype == kc.dtype == vc.dtype,
        "scatter.dtypes",
        release,
        "key, value, key_cache and value_cache must share one dtype, got "
        f"{key.dtype}, {value.dtype}, {kc.dtype}, {vc.dtype}",
    )
    _need(
        a["compress_lens"] is None
        and a["seq_lens"] is None
        and a["compress_seq_offsets"] is None,
        "scatter.nz_shape",
        release,
        "the 3-D write takes no compress arguments",
    )
    mode = a.get("cache_mode", "PA_NZ")
    _need(
        mode in ("PA_NZ", "Norm", None),
        "scatter.cache_mode",
        release,
        f"cache_mode must be 'PA_NZ' or 'Norm', got {mode!r}",
    )
    nz = mode == "PA_NZ"
    r = "scatter.nz_shape"
    for t in (key, value, kc, vc, slots):
        _need(t.is_contiguous(), r, release, "inputs must be contiguous")
    _need(key.dim() == 3 and value.dim() == 3, r, release, "key/value are [T, N, D]")
    _need(kc.dim() == 4 and vc.dim() == 4, r, release, "caches are 4-D")
    _need(key.shape[:2] == value.shape[:2], r, release, "key/value share [T, N]")
    t, n = key.shape[:2]
    nb, bs = (kc.shape[0], kc.shape[2]) if nz else (kc.shape[0], kc.shape[1])
    for name, x, cache in (("key", key, kc), ("value", value, vc)):
        if nz:
            last = 32 // x.element_size()
            _need(
                cache.shape[-1] == last and cache.shape[1] * last == n * x.shape[2],
                r,
                release,
                f"{name}_cache must be [NB, N*D // {last}, BS, {last}], got "
                f"{tuple(cache.shape)} for {name} {tuple(x.shape)}",
            )
            _need((cache.shape[0], cache.shape[2]) == (nb, bs), r, release, "NB, BS")
        else:
            _need(
                tuple(cache.shape[2:]) == tuple(x.shape[1:])
                and tuple(cache.shape[:2]) == (nb, bs),
                r,
                release,
                f"{name}_cache must be ND [NB, BS, N, D], got {tuple(cache.shape)}",
            )
    _check_slots(slots, t, nb * bs, release)
    write = _write_nz if nz else _write_nd
    write(kc, key, slots)
    write(vc, value, slots)


def _npu_reshape_and_cache(release: str, a: dict) -> None:
    key, value, kc, vc = a["key"], a["value"], a["key_cache"], a["value_cache"]
    slots = a["slot_indices"]
    r = "atb.reshape_and_cache.nd"
    _need(
        key.dtype == value.dtype,
        "cache.mla_no_mixed_dtypes",
        release,
        f"key {key.dtype} and value {value.dtype} in one call",
    )
    _need(
        key.dtype == kc.dtype and value.dtype == vc.dtype,
        r,
        release,
        "key / key_cache and value / value_cache must agree in dtype",
    )
    _need(slots.dtype == torch.int32, r, release, "slot_indices must be int32")
    _need(key.dim() == 3 and value.dim() == 3, r, release, "key/value are [T, N, D]")
    for name, x, cache in (("key", key, kc), ("value", value, vc)):
        _need(
            cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(x.shape[1:]),
            r,
            release,
            f"{name}_cache must be ND [NB, BS, N, D], got {tuple(cache.shape)}",
        )
    nb, bs = kc.shape[:2]
    _check_slots(slots, key.shape[0], nb * bs, release)
    _write_nd(kc, key, slots)
    _write_nd(vc, value, slots)


# -- paged attention (v1) --------------------------------------------------------------
def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int, bs: int, fmt: str):
    """Token rows ``[n, W]`` of one sequence from a paged cache in ``fmt``."""
    pos = torch.arange(n, device=table_row.device)
    blk = table_row.long()[pos // bs]
    row = pos % bs
    if fmt == "nz5":  # [NB, N, D // C0, BS, C0]
        nb, heads, d1, _, cols = cache.shape
        return cache[blk, :, :, row, :].reshape(n, heads * d1 * cols)
    if fmt == "nd3":  # [NB, BS, H]
        return cache[blk, row, :]
    # nd4: [NB, N, BS, D]
    return cache[blk, :, row, :].reshape(n, -1)


def _attend(q, k, v, scale):
    """``q`` ``[N, D]``, ``k``/``v`` ``[L, N, D]`` fp32 (already expanded)."""
    s = torch.einsum("nd,lnd->nl", q, k) * scale
    return torch.einsum("nl,lnd->nd", torch.softmax(s, dim=-1), v)


def npu_fused_infer_attention_score(release: str, a: dict):
    query, key, value = a["query"], a["key"], a["value"]
    pa = "fia.paged_args"
    _need(a["input_layout"] == "BNSD", pa, release, "input_layout must be 'BNSD'")
    _need(query.dim() == 4 and query.shape[2] == 1, pa, release, "query [B, N, 1, D]")
    b, n, _, d = query.shape
    hkv = a["num_key_value_heads"] or n
    _need(a["num_heads"] == n, pa, release, f"num_heads {a['num_heads']} != N {n}")
    _need(n % hkv == 0, pa, release, "num_key_value_heads must divide num_heads")
    table, lens, bs = a["block_table"], a["actual_seq_lengths_kv"], a["block_size"]
    _need(
        table is not None
        and table.dtype == torch.int32
        and table.dim() == 2
        and table.shape[0] == b,
        pa,
        release,
        "block_table must be int32 [B, max_blocks]",
    )
    _need(
        isinstance(lens, (list, tuple)) and len(lens) == b,
        pa,
        release,
        "actual_seq_lengths_kv: one length per batch entry",
    )
    _need(
        max(lens) <= table.shape[1] * bs, pa, release, "block_table covers the lengths"
    )
    _need(key.shape == value.shape, pa, release, "key and value shapes must match")
    _need(
        key.dtype != torch.float8_e4m3fn,
        "npu.fp8_kv",
        release,
        "key / value are float16, bfloat16, int8 or int4: no float8_e4m3fn KV",
    )
    _need(
        key.dtype in (torch.float16, torch.bfloat16, torch.int8),
        "npu.cache_dtype",
        release,
        f"key / value must be float16, bfloat16 or int8, got {key.dtype}",
    )
    _need(n <= 256, "fia.heads", release, f"N = {n} > 256")
    _need(n // hkv <= 64, "fia.group", release, f"N / KV_N = {n // hkv} > 64")
    _need(
        a["inner_precise"] in (0, 1),
        "fia.inner_precise",
        release,
        f"Q_S = 1 takes inner_precise 0 or 1, got {a['inner_precise']}",
    )
    no_offsets = (
        a["key_antiquant_offset"] is None and a["value_antiquant_offset"] is None
    )
    _need(no_offsets and a["antiquant_offset"] is None, "npu.offsets", release,
          "antiquant offsets are not supported")  # fmt: skip
    if key.dtype == torch.int8:
        _need(
            _at_least(release, "7.2.0"),
            "route.decode.int8_kv.nz",
            release,
            "NZ int8 KV decode is not documented",
        )
        r = "fia.int8nz.kv_layout"
        _need(
            key.dim() == 5 and key.shape[-1] == 32 and key.shape[1] == hkv,
            r,
            release,
            f"int8 key must be NZ [NB, {hkv}, D // 32, BS, 32], got {tuple(key.shape)}",
        )
        _need(key.shape[2] * 32 == d, r, release, f"key D must equal query D {d}")
        _need(
            query.dtype == torch.bfloat16,
            "fia.int8nz.query_dtype",
            release,
            f"query must be bfloat16, got {query.dtype}",
        )
        _need(d == 128, "fia.int8nz.head_dim", release, f"D must be 128, got {d}")
        _need(
            key.shape[3] in (128, 512) and key.shape[3] == bs,
            "fia.int8nz.block_size",
            release,
            f"block size must be 128 or 512 (and block_size), got {key.shape[3]}",
        )
        _need(
            (n, hkv) in INT8_NZ_HEAD_PAIRS,
            "fia.int8nz.heads",
            release,
            f"(num_heads, num_key_value_heads) = ({n}, {hkv}) is not one of "
            f"{sorted(INT8_NZ_HEAD_PAIRS)}",
        )
        r = "fia.int8nz.antiquant_scale"
        scales = []
        for name in ("key", "value"):
            s = a[f"{name}_antiquant_scale"]
            _need(s is not None, r, release, f"{name}_antiquant_scale is required")
            _need(
                s.dtype == torch.bfloat16 and s.is_contiguous(),
                r,
                release,
                f"{name}_antiquant_scale must be contiguous bfloat16, got {s.dtype}"
                + ("" if s.is_contiguous() else " (non-contiguous)"),
            )
            _need(
                tuple(s.shape) == (hkv, 1, d),
                r,
                release,
                f"{name}_antiquant_scale must be [{hkv}, 1, {d}], got {tuple(s.shape)}",
            )
            _need(
                a[f"{name}_antiquant_mode"] == 0,
                r,
                release,
                f"{name}_antiquant_mode must be 0 (per-channel)",
            )
            scales.append(s.float().reshape(hkv, d))
        _need(
            a["inner_precise"] == 1,
            "fia.int8nz.inner_precise",
            release,
            "int8 NZ supports only inner_precise = 1 (high performance)",
        )
        fmt = "nz5"
    else:
        _need(
            a["key_antiquant_scale"] is None and a["antiquant_scale"] is None,
            "fia.pa.kv_layout",
            release,
            "float KV takes no antiquant scales",
        )
        _need(
            query.dtype in (torch.float16, torch.bfloat16),
            "fia.pa.query_dtype",
            release,
            f"query must be float16/bfloat16, got {query.dtype}",
        )
        _need(
            key.dtype == query.dtype,
            "fia.pa.dtypes_match",
            release,
            f"key {key.dtype} must match query {query.dtype}",
        )
        r = "fia.pa.kv_layout"
        if key.dim() == 3:
            fmt, kv_bs, width = "nd3", key.shape[1], key.shape[2]
        elif key.dim() == 4:
            fmt, kv_bs, width = "nd4", key.shape[2], key.shape[1] * key.shape[3]
        else:
            fmt, kv_bs, width = "", 0, 0
        _need(
            fmt != "",
            r,
            release,
            f"float paged KV must be ND [NB, BS, H] or [NB, KV_N, BS, D], got "
            f"{tuple(key.shape)} (float NZ is not a documented configuration)",
        )
        _need(width == hkv * d and kv_bs == bs, r, release, "KV shape vs heads / BS")
        hi = 512 if _at_least(release, "7.2.0") else None
        _need(
            bs % 16 == 0 and (hi is None or bs <= hi),
            "fia.pa.block_size",
            release,
            f"block_size must be 16-aligned{' and <= 512' if hi else ''}, got {bs}",
        )
        _need(
            fmt != "nd3" or width <= 65535,
            "fia.pa.kv_width",
            release,
            f"[NB, BS, H] with H = {width} > 65535",
        )
        _need(d <= 512, "fia.pa.head_dim", release, f"D = {d} > 512")
        scales = None
    g = n // hkv
    out = torch.zeros(b, n, 1, d, dtype=torch.float32, device=query.device)
    for i in range(b):
        k = _gather(key, table[i], lens[i], bs, fmt).float().view(-1, hkv, d)
        v = _gather(value, table[i], lens[i], bs, fmt).float().view(-1, hkv, d)
        if scales is not None:
            k, v = k * scales[0], v * scales[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out[i, :, 0] = _attend(query[i, :, 0].float(), k, v, float(a["scale"]))
    lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out.to(query.dtype), lse


# -- FAQuant through ATB ---------------------------------------------------------------
def _npu_paged_attention_quant(release: str, a: dict) -> None:
    q, kc, vc, out = a["query"], a["key_cache"], a["value_cache"], a["out"]
    n, hkv = a["num_heads"], a["num_kv_heads"]
    r = "atb.pa_quant.args"
    _need(
        q.dtype == torch.int8 and q.dim() == 3 and q.shape[1] == n,
        r,
        release,
        f"query must be int8 [T, {n}, D], got {q.dtype} {tuple(q.shape)}",
    )
    t, _, d = q.shape
    for name, c in (("key_cache", kc), ("value_cache", vc)):
        _need(
            c.dtype == torch.int8 and c.dim() == 4 and tuple(c.shape[2:]) == (hkv, d),
            r,
            release,
            f"{name} must be int8 ND [NB, BS, {hkv}, {d}], got {c.dtype} "
            f"{tuple(c.shape)}",
        )
    table = a["block_table"]
    _need(
        table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == t,
        r,
        release,
        "block_table must be int32 [T, max_blocks]",
    )
    _need(a["quant_type"] == 3, r, release, "quant_type must be 3 (int8 Q, K, V)")
    codes = {1: torch.float16, 27: torch.bfloat16}
    _need(
        a["outdata_type"] in codes,
        "atb.pa_quant.out_dtype",
        release,
        f"outdata_type must be 1 (fp16) or 27 (bf16), got {a['outdata_type']}",
    )
    _need(
        out.dtype == codes[a["outdata_type"]] and tuple(out.shape) == (t, n, d),
        r,
        release,
        f"out must be {codes[a['outdata_type']]} [{t}, {n}, {d}]",
    )
    for name in ("k_descale", "v_descale"):
        s = a[name]
        _need(
            s.dtype == torch.float32 and tuple(s.shape) == (n,),
            r,
            release,
            f"{name} must be float32 [{n}] (per query head)",
        )
    lens_t = a["context_lens"]
    _need(
        lens_t.dtype == torch.int32 and lens_t.dim() == 1 and lens_t.shape[0] == t,
        "atb.pa_quant.context_lens",
        release,
        f"context_lens must be int32 [{t}], got {lens_t.dtype} {tuple(lens_t.shape)}",
    )
    _need(
        _is_host(lens_t),
        "atb.pa_quant.context_lens",
        release,
        f"context_lens must be a host tensor, got one on {lens_t.device}",
    )
    lens = [int(x) for x in lens_t.cpu().tolist()]
    bs = kc.shape[1]
    g = n // hkv
    kd, vd = a["k_descale"].float(), a["v_descale"].float()
    for i in range(t):
        k = _gather(kc, table[i], lens[i], bs, "nd3").float().view(-1, hkv, d)
        v = _gather(vc, table[i], lens[i], bs, "nd3").float().view(-1, hkv, d)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("nd,lnd->nl", q[i].float(), k) * kd.view(n, 1)
        s = s * float(a["scale_value"])
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        row_sum = p.sum(dim=-1, keepdim=True)
        # op-plugin's golden: the probabilities are requantized to int8 with
        # rowmax(p) / 127 (rowmax is 1 after the max subtraction), rounding in fp16
        p_q = torch.round((p * 127.0).to(torch.float16).float())
        o = torch.einsum("nl,lnd->nd", p_q, v) * vd.view(n, 1) / 127.0 / row_sum
        out[i] = o.to(out.dtype)


# -- MLA through the v2 fused attention ------------------------------------------------
def npu_fused_infer_attention_score_v2(release: str, a: dict):
    _need(
        _at_least(release, "7.2.0"),
        "route.mla_decode.nz",
        release,
        "npu_fused_infer_attention_score_v2 does not exist",
    )
    query, key, value = a["query"], a["key"], a["value"]
    qr, kr = a["query_rope"], a["key_rope"]
    lay = "fia2.mla.layout"
    _need(a["input_layout"] == "BSND_NBSD", lay, release, "input_layout 'BSND_NBSD'")
    _need(qr is not None and kr is not None, lay, release, "MLA needs query/key rope")
    _need(query.dim() == 4 and query.shape[1] == 1, lay, release, "query [B, 1, N, R]")
    b, _, n, r = query.shape
    _need(
        tuple(qr.shape[:3]) == (b, 1, n) and qr.dim() == 4,
        lay,
        release,
        f"query_rope must be [B, 1, N, Dr], got {tuple(qr.shape)}",
    )
    dr = qr.shape[3]
    _need(
        key is value or (key.shape == value.shape and _same_storage(key, value)),
        lay,
        release,
        "key and value are the same latent cache",
    )
    cols = 32 // key.element_size()
    _need(
        key.dim() == 5 and key.shape[1] == 1 and key.shape[4] == cols,
        lay,
        release,
        f"key must be the one-head NZ latent [NB, 1, R // {cols}, BS, {cols}], got "
        f"{tuple(key.shape)}",
    )
    _need(key.shape[2] * cols == r, lay, release, "latent width must equal query R")
    bs = a["block_size"]
    _need(key.shape[3] == bs, lay, release, "key block size == block_size")
    rcols = 32 // kr.element_size()
    _need(
        kr.dim() == 5
        and tuple(kr.shape[:2]) == (key.shape[0], 1)
        and kr.shape[3] == bs
        and kr.shape[4] == rcols
        and kr.shape[2] * rcols == dr,
        lay,
        release,
        f"key_rope must be NZ [NB, 1, Dr // {rcols}, BS, {rcols}], got "
        f"{tuple(kr.shape)}",
    )
    _need(a["num_query_heads"] == n, lay, release, "num_query_heads == N")
    _need(a["num_key_value_heads"] in (0, 1), lay, release, "one latent KV head")
    table, lens = a["block_table"], a["actual_seq_kvlen"]
    _need(
        table is not None and table.dtype == torch.int32 and table.shape[0] == b,
        lay,
        release,
        "block_table must be int32 [B, max_blocks]",
    )
    _need(
        isinstance(lens, (list, tuple)) and len(lens) == b,
        lay,
        release,
        "actual_seq_kvlen: one length per batch entry",
    )
    _need(
        n > 0 and n <= 128 and n & (n - 1) == 0,
        "fia2.mla.heads",
        release,
        f"query heads N = {n} must be a power of two <= 128",
    )
    _need(r == 512, "fia2.mla.latent_dim", release, f"R must be 512, got {r}")
    _need(dr == 64, "fia2.mla.rope_dim", release, f"Dr must be 64, got {dr}")
    if release == "7.2.0":
        _need(bs == 128, "fia2.mla.block_size", release, f"NZ needs BS 128, got {bs}")
    else:
        _need(
            bs % 16 == 0 and bs <= 1024,
            "fia2.mla.block_size",
            release,
            f"block_size must be 16-aligned and <= 1024, got {bs}",
        )
    qa = "fia2.mla.quant_args"
    no_offsets = a["dequant_offset_key"] is None and a["dequant_offset_value"] is None
    _need(no_offsets, qa, release, "no dequant offsets")
    if query.dtype == torch.int8:
        _need(
            qr.dtype == torch.bfloat16 and kr.dtype == torch.bfloat16,
            "fia2.mla.query_dtype",
            release,
            f"FAKQuant takes bfloat16 query_rope / key_rope, got {qr.dtype}, "
            f"{kr.dtype}",
        )
        _need(key.dtype == torch.int8, qa, release, "int8 query needs an int8 latent")
        _need(
            (a["query_quant_mode"], a["key_quant_mode"], a["value_quant_mode"])
            == (3, 0, 0),
            qa,
            release,
            "query_quant_mode 3, key/value_quant_mode 0",
        )
        qs = a["dequant_scale_query"]
        _need(
            qs is not None
            and qs.dtype == torch.float32
            and tuple(qs.shape) == (b, 1, n),
            qa,
            release,
            f"dequant_scale_query must be float32 [{b}, 1, {n}]",
        )
        for name in ("dequant_scale_key", "dequant_scale_value"):
            s = a[name]
            _need(
                s is not None and s.dtype == torch.float32 and s.numel() == 1,
                qa,
                release,
                f"{name} must be a float32 per-tensor scale",
            )
        q = query.float() * qs.float().unsqueeze(-1)
        kscale = float(a["dequant_scale_key"].reshape(-1)[0])
    else:
        _need(
            query.dtype in (torch.float16, torch.bfloat16)
            and qr.dtype == query.dtype
            and key.dtype == query.dtype,
            "fia2.mla.float_dtype",
            release,
            f"query, query_rope and the latent share a float16/bfloat16 dtype, got "
            f"{query.dtype}, {qr.dtype}, {key.dtype}",
        )
        _need(
            a["dequant_scale_query"] is None and a["dequant_scale_key"] is None,
            qa,
            release,
            "a float MLA call takes no dequant scales",
        )
        q, kscale = query.float(), 1.0
    scale = float(a["softmax_scale"])
    out = torch.zeros(n, b, 1, r, dtype=torch.float32, device=query.device)
    for i in range(b):
        lat = _gather(key, table[i], lens[i], bs, "nz5").float() * kscale
        rope = _gather(kr, table[i], lens[i], bs, "nz5").float()
        s = (q[i, 0] @ lat.T + qr[i, 0].float() @ rope.T) * scale
        out[:, i, 0] = torch.softmax(s, dim=-1) @ lat
    lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out.to(qr.dtype), lse


OPS = {
    "npu_quantize": npu_quantize,
    "npu_scatter_pa_kv_cache": npu_scatter_pa_kv_cache,
    "_npu_reshape_and_cache": _npu_reshape_and_cache,
    "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
    "_npu_paged_attention_quant": _npu_paged_attention_quant,
    "npu_fused_infer_attention_score_v2": npu_fused_infer_attention_score_v2,
    "npu_dynamic_quant": npu_dynamic_quant,
    "npu_quant_matmul": npu_quant_matmul,
}
