"""The strict fake of torch_npu refuses the counter-example of every rule.

Each case starts from a call the fake accepts (checked too) and breaks one
documented rule; the fake must raise naming that rule's id. Every rule of the
capability table is enforced by the fake, and every spec rule is also refused by
:func:`unsupported_reasons` with its id, value and release.
"""

from __future__ import annotations

import pytest
import strict_fake_torch_npu as fake_npu
import torch
from ascend_fa.backends.base import AttentionSpec, linear_spec
from ascend_fa.backends.npu_capabilities import RELEASES, RULES, unsupported_reasons

BF16, I8 = torch.bfloat16, torch.int8


def _quantize(**kw):
    args = dict(
        self=torch.randn(4, 256).bfloat16(),
        scales=torch.rand(256) + 0.1,
        zero_points=None,
        dtype=torch.qint8,
        axis=-1,
        div_mode=True,
    )
    args.update(kw)
    return "npu_quantize", (), args


def _quantize_mul(**kw):
    args = dict(
        self=torch.randn(4, 256).bfloat16(),
        scales=torch.full((256,), 0.5, dtype=BF16),
        zero_points=torch.full((256,), 3.0, dtype=BF16),
        dtype=torch.qint8,
        axis=-1,
        div_mode=False,
    )
    args.update(kw)
    return "npu_quantize", (), args


def _dynamic(**kw):
    args = dict(input=torch.randn(4, 256).bfloat16())
    args.update(kw)
    return "npu_dynamic_quant", (), args


def _qmm(m=4, k=256, n=64, dynamic=False, **kw):
    args = dict(
        x1=torch.randint(-128, 128, (m, k), dtype=I8),
        x2=torch.randint(-128, 128, (k, n), dtype=I8),
        scale=torch.full((n,), 1e-4),
        output_dtype=BF16,
    )
    if dynamic:
        args.update(pertoken_scale=torch.full((m,), 0.01), bias=torch.zeros(n))
    else:
        args.update(bias=torch.zeros(n, dtype=torch.int32))
    args.update(kw)
    return "npu_quant_matmul", (), args


def _scatter(release="26.0.0", dtype=I8, last=32, **kw):
    key = torch.zeros(3, 1, 128, dtype=dtype)
    args = dict(
        key=key,
        value=key.clone(),
        key_cache=torch.zeros(2, 128 // last, 128, last, dtype=dtype),
        value_cache=torch.zeros(2, 128 // last, 128, last, dtype=dtype),
        slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    if release == "26.0.0":
        args["cache_mode"] = "PA_NZ"
    args.update(kw)
    return "npu_scatter_pa_kv_cache", (), args


def _atb_write(**kw):
    key = torch.zeros(3, 1, 128, dtype=BF16)
    args = dict(
        key=key,
        value=key.clone(),
        key_cache=torch.zeros(2, 128, 1, 128, dtype=BF16),
        value_cache=torch.zeros(2, 128, 1, 128, dtype=BF16),
        slot_indices=torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    args.update(kw)
    return "_npu_reshape_and_cache", (), args


def _fia_int8(n=10, hkv=1, d=128, bs=128, **kw):
    kv = torch.zeros(2, hkv, d // 32, bs, 32, dtype=I8)
    s = torch.full((hkv, 1, d), 0.02, dtype=BF16)
    args = dict(
        block_table=torch.tensor([[0]], dtype=torch.int32),
        actual_seq_lengths_kv=[5],
        num_heads=n,
        num_key_value_heads=hkv,
        input_layout="BNSD",
        scale=0.1,
        block_size=bs,
        key_antiquant_scale=s,
        value_antiquant_scale=s.clone(),
        key_antiquant_mode=0,
        value_antiquant_mode=0,
        inner_precise=1,
    )
    query = kw.pop("query", torch.randn(1, n, 1, d).bfloat16())
    key = kw.pop("key", kv)
    args.update(kw)
    return "npu_fused_infer_attention_score", (query, key, key), args


def _fia_float(n=2, hkv=1, d=64, bs=16, qdt=BF16, kdt=BF16, **kw):
    kv = torch.randn(2, bs, hkv * d).to(kdt)
    args = dict(
        block_table=torch.tensor([[0]], dtype=torch.int32),
        actual_seq_lengths_kv=[5],
        num_heads=n,
        num_key_value_heads=hkv,
        input_layout="BNSD",
        scale=0.1,
        block_size=bs,
        inner_precise=0,
    )
    query = torch.randn(1, n, 1, d).to(qdt)
    key = kw.pop("key", kv)
    args.update(kw)
    return "npu_fused_infer_attention_score", (query, key, key), args


def _pa_quant(**kw):
    args = dict(
        query=torch.zeros(1, 2, 64, dtype=I8),
        key_cache=torch.zeros(2, 16, 1, 64, dtype=I8),
        value_cache=torch.zeros(2, 16, 1, 64, dtype=I8),
        num_kv_heads=1,
        num_heads=2,
        scale_value=0.1,
        block_table=torch.tensor([[0]], dtype=torch.int32),
        context_lens=torch.tensor([5], dtype=torch.int32),
        quant_type=3,
        outdata_type=27,
        k_descale=torch.ones(2),
        v_descale=torch.ones(2),
        out=torch.zeros(1, 2, 64, dtype=BF16),
    )
    args.update(kw)
    return "_npu_paged_attention_quant", (), args


def _mla(n=16, r=512, dr=64, bs=128, quant=True, rope_dtype=BF16, **kw):
    ldt = I8 if quant else kw.pop("latent_dtype", BF16)
    cols = 32 // torch.empty((), dtype=ldt).element_size()
    latent = torch.zeros(2, 1, r // cols, bs, cols, dtype=ldt)
    args = dict(
        query_rope=torch.randn(1, 1, n, dr).to(rope_dtype),
        key_rope=torch.zeros(2, 1, dr // 16, bs, 16, dtype=rope_dtype),
        block_table=torch.tensor([[0]], dtype=torch.int32),
        actual_seq_kvlen=[5],
        num_query_heads=n,
        num_key_value_heads=1,
        softmax_scale=0.1,
        input_layout="BSND_NBSD",
        block_size=bs,
    )
    if quant:
        args.update(
            query_quant_mode=3,
            key_quant_mode=0,
            value_quant_mode=0,
            dequant_scale_query=torch.full((1, 1, n), 0.01),
            dequant_scale_key=torch.tensor([0.02]),
            dequant_scale_value=torch.tensor([0.02]),
        )
    qdt = I8 if quant else kw.pop("query_dtype", BF16)
    query = torch.zeros(1, 1, n, r).to(qdt)
    args.update(kw)
    return "npu_fused_infer_attention_score_v2", (query, latent, latent), args


GOOD = [
    ("26.0.0", _quantize()),
    ("7.1.0", _quantize(zero_points=torch.full((256,), 2, dtype=torch.int32))),
    ("7.1.0", _quantize_mul()),
    (
        "26.0.0",
        _quantize_mul(scales=torch.full((1,), 0.5, dtype=BF16), zero_points=None),
    ),  # fmt: skip
    ("7.1.0", _dynamic()),
    ("26.0.0", _dynamic(input=torch.randn(2, 3, 64).half())),
    ("7.1.0", _qmm()),
    (
        "7.3.0",
        _qmm(
            scale=torch.full((64,), 1000, dtype=torch.int64), output_dtype=torch.float16
        ),
    ),  # fmt: skip
    ("26.0.0", _qmm(dynamic=True)),
    ("7.2.0", _qmm(dynamic=True, output_dtype=torch.float16, bias=None)),
    ("7.2.0", _scatter("7.2.0")),
    ("26.0.0", _scatter()),
    ("26.0.0", _scatter(dtype=BF16, last=16)),
    ("7.1.0", _atb_write()),
    ("7.2.0", _fia_int8()),
    ("7.1.0", _fia_float()),
    ("26.0.0", _fia_float(n=128, hkv=64, d=512)),
    ("7.1.0", _pa_quant()),
    ("7.2.0", _mla()),
    ("26.0.0", _mla(bs=256)),
    ("7.3.0", _mla(quant=False)),
]


def _call(release, case):
    name, args, kwargs = case
    fake = fake_npu.StrictFakeTorchNPU(release)
    return getattr(fake, name)(*args, **kwargs)


@pytest.mark.parametrize("release,case", GOOD)
def test_the_good_calls_are_accepted(release, case):
    _call(release, case)


_MIXED = dict(
    key=torch.zeros(3, 1, 512, dtype=I8),
    value=torch.zeros(3, 1, 64, dtype=BF16),
    key_cache=torch.zeros(2, 16, 128, 32, dtype=I8),
    value_cache=torch.zeros(2, 4, 128, 16, dtype=BF16),
)

#: rule id -> (release, counter-example call)
COUNTER = {
    "npu.cache_dtype": ("26.0.0", _fia_float(qdt=BF16, kdt=torch.float32)),
    "npu.fp8_kv": ("7.3.0", _fia_float(qdt=BF16, kdt=torch.float8_e4m3fn)),
    "npu.offsets": (
        "26.0.0",
        _fia_int8(key_antiquant_offset=torch.zeros(1, 1, 128, dtype=BF16)),
    ),
    "route.decode.int8_kv.nz": ("7.1.0", _fia_int8()),
    "fia.int8nz.query_dtype": (
        "7.2.0",
        _fia_int8(query=torch.randn(1, 10, 1, 128).half()),
    ),
    "fia.int8nz.head_dim": ("7.2.0", _fia_int8(d=64)),
    "fia.int8nz.block_size": ("7.3.0", _fia_int8(bs=64)),
    "fia.int8nz.heads": ("26.0.0", _fia_int8(n=32, hkv=8)),
    "fia.int8nz.antiquant_scale": (
        "26.0.0",
        # the old mapping: fp32 scales expanded without a copy (non-contiguous)
        _fia_int8(
            key_antiquant_scale=torch.full((1, 1, 1), 0.02).expand(1, 1, 128),
            value_antiquant_scale=torch.full((1, 1, 1), 0.02).expand(1, 1, 128),
        ),
    ),
    "fia.int8nz.kv_layout": (
        "26.0.0",
        _fia_int8(key=torch.zeros(2, 4, 128, 32, dtype=I8)),
    ),
    "fia.int8nz.inner_precise": ("26.0.0", _fia_int8(inner_precise=0)),
    "fia.pa.query_dtype": ("26.0.0", _fia_float(qdt=torch.float32)),
    "fia.pa.dtypes_match": ("26.0.0", _fia_float(qdt=torch.float16)),
    "fia.pa.block_size": ("26.0.0", _fia_float(bs=1024)),
    "fia.pa.kv_width": ("26.0.0", _fia_float(n=128, hkv=128, d=512)),
    "fia.pa.head_dim": ("26.0.0", _fia_float(d=576)),
    "fia.pa.kv_layout": (
        "7.1.0",
        _fia_float(key=torch.zeros(2, 1, 4, 16, 16, dtype=BF16)),
    ),
    "fia.heads": ("26.0.0", _fia_float(n=264, hkv=8)),
    "fia.group": ("26.0.0", _fia_float(n=130, hkv=2)),
    "fia.inner_precise": ("26.0.0", _fia_float(inner_precise=2)),
    "fia.paged_args": ("26.0.0", _fia_float(input_layout="BSH")),
    "atb.pa_quant.out_dtype": ("26.0.0", _pa_quant(outdata_type=0)),
    "atb.pa_quant.context_lens": (
        "26.0.0",
        _pa_quant(context_lens=torch.tensor([5], dtype=torch.int64)),
    ),
    "atb.pa_quant.args": ("26.0.0", _pa_quant(quant_type=1)),
    "scatter.dtypes": ("26.0.0", _scatter(**_MIXED)),
    "scatter.nz_shape": (
        "26.0.0",
        _scatter(
            key_cache=torch.zeros(2, 8, 128, 16, dtype=I8),
            value_cache=torch.zeros(2, 8, 128, 16, dtype=I8),
        ),
    ),
    "scatter.cache_mode": ("26.0.0", _scatter(cache_mode="NZ")),
    "cache.slots": (
        "7.2.0",
        _scatter("7.2.0", slot_mapping=torch.tensor([0, -1, 2], dtype=torch.int32)),
    ),
    "atb.reshape_and_cache.nd": (
        "26.0.0",
        _atb_write(slot_indices=torch.tensor([0, 1, 2])),
    ),
    "cache.mla_no_mixed_dtypes": (
        "7.1.0",
        _atb_write(
            key=torch.zeros(3, 1, 512, dtype=I8),
            key_cache=torch.zeros(2, 128, 1, 512, dtype=I8),
            value=torch.zeros(3, 1, 64, dtype=BF16),
            value_cache=torch.zeros(2, 128, 1, 64, dtype=BF16),
        ),
    ),
    "quantize.args": ("7.1.0", _quantize(scales=torch.rand(128) + 0.1)),
    "quantize.static.input_dtype": (
        "26.0.0",
        _quantize_mul(self=torch.randn(4, 256).double()),
    ),
    "quantize.mul_mode.scale_dtype": (
        "7.2.0",
        _quantize_mul(scales=torch.full((256,), 0.5), zero_points=torch.zeros(256)),
    ),
    "quantize.mul_mode": ("7.3.0", _quantize_mul(axis=-3)),
    "dynamic_quant.input_dtype": ("26.0.0", _dynamic(input=torch.randn(4, 256))),
    "dynamic_quant.args": (
        "7.1.0",
        _dynamic(smooth_scales=torch.ones(256, dtype=BF16)),
    ),
    "qmm.out_dtype": ("26.0.0", _qmm(output_dtype=torch.float32)),
    "qmm.k": ("7.1.0", _qmm(m=1, k=65536, n=1)),
    "qmm.n": ("7.2.0", _qmm(m=1, k=1, n=65536)),
    "qmm.deq_scale": (
        "26.0.0",
        _qmm(scale=torch.full((64,), 1000, dtype=torch.int64)),
    ),
    "qmm.args": (
        "7.3.0",
        # the checkpoint's [N, K] weight passed as x2 without the transpose
        _qmm(x2=torch.zeros(64, 256, dtype=I8)),
    ),
    "fia2.mla.heads": ("26.0.0", _mla(n=12)),
    "fia2.mla.latent_dim": ("26.0.0", _mla(r=256)),
    "fia2.mla.rope_dim": ("26.0.0", _mla(dr=32)),
    "fia2.mla.block_size": ("7.2.0", _mla(bs=256)),
    "fia2.mla.query_dtype": ("26.0.0", _mla(rope_dtype=torch.float16)),
    "fia2.mla.float_dtype": (
        "26.0.0",
        _mla(quant=False, query_dtype=torch.float32, latent_dtype=BF16),
    ),
    "fia2.mla.quant_args": ("26.0.0", _mla(query_quant_mode=0)),
    "fia2.mla.layout": ("26.0.0", _mla(input_layout="BNSD")),
}


def test_every_table_rule_is_enforced_and_has_a_counter_example():
    ids = {r.id for r in RULES}
    assert ids <= fake_npu.ENFORCED_RULES
    assert ids - {"route"} <= set(COUNTER) | {
        "route.cache_write.nz",
        "route.mla_decode.nz",
    }


@pytest.mark.parametrize("rule_id", sorted(COUNTER))
def test_the_fake_refuses_the_counter_example(rule_id):
    release, case = COUNTER[rule_id]
    with pytest.raises(fake_npu.FakeRuleViolation) as err:
        _call(release, case)
    assert f"[{rule_id}]" in str(err.value)
    assert f"torch_npu {release}" in str(err.value)


@pytest.mark.parametrize(
    "name", ["npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score_v2"]
)
def test_7_1_0_has_no_scatter_and_no_v2_attention(name):
    assert not hasattr(fake_npu.StrictFakeTorchNPU("7.1.0"), name)
    assert hasattr(fake_npu.StrictFakeTorchNPU("7.2.0"), name)


@pytest.mark.parametrize("release", ["7.2.0", "7.3.0"])
def test_cache_mode_is_a_type_error_before_26(release):
    name, args, kwargs = _scatter(release)
    kwargs["cache_mode"] = "PA_NZ"
    fake = fake_npu.StrictFakeTorchNPU(release)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_mode'"):
        getattr(fake, name)(*args, **kwargs)
    assert fake.calls == []


def test_binding_errors_are_type_errors():
    fake = fake_npu.StrictFakeTorchNPU("26.0.0")
    name, args, kwargs = _fia_float()
    with pytest.raises(TypeError, match="unexpected keyword argument 'layout'"):
        fake.npu_fused_infer_attention_score(*args, **kwargs, layout="BNSD")
    with pytest.raises(TypeError, match="takes 3 positional arguments but 4"):
        fake.npu_fused_infer_attention_score(*args, 1, **kwargs)
    with pytest.raises(TypeError, match="argument 'num_heads' must be int"):
        fake.npu_fused_infer_attention_score(*args, **{**kwargs, "num_heads": 2.0})
    with pytest.raises(TypeError, match="'actual_seq_lengths_kv' must be SymInt"):
        fake.npu_fused_infer_attention_score(
            *args, **{**kwargs, "actual_seq_lengths_kv": torch.tensor([5])}
        )
    with pytest.raises(TypeError, match="missing required argument 'out'"):
        _, _, pa = _pa_quant()
        pa.pop("out")
        fake._npu_paged_attention_quant(**pa)
    # 26.0.0 types npu_quantize's dtype as int; a torch.dtype still binds
    _call("26.0.0", _quantize())
    with pytest.raises(TypeError, match="argument 'dtype' must be ScalarType"):
        _call("7.2.0", _quantize(dtype=12))


def _spec(**kw):
    base = dict(
        op="decode",
        mode="int8_kv",
        query_dtype=BF16,
        cache_dtype=I8,
        head_dim=128,
        num_heads=10,
        num_kv_heads=1,
        block_size=128,
        layout="nz",
        device_type="npu",
    )
    base.update(kw)
    return AttentionSpec(**base)


def _mla_spec(**kw):
    base = dict(
        op="mla_decode",
        mode="fakquant",
        num_heads=16,
        head_dim=512,
        extra=(("rope_dim", 64),),
        num_kv_heads=1,
    )
    base.update(kw)
    return _spec(**base)


def _float_spec(**kw):
    base = dict(mode="float", cache_dtype=BF16, layout="nd", head_dim=64, num_heads=2)
    base.update(kw)
    return _spec(**base)


#: spec rule id -> (release, spec breaking it, the offending value as printed)
SPEC_COUNTER = {
    "npu.cache_dtype": ("26.0.0", _float_spec(cache_dtype=torch.float32), "float32"),
    "npu.fp8_kv": (
        "7.2.0",
        _spec(mode="fp8_kv", cache_dtype=torch.float8_e4m3fn),
        "float8_e4m3fn",
    ),
    "npu.offsets": ("26.0.0", _spec(has_offsets=True), "True"),
    "fia.int8nz.query_dtype": ("7.2.0", _spec(query_dtype=torch.float16), "float16"),
    "fia.int8nz.head_dim": ("7.3.0", _spec(head_dim=64), "64"),
    "fia.int8nz.block_size": ("26.0.0", _spec(block_size=256), "256"),
    "fia.int8nz.heads": ("26.0.0", _spec(num_heads=32, num_kv_heads=8), "(32, 8)"),
    "fia.pa.query_dtype": (
        "7.1.0",
        _float_spec(query_dtype=torch.float32, cache_dtype=torch.float16),
        "float32",
    ),
    "fia.pa.dtypes_match": ("7.1.0", _float_spec(query_dtype=torch.float16), "False"),
    "fia.pa.block_size": ("26.0.0", _float_spec(block_size=1024), "1024"),
    "fia.pa.kv_width": (
        "26.0.0",
        _float_spec(num_kv_heads=256, num_heads=256, head_dim=512),
        "131072",
    ),
    "fia.pa.head_dim": ("26.0.0", _float_spec(head_dim=576), "576"),
    "fia.heads": ("26.0.0", _float_spec(num_heads=264, num_kv_heads=8), "264"),
    "fia.group": ("26.0.0", _float_spec(num_heads=130, num_kv_heads=2), "65"),
    "atb.pa_quant.out_dtype": (
        "26.0.0",
        _spec(mode="faquant", layout="nd", query_dtype=torch.float32),
        "float32",
    ),
    "fia2.mla.heads": ("26.0.0", _mla_spec(num_heads=12), "12"),
    "fia2.mla.latent_dim": ("26.0.0", _mla_spec(head_dim=256), "256"),
    "fia2.mla.rope_dim": ("26.0.0", _mla_spec(extra=(("rope_dim", 32),)), "32"),
    "fia2.mla.block_size": ("7.2.0", _mla_spec(block_size=256), "256"),
    "fia2.mla.query_dtype": ("26.0.0", _mla_spec(query_dtype=torch.float16), "float16"),
    "fia2.mla.float_dtype": (
        "26.0.0",
        _mla_spec(mode="float", cache_dtype=BF16, query_dtype=torch.float32),
        "float32",
    ),
    "quantize.static.input_dtype": (
        "7.1.0",
        linear_spec("quantize_static", "npu", input_dtype=torch.float64, k=64),
        "float64",
    ),
    "quantize.mul_mode.scale_dtype": (
        "26.0.0",
        linear_spec("quantize_static", "npu", input_dtype=BF16, scale_exact=False),
        "False",
    ),
    "dynamic_quant.input_dtype": (
        "7.2.0",
        linear_spec("dynamic_quant", "npu", input_dtype=torch.float32, k=64),
        "float32",
    ),
    "qmm.out_dtype": (
        "7.3.0",
        linear_spec(
            "quant_matmul_dynamic",
            "npu",
            out_dtype=torch.float32,
            scale_dtype=torch.float32,
            k=64,
            n=64,
        ),  # fmt: skip
        "float32",
    ),
    "qmm.k": (
        "26.0.0",
        linear_spec(
            "quant_matmul",
            "npu",
            out_dtype=BF16,
            scale_dtype=torch.float32,
            k=70000,
            n=64,
        ),  # fmt: skip
        "70000",
    ),
    "qmm.n": (
        "7.1.0",
        linear_spec(
            "quant_matmul_dynamic",
            "npu",
            out_dtype=BF16,
            scale_dtype=torch.float32,
            k=64,
            n=65536,
        ),  # fmt: skip
        "65536",
    ),
    "qmm.deq_scale": (
        "26.0.0",
        linear_spec(
            "quant_matmul",
            "npu",
            out_dtype=BF16,
            scale_dtype=torch.int64,
            k=64,
            n=64,
        ),  # fmt: skip
        "(int64, bfloat16)",
    ),
}


def test_every_spec_rule_has_a_counter_example():
    assert {r.id for r in RULES if r.kind == "spec"} == set(SPEC_COUNTER)


@pytest.mark.parametrize("rule_id", sorted(SPEC_COUNTER))
def test_the_table_refuses_the_counter_spec(rule_id):
    release, spec, value = SPEC_COUNTER[rule_id]
    reasons = [r for r in unsupported_reasons(spec, release) if f"[{rule_id}]" in r]
    assert len(reasons) == 1, unsupported_reasons(spec, release)
    assert f"= {value}," in reasons[0] and f"torch_npu {release}" in reasons[0]
    assert "Ascend/op-plugin:" in reasons[0]


@pytest.mark.parametrize("release", RELEASES)
def test_documented_configurations_pass_the_table(release):
    newer = RELEASES.index(release) >= 1
    ok = [
        linear_spec("quantize_static", "npu", input_dtype=BF16, k=4096),
        linear_spec("dynamic_quant", "npu", input_dtype=torch.float16, k=4096),
        linear_spec(
            "quant_matmul",
            "npu",
            out_dtype=torch.float16,
            scale_dtype=torch.int64,
            k=4096,
            n=65535,
        ),  # fmt: skip
        linear_spec(
            "quant_matmul_dynamic",
            "npu",
            out_dtype=BF16,
            scale_dtype=torch.float32,
            k=65535,
            n=4096,
        ),  # fmt: skip
        _float_spec(),
        _spec(mode="faquant", layout="nd"),
        _spec(op="cache_write", layout="nd"),
    ]
    if newer:
        ok += [_spec(), _mla_spec(), _spec(op="cache_write")]
    for spec in ok:
        assert unsupported_reasons(spec, release) == [], (spec, release)
    if not newer:
        for spec in (_spec(), _mla_spec(), _spec(op="cache_write")):
            (reason,) = unsupported_reasons(spec, release)
            assert "documented from torch_npu 7.2.0" in reason
            assert "not in torch_npu 7.1.0" in reason
