"""Subprocess driver: the public API on tensors whose device is ``npu``, through the
NPU backend's registered kernels, into the STRICT FAKE of torch_npu of one release.

Run as ``python npu_route_driver.py RELEASE [selftest]``; prints one JSON object
``{check: {"ok": bool, "detail": str}}``. A subprocess because naming torch's
PrivateUse1 backend ``npu`` (what torch_npu does on import, and what the fake
device needs) cannot be undone in-process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

RELEASE = sys.argv[1]
SELFTEST = sys.argv[2:] == ["selftest"]
if RELEASE == "7.3.0":  # binds like 7.2.0; the variable tells them apart
    os.environ["ASCEND_FA_TORCH_NPU_RELEASE"] = RELEASE

import strict_fake_torch_npu as fake_npu  # noqa: E402
from ascend_fa.atb_ops.attention import (  # noqa: E402
    mla_paged_attention_ref,
    paged_attention_ref,
)
from ascend_fa.backends import get_backend  # noqa: E402
from npu_cases import (  # noqa: E402
    budget_ok,
    gqa_cache_shape,
    gqa_case,
    mla_cache_shapes,
    mla_case,
)
from strict_fake_torch_npu import device  # noqa: E402

from ascend_fa import (  # noqa: E402
    PagedKVCache,
    mla_paged_attention,
    paged_attention,
    reshape_and_cache,
    reshape_and_cache_mla,
)
from ascend_fa.errors import UnsupportedError  # noqa: E402

device.enable()
FAKE = fake_npu.install(RELEASE)
NEWER = fake_npu.RELEASES.index(RELEASE) >= 1
RESULTS: dict[str, dict] = {}
npu = device.to_npu


def check(name):
    def run(fn):
        FAKE.calls.clear()
        try:
            detail = fn()
            RESULTS[name] = {"ok": True, "detail": str(detail or "")}
        except Exception as exc:  # reported, the test shows it
            RESULTS[name] = {
                "ok": False,
                "detail": f"{type(exc).__name__}: {exc} | "
                + traceback.format_exc(limit=4).replace("\n", " / "),
            }
        return fn

    return run


def expect_refusal(fn, *names):
    try:
        fn()
    except UnsupportedError as exc:
        msg = str(exc)
        missing = [n for n in (*names, f"torch_npu {RELEASE}") if n not in msg]
        assert not missing, f"refusal lacks {missing}: {msg}"
        assert FAKE.calls == [], f"torch_npu was called: {FAKE.call_names}"
        return msg[:200]
    raise AssertionError("not refused")


@check("backend_selected")
def _():
    backend = get_backend()
    assert backend.name == "npu", backend
    assert backend.release == RELEASE, backend.release
    return backend.release


@check("cache_layouts")
def _():
    lay = {
        m: PagedKVCache(1, 1, 128, num_blocks=2, mode=m, backend="npu").layout
        for m in ("float", "int8_kv", "faquant")
    }
    mla = PagedKVCache(1, 1, 512, num_blocks=2, mla=True, backend="npu")
    assert lay == {"float": "nd", "int8_kv": "nz", "faquant": "nd"}, lay
    assert mla.layout == "nz" and mla.key_caches[0].device.type == "npu"
    return lay


def gqa_write(case, dtype, layout):
    shape = gqa_cache_shape(case, dtype, layout)
    kc = npu(torch.zeros(shape, dtype=dtype))
    vc = npu(torch.zeros(shape, dtype=dtype))
    quant = dtype == torch.int8
    ks, vs = (npu(case["ks"]), npu(case["vs"])) if quant else (None, None)
    reshape_and_cache(
        npu(case["key"]), npu(case["value"]), kc, vc, npu(case["slots"]),
        k_scale=ks, v_scale=vs, layout=layout,
    )  # fmt: skip
    # the CPU reference write of the same tokens
    wk, wv = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    reshape_and_cache(
        case["key"], case["value"], wk, wv, case["slots"],
        k_scale=case["ks"] if quant else None, v_scale=case["vs"] if quant else None,
        layout=layout, backend="cpu",
    )  # fmt: skip
    assert torch.equal(kc.cpu(), wk) and torch.equal(vc.cpu(), wv), "bytes differ"
    return kc, vc


@check("write_int8_nz")
def _():
    case = gqa_case()
    if not NEWER:
        return expect_refusal(
            lambda: gqa_write(case, torch.int8, "nz"), "[route.cache_write.nz]"
        )
    gqa_write(case, torch.int8, "nz")
    assert FAKE.call_names[-1] == "npu_scatter_pa_kv_cache", FAKE.call_names
    return FAKE.call_names


@check("write_bf16_nd")
def _():
    gqa_write(gqa_case(), torch.bfloat16, "nd")
    assert FAKE.call_names == ["_npu_reshape_and_cache"], FAKE.call_names


def decode(case, kc, vc, mode, layout):
    quant = mode != "float"
    kw = dict(
        num_kv_heads=case["hkv"], scale=case["scale"],
        k_scale=case["ks"] if quant else None, v_scale=case["vs"] if quant else None,
        q_scale=case["qs"] if mode == "faquant" else None, layout=layout,
    )  # fmt: skip
    out = paged_attention(
        npu(case["query"]), kc, vc, npu(case["table"]), npu(case["seq_lens"]),
        **{k: npu(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
    )  # fmt: skip
    assert out.device.type == "npu"
    args = (case["query"], kc.cpu(), vc.cpu(), case["table"], case["seq_lens"])
    ok, err, allowed = budget_ok(out.cpu(), paged_attention_ref, args, kw)
    assert ok, f"max err {err:.3g} > {allowed:.3g}"
    return f"max err {err:.3g} <= {allowed:.3g}"


@check("decode_float_nd")
def _():
    case = gqa_case()
    kc, vc = gqa_write(case, torch.bfloat16, "nd")
    FAKE.calls.clear()
    detail = decode(case, kc, vc, "float", "nd")
    assert FAKE.call_names == ["npu_fused_infer_attention_score"], FAKE.call_names
    return detail


@check("decode_int8_kv_nz")
def _():
    case = gqa_case()
    if not NEWER:
        kc = npu(torch.zeros(gqa_cache_shape(case, torch.int8, "nz"), dtype=torch.int8))
        return expect_refusal(
            lambda: decode(case, kc, kc.clone(), "int8_kv", "nz"),
            "[route.decode.int8_kv.nz]",
        )
    kc, vc = gqa_write(case, torch.int8, "nz")
    FAKE.calls.clear()
    return decode(case, kc, vc, "int8_kv", "nz")


@check("decode_int8_kv_32_8_refused")
def _():
    case = gqa_case(h=32, hkv=8)
    kc = npu(torch.zeros(gqa_cache_shape(case, torch.int8, "nz"), dtype=torch.int8))
    FAKE.calls.clear()
    names = ("[fia.int8nz.heads]", "(32, 8)", "(10, 1)", "(128, 16)")
    return expect_refusal(
        lambda: decode(case, kc, kc.clone(), "int8_kv", "nz"),
        *(names if NEWER else ("[route.decode.int8_kv.nz]",)),
    )


@check("c8_write_and_decode_nz")
def _():
    """C8: per-channel [Hkv, D] scales, written with vllm-ascend's tensor ops and
    read through FIA's per-channel [Hkv, 1, D] antiquant scales."""
    case = gqa_case()
    for side, x in (("ks", case["key"]), ("vs", case["value"])):
        case[side] = (x.float().abs().amax(dim=0) / 127).clamp(min=2.0**-23)
    if not NEWER:
        return expect_refusal(
            lambda: gqa_write(case, torch.int8, "nz"), "[route.cache_write.nz]"
        )
    kc, vc = gqa_write(case, torch.int8, "nz")
    assert FAKE.call_names == ["npu_scatter_pa_kv_cache"], FAKE.call_names
    FAKE.calls.clear()
    detail = decode(case, kc, vc, "int8_kv", "nz")
    (call,) = FAKE.calls_to("npu_fused_infer_attention_score")
    want = case["ks"].to(torch.bfloat16).view(case["hkv"], 1, case["d"])
    assert torch.equal(call["key_antiquant_scale"].cpu(), want)
    return detail


@check("fp8_kv_refused")
def _():
    case = gqa_case()
    fp8 = torch.float8_e4m3fn
    kc = npu(torch.zeros(gqa_cache_shape(case, fp8, "nz"), dtype=fp8))
    s = npu(torch.tensor([0.01]))
    FAKE.calls.clear()
    expect_refusal(
        lambda: reshape_and_cache(
            npu(case["key"]), npu(case["value"]), kc, kc.clone(), npu(case["slots"]),
            k_scale=s, v_scale=s,
        ),
        "[npu.fp8_kv]", "float8_e4m3fn",
    )  # fmt: skip
    return expect_refusal(
        lambda: paged_attention(
            npu(case["query"]), kc, kc.clone(), npu(case["table"]),
            npu(case["seq_lens"]), num_kv_heads=case["hkv"], scale=case["scale"],
            k_scale=s, v_scale=s,
        ),
        "[npu.fp8_kv]",
    )  # fmt: skip


@check("decode_faquant_nd")
def _():
    case = gqa_case()
    kc, vc = gqa_write(case, torch.int8, "nd")
    FAKE.calls.clear()
    detail = decode(case, kc, vc, "faquant", "nd")
    (call,) = FAKE.calls_to("_npu_paged_attention_quant")
    assert call["context_lens"].device.type == "cpu"
    return detail


@check("decode_float_nz_refused")
def _():
    case = gqa_case()
    kc = npu(
        torch.zeros(gqa_cache_shape(case, torch.bfloat16, "nz"), dtype=torch.bfloat16)
    )
    return expect_refusal(
        lambda: decode(case, kc, kc.clone(), "float", "nz"), "[route]", "'nz'"
    )


@check("fake_refuses_device_context_lens")
def _():
    kw = dict(
        query=npu(torch.zeros(1, 2, 64, dtype=torch.int8)),
        key_cache=npu(torch.zeros(2, 16, 1, 64, dtype=torch.int8)),
        value_cache=npu(torch.zeros(2, 16, 1, 64, dtype=torch.int8)),
        num_kv_heads=1, num_heads=2, scale_value=0.1,
        block_table=npu(torch.tensor([[0]], dtype=torch.int32)),
        context_lens=npu(torch.tensor([5], dtype=torch.int32)),
        quant_type=3, outdata_type=27, k_descale=npu(torch.ones(2)),
        v_descale=npu(torch.ones(2)), out=npu(torch.zeros(1, 2, 64).bfloat16()),
    )  # fmt: skip
    try:
        FAKE._npu_paged_attention_quant(**kw)
    except fake_npu.FakeRuleViolation as exc:
        assert "[atb.pa_quant.context_lens]" in str(exc)
        return str(exc)[:120]
    raise AssertionError("a device context_lens was accepted")


def mla_write(case, quantized):
    (ls, ldt), (rs, rdt) = mla_cache_shapes(case, quantized)
    lc, rc = npu(torch.zeros(ls, dtype=ldt)), npu(torch.zeros(rs, dtype=rdt))
    ks = case["ks"] if quantized else None
    reshape_and_cache_mla(
        npu(case["latent"]), npu(case["rope"]), lc, rc, npu(case["slots"]),
        k_scale=npu(ks),
    )  # fmt: skip
    wl, wr = torch.zeros(ls, dtype=ldt), torch.zeros(rs, dtype=rdt)
    reshape_and_cache_mla(
        case["latent"], case["rope"], wl, wr, case["slots"], k_scale=ks,
        backend="cpu",
    )  # fmt: skip
    assert torch.equal(lc.cpu(), wl) and torch.equal(rc.cpu(), wr), "bytes differ"
    return lc, rc


def mla_decode(case, lc, rc, quantized, static):
    ks = case["ks"] if quantized else None
    qs = case["qs"] if static else None
    out = mla_paged_attention(
        npu(case["qn"]), npu(case["qr"]), lc, rc, npu(case["table"]),
        npu(case["seq_lens"]), scale=case["scale"], k_scale=npu(ks), q_scale=npu(qs),
    )  # fmt: skip
    args = (case["qn"], case["qr"], lc.cpu(), rc.cpu(), case["table"], case["seq_lens"])
    kw = dict(scale=case["scale"], k_scale=ks, q_scale=qs)
    ok, err, allowed = budget_ok(out.cpu(), mla_paged_attention_ref, args, kw)
    assert ok, f"max err {err:.3g} > {allowed:.3g}"
    return f"max err {err:.3g} <= {allowed:.3g}"


@check("mla_fakquant")
def _():
    case = mla_case()
    if not NEWER:
        return expect_refusal(
            lambda: mla_write(case, True), "[route.mla_cache_write.nz]"
        )
    lc, rc = mla_write(case, True)
    writes = [c for c in FAKE.calls if c.name == "npu_scatter_pa_kv_cache"]
    assert len(writes) == 1 and writes[0]["value"].dtype == torch.int8
    FAKE.calls.clear()
    dyn = mla_decode(case, lc, rc, True, False)
    return dyn + "; static " + mla_decode(case, lc, rc, True, True)


@check("mla_heads_12_refused")
def _():
    case = mla_case(h=12)
    (ls, ldt), (rs, rdt) = mla_cache_shapes(case, True)
    lc, rc = npu(torch.zeros(ls, dtype=ldt)), npu(torch.zeros(rs, dtype=rdt))
    names = ("[fia2.mla.heads]", "= 12") if NEWER else ("[route.mla_decode.nz]",)
    return expect_refusal(lambda: mla_decode(case, lc, rc, True, False), *names)


@check("linear_ops")
def _():
    from ascend_fa.atb_ops import linear as lin
    from ascend_fa.backends import CapabilityError

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 64, generator=gen) * 3).bfloat16()
    w = torch.randint(-128, 128, (32, 64), generator=gen).to(torch.int8)
    ws = (torch.rand(32, generator=gen) + 0.5) * 1e-3
    codes, pts = lin.dynamic_quant(npu(x))
    assert codes.device.type == "npu" and FAKE.call_names == ["npu_dynamic_quant"]
    y = lin.quant_matmul_dynamic(codes, npu(w), npu(ws), pts, out_dtype=torch.bfloat16)
    want_codes, want_pts = lin.dynamic_quant_ref(x)
    want = lin.quant_matmul_dynamic_ref(want_codes, w, ws, want_pts, None, y.dtype)
    assert torch.equal(y.cpu(), want), "dynamic linear differs from the golden"
    FAKE.calls.clear()
    try:
        lin.quant_matmul_dynamic(codes, npu(w), npu(ws), pts, out_dtype=torch.float32)
    except CapabilityError as exc:
        assert "[qmm.out_dtype]" in str(exc) and f"torch_npu {RELEASE}" in str(exc)
        assert FAKE.calls == [], FAKE.call_names
        return "dynamic linear bit-equal; float32 output refused"
    raise AssertionError("float32 output not refused")


def _selftest():
    from ascend_fa.selftest import run_selftest

    result = run_selftest("npu")
    bad = [r for r in result.rows if r.status == "FAIL"]
    assert not bad, [(r.op, r.detail) for r in bad]
    skipped = {r.op for r in result.rows if r.status == "SKIP"}
    assert all("prefill" in op for op in skipped) or not NEWER, skipped
    assert result.ok
    return f"{len(result.rows)} cases, skipped {sorted(skipped)}"


if SELFTEST:
    check("selftest_library")(_selftest)
print(json.dumps({"release": RELEASE, "results": RESULTS}))
sys.stdout.flush()
