"""Clip search: numerics bit-exact vs the INT8 primitives, attention vs an fp64
reference, the search never worse than its start, keepers, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from ascend_fa.atb_ops import dequantize_per_head, quantize_per_head
from builders import byte_tokenizer, tiny_llama

from ascend_fa.calibration import FA3FakeQuant, FA3QuantConfig, Recipe
from ascend_fa.calibration.search import (
    SampleKeeper,
    SearchConfig,
    attention_core,
    calibrate_with_search,
    fake_quant,
    layer_objective,
    search_layer,
)


def rows_with_outliers(seed: int, h=4, hkv=2, n=24, d=8, nrows=2):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(nrows):
        q = (
            torch.randn(h, n, d, generator=g)
            * torch.tensor([1.0, 4.0, 0.3, 2.0])[:h, None, None]
        )
        k = torch.randn(hkv, n, d, generator=g)
        v = torch.randn(hkv, n, d, generator=g)
        k[0, 3, 1] = 25.0  # one rare large key value: clipping it matters
        v[1, 5, 2] = -12.0
        rows.append((q, k, v))
    return rows


def minmax_start(rows):
    out = {}
    for i, b in enumerate(("fa_q", "fa_k", "fa_v")):
        amax = torch.stack([r[i].abs().amax(dim=(1, 2)) for r in rows]).amax(0)
        out[b] = amax / 127
    return out


# ------------------------------------------------------------------ numerics
def test_fake_quant_bit_equal_to_int8_primitives(rng):
    x = torch.randn(2, 5, 7, 8, generator=rng) * 3
    scale = torch.rand(5, generator=rng) * 0.05 + 1e-3  # clips the tails on purpose
    ref = dequantize_per_head(quantize_per_head(x, scale, axis=1), scale, axis=1)
    assert torch.equal(fake_quant(x, scale, axis=1), ref)
    # ties to even: 2.5 -> 2, 3.5 -> 4, and saturation at -128 / 127
    s = torch.ones(1)
    t = torch.tensor([[2.5, 3.5, -2.5, 200.0, -200.0]])
    assert fake_quant(t, s).tolist() == [[2.0, 4.0, -2.0, 127.0, -128.0]]


def _naive_attention(q, k, v, scaling, window=None):
    h, n, _ = q.shape
    group = h // k.shape[0]
    out = torch.zeros(h, n, v.shape[-1], dtype=torch.float64)
    for hh in range(h):
        kk, vv = k[hh // group].double(), v[hh // group].double()
        for i in range(n):
            lo = 0 if window is None else max(0, i - window + 1)
            logits = (q[hh, i].double() @ kk[lo : i + 1].T) * scaling
            p = torch.softmax(logits, dim=0)
            out[hh, i] = p @ vv[lo : i + 1]
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_attention_core_matches_naive_fp64(rng, window):
    q = torch.randn(6, 9, 4, generator=rng)
    k = torch.randn(2, 9, 4, generator=rng)
    v = torch.randn(2, 9, 4, generator=rng)
    got = attention_core(q, k, v, 0.5, window)
    ref = _naive_attention(q, k, v, 0.5, window)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=2e-6, rtol=0)


# -------------------------------------------------------------------- search
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("objective", ["attention", "tensor_mse"])
def test_search_never_worse_than_start(seed, objective):
    rows = rows_with_outliers(seed)
    g = torch.Generator().manual_seed(100 + seed)
    # Random starts, some far off (too small and too large).
    start = {
        b: s * torch.exp(torch.randn(s.shape, generator=g))
        for b, s in minmax_start(rows).items()
    }
    cfg = SearchConfig(objective=objective, rounds=2)
    res = search_layer(rows, start, 0.35, cfg)
    before = layer_objective(rows, start, 0.35, objective=objective)
    after = layer_objective(rows, res.scales, 0.35, objective=objective)
    assert math.isclose(res.start_objective, before, rel_tol=1e-9)
    assert math.isclose(res.final_objective, after, rel_tol=1e-9)
    assert after <= before
    # The chosen scales are grid multiples of the start.
    for b in res.scales:
        assert torch.allclose(res.scales[b], start[b] * res.multipliers[b])
        assert all(
            any(math.isclose(float(m), g, rel_tol=1e-6) for g in cfg.grid)
            for m in res.multipliers[b]
        )


def test_search_improves_outlier_dominated_layer():
    rows = rows_with_outliers(7)
    start = minmax_start(rows)  # min/max: the K outlier stretches head 0's step
    res = search_layer(rows, start, 0.35)
    assert res.final_objective < 0.9 * res.start_objective
    # Query heads are independent: each one's error is no worse than at the start.
    assert res.final_objective <= res.start_objective


def test_search_config_validation():
    assert 1.0 in SearchConfig(grid=(0.5, 0.8)).grid
    assert SearchConfig(grid=(0.8, 0.5, 0.8)).grid == (0.5, 0.8, 1.0)
    with pytest.raises(ValueError, match="unknown objective 'l1'"):
        SearchConfig(objective="l1")
    with pytest.raises(ValueError, match="grid must be non-empty"):
        SearchConfig(grid=(0.5, -1.0))
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        SearchConfig(rounds=0)
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        SearchConfig(tokens=True)


def test_search_layer_bad_inputs():
    rows = rows_with_outliers(0)
    start = minmax_start(rows)
    with pytest.raises(ValueError, match="no retained rows"):
        search_layer([], start, 0.35)
    with pytest.raises(ValueError, match="start scales miss 'fa_v'"):
        search_layer(rows, {"fa_q": start["fa_q"], "fa_k": start["fa_k"]}, 0.35)
    bad = dict(start, fa_q=start["fa_q"][:2])
    with pytest.raises(
        ValueError, match="row 0 has q/k/v heads 4/2/2, start scales have 2/2/2"
    ):
        search_layer(rows, bad, 0.35)
    with pytest.raises(ValueError, match="not a GQA layout"):
        search_layer(rows, dict(start, fa_q=torch.ones(3)), 0.35)


def test_sample_keeper_keeps_real_tokens_of_first_rows(rng):
    keeper = SampleKeeper(rows=3, tokens=4)
    x = torch.randn(2, 3, 6, 5, generator=rng)
    mask = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    keeper.add(x, mask)
    keeper.add(x * 2, None)  # only one more row fits
    assert len(keeper.rows) == 3
    assert torch.equal(keeper.rows[0], x[0, :, :4])
    assert torch.equal(keeper.rows[1], x[1][:, mask[1]])
    assert torch.equal(keeper.rows[2], (x * 2)[0, :, :4])
    with pytest.raises(ValueError, match=r"x must be \[B, H, S, D\]"):
        keeper.add(torch.ones(3, 4))


# --------------------------------------------------------------- end to end
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 3.14159, 2.71828, 1.41421 and 42.",
    "User: how far is it?\nAssistant: about twelve kilometres.",
    "A short line.",
]


def test_calibrate_with_search_installs_searched_scales():
    model = tiny_llama()
    tok = byte_tokenizer()
    report: dict = {}
    procs, adapter, ranges = calibrate_with_search(
        model,
        tok,
        TEXTS,
        recipe=Recipe(processors=[FA3QuantConfig()]),
        max_length=48,
        batch_size=2,
        search=SearchConfig(rows=3, tokens=32),
        report=report,
    )
    scales = procs[0].export_scales(model)
    assert sorted(scales) == [f"model.layers.{i}.self_attn" for i in range(2)]
    for name, entry in scales.items():
        assert report[name]["final_objective"] <= report[name]["start_objective"]
        for b, (scale, offset) in entry.items():
            heads = 4 if b == "fa_q" else 2
            assert scale.shape == (heads,) and torch.equal(
                offset, torch.zeros(heads, dtype=torch.int8)
            )
            lo, hi = ranges[name][b]
            assert torch.equal(hi, 127 * scale) and torch.equal(lo, -127 * scale)
            assert isinstance(model.get_submodule(f"{name}.{b}"), FA3FakeQuant)
    procs[0].remove(model, adapter)
    assert not hasattr(model.model.layers[0].self_attn, "fa_q")


def test_calibrate_with_search_rejects_empty_recipe():
    model = tiny_llama()
    recipe = Recipe(processors=[FA3QuantConfig(include=["nothing.*"])])
    with (
        pytest.warns(UserWarning, match="matches no attention module"),
        pytest.raises(ValueError, match="selects no attention module"),
    ):
        calibrate_with_search(model, byte_tokenizer(), TEXTS, recipe=recipe)
    assert not hasattr(model.model.layers[0].self_attn, "fa_q")
