"""The W8A8 linear ops' NPU mapping driven into the STRICT FAKE of torch_npu, once
per release.

Like ``test_npu_backend_fake.py``: the NPU backend registers its kernels for the
PrivateUse1 key when it imports the fake (:mod:`strict_fake_torch_npu`, bound to
each release's yaml schemas, every documented rule enforced, the device's values
returned); the tests redispatch the ``ascend_fa`` linear ops to that key with host
tensors. Integer codes and matmul outputs must equal the plain-Python golden
references of ``atb_ops/linear.py`` bit for bit; refusals happen before any
torch_npu call and name the rule and the release.
"""

from __future__ import annotations

import pytest
import strict_fake_torch_npu as fake_npu
import torch
from ascend_fa.atb_ops.linear import (
    dynamic_quant_ref,
    encode_deq_scale_int64,
    quant_matmul_dynamic_ref,
    quant_matmul_ref,
    quantize_static_ref,
)
from ascend_fa.backends import CapabilityError
from ascend_fa.backends import npu as npu_backend
from ascend_fa.backends.npu_capabilities import RELEASE_ENV_VAR, RELEASES

from ascend_fa.linear.modules import W8A8DynamicLinear, W8A8Linear

PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
BF16, F16, I8 = torch.bfloat16, torch.float16, torch.int8


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
    yield module
    fake_npu.uninstall()


def refused(fake, fn, *names) -> str:
    with pytest.raises(CapabilityError) as err:
        fn()
    msg = str(err.value)
    for name in (*names, f"torch_npu {fake.release}"):
        assert name in msg, msg
    assert fake.calls == []
    return msg


def _x(m=5, k=96, dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[1, 7] = 40.0  # saturates
    return x.to(dtype)


def _codes(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


# -- quantize_static ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_quantize_static_multiply_mode(fake, dtype):
    x = _x(dtype=dtype)
    # 1 / input_scale in the model dtype, as W8A8Linear passes it
    scale = torch.reciprocal(torch.tensor([0.037], dtype=dtype)).float()
    offset = torch.tensor([-3.0])
    got = npu_op("quantize_static", x, scale, offset, False)
    assert torch.equal(got, quantize_static_ref(x, scale, offset, False))
    (call,) = fake.calls
    assert call.name == "npu_quantize"
    assert call["div_mode"] is False and call["axis"] == -1
    for name in ("scales", "zero_points"):
        assert call[name].dtype == dtype and tuple(call[name].shape) == (96,)


@pytest.mark.parametrize("offset", [0.0, 5.0])
def test_quantize_static_divide_mode(fake, offset):
    x = _x(dtype=torch.float32)
    scale, off = torch.tensor([0.0371]), torch.tensor([offset])
    got = npu_op("quantize_static", x, scale, off, True)
    assert torch.equal(got, quantize_static_ref(x, scale, off, True))
    zero = fake.calls[0]["zero_points"]
    assert (zero is None) == (offset == 0.0)


def test_quantize_static_refusals(fake):
    x = _x()
    # 0.1 is not a bfloat16 value: the device would multiply by another scale
    refused(
        fake,
        lambda: npu_op(
            "quantize_static", x, torch.tensor([0.1]), torch.zeros(1), False
        ),
        "[quantize.mul_mode.scale_dtype]",
        "= False",
    )
    refused(
        fake,
        lambda: npu_op(
            "quantize_static", x.double(), torch.tensor([0.5]), torch.zeros(1), False
        ),
        "[quantize.static.input_dtype]",
        "float64",
    )


# -- dynamic_quant -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_dynamic_quant_with_an_all_zero_row(fake, dtype):
    x = _x(dtype=dtype)
    x[3] = 0  # the device leaves this row's codes undefined (the fake writes 127)
    codes, scale = npu_op("dynamic_quant", x)
    want_codes, want_scale = dynamic_quant_ref(x)
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert bool((codes[3] == 0).all()) and float(scale[3]) == 0.0
    assert fake.call_names == ["npu_dynamic_quant"]


def test_dynamic_quant_refuses_float32(fake):
    refused(
        fake,
        lambda: npu_op("dynamic_quant", _x(dtype=torch.float32)),
        "[dynamic_quant.input_dtype]",
        "float32",
    )


# -- quant_matmul --------------------------------------------------------------------
def _static_operands(n=48, k=96, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x_q, w = _codes((5, k), seed), _codes((n, k), seed + 1)
    deq = (torch.rand(n, generator=gen) + 0.5) * 1e-4
    qb = torch.randint(-(2**20), 2**20, (n,), generator=gen, dtype=torch.int32)
    return x_q, w, deq, qb


@pytest.mark.parametrize("out", ["bfloat16", "float16"])
def test_quant_matmul_float32_scale(fake, out):
    x_q, w, deq, qb = _static_operands()
    got = npu_op("quant_matmul", x_q, w, deq, qb, out)
    want = quant_matmul_ref(x_q, w, deq, qb, getattr(torch, out))
    assert got.dtype == want.dtype and torch.equal(got, want)
    (call,) = fake.calls
    assert tuple(call["x2"].shape) == (96, 48) and call["x2"].is_contiguous()
    assert call["bias"].dtype == torch.int32 and call["pertoken_scale"] is None


def test_quant_matmul_int64_scale_fp16_model(fake):
    x_q, w, deq, qb = _static_operands()
    deq64 = encode_deq_scale_int64(deq)  # low mantissa bits dropped by the device
    got = npu_op("quant_matmul", x_q, w, deq64, None, "float16")
    assert torch.equal(got, quant_matmul_ref(x_q, w, deq64, None, F16))


def test_quant_matmul_refusals(fake):
    x_q, w, deq, qb = _static_operands()
    refused(
        fake,
        lambda: npu_op("quant_matmul", x_q, w, deq, qb, "float32"),
        "[qmm.out_dtype]",
        "float32",
    )
    deq64 = encode_deq_scale_int64(deq)
    refused(
        fake,
        lambda: npu_op("quant_matmul", x_q, w, deq64, qb, "bfloat16"),
        "[qmm.deq_scale]",
        "(int64, bfloat16)",
    )


@pytest.mark.parametrize("out", ["bfloat16", "float16"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_matmul_dynamic(fake, out, with_bias):
    gen = torch.Generator().manual_seed(3)
    x_q, w = _codes((5, 96), 4), _codes((48, 96), 5)
    ws = (torch.rand(48, generator=gen) + 0.5) * 1e-3
    pts = (torch.rand(5, generator=gen) + 0.5) * 1e-2
    bias = torch.randn(48, generator=gen).to(BF16).float() if with_bias else None
    got = npu_op("quant_matmul_dynamic", x_q, w, ws, pts, bias, out)
    want = quant_matmul_dynamic_ref(x_q, w, ws, pts, bias, getattr(torch, out))
    assert torch.equal(got, want)
    (call,) = fake.calls
    assert call["pertoken_scale"].dtype == torch.float32
    assert call["bias"] is None or call["bias"].dtype == torch.float32


# -- whole linears: the module's integer forward, op by op on the npu kernels ---------
def test_w8a8_linear_forward_on_the_npu_kernels(fake):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 64, generator=gen) * 0.05
    bias = torch.randn(40, generator=gen) * 0.1
    x = _x(m=7, k=64, seed=7)
    lin = W8A8Linear.from_float(weight, bias, -4.0, 6.0, dtype=BF16, name="l")
    q = npu_op(
        "quantize_static", x, lin.activation_reciprocal(),
        lin.input_offset.float(), False,
    )  # fmt: skip
    y = npu_op("quant_matmul", q, lin.weight, lin.deq_scale, lin.quant_bias, "bfloat16")
    assert torch.equal(y, lin(x))
    dyn = W8A8DynamicLinear.from_float(weight, bias, dtype=BF16)
    q, pts = npu_op("dynamic_quant", x)
    y = npu_op(
        "quant_matmul_dynamic", q, dyn.weight, dyn.weight_scale, pts, dyn.bias,
        "bfloat16",
    )  # fmt: skip
    assert torch.equal(y, dyn(x))
