"""The native fused decode over an int8 paged cache (``afa_gqa_decode``) against
the eager torch path and the float64 reference: every query mode, both layouts,
vector and scalar paths, any thread count, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops.attention import paged_attention_cpu, paged_attention_ref
from ascend_fa.atb_ops.native import native_disabled, native_kernels
from test_paged_attention import FLOOR, _amax_scale, build

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="no native kernels (no C compiler)"
)

#: |native - eager| <= REL * max|eager|: the two differ by fp32 rounding only (the
#: order of the dot products' and P.V's sums, a ~1 ulp exp), a few ulp of the
#: largest output.
REL = 1e-5


def _case(rng, mode, layout, d, lens, dtype=torch.float32, hkv=2, h=6):
    env = build(rng, mode="faquant", dtype=dtype, layout=layout, lens=lens, h=h,
                hkv=hkv, d=d)  # fmt: skip
    query = torch.randn(len(lens), h, d, generator=rng).to(dtype)
    if mode == "faquant":
        sc = dict(k_scale=env["ks"], v_scale=env["vs"], q_scale=_amax_scale(query, 1))
    elif mode == "c8_channel":
        sc = {
            n + "_scale": (
                env[n + "s"].view(hkv, 1) * (1 + torch.rand(hkv, d, generator=rng))
            ).contiguous()  # fmt: skip
            for n in "kv"
        }
    else:  # int8 K/V per head, float query
        sc = dict(k_scale=env["ks"], v_scale=env["vs"])
    args = (query, env["kc"], env["vc"], env["table"], env["seq_lens"], hkv,
            1 / math.sqrt(d))  # fmt: skip
    return args, sc, layout


def _call(args, sc, layout):
    return paged_attention_cpu(*args, sc.get("k_scale"), sc.get("v_scale"),
                               sc.get("q_scale"), layout)  # fmt: skip


def _close(native, eager):
    err = float((native.double() - eager.double()).abs().max())
    assert err <= REL * float(eager.double().abs().max()) + 1e-7, err


@pytest.mark.parametrize("layout,d", [("nd", 64), ("nd", 32), ("nd", 20), ("nz", 64)])
@pytest.mark.parametrize("mode", ["faquant", "c8_channel", "int8_kv"])
def test_native_equals_eager_within_fp32_rounding(rng, mode, layout, d):
    """Lengths 1, inside a block, on a block boundary and across blocks (BS 32);
    D 20 takes the scalar loops (not a multiple of 8)."""
    case = _case(rng, mode, layout, d, [1, 37, 64, 70])
    native = _call(*case)
    with native_disabled():
        eager = _call(*case)
    _close(native, eager)
    args, sc, _ = case
    kw = dict(num_kv_heads=args[5], scale=args[6], layout=layout, **sc)
    ref = paged_attention_ref(*args[:5], **kw)
    assert float((native.double() - ref).abs().max()) <= FLOOR


def test_scalar_path_equals_vector_path_within_fp32_rounding(rng):
    kernels = native_kernels()
    case = _case(rng, "faquant", "nd", 64, [5, 70, 33])
    vec = _call(*case)
    try:
        kernels.set_simd(False)
        scalar = _call(*case)
    finally:
        kernels.set_simd(True)
    _close(scalar, vec)


def test_thread_count_does_not_change_a_bit(rng):
    """The tasks (sequence, KV head) split across threads; each task's arithmetic
    is the same whichever thread runs it."""
    case = _case(rng, "c8_channel", "nd", 64, [9, 70, 41, 3, 64], hkv=3, h=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _call(*case)
        torch.set_num_threads(max(2, threads))
        many = _call(*case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_bf16_query_output_dtype_and_budget(rng):
    case = _case(rng, "faquant", "nz", 64, [70, 12], dtype=torch.bfloat16)
    out = _call(*case)
    assert out.dtype == torch.bfloat16
    with native_disabled():
        eager = _call(*case)
    # one bf16 rounding of values that differ by fp32 rounding: at most 1 ulp apart
    assert float((out.float() - eager.float()).abs().max()) <= 2**-7 * float(
        eager.float().abs().max()
    )


def test_unchecked_call_refuses_bad_block_and_length(rng):
    """``paged_attention_cpu`` is also called directly, unchecked (a serving
    step's later layers): the kernel still refuses a block id outside the cache
    and a length past the block table, in one line, instead of reading outside."""
    args, sc, layout = _case(rng, "faquant", "nd", 64, [40, 9])
    bad = args[3].clone()
    bad[0, 1] = 10_000
    with pytest.raises(ValueError, match="block_table names a block outside"):
        _call((*args[:3], bad, *args[4:]), sc, layout)
    long = args[4].clone()
    long[1] = 10_000
    with pytest.raises(ValueError, match="sequence length is outside"):
        _call((*args[:4], long, *args[5:]), sc, layout)


def _child_decode(case, conn):
    torch.set_num_threads(2)
    conn.send(_call(*case).numpy().tobytes())  # bytes: no shared-memory handle
    conn.close()


def test_forked_child_runs_its_own_threads(rng):
    """A child forked after the parent's decode ran its worker threads still
    decodes (its own pool: the parent's threads do not exist in it)."""
    import multiprocessing as mp

    case = _case(rng, "faquant", "nd", 64, [70, 33, 9], hkv=3, h=9)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = _call(*case)
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_decode, args=(case, child))
        proc.start()
        assert parent.poll(60), "the forked child's decode did not finish"
        got = parent.recv()
        proc.join(10)
    finally:
        torch.set_num_threads(threads)
    assert got == want.numpy().tobytes()
