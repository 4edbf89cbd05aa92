"""The NPU mapping driven into a STRICT FAKE of torch_npu, once per release.

No device is involved. :mod:`strict_fake_torch_npu` stands in for torch_npu (the
calls of one release, bound to its yaml schemas, every documented rule enforced,
the device's bytes written). The NPU backend registers its kernels for the
PrivateUse1 key when it imports the fake; these tests reach those kernels by
redispatching the ``ascend_fa`` ops to that key with host tensors (the
subprocess tests in ``test_npu_route_subprocess.py`` go through the public API on
tensors whose device is ``npu``). Values are compared with the CPU reference:
cache bytes bit-equal, attention within the device error budget.
"""

from __future__ import annotations

import pytest
import strict_fake_torch_npu as fake_npu
import torch
from ascend_fa.atb_ops.attention import mla_paged_attention_ref, paged_attention_ref
from ascend_fa.backends import CapabilityError
from ascend_fa.backends import npu as npu_backend
from ascend_fa.backends.npu_capabilities import RELEASE_ENV_VAR, RELEASES
from npu_cases import budget_ok, gqa_cache_shape, gqa_case, mla_cache_shapes, mla_case

PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


def cpu_write(*args, mla: bool = False) -> None:
    """The CPU reference write (the emulation kernel, itself bit-equal to the
    per-token loops in test_cache_write.py)."""
    op = torch.ops.ascend_fa.reshape_and_cache_mla if mla else None
    (op or torch.ops.ascend_fa.reshape_and_cache)(*args)


def npu_op(name: str, *args):
    """Run the kernel the NPU backend registered for ``ascend_fa::<name>``."""
    return getattr(torch.ops.ascend_fa, name).default.redispatch(PRIVATEUSE1, *args)


@pytest.fixture(params=RELEASES)
def fake(request, monkeypatch):
    release = request.param
    if release == "7.3.0":  # binds like 7.2.0: only the variable tells them apart
        monkeypatch.setenv(RELEASE_ENV_VAR, release)
    module = fake_npu.install(release)
    npu_backend.import_torch_npu()
    assert npu_backend.current_release() == release
    assert npu_backend.kernels_registered()
    yield module
    fake_npu.uninstall()


def at_least(fake, release: str) -> bool:
    return RELEASES.index(fake.release) >= RELEASES.index(release)


def refused(fake, fn, *names):
    """``fn`` raises CapabilityError naming each of ``names`` and the release,
    before any torch_npu call."""
    with pytest.raises(CapabilityError) as err:
        fn()
    msg = str(err.value)
    for name in (*names, f"torch_npu {fake.release}"):
        assert name in msg, msg
    assert fake.calls == []
    return msg


# -- release detection ------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_release_detected_from_the_calls_it_offers(release):
    module = fake_npu.StrictFakeTorchNPU(release)
    expected = "7.2.0" if release == "7.3.0" else release
    assert npu_backend.detect_release(module) == expected


def test_release_named_by_the_version_string():
    module = fake_npu.StrictFakeTorchNPU("7.2.0")
    module.__version__ = "2.7.1-7.3.0"
    assert npu_backend.detect_release(module) == "7.3.0"
    module.__version__ = "2.7.1.post4"  # a plain torch_npu version names none
    assert npu_backend.detect_release(module) == "7.2.0"


def test_release_variable_overrides_and_is_validated(monkeypatch):
    monkeypatch.setenv(RELEASE_ENV_VAR, "7.3.0")
    assert npu_backend.detect_release(fake_npu.StrictFakeTorchNPU("7.2.0")) == "7.3.0"
    monkeypatch.setenv(RELEASE_ENV_VAR, "9.9.9")
    with pytest.raises(ValueError, match="unknown torch_npu release '9.9.9'"):
        npu_backend.detect_release(fake_npu.StrictFakeTorchNPU("7.2.0"))


# -- cache writes --------------------------------------------------------------------
@pytest.mark.parametrize("quantized", [False, True])
def test_nz_cache_write(fake, quantized):
    case = gqa_case()
    dtype = torch.int8 if quantized else torch.bfloat16
    shape = gqa_cache_shape(case, dtype, "nz")
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    scales = (case["ks"], case["vs"]) if quantized else (None, None)
    args = (case["key"], case["value"], kc, vc, case["slots"], *scales, "nz")
    if not at_least(fake, "7.2.0"):
        refused(fake, lambda: npu_op("reshape_and_cache", *args),
                "[route.cache_write.nz]", "7.2.0")  # fmt: skip
        return
    npu_op("reshape_and_cache", *args)
    want = ["npu_quantize", "npu_quantize"] if quantized else []
    assert fake.call_names == [*want, "npu_scatter_pa_kv_cache"]
    scatter = fake.calls[-1]
    # cache_mode is a keyword from 26.0.0 on; before, passing it is a TypeError
    assert ("cache_mode" in scatter.args) == at_least(fake, "26.0.0")
    if "cache_mode" in scatter.args:
        assert scatter["cache_mode"] == "PA_NZ"
    t = case["slots"].numel() - 1  # the padding token never reaches the device
    assert tuple(scatter["slot_mapping"].shape) == (t,)
    assert bool((scatter["slot_mapping"] >= 0).all())
    assert scatter["key"].dtype == dtype == scatter["key_cache"].dtype
    wk, wv = torch.zeros_like(kc), torch.zeros_like(vc)
    cpu_write(case["key"], case["value"], wk, wv, case["slots"], *scales, "nz")
    assert torch.equal(kc, wk) and torch.equal(vc, wv)


@pytest.mark.parametrize("quantized", [False, True])
def test_nd_cache_write_goes_through_atb(fake, quantized):
    case = gqa_case()
    dtype = torch.int8 if quantized else torch.bfloat16
    shape = gqa_cache_shape(case, dtype, "nd")
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    scales = (case["ks"], case["vs"]) if quantized else (None, None)
    npu_op(
        "reshape_and_cache", case["key"], case["value"], kc, vc, case["slots"],
        *scales, "nd",
    )  # fmt: skip
    assert fake.call_names[-1] == "_npu_reshape_and_cache"
    assert "npu_scatter_pa_kv_cache" not in fake.call_names
    assert fake.calls[-1]["slot_indices"].dtype == torch.int32
    wk, wv = torch.zeros_like(kc), torch.zeros_like(vc)
    cpu_write(case["key"], case["value"], wk, wv, case["slots"], *scales, "nd")
    assert torch.equal(kc, wk) and torch.equal(vc, wv)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("layout", ["nz", "nd"])
def test_mla_cache_write_never_mixes_dtypes(fake, quantized, layout):
    case = mla_case()
    (lshape, ldt), (rshape, rdt) = mla_cache_shapes(case, quantized, layout)
    lc, rc = torch.zeros(lshape, dtype=ldt), torch.zeros(rshape, dtype=rdt)
    ks = case["ks"] if quantized else None
    args = (case["latent"], case["rope"], lc, rc, case["slots"], ks, layout)
    if layout == "nz" and not at_least(fake, "7.2.0"):
        refused(fake, lambda: npu_op("reshape_and_cache_mla", *args),
                "[route.mla_cache_write.nz]", "7.2.0")  # fmt: skip
        return
    npu_op("reshape_and_cache_mla", *args)
    writes = [c for c in fake.calls if c.name != "npu_quantize"]
    assert len(writes) == 1
    w = writes[0]
    names = ("key", "value", "key_cache", "value_cache")
    assert len({w[n].dtype for n in names}) == 1  # rule 3: one dtype per call
    wl, wr = torch.zeros_like(lc), torch.zeros_like(rc)
    cpu_write(case["latent"], case["rope"], wl, wr, case["slots"], ks, layout, mla=True)
    assert torch.equal(lc, wl) and torch.equal(rc, wr)


# -- decode --------------------------------------------------------------------------
def _gqa_caches(case, mode, layout):
    dtype = torch.bfloat16 if mode == "float" else torch.int8
    shape = gqa_cache_shape(case, dtype, layout)
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    scales = (None, None) if mode == "float" else (case["ks"], case["vs"])
    cpu_write(case["key"], case["value"], kc, vc, case["slots"], *scales, layout)
    return kc, vc, scales


def _decode(case, mode, layout, kc, vc, scales):
    q_scale = case["qs"] if mode == "faquant" else None
    args = (case["query"], kc, vc, case["table"], case["seq_lens"])
    kw = dict(
        num_kv_heads=case["hkv"], scale=case["scale"], k_scale=scales[0],
        v_scale=scales[1], q_scale=q_scale, layout=layout,
    )  # fmt: skip
    return args, kw, lambda: npu_op(
        "paged_attention", *args, case["hkv"], case["scale"], scales[0], scales[1],
        q_scale, layout,
    )  # fmt: skip


def test_float_decode_reads_the_nd_paged_layout(fake):
    case = gqa_case()
    kc, vc, scales = _gqa_caches(case, "float", "nd")
    args, kw, run = _decode(case, "float", "nd", kc, vc, scales)
    out = run()
    (call,) = fake.calls_to("npu_fused_infer_attention_score")
    assert tuple(call["key"].shape) == (case["nb"], case["bs"], case["hkv"] * 128)
    assert call["input_layout"] == "BNSD" and call["inner_precise"] == 0
    assert call["key_antiquant_scale"] is None
    ok, err, allowed = budget_ok(out, paged_attention_ref, args, kw)
    assert ok, (err, allowed)


def test_float_nz_decode_is_refused(fake):
    case = gqa_case()
    kc, vc, scales = _gqa_caches(case, "float", "nz")
    _, _, run = _decode(case, "float", "nz", kc, vc, scales)
    refused(fake, run, "[route]", "decode", "'nz'")


def test_int8_kv_decode(fake):
    case = gqa_case()
    kc, vc, scales = _gqa_caches(case, "int8_kv", "nz")
    args, kw, run = _decode(case, "int8_kv", "nz", kc, vc, scales)
    if not at_least(fake, "7.2.0"):
        refused(fake, run, "[route.decode.int8_kv.nz]", "7.2.0")
        return
    out = run()
    (call,) = fake.calls_to("npu_fused_infer_attention_score")
    s = call["key_antiquant_scale"]
    assert s.dtype == torch.bfloat16 and s.is_contiguous()
    assert tuple(s.shape) == (case["hkv"], 1, case["d"])
    assert call["inner_precise"] == 1 and call["key_antiquant_mode"] == 0
    assert tuple(call["key"].shape) == (case["nb"], 1, 4, 128, 32)
    assert call["actual_seq_lengths_kv"] == [20, 150]
    ok, err, allowed = budget_ok(out, paged_attention_ref, args, kw)
    assert ok, (err, allowed)


def test_int8_kv_head_pair_refused_before_any_call(fake):
    case = gqa_case(h=32, hkv=8)
    kc, vc, scales = _gqa_caches(case, "int8_kv", "nz")
    _, _, run = _decode(case, "int8_kv", "nz", kc, vc, scales)
    if not at_least(fake, "7.2.0"):
        refused(fake, run, "[route.decode.int8_kv.nz]")
        return
    msg = refused(fake, run, "[fia.int8nz.heads]", "(32, 8)")
    for pair in ("(10, 1)", "(64, 8)", "(80, 8)", "(128, 16)"):
        assert pair in msg


def test_faquant_decode_through_atb_with_host_context_lens(fake):
    case = gqa_case()
    kc, vc, scales = _gqa_caches(case, "faquant", "nd")
    args, kw, run = _decode(case, "faquant", "nd", kc, vc, scales)
    out = run()
    assert fake.call_names == ["npu_quantize", "_npu_paged_attention_quant"]
    call = fake.calls[-1]
    lens = call["context_lens"]
    assert lens.dtype == torch.int32 and lens.device.type == "cpu"
    assert call["quant_type"] == 3 and call["outdata_type"] == 27
    assert call["query"].dtype == torch.int8
    ok, err, allowed = budget_ok(out, paged_attention_ref, args, kw)
    assert ok, (err, allowed)


def test_prefill_is_refused(fake):
    case = gqa_case()
    kc, vc, scales = _gqa_caches(case, "int8_kv", "nz")
    refused(
        fake,
        lambda: npu_op(
            "prefill_attention", case["query"].unsqueeze(1), kc, vc, case["table"],
            case["seq_lens"], None, 1, 0.1, *scales, None, "nz",
        ),
        "prefill",
    )  # fmt: skip


def _mla_caches(case, quantized):
    (lshape, ldt), (rshape, rdt) = mla_cache_shapes(case, quantized)
    lc, rc = torch.zeros(lshape, dtype=ldt), torch.zeros(rshape, dtype=rdt)
    ks = case["ks"] if quantized else None
    cpu_write(case["latent"], case["rope"], lc, rc, case["slots"], ks, "nz", mla=True)
    return lc, rc, ks


@pytest.mark.parametrize("q_mode", ["dynamic", "static", "float"])
def test_mla_decode(fake, q_mode):
    case = mla_case()
    lc, rc, ks = _mla_caches(case, q_mode != "float")
    qs = case["qs"] if q_mode == "static" else None
    args = (case["qn"], case["qr"], lc, rc, case["table"], case["seq_lens"])

    def run():
        return npu_op("mla_paged_attention", *args, case["scale"], ks, qs, "nz")

    if not at_least(fake, "7.2.0"):
        refused(fake, run, "[route.mla_decode.nz]", "7.2.0")
        return
    out = run()
    (call,) = fake.calls_to("npu_fused_infer_attention_score_v2")
    assert call["input_layout"] == "BSND_NBSD" and call["key"] is call["value"]
    if q_mode != "float":
        assert call["query"].dtype == torch.int8
        assert tuple(call["dequant_scale_query"].shape) == (2, 1, 16)
        assert (call["query_quant_mode"], call["key_quant_mode"]) == (3, 0)
    kw = dict(scale=case["scale"], k_scale=ks, q_scale=qs)
    ok, err, allowed = budget_ok(out, mla_paged_attention_ref, args, kw)
    assert ok, (err, allowed)


def test_mla_query_heads_must_be_a_power_of_two(fake):
    case = mla_case(h=12)
    lc, rc, ks = _mla_caches(case, True)
    args = (case["qn"], case["qr"], lc, rc, case["table"], case["seq_lens"])

    def run():
        return npu_op("mla_paged_attention", *args, case["scale"], ks, None, "nz")

    if not at_least(fake, "7.2.0"):
        refused(fake, run, "[route.mla_decode.nz]")
        return
    refused(fake, run, "[fia2.mla.heads]", "num_heads = 12", "power of two <= 128")


def test_import_ascend_fa_never_imports_torch_npu():
    import subprocess
    import sys

    code = (
        "import sys, ascend_fa; ascend_fa.paged_attention; ascend_fa.PagedKVCache; "
        "import ascend_fa.backends.npu; ascend_fa.get_backend(); "
        "print('torch_npu' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
