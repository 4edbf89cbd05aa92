"""W8A8 linear ops: bit-equal to the naive loop references, opcheck, bad input."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import linear as linear_ops
from ascend_fa.atb_ops.linear import (
    decode_deq_scale,
    dynamic_quant,
    dynamic_quant_ref,
    encode_deq_scale_int64,
    int_gemm,
    int_gemm_float,
    quant_matmul,
    quant_matmul_dynamic,
    quant_matmul_dynamic_ref,
    quant_matmul_ref,
    quantize_static,
    quantize_static_ref,
)


def _codes(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("div_mode", [False, True])
def test_quantize_static_matches_ref(dtype, div_mode):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 13, generator=g) * 3).to(dtype)
    # exact ties on purpose: x * scale + offset lands on .5 for some elements
    x[0, :4] = torch.tensor([0.25, 0.75, -0.25, 1.25]).to(dtype)
    scale = torch.tensor([2.0]) if not div_mode else torch.tensor([0.5])
    offset = torch.tensor([3.0])
    got = quantize_static(x, scale, offset, div_mode=div_mode)
    assert got.dtype == torch.int8
    assert torch.equal(got, quantize_static_ref(x, scale, offset, div_mode))
    # offset added before rounding: 0.25 * 2 + 3 = 3.5 -> 4 (ties to even)
    if not div_mode:
        assert int(got[0, 0]) == 4 and int(got[0, 1]) == 4  # 1.5 + 3 = 4.5 -> 4


def test_quantize_static_saturates():
    x = torch.tensor([[1e6, -1e6, 0.0]])
    got = quantize_static(x, torch.tensor([1.0]), torch.tensor([-5.0]))
    assert got.tolist() == [[127, -128, -5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dynamic_quant_matches_ref(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 11, generator=g) * 2).to(dtype)
    x[3] = 0  # all-zero token: codes 0, scale 0 (documented safe value)
    q, s = dynamic_quant(x)
    rq, rs = dynamic_quant_ref(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert float(s[3]) == 0.0 and bool((q[3] == 0).all())
    assert bool((q.abs().amax(dim=1)[[0, 1, 2, 4, 5]] == 127).all())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deq_kind", ["fp32", "int64"])
def test_quant_matmul_matches_ref(out_dtype, deq_kind):
    x, w = _codes((5, 37), 3), _codes((9, 37), 4)
    g = torch.Generator().manual_seed(5)
    deq = torch.rand(9, generator=g) * 1e-3 + 1e-5
    if deq_kind == "int64":
        deq = encode_deq_scale_int64(deq)
    qb = torch.randint(-(2**20), 2**20, (9,), generator=g, dtype=torch.int32)
    got = quant_matmul(x, w, deq, qb, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (5, 9)
    assert torch.equal(got, quant_matmul_ref(x, w, deq, qb, out_dtype))
    assert torch.equal(
        quant_matmul(x, w, deq, None, out_dtype=out_dtype),
        quant_matmul_ref(x, w, deq, None, out_dtype),
    )


def test_quant_matmul_integer_sum_is_exact_for_large_k():
    # Every product is -128 * -128: the sum 16384 * K is far beyond fp32's 2**24,
    # and the op must still see the exact integer before the fp32 conversion.
    k = 4099
    x = torch.full((2, k), -128, dtype=torch.int8)
    w = torch.full((3, k), -128, dtype=torch.int8)
    got = quant_matmul(x, w, torch.ones(3), torch.tensor([1, 0, -1], dtype=torch.int32))
    exact = [16384 * k + 1, 16384 * k, 16384 * k - 1]
    want = torch.tensor(exact, dtype=torch.float64).float()
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("int8_gemm", [True, False], ids=["int_mm", "fp32-chunks"])
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (3, 7, 5), (17, 1500, 24), (5, 2051, 9), (0, 8, 4)]
)
def test_int_gemm_is_the_exact_int32_product(shape, int8_gemm, monkeypatch):
    """Both spellings of the accumulator (torch's int8 GEMM, and fp32 GEMMs over
    exact K chunks for CPUs where those are faster, builds or devices without it)
    equal a naive integer loop, including K beyond one 1024-wide chunk (two and
    three chunks) and an empty batch."""
    if int8_gemm and not hasattr(torch, "_int_mm"):
        pytest.skip("this torch build has no torch._int_mm")
    monkeypatch.setattr(linear_ops, "_CPU_INT_MM", int8_gemm)
    m, k, n = shape
    x, w = _codes((m, k), seed=3), _codes((n, k), seed=4)
    got = int_gemm(x, w)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    want = [[sum(a * b for a, b in zip(r, c)) for c in w.tolist()] for r in x.tolist()]
    assert got.tolist() == want
    # the extreme sum: -128 * -128 over K = 65535, the largest K the device takes
    big = torch.full((1, 65535), -128, dtype=torch.int8)
    assert int(int_gemm(big, big)[0, 0]) == 16384 * 65535


@pytest.mark.parametrize("int8_gemm", [True, False], ids=["int_mm", "fp32-chunks"])
@pytest.mark.parametrize("k", [1, 1024, 1500, 2048, 2051])
def test_int_gemm_float_is_the_int32_product_converted(k, int8_gemm, monkeypatch):
    """``int_gemm_float`` of int8 codes or of the same integers held in float equals
    ``int_gemm(...).float()`` bit for bit: one, two (added in fp32) and three
    chunks (added in int32), with sums past 2**24 where fp32 rounds."""
    if int8_gemm and not hasattr(torch, "_int_mm"):
        pytest.skip("this torch build has no torch._int_mm")
    monkeypatch.setattr(linear_ops, "_CPU_INT_MM", int8_gemm)
    x, w = _codes((6, k), seed=5), _codes((4, k), seed=6)
    x[0], w[0] = -128, -128  # the largest sums: 16384 * k
    x[1, : k // 2], w[1] = 127, 127
    want = int_gemm(x, w).float()
    for a, b in ((x, w), (x.float(), w.float())):
        got = int_gemm_float(a, b)
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.fixture
def auto_path(monkeypatch):
    """``ASCEND_FA_INT_GEMM`` unset, no in-process override, nothing decided or
    timed yet; yields a function that makes ``auto`` see the given int8
    dot-product instructions."""
    monkeypatch.delenv(linear_ops.INT_GEMM_ENV, raising=False)
    monkeypatch.setattr(linear_ops, "_CPU_INT_MM", None)
    monkeypatch.setattr(linear_ops, "_CPU_PATH", None)
    monkeypatch.setattr(linear_ops, "_SHAPES", {})

    def cpu_has(*names):
        monkeypatch.setattr(linear_ops, "_CPU_PATH", None)
        monkeypatch.setattr(linear_ops, "int8_dot_instructions", lambda: names)

    return cpu_has


def test_int_gemm_path_is_decided_by_the_cpu_instructions(auto_path):
    """``auto`` picks ``_int_mm`` from the CPU's int8 dot-product instructions
    (no timing), else the fp32 chunks; the reason says which and why."""
    auto_path()
    path = linear_ops.int_gemm_path()
    assert (path.path, path.source, path.timed) == ("fp32", "cpu", False)
    assert "no int8 dot-product instructions" in path.reason
    assert "fp32 GEMM chunks" in path.describe()
    auto_path("AVX512-VNNI", "AMX-INT8")
    path = linear_ops.int_gemm_path()
    assert (path.path, path.source, path.timed) == ("int_mm", "cpu", True)
    assert "AVX512-VNNI, AMX-INT8" in path.reason
    assert linear_ops.int_gemm_path() is path  # decided once per process


def test_int8_dot_instructions_reads_this_cpu():
    """On this machine the answer agrees with the kernel's CPU flags."""
    found = linear_ops.int8_dot_instructions()
    flags = linear_ops._cpu_flags()
    for flag, name in linear_ops._INT8_DOT_FLAGS.items():
        if flag in flags:
            assert name in found


@pytest.mark.parametrize("forced", ["int_mm", "fp32", " FP32 "])
def test_int_gemm_setting_forces_either_path(forced, auto_path, monkeypatch):
    """``ASCEND_FA_INT_GEMM`` overrides the CPU's choice (read on every call) and
    the product runs where it says, exact either way."""
    if not hasattr(torch, "_int_mm"):
        pytest.skip("this torch build has no torch._int_mm")
    auto_path("AVX512-VNNI")
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    monkeypatch.setenv(linear_ops.INT_GEMM_ENV, forced)
    want = forced.strip().lower()
    path = linear_ops.int_gemm_path()
    assert (path.path, path.source, path.timed) == (want, "setting", False)
    assert linear_ops.INT_GEMM_ENV in path.reason
    x, w = _codes((64, 300), seed=1), _codes((40, 300), seed=2)
    got = int_gemm(x, w)
    assert torch.equal(got, linear_ops._chunked_gemm(x, w))
    assert len(calls) == (1 if want == "int_mm" else 0)


def test_int_gemm_setting_refuses_other_values(auto_path, monkeypatch):
    from ascend_fa.settings import SettingError

    monkeypatch.setenv(linear_ops.INT_GEMM_ENV, "fast")
    with pytest.raises(SettingError) as err:
        int_gemm(_codes((4, 8)), _codes((3, 8)))
    assert str(err.value) == (
        "ASCEND_FA_INT_GEMM='fast': expected auto, int_mm or fp32"
    )


@pytest.mark.parametrize("loser", ["int_mm", "fp32"])
def test_a_measured_loss_reverses_int_mm_for_that_shape(loser, auto_path, monkeypatch):
    """Where the CPU picks ``_int_mm``, the first product of each shape runs both
    paths interleaved; ``_int_mm`` stays unless it loses by more than the margin,
    and the verdict holds for the shape (M rounded up to a power of two). The
    clock is a fake one that each call advances (the loser 3 units, the winner
    1), so no real timing is involved; the products stay exact."""
    import types

    if not hasattr(torch, "_int_mm"):
        pytest.skip("this torch build has no torch._int_mm")
    auto_path("AVX512-VNNI")
    real_int, real_fp = torch._int_mm, linear_ops._chunked_gemm
    clock = [0.0]
    calls = {"int_mm": 0, "fp32": 0}

    def timed(name, fn):
        def run(*args):
            calls[name] += 1
            clock[0] += 3.0 if name == loser else 1.0
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "_int_mm", timed("int_mm", real_int))
    monkeypatch.setattr(linear_ops, "_chunked_gemm", timed("fp32", real_fp))
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(linear_ops, "time", fake_time)
    x, w = _codes((100, 256), seed=7), _codes((256, 256), seed=8)
    want = real_fp(x, w)
    assert torch.equal(int_gemm(x, w), want)  # the timed first product
    pairs = linear_ops._TIMED_PAIRS
    assert calls == {"int_mm": 1 + pairs, "fp32": 1 + pairs}
    timing = linear_ops.int_gemm_report()["timed_shapes"]["128x256x256"]
    winner = "fp32" if loser == "int_mm" else "int_mm"
    assert timing == {"path": winner, "ratio": 3.0 if loser == "int_mm" else 0.333}
    # a later product of the same shape class (M = 70 -> 128) is not timed again
    x2 = _codes((70, 256), seed=9)
    assert torch.equal(int_gemm(x2, w), real_fp(x2, w))
    assert calls[winner] == 2 + pairs and calls[loser] == 1 + pairs
    assert torch.equal(int_gemm_float(x2, w), real_fp(x2, w).float())


def test_small_products_are_not_timed(auto_path, monkeypatch):
    auto_path("AVX-VNNI")
    x, w = _codes((8, 64), seed=1), _codes((16, 64), seed=2)
    assert torch.equal(int_gemm(x, w), linear_ops._chunked_gemm(x, w))
    assert linear_ops.int_gemm_report()["timed_shapes"] == {}


def test_int64_deq_scale_keeps_fp19():
    v = torch.tensor([1.0 + 2**-20, 3.0e-4])
    enc = encode_deq_scale_int64(v)
    assert enc.dtype == torch.int64
    # the fp32 bit pattern, as msModelSlim's deqscale2int64 writes it
    assert int(enc[0]) == int(torch.tensor([1.0 + 2**-20]).view(torch.int32))
    dec = decode_deq_scale(enc)
    assert float(dec[0]) == 1.0  # the low 13 mantissa bits are dropped
    bits = int(dec[1:].view(torch.int32))
    assert bits & 0x1FFF == 0
    assert decode_deq_scale(v).equal(v)


@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_matmul_dynamic_matches_ref(with_bias):
    x, w = _codes((4, 21), 6), _codes((7, 21), 7)
    g = torch.Generator().manual_seed(8)
    ws = torch.rand(7, generator=g) * 1e-2
    pts = torch.rand(4, generator=g) * 1e-2
    bias = torch.randn(7, generator=g).bfloat16() if with_bias else None
    for out in (torch.float32, torch.bfloat16):
        got = quant_matmul_dynamic(x, w, ws, pts, bias, out_dtype=out)
        assert torch.equal(got, quant_matmul_dynamic_ref(x, w, ws, pts, bias, out))


def test_opcheck_every_op():
    x = torch.randn(4, 8)
    x_q, w = _codes((4, 8), 9), _codes((3, 8), 10)
    cases = [
        (
            torch.ops.ascend_fa.quantize_static,
            (x, torch.ones(1), torch.zeros(1), False),
        ),
        (torch.ops.ascend_fa.dynamic_quant, (x,)),
        (
            torch.ops.ascend_fa.quant_matmul,
            (x_q, w, torch.ones(3), torch.zeros(3, dtype=torch.int32), "bfloat16"),
        ),
        (torch.ops.ascend_fa.quant_matmul, (x_q, w, torch.ones(3), None, "float32")),
        (
            torch.ops.ascend_fa.quant_matmul_dynamic,
            (x_q, w, torch.ones(3), torch.ones(4), torch.zeros(3), "float16"),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_bad_inputs_name_the_problem():
    x_q, w = _codes((2, 8), 1), _codes((3, 8), 2)
    with pytest.raises(ValueError, match="x_q must be torch.int8"):
        quant_matmul(x_q.float(), w, torch.ones(3))
    with pytest.raises(ValueError, match="K = 7"):
        quant_matmul(_codes((2, 7)), w, torch.ones(3))
    with pytest.raises(ValueError, match=r"deq_scale must have shape \[3\]"):
        quant_matmul(x_q, w, torch.ones(4))
    with pytest.raises(ValueError, match="quant_bias must be one of"):
        quant_matmul(x_q, w, torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="out_dtype"):
        quant_matmul(x_q, w, torch.ones(3), out_dtype=torch.int8)
    with pytest.raises(ValueError, match="pertoken_scale must have shape"):
        quant_matmul_dynamic(x_q, w, torch.ones(3), torch.ones(5))
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        quantize_static(torch.ones(2, 2), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="must be floating"):
        dynamic_quant(x_q)


class _Dispatched(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: with it active, the linears'
    forward takes the checked ops through ``torch.ops`` (no direct CPU call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_forward_direct_path_is_the_ops_bit_for_bit(dtype, rows):
    """The decode fast path of W8A8Linear / W8A8DynamicLinear (the ops' CPU
    arithmetic called directly on the module's checked buffers) gives the integers
    and roundings of the checked ops and of the naive references, one token
    (decode) and several, bias folded (static) and float bias (dynamic)."""
    from ascend_fa.linear import W8A8DynamicLinear, W8A8Linear

    g = torch.Generator().manual_seed(11)
    w = torch.randn(13, 40, generator=g)
    b = torch.randn(13, generator=g)
    x = (torch.randn(2, rows, 40, generator=g) * 3).to(dtype)
    static = W8A8Linear.from_float(w, b, -4.0, 5.0, dtype=dtype)
    dynamic = W8A8DynamicLinear.from_float(w, b, dtype=dtype)
    flat = x.reshape(-1, 40)
    assert static._direct(x) and dynamic._direct(x)
    with _Dispatched():
        assert not static._direct(x)
        static_ops, dynamic_ops = static(x), dynamic(x)
    codes = quantize_static_ref(flat, static.activation_reciprocal(),
                                static.input_offset.float())  # fmt: skip
    ref = quant_matmul_ref(codes, static.weight, static.deq_scale, static.quant_bias,
                           dtype).view(2, rows, 13)  # fmt: skip
    got = static(x)
    assert got.dtype == dtype and torch.equal(got, static_ops) and torch.equal(got, ref)
    q, pts = dynamic_quant_ref(flat)
    ref = quant_matmul_dynamic_ref(q, dynamic.weight, dynamic.weight_scale, pts,
                                   dynamic.bias, dtype).view(2, rows, 13)  # fmt: skip
    got = dynamic(x)
    assert torch.equal(got, dynamic_ops) and torch.equal(got, ref)
