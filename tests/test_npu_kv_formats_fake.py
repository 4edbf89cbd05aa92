"""C8 (per-channel int8) and FP8 KV caches on the NPU mapping, driven into the
STRICT FAKE of torch_npu once per release (see ``test_npu_backend_fake.py`` for
how the fake is reached: the kernels registered for the PrivateUse1 key, on host
tensors).

C8 maps onto what the device documents: the cache write quantizes with the plain
tensor ops vllm-ascend uses (bytes bit-equal to the CPU reference), the decode
passes the ``[Hkv, D]`` scales as FIA's per-channel ``[Hkv, 1, D]`` bf16
antiquant scales. FP8 KV has no mapped path: it is refused before any call.
"""

from __future__ import annotations

import pytest
import strict_fake_torch_npu as fake_npu
import torch
from ascend_fa.atb_ops.attention import paged_attention_ref
from ascend_fa.backends import CapabilityError
from ascend_fa.backends import npu as npu_backend
from ascend_fa.backends.npu_capabilities import RELEASE_ENV_VAR, RELEASES
from npu_cases import budget_ok, gqa_cache_shape, gqa_case

PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
FP8 = torch.float8_e4m3fn


@pytest.fixture(params=RELEASES)
def fake(request, monkeypatch):
    release = request.param
    if release == "7.3.0":  # binds like 7.2.0: only the variable tells them apart
        monkeypatch.setenv(RELEASE_ENV_VAR, release)
    module = fake_npu.install(release)
    npu_backend.import_torch_npu()
    assert npu_backend.current_release() == release
    yield module
    fake_npu.uninstall()


def npu_op(name: str, *args):
    return getattr(torch.ops.ascend_fa, name).default.redispatch(PRIVATEUSE1, *args)


def newer(fake) -> bool:
    return RELEASES.index(fake.release) >= RELEASES.index("7.2.0")


def refused(fake, fn, *names) -> str:
    with pytest.raises(CapabilityError) as err:
        fn()
    msg = str(err.value)
    for name in (*names, f"torch_npu {fake.release}"):
        assert name in msg, msg
    assert fake.calls == []  # before any torch_npu call
    return msg


def c8_case():
    """The documented int8 NZ decode sizes with per-channel scales that really
    vary along D (from the data, per channel)."""
    case = gqa_case()
    for side, x in (("ks", case["key"]), ("vs", case["value"])):
        case[side] = (x.float().abs().amax(dim=0) / 127).clamp(min=2.0**-23)
    return case


def cpu_caches(case, layout, dtype=torch.int8):
    shape = gqa_cache_shape(case, dtype, layout)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("layout", ["nz", "nd"])
def test_c8_cache_write_bytes_equal_the_cpu_reference(fake, layout):
    case = c8_case()
    kc, vc = cpu_caches(case, layout)
    args = (case["key"], case["value"], kc, vc, case["slots"], case["ks"], case["vs"])
    if layout == "nz" and not newer(fake):
        refused(fake, lambda: npu_op("reshape_and_cache", *args, layout),
                "[route.cache_write.nz]", "7.2.0")  # fmt: skip
        return
    npu_op("reshape_and_cache", *args, layout)
    # C8 codes come from vllm-ascend's tensor ops, not npu_quantize (fp32 divide)
    write = "npu_scatter_pa_kv_cache" if layout == "nz" else "_npu_reshape_and_cache"
    assert fake.call_names == [write]
    assert fake.calls[0]["key"].dtype == torch.int8
    wk, wv = cpu_caches(case, layout)
    torch.ops.ascend_fa.reshape_and_cache(
        case["key"], case["value"], wk, wv, case["slots"], case["ks"], case["vs"],
        layout,
    )  # fmt: skip
    assert torch.equal(kc, wk) and torch.equal(vc, wv)


def test_c8_decode_maps_per_channel_antiquant_scales(fake):
    case = c8_case()
    kc, vc = cpu_caches(case, "nz")
    torch.ops.ascend_fa.reshape_and_cache(
        case["key"], case["value"], kc, vc, case["slots"], case["ks"], case["vs"], "nz"
    )
    args = (case["query"], kc, vc, case["table"], case["seq_lens"])
    kw = dict(num_kv_heads=case["hkv"], scale=case["scale"], k_scale=case["ks"],
              v_scale=case["vs"], layout="nz")  # fmt: skip

    def run():
        return npu_op(
            "paged_attention", *args, case["hkv"], case["scale"], case["ks"],
            case["vs"], None, "nz",
        )  # fmt: skip

    if not newer(fake):
        refused(fake, run, "[route.decode.int8_kv.nz]", "7.2.0")
        return
    out = run()
    (call,) = fake.calls_to("npu_fused_infer_attention_score")
    for name, s in (("key", case["ks"]), ("value", case["vs"])):
        got = call[f"{name}_antiquant_scale"]
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert tuple(got.shape) == (case["hkv"], 1, case["d"])
        # channel for channel: [Hkv, D] -> [Hkv, 1, D], no averaging over D
        assert torch.equal(got, s.to(torch.bfloat16).view(case["hkv"], 1, case["d"]))
        assert call[f"{name}_antiquant_mode"] == 0
    assert len(set(call["key_antiquant_scale"].flatten().tolist())) > 1
    ok, err, allowed = budget_ok(out, paged_attention_ref, args, kw)
    assert ok, (err, allowed)


def test_c8_decode_head_pair_rule_still_holds(fake):
    case = gqa_case(h=32, hkv=8)
    ks = torch.full((8, 128), 0.02)
    kc, vc = cpu_caches(case, "nz")

    def run():
        return npu_op(
            "paged_attention", case["query"], kc, vc, case["table"],
            case["seq_lens"], 8, case["scale"], ks, ks, None, "nz",
        )  # fmt: skip

    if not newer(fake):
        refused(fake, run, "[route.decode.int8_kv.nz]")
        return
    refused(fake, run, "[fia.int8nz.heads]", "(32, 8)")


@pytest.mark.parametrize("layout", ["nz", "nd"])
def test_fp8_kv_is_refused_before_any_call(fake, layout):
    case = gqa_case()
    kc, vc = cpu_caches(case, layout, FP8)
    s = torch.tensor([0.01])
    write = (case["key"], case["value"], kc, vc, case["slots"], s, s, layout)
    refused(fake, lambda: npu_op("reshape_and_cache", *write),
            "[npu.fp8_kv]", "float8_e4m3fn")  # fmt: skip
    dec = (case["query"], kc, vc, case["table"], case["seq_lens"], case["hkv"],
           case["scale"], s, s, None, layout)  # fmt: skip
    refused(fake, lambda: npu_op("paged_attention", *dec), "[npu.fp8_kv]")
    # what a user on the device sees through the public API's capability check
    backend = npu_backend.NPUBackend(fake.release)
    from ascend_fa.backends.base import cache_write_spec

    spec = cache_write_spec(
        key_dtype=torch.bfloat16, cache_dtype=FP8, num_kv_heads=1, head_dim=128,
        block_size=128, layout=layout, device_type="npu",
    )  # fmt: skip
    assert spec.mode == "fp8_kv"
    assert any("[npu.fp8_kv]" in r for r in backend.unsupported_reasons(spec))
