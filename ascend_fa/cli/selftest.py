"""``ascend-fa selftest [--backend NAME]``: run every cache/attention op on a backend
and compare it with the CPU golden references.

* cache writes (float, int8-KV NZ, int8 ND, MLA latent + rope): codes must be
  bit-exact against the per-token loops of :mod:`ascend_fa.atb_ops.cache`;
* attention (decode and prefill; float, int8-KV, FAQuant, MLA FAKQuant with dynamic
  and static query scales): max abs error against a float64 computation from the
  dequantized cache (and dequantized query codes) must stay within
  ``2 x`` the error of the same computation done plainly in the query dtype, plus a
  floor: ``1e-3`` for the emulation backends, ``2e-2`` for device backends, whose
  kernels requantize the softmax probabilities to int8 internally.

Sizes are chosen to fit the NPU kernels (bf16, D = 128, BS = 128, R = 512, Dr = 64);
a case the backend refuses is reported as SKIP with its reasons. On ``cpu`` this
compares the default op kernels with the naive references. Exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

COMMAND = "selftest"
HELP = "run every cache/attention op on a backend and compare with the CPU reference"

__all__ = ["COMMAND", "HELP", "add_arguments", "run", "run_selftest"]

EMULATION_FLOOR = 1e-3
DEVICE_FLOOR = 2e-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default=None, help="backend name (default: the selected backend)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


class _Skip(Exception):
    pass


def _cases(backend, seed: int) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
    import torch

    from ascend_fa import attention as api
    from ascend_fa.atb_ops import attention as ref_attn
    from ascend_fa.atb_ops import cache as ref_cache
    from ascend_fa.atb_ops import nz_cache_shape, per_head_qparams

    dev = backend.device
    gen = torch.Generator().manual_seed(seed)
    reference = backend.name in ("cpu", "cuda")
    floor = EMULATION_FLOOR if reference else DEVICE_FLOOR
    hkv, h, d, bs, r, dr = 2, 8, 128, 128, 512, 64
    lens = [40, 150]
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 1
    order = torch.randperm(nb, generator=gen).tolist()
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    slots_l, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per[b]]
        pos += per[b]
        table[b, : per[b]] = torch.tensor(blocks, dtype=torch.int32)
        slots_l += [blocks[t // bs] * bs + t % bs for t in range(n)]
    slots = torch.tensor(slots_l, dtype=torch.int32)
    slots[5] = -1  # a padding token
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    t_all = slots.numel()
    bf16 = torch.bfloat16
    key = torch.randn(t_all, hkv, d, generator=gen).to(bf16)
    value = torch.randn(t_all, hkv, d, generator=gen).to(bf16)
    latent = torch.randn(t_all, r, generator=gen).to(bf16)
    rope = torch.randn(t_all, dr, generator=gen).to(bf16)

    def qparams(x: torch.Tensor, axis: int) -> torch.Tensor:
        dims = [i for i in range(x.dim()) if i != axis]
        amax = x.float().abs().amax(dim=dims)
        return per_head_qparams(-amax, amax)[0]

    ks, vs = qparams(key, 1), qparams(value, 1)
    lat_scale = qparams(latent.unsqueeze(1), 1)
    q_dec = torch.randn(2, h, d, generator=gen).to(bf16)
    q_pre = torch.randn(2, 4, h, d, generator=gen).to(bf16)
    qn = torch.randn(2, h, r, generator=gen).to(bf16)
    qr = torch.randn(2, h, dr, generator=gen).to(bf16)
    qn_scale = qparams(qn, 1)

    def on(x):
        return None if x is None else x.to(dev)

    def call(fn, *args, **kw):
        try:
            return fn(
                *[on(a) if isinstance(a, torch.Tensor) else a for a in args],
                **{
                    k: on(v) if isinstance(v, torch.Tensor) else v
                    for k, v in kw.items()
                },
                backend=backend,
            )
        except ValueError as exc:
            if str(exc).startswith(f"backend {backend.name!r} cannot run"):
                raise _Skip(" ".join(str(exc).split("\n")[1:]).strip()) from exc
            raise

    memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def gqa_caches(dtype, layout, scales):
        # golden caches from the per-token loops (memoized: they are slow by design)
        tag = ("gqa", dtype, layout, scales[0] is not None)
        if tag in memo:
            return memo[tag]
        shape = (
            nz_cache_shape(nb, bs, hkv, d, dtype)
            if layout == "nz"
            else (nb, bs, hkv, d)
        )
        kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        ref_cache.reshape_and_cache_ref(key, value, kc, vc, slots, *scales, layout)
        memo[tag] = kc, vc
        return kc, vc

    def mla_caches(quantized, layout="nz"):
        tag = ("mla", quantized, layout)
        if tag in memo:
            return memo[tag]
        ldt = torch.int8 if quantized else bf16
        lc = torch.zeros(nz_cache_shape(nb, bs, 1, r, ldt), dtype=ldt)
        rc = torch.zeros(nz_cache_shape(nb, bs, 1, dr, bf16), dtype=bf16)
        ref_cache.reshape_and_cache_mla_ref(
            latent, rope, lc, rc, slots, lat_scale if quantized else None, layout
        )
        memo[tag] = lc, rc
        return lc, rc

    def cache_case(dtype, layout, quantized):
        def go():
            scales = (ks, vs) if quantized else (None, None)
            want_k, want_v = gqa_caches(dtype, layout, scales)
            got_k = torch.zeros_like(want_k, device=dev)
            got_v = torch.zeros_like(want_v, device=dev)
            call(
                api.reshape_and_cache,
                key,
                value,
                got_k,
                got_v,
                slots,
                k_scale=scales[0],
                v_scale=scales[1],
                layout=layout,
            )
            ok = torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
            return ok, "bit-exact" if ok else "codes differ"

        return go

    def mla_cache_case():
        want_l, want_r = mla_caches(True)
        got_l = torch.zeros_like(want_l, device=dev)
        got_r = torch.zeros_like(want_r, device=dev)
        call(
            api.reshape_and_cache_mla,
            latent,
            rope,
            got_l,
            got_r,
            slots,
            k_scale=lat_scale,
        )
        ok = torch.equal(got_l.cpu(), want_l) and torch.equal(got_r.cpu(), want_r)
        return ok, "bit-exact" if ok else "codes differ"

    def budget(out, ref_fn, args, kw):
        ref = ref_fn(*args, **kw)
        plain = ref_fn(*args, **kw, compute_dtype=bf16)
        err = float((out.cpu().double() - ref).abs().max())
        allowed = 2 * float((plain.double() - ref).abs().max()) + floor
        return err <= allowed, f"max err {err:.2e} <= {allowed:.2e}"

    def gqa_case(mode, prefill=False):
        def go():
            layout = backend.preferred_layout(mode) if mode != "float" else "nz"
            quant = mode != "float"
            dtype = torch.int8 if quant else bf16
            kc, vc = gqa_caches(dtype, layout, (ks, vs) if quant else (None, None))
            query = q_pre if prefill else q_dec
            kw = dict(
                num_kv_heads=hkv,
                scale=1 / math.sqrt(d),
                k_scale=ks if quant else None,
                v_scale=vs if quant else None,
                q_scale=(
                    qparams(query, query.dim() - 2) if mode == "faquant" else None
                ),
                layout=layout,
            )
            args = (query, kc, vc, table, seq_lens)
            fn = api.prefill_attention if prefill else api.paged_attention
            out = call(fn, *args, **kw)
            ref_fn = (
                ref_attn.prefill_attention_ref
                if prefill
                else ref_attn.paged_attention_ref
            )
            return budget(out, ref_fn, args, kw)

        return go

    def mla_case(q_mode, prefill=False):
        def go():
            lc, rc = mla_caches(True)
            qs = qn_scale if q_mode == "static" else None
            q1, q2 = (qn.unsqueeze(1), qr.unsqueeze(1)) if prefill else (qn, qr)
            args = (q1, q2, lc, rc, table, seq_lens)
            kw = dict(scale=1 / math.sqrt(r + dr), k_scale=lat_scale, q_scale=qs)
            fn = api.mla_prefill_attention if prefill else api.mla_paged_attention
            out = call(fn, *args, **kw)
            ref_fn = (
                ref_attn.mla_prefill_attention_ref
                if prefill
                else ref_attn.mla_paged_attention_ref
            )
            return budget(out, ref_fn, args, kw)

        return go

    return [
        ("reshape_and_cache bf16 nz", cache_case(bf16, "nz", False)),
        ("reshape_and_cache int8 nz", cache_case(torch.int8, "nz", True)),
        ("reshape_and_cache int8 nd", cache_case(torch.int8, "nd", True)),
        ("reshape_and_cache_mla int8", mla_cache_case),
        ("paged_attention float", gqa_case("float")),
        ("paged_attention int8_kv", gqa_case("int8_kv")),
        ("paged_attention faquant", gqa_case("faquant")),
        ("prefill_attention int8_kv", gqa_case("int8_kv", prefill=True)),
        ("prefill_attention faquant", gqa_case("faquant", prefill=True)),
        ("mla_paged_attention dynamic-q", mla_case("dynamic")),
        ("mla_paged_attention static-q", mla_case("static")),
        ("mla_prefill_attention", mla_case("dynamic", prefill=True)),
    ]


def run_selftest(backend=None, seed: int = 0) -> list[dict]:
    """Run every case on ``backend`` (a name, a Backend, or None for the selected
    one); returns rows ``{"op", "status", "detail", "seconds"}``."""
    from ascend_fa.backends import Backend, get_backend

    if not isinstance(backend, Backend):
        backend = get_backend(backend)
    rows = []
    for name, case in _cases(backend, seed):
        start = time.perf_counter()
        try:
            ok, detail = case()
            status = "PASS" if ok else "FAIL"
        except _Skip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # a crash is a failure, reported with its message
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}".split("\n")[0]
        rows.append(
            {
                "op": name,
                "status": status,
                "detail": detail,
                "seconds": time.perf_counter() - start,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from ascend_fa.backends import get_backend
    from ascend_fa.benchmarks._util import print_table

    backend = get_backend(args.backend)
    rows = run_selftest(backend, args.seed)
    print_table(
        ["op", "status", "detail", "s"],
        [[r["op"], r["status"], r["detail"], round(r["seconds"], 2)] for r in rows],
        title=f"ascend-fa selftest on backend {backend.name!r} "
        f"(device {backend.device})",
    )
    failed = [r for r in rows if r["status"] == "FAIL"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if failed else 0
