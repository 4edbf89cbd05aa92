"""FP8 E4M3 KV-cache rounding: round to nearest (vLLM on CUDA) and toward zero
(vLLM on CPU, ``fp8_rounding="trunc"``).

The truncation is checked against two independent references: the CPU kernel's bit
recipe replayed one value at a time with Python floats and ``struct``
(:func:`~ascend_fa.atb_ops.cache.fp8_trunc_ref`), and, on E4M3's normal range, the
definition "the largest code whose magnitude does not exceed ``|x / s|``" searched
in the table of all codes.
"""

from __future__ import annotations

import json

import pytest
import torch
from ascend_fa.atb_ops import nz_cache_shape
from ascend_fa.atb_ops.cache import (
    fp8_trunc_ref,
    reshape_and_cache_ref,
    token_rows_ref,
)
from ascend_fa.atb_ops.quant import fp8_codes

from ascend_fa import reshape_and_cache
from ascend_fa.calibration.kv import FP8FakeQuant, KVQuantSpec
from ascend_fa.cli import main

FP8 = torch.float8_e4m3fn
CODES = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # +0 .. 448


def _edge_values(scale: float) -> torch.Tensor:
    """Every non-negative code's value times ``scale``, one fp32 ulp either side,
    midpoints, both signs, zeros, values past 448 and deep in the subnormals."""
    v = CODES.double() * scale
    mids = (v[1:] + v[:-1]) / 2
    base = torch.cat([v, mids]).float()
    up = torch.nextafter(base, torch.full_like(base, float("inf")))
    down = torch.nextafter(base, torch.zeros_like(base))
    tiny = torch.tensor([2.0**-40, 2.0**-31, 2.0**-30, 2.0**-12, 2.0**-10]) * scale
    big = torch.tensor([449.0, 460.0, 1e6, float(torch.finfo(torch.float32).max)])
    pos = torch.cat([base, up, down, tiny.float(), big * scale])
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7e-3, 7.0])
def test_trunc_codes_bit_equal_the_naive_kernel_recipe(dtype, scale):
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(600, generator=g) * torch.logspace(-9, 3, 600)
    x = torch.cat([_edge_values(scale), rand * scale]).to(dtype)
    x = x[torch.isfinite(x)]
    n = x.numel() - x.numel() % 6
    x = x[:n].view(-1, 2, 3)
    s = torch.tensor([scale, scale * 1.5])
    got = fp8_codes(x, s.view(1, 2, 1), "trunc").view(torch.uint8)
    want = fp8_trunc_ref(x, s).view(torch.uint8)
    assert torch.equal(got, want)
    # saturated, never NaN; zero stored as +0
    assert not bool(torch.isnan(got.view(FP8).float()).any())
    zeros = x.float() == 0
    assert bool((got[zeros] == 0).all())


def test_trunc_is_the_largest_code_not_above():
    """On E4M3's normal range (|y| >= 2**-6) the code is the table's largest
    magnitude not above ``|y|`` with ``y``'s sign, where nearest rounding differs
    for about half of random values."""
    g = torch.Generator().manual_seed(1)
    y = (torch.rand(20000, generator=g) * 2 - 1) * 460
    y = y[y.abs() >= 2.0**-6]
    got = fp8_codes(y, torch.ones(1), "trunc").float()
    mag = y.abs().clamp(max=448).unsqueeze(1)
    below = torch.where(CODES.unsqueeze(0) <= mag, CODES.unsqueeze(0), -1.0)
    want = below.max(dim=1).values * torch.sign(y)
    assert torch.equal(got, want)
    nearest = fp8_codes(y, torch.ones(1)).float()
    assert 0.3 < float((nearest == got).float().mean()) < 0.7
    assert bool((got.abs() <= nearest.abs()).all())


def test_nearest_stays_the_default():
    x = torch.randn(2, 3, 32) * 10
    s = torch.tensor([0.02])
    assert torch.equal(
        fp8_codes(x, s).view(torch.uint8),
        (x / s).clamp(-448, 448).to(FP8).view(torch.uint8),
    )
    with pytest.raises(ValueError, match="fp8_rounding must be one of nearest, trunc"):
        fp8_codes(x, s, "floor")


@pytest.mark.parametrize("layout", ["nz", "nd"])
@pytest.mark.parametrize("per_head", [False, True])
def test_cache_write_trunc_bit_equal_naive_loop(layout, per_head):
    g = torch.Generator().manual_seed(2)
    t, hkv, d, nb, bs = 70, 2, 32, 4, 32
    key = (torch.randn(t, hkv, d, generator=g) * 4).bfloat16()
    value = (torch.randn(t, hkv, d, generator=g) * 2).bfloat16()
    ks = key.float().abs().amax(dim=(0, 2)) / 448 * 0.7  # some values saturate
    vs = value.float().abs().amax(dim=(0, 2)) / 448
    if not per_head:
        ks, vs = ks.max().reshape(1), vs.max().reshape(1)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int32)
    slots[::9] = -1
    shape = nz_cache_shape(nb, bs, hkv, d, FP8) if layout == "nz" else (nb, bs, hkv, d)
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    kr, vr = kc.clone(), vc.clone()
    kw = dict(k_scale=ks, v_scale=vs, layout=layout, fp8_rounding="trunc")
    reshape_and_cache(key, value, kc, vc, slots, **kw)
    reshape_and_cache_ref(key, value, kr, vr, slots, ks, vs, layout, "trunc")
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    # and it is not the nearest-rounded cache
    kn, vn = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    reshape_and_cache(key, value, kn, vn, slots, k_scale=ks, v_scale=vs, layout=layout)
    assert not torch.equal(kn.view(torch.uint8), kc.view(torch.uint8))


def test_op_takes_the_rounding_and_refuses_a_bad_one():
    from torch.library import opcheck

    key = torch.randn(5, 2, 32).bfloat16()
    kc = torch.zeros(nz_cache_shape(1, 32, 2, 32, FP8), dtype=FP8)
    vc = kc.clone()
    s = torch.tensor([0.01])
    slots = torch.arange(5, dtype=torch.int32)
    op = torch.ops.ascend_fa.reshape_and_cache.default
    # opcheck's schema test compares float8 tensors with arithmetic CPU torch lacks
    for util in ("test_autograd_registration", "test_faketensor"):
        opcheck(op, (key, key, kc, vc, slots, s, s, "nz", "trunc"), test_utils=util)
    op(key, key, kc, vc, slots, s, s, "nz", "trunc")
    rows = torch.stack([token_rows_ref(kc, i, "nz") for i in range(5)])
    want = fp8_trunc_ref(key, s).view(5, -1)
    assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
    before = kc.clone()
    with pytest.raises(ValueError, match="reshape_and_cache: fp8_rounding must be"):
        reshape_and_cache(key, key, kc, vc, slots, k_scale=s, v_scale=s,
                          fp8_rounding="up")  # fmt: skip
    assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))


def test_eval_fake_quant_trunc_takes_one_scale_per_layer():
    """vLLM's CPU kernel gets the max of a per-head scale: trunc fake-quant of a
    per-head scale equals trunc fake-quant of its max."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 9, 32, generator=g).bfloat16() * 3
    per_head = torch.tensor([0.004, 0.009])
    fq = FP8FakeQuant("fa_k", per_head, 2, "trunc")
    assert torch.equal(fq.scale, torch.tensor([0.009]))
    s = torch.tensor([0.009]).view(1, 1, 1, 1)
    want = (fp8_trunc_ref(x[0].transpose(0, 1), s.view(1)).float() * 0.009).bfloat16()
    assert torch.equal(fq(x)[0].transpose(0, 1), want)
    near = FP8FakeQuant("fa_k", per_head, 2)
    assert torch.equal(near.scale, per_head)
    spec = KVQuantSpec("fp8", {}, fp8_rounding="trunc")
    assert spec.fp8_rounding == "trunc"
    with pytest.raises(ValueError, match="fp8_rounding must be one of"):
        KVQuantSpec("fp8", {}, fp8_rounding="nearest-even")


def _artifact(path, kind):
    from safetensors.torch import save_file

    path.mkdir()
    attn = "model.layers.0.self_attn"
    if kind == "fp8":
        t = {f"{attn}.k_scale": torch.tensor([0.01]), f"{attn}.v_scale": torch.ones(1)}
    else:
        t = {
            f"{attn}.{s}_proj.kv_cache_{n}": torch.full((16,), v)
            for s in "kv"
            for n, v in (("scale", 0.1), ("offset", 0.0))
        }
    save_file(t, str(path / "quant_model_weights.safetensors"))
    (path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    return path


@pytest.mark.parametrize("verb", ["eval", "emulate"])
def test_cli_bad_rounding_is_one_line_exit_2(verb, tmp_path, capsys):
    fp8 = _artifact(tmp_path / "fp8", "fp8")
    c8 = _artifact(tmp_path / "c8", "c8")
    cases = [
        (fp8, "nearset", "--fp8-rounding 'nearset': choose nearest (vLLM's CUDA"),
        (c8, "trunc", "--fp8-rounding trunc"),
    ]
    for art, value, message in cases:
        rc = main([verb, "--artifact", str(art), "--fp8-rounding", value])
        err = capsys.readouterr().err
        assert rc == 2
        assert err.count("\n") == 1 and err.startswith(f"ascend-fa {verb}: error: ")
        assert message in err


def test_eval_runs_the_artifact_with_either_rounding(tmp_path):
    """``eval --fp8-rounding trunc`` on a vLLM FP8 artifact: its row is labelled,
    and its fake-quant differs from the default (nearest) run's."""
    import sys
    from pathlib import Path

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parent))
    from builders import save_tiny

    src = save_tiny(tmp_path / "src", "llama")
    art = tmp_path / "fp8"
    art.mkdir()
    scales = {
        f"model.layers.{i}.self_attn.{side}_scale": torch.tensor([0.004, 0.002])
        for i in range(2)
        for side in "kv"
    }
    save_file(scales, str(art / "quant_model_weights.safetensors"))
    (art / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    text = tmp_path / "heldout.txt"
    text.write_text("the keeper climbed the stairs at dusk and lit the lamp. " * 6)
    rows = {}
    for rounding in ("nearest", "trunc"):
        out = tmp_path / f"{rounding}.json"
        args = ["eval", "--model", str(src), "--artifact", str(art), "--data",
                str(text), "--window", "48", "--fp8-rounding", rounding,
                "--json", str(out), "-q"]  # fmt: skip
        assert main(args) == 0
        rows[rounding] = json.loads(out.read_text())
    near = rows["nearest"]["results"]["heldout"]["artifact fp8"]
    trunc = rows["trunc"]["results"]["heldout"]["artifact fp8 (FP8 trunc)"]
    assert near["perplexity_delta_pct"] != trunc["perplexity_delta_pct"]
