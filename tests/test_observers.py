"""PerHeadObserver: per-head semantics, union/pooled accumulation, masks, resume."""

from __future__ import annotations

import pytest
import torch
from ascend_fa.atb_ops import per_head_qparams
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_fa.calibration import PerHeadObserver, abs_quantile, recall_window


def per_head_rows(x: torch.Tensor) -> torch.Tensor:
    """Independent per-head flattening of [B, H, S, D]: head h is x[:, h]."""
    return torch.stack([x[:, h].reshape(-1) for h in range(x.shape[1])])


def brute_window(row: list[float], ratio: float) -> tuple[float, float]:
    s = sorted(row)
    t = int(ratio * len(s))
    best = min(range(len(s) - t + 1), key=lambda i: (s[i + t - 1] - s[i], i))
    return s[best], s[best + t - 1]


def scaled_batch(b: int, h: int, s: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 3, h).view(1, h, 1, 1)  # heads 1e-2 .. 1e3
    return torch.randn(b, h, s, d, generator=g) * scales


def test_per_head_with_batch_gt_one():
    x = scaled_batch(3, 4, 5, 8, seed=0)
    obs = PerHeadObserver(4, ratio=0.95)
    obs.update(x)
    lo, hi = obs.range()
    rows = x.double()
    for h in range(4):
        exp = brute_window(rows[:, h].reshape(-1).tolist(), 0.95)
        assert (lo[h].item(), hi[h].item()) == exp
    # The reference tool's view(H, -1) mixes heads when B > 1: make sure this test
    # would catch it (head 0 would pick up samples of head 3, 1e5x larger).
    wrong_lo, wrong_hi = recall_window(x.reshape(4, -1), 0.95)
    assert not torch.equal(wrong_hi, hi)
    assert hi[0] < 0.1 and wrong_hi.max() > 100


def test_head_axis_zero_matches_recall_window():
    x = torch.randn(3, 1000)
    obs = PerHeadObserver(3, head_axis=0, ratio=0.99)
    obs.update(x)
    lo, hi = recall_window(x, 0.99)
    assert torch.equal(obs.range()[0], lo) and torch.equal(obs.range()[1], hi)


@pytest.mark.parametrize("method", ["recall_window", "abs_quantile", "minmax"])
def test_union_is_seed_rule(method):
    batches = [scaled_batch(2, 3, 7, 4, seed=i) for i in range(4)]
    obs = PerHeadObserver(3, method=method, ratio=0.9)
    lo = torch.full((3,), float("inf"))
    hi = torch.full((3,), float("-inf"))
    for xb in batches:
        obs.update(xb)
        rows = per_head_rows(xb)
        if method == "recall_window":
            b_lo, b_hi = recall_window(rows, 0.9)
        elif method == "abs_quantile":
            b_hi = abs_quantile(rows, 0.9)
            b_lo = -b_hi
        else:
            b_lo, b_hi = rows.amin(1), rows.amax(1)
        lo, hi = torch.minimum(lo, b_lo), torch.maximum(hi, b_hi)
    got_lo, got_hi = obs.range()
    assert torch.equal(got_lo, lo) and torch.equal(got_hi, hi)
    assert obs.num_samples.tolist() == [4 * 2 * 7 * 4] * 3


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    ratio=st.sampled_from([1.0, 0.99, 0.9, 0.75, 0.5]),
    method=st.sampled_from(["recall_window", "abs_quantile", "minmax"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    slack=st.integers(0, 50),
    seed=st.integers(0, 10_000),
)
def test_pooled_equals_concatenation(sizes, ratio, method, dtype, slack, seed):
    g = torch.Generator().manual_seed(seed)
    batches = [
        (
            torch.randn(b, 2, 3, 4, generator=g)
            / torch.rand(b, 2, 3, 4, generator=g).clamp_min(0.05)
        ).to(dtype)
        for b in sizes
    ]
    total = sum(sizes) * 12
    obs = PerHeadObserver(
        2, method=method, ratio=ratio, accumulate="pooled", max_samples=total + slack
    )
    for xb in batches:
        obs.update(xb)
    rows = torch.cat([per_head_rows(xb) for xb in batches], dim=1)
    lo, hi = obs.range()
    if int(ratio * total) < 1:
        return
    for h, row in enumerate(rows.double().tolist()):
        if method == "recall_window":
            exp = brute_window(row, ratio)
        elif method == "abs_quantile":
            a = sorted(abs(v) for v in row)[int(ratio * total) - 1]
            exp = (-a, a)
        else:
            exp = (min(row), max(row))
        assert (lo[h].item(), hi[h].item()) == exp


def test_pooled_differs_from_union_and_is_exact():
    # Two batches with outliers in different places: the union of per-batch windows
    # is wider than the window of the pooled data.
    a = torch.zeros(1, 1, 1, 1000)
    a[..., :1] = 50.0
    b = torch.zeros(1, 1, 1, 1000)
    b[..., :1] = -50.0
    union = PerHeadObserver(1, ratio=0.999)
    pooled = PerHeadObserver(1, ratio=0.999, accumulate="pooled", max_samples=2000)
    for xb in (a, b):
        union.update(xb)
        pooled.update(xb)
    assert union.range()[0].item() == 0.0 and union.range()[1].item() == 0.0
    # 2000 samples, T = 1998: the two outliers fall out only together; the narrowest
    # window keeps one of them -> [-50, 0] (leftmost).
    assert [t.item() for t in pooled.range()] == list(
        brute_window(torch.cat([a, b], -1).flatten().tolist(), 0.999)
    )


def test_token_mask_drops_padding():
    x = scaled_batch(2, 3, 6, 4, seed=1)
    mask = torch.tensor(
        [[True, True, True, True, False, False], [False, True, True, True, True, True]]
    )
    padded = x.clone()
    padded[~mask[:, None, :, None].expand_as(x)] = 1e6  # would dominate any range
    for accumulate in ("union", "pooled"):
        obs = PerHeadObserver(
            3,
            ratio=1.0,
            accumulate=accumulate,
            max_samples=1000,
            method="recall_window",
        )
        obs.update(padded, mask)
        real = torch.cat([x[0, :, :4].reshape(3, -1), x[1, :, 1:].reshape(3, -1)], 1)
        assert torch.equal(obs.range()[0], real.amin(1))
        assert torch.equal(obs.range()[1], real.amax(1))
        assert obs.num_samples.tolist() == [9 * 4] * 3
    # an all-True mask is the same as no mask; an all-False mask observes nothing
    obs = PerHeadObserver(3)
    obs.update(x, torch.ones(2, 6, dtype=torch.bool))
    ref = PerHeadObserver(3)
    ref.update(x)
    assert torch.equal(obs.range()[1], ref.range()[1])
    obs.update(x, torch.zeros(2, 6, dtype=torch.bool))
    assert obs.num_samples.tolist() == ref.num_samples.tolist()


@pytest.mark.parametrize("accumulate", ["union", "pooled"])
@pytest.mark.parametrize("method", ["recall_window", "abs_quantile", "minmax"])
def test_merge_and_resume(method, accumulate):
    batches = [scaled_batch(1, 2, 9, 8, seed=i) for i in range(6)]
    kw = dict(method=method, ratio=0.97, accumulate=accumulate, max_samples=6 * 72)
    seq = PerHeadObserver(2, **kw)
    for xb in batches:
        seq.update(xb)
    a, b = PerHeadObserver(2, **kw), PerHeadObserver(2, **kw)
    for i, xb in enumerate(batches):
        (a if i % 2 else b).update(xb)
    # min/max of per-batch windows and the union of tails are order-free: exact
    merged = a.merge(b)
    assert merged is a
    assert all(torch.equal(u, v) for u, v in zip(merged.range(), seq.range()))
    # resume: save after 3 batches, continue in a fresh observer
    first = PerHeadObserver(2, **kw)
    for xb in batches[:3]:
        first.update(xb)
    resumed = PerHeadObserver(2, **kw)
    resumed.load_state_dict(first.state_dict())
    for xb in batches[3:]:
        resumed.update(xb)
    assert all(torch.equal(u, v) for u, v in zip(resumed.range(), seq.range()))
    assert torch.equal(resumed.num_samples, seq.num_samples)


def test_qparams_via_per_head_qparams():
    obs = PerHeadObserver(4, ratio=0.99)
    x = scaled_batch(2, 4, 16, 8, seed=3).bfloat16()
    obs.update(x)
    scale, offset = obs.qparams()
    ref_scale, ref_offset = per_head_qparams(*obs.range())
    assert scale.dtype == torch.float32 and offset.dtype == torch.int8
    assert torch.equal(scale, ref_scale) and torch.equal(offset, ref_offset)
    assert bool((scale[1:] > scale[:-1]).all())  # heads keep their own scales


def test_empty_head_error_names_module_and_head():
    obs = PerHeadObserver(2, name="model.layers.3.self_attn.fa_k")
    with pytest.raises(
        ValueError, match=r"'model.layers.3.self_attn.fa_k': head 0 saw no"
    ):
        obs.qparams()
    obs.update(torch.randn(1, 2, 3, 4), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="head 0 saw no data"):
        obs.range()


def test_pooled_bounds():
    with pytest.raises(ValueError, match=r"accumulate='pooled' needs max_samples"):
        PerHeadObserver(2, accumulate="pooled")
    obs = PerHeadObserver(2, accumulate="pooled", max_samples=100, name="att.fa_q")
    obs.update(torch.randn(1, 2, 10, 8))
    with pytest.raises(
        ValueError,
        match=r"'att.fa_q': 80 \+ 80 samples per head exceed "
        r"max_samples=100",
    ):
        obs.update(torch.randn(1, 2, 10, 8))
    other = PerHeadObserver(2, accumulate="pooled", max_samples=100, name="att.fa_q")
    other.update(torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="merged samples per head 112 exceed"):
        obs.merge(other)
    # k_max follows tail_size(ratio, max_samples)
    assert PerHeadObserver(1, accumulate="pooled", max_samples=10**6).k_max == 101


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_heads=0), "num_heads must be a positive int"),
        (dict(num_heads=2, method="mse"), "unknown method 'mse'"),
        (dict(num_heads=2, accumulate="sum"), "unknown accumulate 'sum'"),
        (dict(num_heads=2, ratio=0.0), r"ratio must be in \(0, 1\]"),
        (dict(num_heads=2, max_samples=0), "max_samples must be a positive int"),
        (dict(num_heads=2, head_axis=1.0), "head_axis must be an int"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerHeadObserver(**kwargs)


@pytest.mark.parametrize(
    ("x", "mask", "match"),
    [
        (torch.randn(1, 3, 4, 8), None, r"'q': expected 2 heads on axis 1, got shape"),
        (torch.randn(1, 2, 4, 8).double(), None, "got torch.float64"),
        ("x", None, "x must be a tensor, got str"),
        (
            torch.randn(1, 2, 4, 8),
            torch.ones(1, 5, dtype=torch.bool),
            r"token_mask must be bool \[B, S\] = \[1, 4\], got torch.bool \(1, 5\)",
        ),
        (torch.randn(1, 2, 4, 8), torch.ones(1, 4), r"got torch.float32 \(1, 4\)"),
        (
            torch.randn(3, 2, 16),
            torch.ones(3, 16, dtype=torch.bool),
            r"token_mask needs x as \[B, H, S, D\]",
        ),
    ],
)
def test_bad_update(x, mask, match):
    obs = PerHeadObserver(2, name="q")
    with pytest.raises(ValueError, match=match):
        obs.update(x, mask)


def test_non_finite_update_names_observer_and_head():
    x = torch.randn(2, 3, 8, 4)
    x[1, 2, 5, 0] = float("nan")
    for method in ("recall_window", "minmax", "abs_quantile"):
        obs = PerHeadObserver(3, method=method, name="l.fa_v")
        with pytest.raises(ValueError, match=r"observer 'l.fa_v': head 2 contains NaN"):
            obs.update(x)


def test_ratio_too_small_for_batch():
    obs = PerHeadObserver(1, ratio=0.01, name="p")
    with pytest.raises(ValueError, match=r"observer 'p': T = int\(ratio \* N\)"):
        obs.update(torch.randn(1, 1, 2, 4))


def test_load_state_mismatch():
    a = PerHeadObserver(2, ratio=0.99)
    b = PerHeadObserver(2, ratio=0.9)
    with pytest.raises(
        ValueError,
        match=r"state has ratio=0.99 but this observer has "
        r"ratio=0.9",
    ):
        b.load_state_dict(a.state_dict())
    with pytest.raises(
        ValueError, match="cannot merge observers with different settings"
    ):
        b.merge(a)
    sd = a.state_dict()
    sd["lo"] = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"state 'lo' must be a tensor of shape \(2,\)"
    ):
        a.load_state_dict(sd)
    del sd["lo"]
    with pytest.raises(ValueError, match="state is missing 'lo'"):
        a.load_state_dict(sd)


MASKS = {
    "right+left": [[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]],
    "holes": [[1, 0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 1]],
    "empty row": [[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]],
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize(
    "kw",
    [
        dict(method="recall_window", ratio=0.9),
        dict(method="abs_quantile", ratio=0.8),
        dict(method="minmax"),
        dict(method="recall_window", ratio=0.7, accumulate="pooled", max_samples=5000),
    ],
)
def test_masked_update_equals_real_tokens(mask_name, kw):
    mask = torch.tensor(MASKS[mask_name], dtype=torch.bool)
    x = scaled_batch(3, 2, 7, 4, seed=5)
    x[~mask[:, None, :, None].expand_as(x)] = float("nan")  # padding is never read
    real = torch.cat([x[b, :, mask[b]] for b in range(3)], dim=1)  # [H, M, D]
    masked = PerHeadObserver(2, **kw)
    masked.update(x, mask)
    plain = PerHeadObserver(2, **kw)
    plain.update(real.unsqueeze(0))
    assert torch.equal(masked.num_samples, plain.num_samples)
    for got, want in zip(masked.range(), plain.range()):
        assert torch.equal(got, want)
    if kw["method"] == "recall_window":
        rows = real.reshape(2, -1).double().tolist()
        lo, hi = masked.range()
        for h in range(2):
            assert (lo[h].item(), hi[h].item()) == brute_window(rows[h], kw["ratio"])
