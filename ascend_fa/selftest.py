"""Device self-test: every cache write, attention variant and W8A8 linear op on a
backend, against the CPU golden references.

:func:`run_selftest` runs each case through the public API on the backend's device
(so on ``npu`` it takes the one dispatch route into torch_npu) and compares:

* cache writes: the bytes must equal the per-token loops of
  :mod:`ascend_fa.atb_ops.cache` exactly (max error 0, budget 0);
* attention (decode and prefill; float, int8-KV, FAQuant, MLA FAKQuant with dynamic
  and static query scales): the max abs error against a float64 computation from
  the dequantized cache (and dequantized query codes) must stay within ``2 x`` the
  error of the same computation done plainly in bf16, plus a floor: ``1e-3`` for
  the emulation backends, ``2e-2`` for device backends, whose kernels requantize
  the softmax probabilities and take bf16 dequant scales.

W8A8 linear ops (``quantize_static``, ``dynamic_quant``, ``quant_matmul`` with a
float32 and an int64 ``deq_scale``, ``quant_matmul_dynamic``) are compared with
the plain-Python golden references of :mod:`ascend_fa.atb_ops.linear`: bit-equal
on the emulation backends (budget 0); on a device, codes within one step (the
device's rounding of a tie may differ) and matmul outputs within one unit of the
output dtype at the largest output magnitude.

Sizes fit the documented NPU kernels: GQA ``H = 10, Hkv = 1`` (an int8 NZ decode
pair), ``D = 128``, ``BS = 128``; MLA ``H = 16, R = 512, Dr = 64``. A case the
backend refuses (e.g. prefill on the NPU, or NZ writes on torch_npu 7.1.0) is a
SKIP that carries the refusal's reasons. The result says PASS only when no case
fails.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from . import attention as api
from .atb_ops import attention as ref_attn
from .atb_ops import cache as ref_cache
from .atb_ops import linear as ref_linear
from .atb_ops import nz_cache_shape, per_head_qparams
from .backends import Backend, CapabilityError, get_backend
from .errors import UnsupportedError

__all__ = [
    "DEVICE_FLOOR",
    "EMULATION_FLOOR",
    "SelftestResult",
    "SelftestRow",
    "run_selftest",
]

EMULATION_FLOOR = 1e-3
DEVICE_FLOOR = 2e-2


@dataclass(frozen=True)
class SelftestRow:
    """One case: ``status`` is ``PASS``, ``FAIL`` or ``SKIP``; errors are absolute
    (0 and 0 for bit-exact byte comparisons; None when the case did not run)."""

    op: str
    shapes: str
    status: str
    max_error: float | None
    budget: float | None
    detail: str
    seconds: float


@dataclass(frozen=True)
class SelftestResult:
    """Every case of one run, on one backend."""

    backend: str
    device: str
    release: str | None
    rows: tuple[SelftestRow, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """No case failed."""
        return not any(r.status == "FAIL" for r in self.rows)

    @property
    def counts(self) -> dict[str, int]:
        return {
            s: sum(r.status == s for r in self.rows) for s in ("PASS", "FAIL", "SKIP")
        }

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
            "torch_npu_release": self.release,
            "ok": self.ok,
            "counts": self.counts,
            "rows": [asdict(r) for r in self.rows],
        }


class _Skip(Exception):
    pass


class _Bench:
    """The shared data of one run (host tensors; moved to the device per call)."""

    def __init__(self, backend: Backend, seed: int) -> None:
        self.backend = backend
        self.dev = backend.device
        self.floor = (
            EMULATION_FLOOR if backend.name in ("cpu", "cuda") else DEVICE_FLOOR
        )
        gen = torch.Generator().manual_seed(seed)
        self.h, self.hkv, self.d, self.bs = 10, 1, 128, 128
        self.mh, self.r, self.dr = 16, 512, 64
        lens = [40, 150]
        per = [-(-n // self.bs) for n in lens]
        self.nb = sum(per) + 1
        order = torch.randperm(self.nb, generator=gen).tolist()
        table = torch.zeros(len(lens), max(per), dtype=torch.int32)
        slots, pos = [], 0
        for b, n in enumerate(lens):
            blocks = order[pos : pos + per[b]]
            pos += per[b]
            table[b, : per[b]] = torch.tensor(blocks, dtype=torch.int32)
            slots += [blocks[t // self.bs] * self.bs + t % self.bs for t in range(n)]
        slots.insert(5, -1)  # a padding token
        self.table = table
        self.slots = torch.tensor(slots, dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        t, bf16 = self.slots.numel(), torch.bfloat16
        self.key = torch.randn(t, self.hkv, self.d, generator=gen).to(bf16)
        self.value = torch.randn(t, self.hkv, self.d, generator=gen).to(bf16)
        self.latent = torch.randn(t, self.r, generator=gen).to(bf16)
        self.rope = torch.randn(t, self.dr, generator=gen).to(bf16)
        self.ks, self.vs = _amax(self.key, 1), _amax(self.value, 1)
        self.lat_scale = _amax(self.latent.unsqueeze(1), 1)
        self.q_dec = torch.randn(2, self.h, self.d, generator=gen).to(bf16)
        self.q_pre = torch.randn(2, 4, self.h, self.d, generator=gen).to(bf16)
        self.qn = torch.randn(2, self.mh, self.r, generator=gen).to(bf16)
        self.qr = torch.randn(2, self.mh, self.dr, generator=gen).to(bf16)
        self.qn_scale = _amax(self.qn, 1)
        # W8A8 linears: activations with an outlier, int8 operands
        self.lx = (torch.randn(6, 256, generator=gen) * 2).to(bf16)
        self.lx[2, 5] = 30.0
        self.lx[4] = 0  # an all-zero token (dynamic: codes 0, scale 0)
        self.lxq = torch.randint(-128, 128, (6, 256), generator=gen).to(torch.int8)
        self.lw = torch.randint(-128, 128, (64, 256), generator=gen).to(torch.int8)
        self.ldeq = (torch.rand(64, generator=gen) + 0.5) * 1e-4
        self.lbias = torch.randint(-(2**20), 2**20, (64,), generator=gen).to(
            torch.int32
        )
        self.lpts = (torch.rand(6, generator=gen) + 0.5) * 1e-2
        self.lfbias = torch.randn(64, generator=gen).to(bf16).float()
        self._golden: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def gqa_shapes(self) -> str:
        return f"T={self.slots.numel()} Hkv={self.hkv} D={self.d} BS={self.bs}"

    def on(self, x):
        if isinstance(x, torch.Tensor) and x.device.type != self.dev.type:
            return x.to(self.dev)
        return x

    def call(self, fn: Callable, *args, **kw):
        try:
            return fn(
                *[self.on(a) for a in args],
                **{k: self.on(v) for k, v in kw.items()},
                backend=self.backend,
            )
        except UnsupportedError as exc:
            raise _Skip(str(exc)) from exc

    def op(self, fn: Callable, *args, **kw):
        """A linear op on the device (op layer: the device follows the tensors);
        a capability refusal is a SKIP."""
        try:
            return fn(*[self.on(a) for a in args], **kw)
        except CapabilityError as exc:
            raise _Skip(str(exc).replace("\n", " ")) from exc

    def gqa_cache(self, dtype: torch.dtype, layout: str):
        """Golden caches from the per-token loops (memoized: slow by design)."""
        tag = ("gqa", dtype, layout)
        if tag not in self._golden:
            shape = (
                nz_cache_shape(self.nb, self.bs, self.hkv, self.d, dtype)
                if layout == "nz"
                else (self.nb, self.bs, self.hkv, self.d)
            )
            kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            scales = (self.ks, self.vs) if dtype == torch.int8 else (None, None)
            ref_cache.reshape_and_cache_ref(
                self.key, self.value, kc, vc, self.slots, *scales, layout
            )
            self._golden[tag] = kc, vc
        return self._golden[tag]

    def mla_cache(self, quantized: bool):
        tag = ("mla", quantized)
        if tag not in self._golden:
            ldt = torch.int8 if quantized else torch.bfloat16
            lc = torch.zeros(
                nz_cache_shape(self.nb, self.bs, 1, self.r, ldt), dtype=ldt
            )
            rshape = nz_cache_shape(self.nb, self.bs, 1, self.dr, torch.bfloat16)
            rc = torch.zeros(rshape, dtype=torch.bfloat16)
            ks = self.lat_scale if quantized else None
            ref_cache.reshape_and_cache_mla_ref(
                self.latent, self.rope, lc, rc, self.slots, ks, "nz"
            )
            self._golden[tag] = lc, rc
        return self._golden[tag]


def _amax(x: torch.Tensor, axis: int) -> torch.Tensor:
    dims = [i for i in range(x.dim()) if i != axis]
    amax = x.float().abs().amax(dim=dims)
    return per_head_qparams(-amax, amax)[0]


def _exact(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]):
    same = all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    err = 0.0
    if not same:
        err = max(
            float((g.cpu().double() - w.double()).abs().max())
            for g, w in zip(got, want)
        )
    return same, err, 0.0, "bytes equal the per-token loop" if same else "bytes differ"


def _budget(t: _Bench, out, ref_fn, args, kw):
    ref = ref_fn(*args, **kw)
    plain = ref_fn(*args, **kw, compute_dtype=torch.bfloat16)
    err = float((out.cpu().double() - ref).abs().max())
    allowed = 2 * float((plain.double() - ref).abs().max()) + t.floor
    return err <= allowed, err, allowed, "within 2x the bf16 error + floor"


def _cache_case(t: _Bench, dtype: torch.dtype, layout: str):
    def go():
        want = t.gqa_cache(dtype, layout)
        got = tuple(torch.zeros_like(w, device=t.dev) for w in want)
        quant = dtype == torch.int8
        t.call(
            api.reshape_and_cache, t.key, t.value, *got, t.slots,
            k_scale=t.ks if quant else None, v_scale=t.vs if quant else None,
            layout=layout,
        )  # fmt: skip
        return _exact(got, want)

    return go


def _mla_cache_case(t: _Bench, quantized: bool):
    def go():
        want = t.mla_cache(quantized)
        got = tuple(torch.zeros_like(w, device=t.dev) for w in want)
        ks = t.lat_scale if quantized else None
        t.call(api.reshape_and_cache_mla, t.latent, t.rope, *got, t.slots, k_scale=ks)
        return _exact(got, want)

    return go


def _gqa_case(t: _Bench, mode: str, prefill: bool):
    def go():
        layout = t.backend.preferred_layout(mode)
        dtype = torch.bfloat16 if mode == "float" else torch.int8
        kc, vc = t.gqa_cache(dtype, layout)
        query = t.q_pre if prefill else t.q_dec
        quant = mode != "float"
        kw = dict(
            num_kv_heads=t.hkv,
            scale=1 / math.sqrt(t.d),
            k_scale=t.ks if quant else None,
            v_scale=t.vs if quant else None,
            q_scale=_amax(query, query.dim() - 2) if mode == "faquant" else None,
            layout=layout,
        )
        args = (query, kc, vc, t.table, t.seq_lens)
        out = t.call(
            api.prefill_attention if prefill else api.paged_attention, *args, **kw
        )
        ref_fn = (
            ref_attn.prefill_attention_ref if prefill else ref_attn.paged_attention_ref
        )
        return _budget(t, out, ref_fn, args, kw)

    return go


def _mla_case(t: _Bench, q_mode: str, prefill: bool):
    def go():
        quantized = q_mode != "float"
        lc, rc = t.mla_cache(quantized)
        qs = t.qn_scale if q_mode == "static" else None
        q1, q2 = (t.qn.unsqueeze(1), t.qr.unsqueeze(1)) if prefill else (t.qn, t.qr)
        args = (q1, q2, lc, rc, t.table, t.seq_lens)
        kw = dict(
            scale=1 / math.sqrt(t.r + t.dr),
            k_scale=t.lat_scale if quantized else None,
            q_scale=qs,
        )
        fn = api.mla_prefill_attention if prefill else api.mla_paged_attention
        out = t.call(fn, *args, **kw)
        ref_fn = (
            ref_attn.mla_prefill_attention_ref
            if prefill
            else ref_attn.mla_paged_attention_ref
        )
        return _budget(t, out, ref_fn, args, kw)

    return go


def _device_budget(t: _Bench, want: torch.Tensor) -> float:
    """0 on the emulation backends; on a device one code step (int8) or one unit
    of the output dtype at the largest output magnitude."""
    if t.floor == EMULATION_FLOOR:
        return 0.0
    if want.dtype == torch.int8:
        return 1.0
    return float(want.double().abs().max()) * torch.finfo(want.dtype).eps


def _compare(t: _Bench, got: torch.Tensor, want: torch.Tensor):
    err = float((got.cpu().double() - want.double()).abs().max())
    allowed = _device_budget(t, want)
    detail = "bit-equal to the golden reference" if err == 0 else "vs golden"
    return err <= allowed, err, allowed, detail


def _quantize_case(t: _Bench):
    def go():
        scale = torch.reciprocal(torch.tensor([0.041], dtype=torch.bfloat16)).float()
        offset = torch.tensor([-4.0])
        got = t.op(ref_linear.quantize_static, t.lx, scale, offset, div_mode=False)
        return _compare(t, got, ref_linear.quantize_static_ref(t.lx, scale, offset))

    return go


def _dynamic_quant_case(t: _Bench):
    def go():
        codes, scales = t.op(ref_linear.dynamic_quant, t.lx)
        want_codes, want_scales = ref_linear.dynamic_quant_ref(t.lx)
        ok, err, allowed, detail = _compare(t, codes, want_codes)
        rel = float(
            ((scales.cpu() - want_scales).abs() / want_scales.clamp_min(1e-30)).max()
        )
        if rel > 2 * torch.finfo(torch.float32).eps:
            return False, err, allowed, f"scales differ (relative {rel:.3g})"
        return ok, err, allowed, detail

    return go


def _matmul_case(t: _Bench, out: torch.dtype, int64: bool):
    def go():
        deq = ref_linear.encode_deq_scale_int64(t.ldeq) if int64 else t.ldeq
        args = (t.lxq, t.lw, deq, t.lbias)
        got = t.op(ref_linear.quant_matmul, *args, out_dtype=out)
        return _compare(t, got, ref_linear.quant_matmul_ref(*args, out))

    return go


def _matmul_dynamic_case(t: _Bench):
    def go():
        args = (t.lxq, t.lw, t.ldeq, t.lpts, t.lfbias)
        got = t.op(ref_linear.quant_matmul_dynamic, *args, out_dtype=torch.bfloat16)
        want = ref_linear.quant_matmul_dynamic_ref(*args, torch.bfloat16)
        return _compare(t, got, want)

    return go


def _cases(t: _Bench) -> list[tuple[str, str, Callable]]:
    g = t.gqa_shapes
    dec = f"B=2 H={t.h} Hkv={t.hkv} D={t.d} BS={t.bs} L=40,150"
    pre = f"B=2 S=4 H={t.h} Hkv={t.hkv} D={t.d} BS={t.bs} L=40,150"
    mla = f"B=2 H={t.mh} R={t.r} Dr={t.dr} BS={t.bs} L=40,150"
    lin = "M=6 K=256 N=64"
    return [
        ("reshape_and_cache bf16 nz", g, _cache_case(t, torch.bfloat16, "nz")),
        ("reshape_and_cache bf16 nd", g, _cache_case(t, torch.bfloat16, "nd")),
        ("reshape_and_cache int8 nz", g, _cache_case(t, torch.int8, "nz")),
        ("reshape_and_cache int8 nd", g, _cache_case(t, torch.int8, "nd")),
        ("reshape_and_cache_mla int8", mla, _mla_cache_case(t, True)),
        ("reshape_and_cache_mla bf16", mla, _mla_cache_case(t, False)),
        ("paged_attention float", dec, _gqa_case(t, "float", False)),
        ("paged_attention int8_kv", dec, _gqa_case(t, "int8_kv", False)),
        ("paged_attention faquant", dec, _gqa_case(t, "faquant", False)),
        ("prefill_attention int8_kv", pre, _gqa_case(t, "int8_kv", True)),
        ("prefill_attention faquant", pre, _gqa_case(t, "faquant", True)),
        ("mla_paged_attention dynamic-q", mla, _mla_case(t, "dynamic", False)),
        ("mla_paged_attention static-q", mla, _mla_case(t, "static", False)),
        ("mla_paged_attention float", mla, _mla_case(t, "float", False)),
        ("mla_prefill_attention", mla, _mla_case(t, "dynamic", True)),
        ("quantize_static bf16", "M=6 K=256", _quantize_case(t)),
        ("dynamic_quant bf16", "M=6 K=256", _dynamic_quant_case(t)),
        ("quant_matmul bf16 fp32-deq", lin, _matmul_case(t, torch.bfloat16, False)),
        ("quant_matmul fp16 int64-deq", lin, _matmul_case(t, torch.float16, True)),
        ("quant_matmul_dynamic bf16", lin, _matmul_dynamic_case(t)),
    ]


def _resolve(backend: str | Backend | None) -> Backend:
    if isinstance(backend, Backend):
        return backend
    try:
        return get_backend(backend)
    except ValueError as exc:
        # one line: the first line names the backend and why it is not usable
        raise UnsupportedError(str(exc).split("\n")[0]) from exc


def run_selftest(
    backend: str | Backend | None = None, *, seed: int = 0
) -> SelftestResult:
    """Run every case on ``backend`` (a name, a Backend, or None for the selected
    one). Raises :class:`~ascend_fa.errors.UnsupportedError` (one line) when the
    backend is not usable here, e.g. ``npu`` without torch_npu."""
    chosen = _resolve(backend)
    bench = _Bench(chosen, seed)
    rows = []
    for op, shapes, case in _cases(bench):
        start = time.perf_counter()
        err = allowed = None
        try:
            ok, err, allowed, detail = case()
            status = "PASS" if ok else "FAIL"
        except _Skip as exc:
            status, detail = "SKIP", str(exc)
        except Exception as exc:  # a crash is a failure, reported with its message
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}".split("\n")[0]
        rows.append(
            SelftestRow(
                op, shapes, status, err, allowed, detail, time.perf_counter() - start
            )
        )
    release = getattr(chosen, "release", None)
    return SelftestResult(chosen.name, str(chosen.device), release, tuple(rows))
