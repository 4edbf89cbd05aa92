"""Shapes and data for driving the NPU mapping (shared by the in-process tests and
the fake-device subprocess driver). Sizes fit the documented device rules: GQA
int8 NZ decode with (H, Hkv) = (10, 1), D = 128, BS = 128; MLA with H = 16,
R = 512, Dr = 64, BS = 128."""

from __future__ import annotations

import math

import torch
from ascend_fa.atb_ops import nz_cache_shape, per_head_qparams
from ascend_fa.atb_ops.attention import (
    mla_paged_attention_ref,
    paged_attention_ref,
)

__all__ = ["DEVICE_FLOOR", "amax_scale", "budget_ok", "gqa_case", "mla_case", "paging"]

#: Error floor for device kernels (they requantize probabilities, take bf16 scales).
DEVICE_FLOOR = 2e-2


def amax_scale(x: torch.Tensor, axis: int) -> torch.Tensor:
    dims = [i for i in range(x.dim()) if i != axis]
    amax = x.float().abs().amax(dim=dims)
    return per_head_qparams(-amax, amax)[0]


def paging(gen: torch.Generator, lens: list[int], bs: int):
    """Block table, slots (one padding slot -1 inserted) and NB for ``lens``."""
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 1
    order = torch.randperm(nb, generator=gen).tolist()
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per[b]]
        pos += per[b]
        table[b, : per[b]] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    slots.insert(3, -1)  # a padding token: never written, never sent to the device
    return table, torch.tensor(slots, dtype=torch.int32), nb


def gqa_case(seed: int = 0, *, h=10, hkv=1, d=128, bs=128, lens=(20, 150)):
    gen = torch.Generator().manual_seed(seed)
    table, slots, nb = paging(gen, list(lens), bs)
    t = slots.numel()
    key = torch.randn(t, hkv, d, generator=gen).bfloat16()
    value = torch.randn(t, hkv, d, generator=gen).bfloat16()
    query = torch.randn(len(lens), h, d, generator=gen).bfloat16()
    return dict(
        h=h, hkv=hkv, d=d, bs=bs, nb=nb, table=table, slots=slots,
        seq_lens=torch.tensor(lens, dtype=torch.int32), key=key, value=value,
        query=query, ks=amax_scale(key, 1), vs=amax_scale(value, 1),
        qs=amax_scale(query, 1), scale=1 / math.sqrt(d),
    )  # fmt: skip


def gqa_cache_shape(case: dict, dtype: torch.dtype, layout: str):
    if layout == "nz":
        return nz_cache_shape(case["nb"], case["bs"], case["hkv"], case["d"], dtype)
    return (case["nb"], case["bs"], case["hkv"], case["d"])


def mla_case(seed: int = 0, *, h=16, r=512, dr=64, bs=128, lens=(30, 140)):
    gen = torch.Generator().manual_seed(seed)
    table, slots, nb = paging(gen, list(lens), bs)
    t = slots.numel()
    latent = torch.randn(t, r, generator=gen).bfloat16()
    rope = torch.randn(t, dr, generator=gen).bfloat16()
    qn = torch.randn(len(lens), h, r, generator=gen).bfloat16()
    qr = torch.randn(len(lens), h, dr, generator=gen).bfloat16()
    return dict(
        h=h, r=r, dr=dr, bs=bs, nb=nb, table=table, slots=slots,
        seq_lens=torch.tensor(lens, dtype=torch.int32), latent=latent, rope=rope,
        qn=qn, qr=qr, ks=amax_scale(latent.unsqueeze(1), 1), qs=amax_scale(qn, 1),
        scale=1 / math.sqrt(r + dr),
    )  # fmt: skip


def mla_cache_shapes(case: dict, quantized: bool, layout: str = "nz"):
    ldt = torch.int8 if quantized else torch.bfloat16
    if layout == "nz":
        return (
            (nz_cache_shape(case["nb"], case["bs"], 1, case["r"], ldt), ldt),
            (nz_cache_shape(case["nb"], case["bs"], 1, case["dr"], torch.bfloat16),
             torch.bfloat16),
        )  # fmt: skip
    return (
        ((case["nb"], case["bs"], 1, case["r"]), ldt),
        ((case["nb"], case["bs"], 1, case["dr"]), torch.bfloat16),
    )


def budget_ok(out, ref_fn, args, kw, floor=DEVICE_FLOOR) -> tuple[bool, float, float]:
    """``(ok, err, allowed)``: max error of ``out`` against the float64 reference
    within twice the plain-bf16 error plus ``floor``."""
    ref = ref_fn(*args, **kw)
    plain = ref_fn(*args, **kw, compute_dtype=torch.bfloat16)
    err = float((out.detach().cpu().double() - ref).abs().max())
    allowed = 2 * float((plain.double() - ref).abs().max()) + floor
    return err <= allowed, err, allowed


REFS = {"gqa": paged_attention_ref, "mla": mla_paged_attention_ref}
