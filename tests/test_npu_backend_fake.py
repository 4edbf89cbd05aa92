"""NPU backend argument mapping, checked with a RECORDING FAKE of torch_npu.

No device is involved: :mod:`fake_torch_npu` stands in for ``torch_npu`` and the
backend runs on CPU tensors through ``NPUOnCPU`` (the real backend class with
``device_type = "cpu"``), so the mapping, the documented signatures and the
constraint checks are exercised; the fake computes results from the dequantized
inputs, which are compared with the CPU emulation.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_torch_npu
import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape
from ascend_fa.backends.npu import NPUBackend

from ascend_fa import (
    PagedKVCache,
    mla_paged_attention,
    paged_attention,
    prefill_attention,
    reshape_and_cache,
    reshape_and_cache_mla,
)

TESTS = Path(__file__).parent


class NPUOnCPU(NPUBackend):
    """The NPU backend's mapping on CPU tensors (the fake does the "device" work)."""

    device_type = "cpu"


@pytest.fixture
def fake():
    module = fake_torch_npu.install()
    yield module
    fake_torch_npu.uninstall()


def _table(rng, lens, bs):
    per = [-(-n // bs) for n in lens]
    order = torch.randperm(sum(per) + 1, generator=rng).tolist()
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    slots, pos = [], 0
    for b, n in enumerate(lens):
        blocks = order[pos : pos + per[b]]
        pos += per[b]
        table[b, : per[b]] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[t // bs] * bs + t % bs for t in range(n)]
    return table, torch.tensor(slots, dtype=torch.int32), sum(per) + 1


def _gqa_env(rng, layout, lens=(20, 150), hkv=2, d=128, bs=128):
    table, slots, nb = _table(rng, list(lens), bs)
    shape = (
        nz_cache_shape(nb, bs, hkv, d, torch.int8)
        if layout == "nz"
        else (nb, bs, hkv, d)
    )
    t = slots.numel()
    key = torch.randn(t, hkv, d, generator=rng).bfloat16()
    value = torch.randn(t, hkv, d, generator=rng).bfloat16()
    return dict(
        table=table,
        slots=slots,
        shape=shape,
        key=key,
        value=value,
        ks=torch.tensor([0.03, 0.025]),
        vs=torch.tensor([0.02, 0.03]),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("layout,mode", [("nz", "PA_NZ"), ("nd", "Norm")])
def test_cache_write_maps_to_quantize_then_scatter(fake, rng, layout, mode):
    env = _gqa_env(rng, layout)
    npu_k = torch.zeros(env["shape"], dtype=torch.int8)
    npu_v = npu_k.clone()
    cpu_k, cpu_v = npu_k.clone(), npu_k.clone()
    slots = env["slots"].clone()
    slots[3] = -1
    args = (env["key"], env["value"])
    kw = dict(k_scale=env["ks"], v_scale=env["vs"], layout=layout)
    reshape_and_cache(*args, npu_k, npu_v, slots, **kw, backend=NPUOnCPU())
    reshape_and_cache(*args, cpu_k, cpu_v, slots, **kw, backend="cpu")
    assert [c.name for c in fake.calls] == [
        "npu_quantize",
        "npu_quantize",
        "npu_scatter_pa_kv_cache",
    ]
    quant = fake.calls[0]
    t = slots.numel()
    assert quant["input"] == ((t, 2 * 128), torch.bfloat16)
    assert quant["scales"] == ((2 * 128,), torch.float32)
    assert quant["dtype"] is torch.qint8 and quant["axis"] == -1 and quant["div_mode"]
    scatter = fake.calls[2]
    assert scatter["cache_mode"] == mode
    assert scatter["key"] == ((t, 2, 128), torch.int8)
    assert scatter["slot_mapping"] == ((t,), torch.int32)
    assert torch.equal(npu_k, cpu_k) and torch.equal(npu_v, cpu_v)  # codes bit-exact


def test_int8_kv_decode_maps_to_fused_infer_attention(fake, rng):
    env = _gqa_env(rng, "nz")
    kc = torch.zeros(env["shape"], dtype=torch.int8)
    vc = kc.clone()
    reshape_and_cache(
        env["key"],
        env["value"],
        kc,
        vc,
        env["slots"],
        k_scale=env["ks"],
        v_scale=env["vs"],
    )
    q = torch.randn(2, 8, 128, generator=rng).bfloat16()
    kw = dict(
        num_kv_heads=2, scale=1 / math.sqrt(128), k_scale=env["ks"], v_scale=env["vs"]
    )
    args = (q, kc, vc, env["table"], env["seq_lens"])
    out = paged_attention(*args, **kw, backend=NPUOnCPU())
    emu = paged_attention(*args, **kw, backend="cpu")
    (call,) = fake.calls_to("npu_fused_infer_attention_score")
    assert call["query"] == ((2, 8, 1, 128), torch.bfloat16)
    nb = env["shape"][0]
    assert call["key"] == ((nb, 2, 4, 128, 32), torch.int8)
    assert call["key_antiquant_scale"] == ((2, 1, 128), torch.float32)
    assert call["num_heads"] == 8 and call["num_key_value_heads"] == 2
    assert call["input_layout"] == "BNSD" and call["block_size"] == 128
    assert call["actual_seq_lengths_kv"] == [20, 150]
    assert call["key_antiquant_mode"] == 0 and call["inner_precise"] == 1
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert float((out.float() - emu.float()).abs().max()) <= 1e-2


def test_faquant_decode_maps_to_atb_paged_attention_quant(fake, rng):
    env = _gqa_env(rng, "nd")
    cache = PagedKVCache(
        1,
        2,
        128,
        num_blocks=env["shape"][0],
        block_size=128,
        mode="faquant",
        backend=NPUOnCPU(),
    )
    assert cache.layout == "nd"  # the ATB FAQuant op reads ND int8 caches
    kc, vc = cache.layer(0)
    assert kc.shape == env["shape"]
    reshape_and_cache(
        env["key"],
        env["value"],
        kc,
        vc,
        env["slots"],
        k_scale=env["ks"],
        v_scale=env["vs"],
        layout="nd",
        backend=NPUOnCPU(),
    )
    q = torch.randn(2, 8, 128, generator=rng).bfloat16()
    qs = torch.full((8,), 0.03)
    kw = dict(
        num_kv_heads=2,
        scale=1 / math.sqrt(128),
        k_scale=env["ks"],
        v_scale=env["vs"],
        q_scale=qs,
        layout="nd",
    )
    args = (q, kc, vc, env["table"], env["seq_lens"])
    out = paged_attention(*args, **kw, backend=NPUOnCPU())
    emu = paged_attention(*args, **kw, backend="cpu")
    (call,) = fake.calls_to("_npu_paged_attention_quant")
    assert call["query"] == ((2, 8, 128), torch.int8)
    assert call["quant_type"] == 3 and call["outdatatype"] == 27
    assert call["qk_descale"] == ((8,), torch.float32)
    assert call["num_kv_heads"] == 2 and call["num_heads"] == 8
    assert float((out.float() - emu.float()).abs().max()) <= 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_mla_decode_maps_to_fused_infer_attention_v2(fake, rng, static):
    lens, bs = [30, 140], 128
    table, slots, nb = _table(rng, lens, bs)
    latent = torch.randn(slots.numel(), 512, generator=rng).bfloat16()
    rope = torch.randn(slots.numel(), 64, generator=rng).bfloat16()
    lc = torch.zeros(nz_cache_shape(nb, bs, 1, 512, torch.int8), dtype=torch.int8)
    rc = torch.zeros(
        nz_cache_shape(nb, bs, 1, 64, torch.bfloat16), dtype=torch.bfloat16
    )
    ks = torch.tensor([0.03])
    reshape_and_cache_mla(latent, rope, lc, rc, slots, k_scale=ks, backend=NPUOnCPU())
    lc2, rc2 = torch.zeros_like(lc), torch.zeros_like(rc)
    reshape_and_cache_mla(latent, rope, lc2, rc2, slots, k_scale=ks, backend="cpu")
    assert torch.equal(lc, lc2) and torch.equal(rc, rc2)
    qn = torch.randn(2, 4, 512, generator=rng).bfloat16()
    qr = torch.randn(2, 4, 64, generator=rng).bfloat16()
    qs = torch.full((4,), 0.03) if static else None
    sl = torch.tensor(lens, dtype=torch.int32)
    args = (qn, qr, lc, rc, table, sl)
    out = mla_paged_attention(
        *args, scale=0.07, k_scale=ks, q_scale=qs, backend=NPUOnCPU()
    )
    emu = mla_paged_attention(*args, scale=0.07, k_scale=ks, q_scale=qs, backend="cpu")
    (call,) = fake.calls_to("npu_fused_infer_attention_score_v2")
    assert call["query"] == ((2, 1, 4, 512), torch.int8)
    assert call["key"] == ((nb, 1, 16, 128, 32), torch.int8)
    assert call["key_rope"] == ((nb, 1, 4, 128, 16), torch.bfloat16)
    assert call["dequant_scale_query"] == ((2, 1, 4), torch.float32)
    assert call["dequant_scale_key"] == ((1,), torch.float32)
    assert (call["query_quant_mode"], call["key_quant_mode"]) == (3, 0)
    assert call["input_layout"] == "BSND_NBSD" and call["actual_seq_kvlen"] == lens
    assert out.shape == (2, 4, 512)
    assert float((out.float() - emu.float()).abs().max()) <= 1e-2


def test_unsupported_specs_are_refused_before_any_device_call(fake, rng):
    d, hkv, bs = 64, 2, 64
    kc = torch.zeros(nz_cache_shape(3, bs, hkv, d, torch.int8), dtype=torch.int8)
    q = torch.randn(1, 4, d).half()
    with pytest.raises(ValueError) as err:
        paged_attention(
            q,
            kc,
            kc.clone(),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            num_kv_heads=hkv,
            scale=0.1,
            k_scale=torch.full((hkv,), 0.1),
            v_scale=torch.full((hkv,), 0.1),
            backend=NPUOnCPU(),
        )
    msg = str(err.value)
    for reason in ("needs a bf16 query", "needs head_dim 128", "block_size 128 or 512"):
        assert reason in msg
    # FAQuant over an NZ cache, and prefill, are refused too
    with pytest.raises(ValueError, match="ND int8 caches"):
        paged_attention(
            q.bfloat16(),
            kc,
            kc.clone(),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            num_kv_heads=hkv,
            scale=0.1,
            k_scale=torch.full((hkv,), 0.1),
            v_scale=torch.full((hkv,), 0.1),
            q_scale=torch.full((4,), 0.1),
            backend=NPUOnCPU(),
        )
    with pytest.raises(ValueError, match="prefill is not mapped"):
        prefill_attention(
            q.bfloat16().unsqueeze(1),
            kc,
            kc.clone(),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            num_kv_heads=hkv,
            scale=0.1,
            k_scale=torch.full((hkv,), 0.1),
            v_scale=torch.full((hkv,), 0.1),
            backend=NPUOnCPU(),
        )
    assert fake.calls == []  # nothing reached torch_npu


def test_fake_rejects_undocumented_arguments(fake):
    key = torch.zeros(2, 1, 32, dtype=torch.int8)
    cache = torch.zeros(1, 1, 32, 32, dtype=torch.int8)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(fake_torch_npu.FakeSignatureError, match="cache_mode must be"):
        fake.npu_scatter_pa_kv_cache(key, key, cache, cache, slots, cache_mode="NZ")
    with pytest.raises(fake_torch_npu.FakeSignatureError, match="unknown keyword"):
        fake.npu_scatter_pa_kv_cache(
            key, key, cache, cache, slots, cache_mode="PA_NZ", layout="nz"
        )
    with pytest.raises(fake_torch_npu.FakeSignatureError, match="slot_mapping dtype"):
        fake.npu_scatter_pa_kv_cache(
            key, key, cache, cache, slots.long(), cache_mode="PA_NZ"
        )
    with pytest.raises(
        fake_torch_npu.FakeSignatureError, match="div_mode must be True"
    ):
        fake.npu_quantize(
            torch.zeros(2, 4), torch.ones(4), None, torch.qint8, -1, div_mode=False
        )


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=TESTS,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_ascend_fa_never_imports_torch_npu():
    out = _run("""
        import sys
        import ascend_fa
        ascend_fa.reshape_and_cache, ascend_fa.paged_attention, ascend_fa.PagedKVCache
        import ascend_fa.backends.npu
        print('torch_npu' in sys.modules)
    """)
    assert out == "False"


def test_npu_kernels_registered_after_import_subprocess():
    """With PrivateUse1 named "npu" (what torch_npu's import does), importing the
    backend's torch_npu registers an ``npu`` kernel for each ascend_fa op."""
    out = _run("""
        import torch
        import fake_torch_npu
        from ascend_fa.backends import npu
        fake_torch_npu.install(rename_privateuse1=True)
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        before = has("ascend_fa::paged_attention", "PrivateUse1")
        npu.import_torch_npu()
        names = ["reshape_and_cache", "reshape_and_cache_mla", "paged_attention",
                 "mla_paged_attention"]
        print(before, all(has(f"ascend_fa::{n}", "PrivateUse1") for n in names))
    """)
    assert out == "False True"


def test_selftest_through_the_fake_npu_backend(fake):
    """``ascend-fa selftest --backend npu`` logic: every op the NPU maps passes against
    the CPU reference; prefill (not mapped) is reported as SKIP with its reason."""
    from ascend_fa.cli.selftest import run_selftest

    rows = {r["op"]: r for r in run_selftest(NPUOnCPU(), seed=1)}
    assert rows["prefill_attention int8_kv"]["status"] == "SKIP"
    assert "prefill is not mapped" in rows["prefill_attention int8_kv"]["detail"]
    assert rows["mla_prefill_attention"]["status"] == "SKIP"
    others = [r for name, r in rows.items() if "prefill" not in name]
    assert all(r["status"] == "PASS" for r in others), others
    names = {c.name for c in fake.calls}
    assert names == {
        "npu_quantize",
        "npu_scatter_pa_kv_cache",
        "npu_fused_infer_attention_score",
        "_npu_paged_attention_quant",
        "npu_fused_infer_attention_score_v2",
    }


def test_cache_write_and_mla_widths_refused_on_npu(fake):
    key = torch.randn(4, 4, 8).half()  # D * 2 bytes = 16: not a whole 32-byte row
    kc = torch.zeros(nz_cache_shape(2, 16, 4, 8, torch.float16), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"needs D \* itemsize % 32 == 0, got 8 \* 2"):
        reshape_and_cache(key, key, kc, kc.clone(), torch.arange(4), backend=NPUOnCPU())
    lat = torch.randn(3, 128).bfloat16()
    rope = torch.randn(3, 32).bfloat16()
    lc = torch.zeros(nz_cache_shape(2, 128, 1, 128, torch.int8), dtype=torch.int8)
    rc = torch.zeros(
        nz_cache_shape(2, 128, 1, 32, torch.bfloat16), dtype=torch.bfloat16
    )
    with pytest.raises(ValueError) as err:
        reshape_and_cache_mla(
            lat,
            rope,
            lc,
            rc,
            torch.arange(3),
            k_scale=torch.tensor([0.1]),
            backend=NPUOnCPU(),
        )
    assert "latent width R = 512, got 128" in str(err.value)
    assert "rope width Dr = 64, got 32" in str(err.value)
    assert fake.calls == []
