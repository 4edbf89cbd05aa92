"""recall_window / abs_quantile against a brute-force full sort and window scan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ascend_fa
from ascend_fa.calibration.recall import (
    abs_quantile,
    head_tails,
    recall_window,
    recall_window_sort_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def brute_window(row: list[float], ratio: float) -> tuple[float, float]:
    """Seed 001 verbatim: sort, T = int(ratio * N), scan every window with a Python
    loop, widths in float64 (Python floats), strictly-smaller keeps the leftmost."""
    s = sorted(row)
    n = len(s)
    t = int(ratio * n)
    best = None
    for i in range(n - t + 1):
        width = s[i + t - 1] - s[i]
        if best is None or width < best[0]:
            best = (width, s[i], s[i + t - 1])
    return best[1], best[2]


def brute_abs_quantile(row: list[float], ratio: float) -> float:
    a = sorted(abs(v) for v in row)
    return a[int(ratio * len(a)) - 1]


def rows_of(x: torch.Tensor) -> list[list[float]]:
    return x.double().tolist()  # exact images of bf16/fp16/fp32 samples


def check_against_brute(x: torch.Tensor, ratio: float, chunk: int | None) -> None:
    lo, hi = recall_window(x, ratio, chunk=chunk)
    assert lo.dtype == torch.float32 and hi.dtype == torch.float32
    assert lo.shape == hi.shape == (x.shape[0],)
    for h, row in enumerate(rows_of(x)):
        assert (lo[h].item(), hi[h].item()) == brute_window(row, ratio), (h, chunk)
    v = abs_quantile(x, ratio, chunk=chunk)
    assert v.tolist() == [brute_abs_quantile(r, ratio) for r in rows_of(x)]


def make_samples(
    kind: str, h: int, n: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(h, n, generator=g)
    elif kind == "heavy":  # Student-t-like tails: a few samples 100-1000x the bulk
        x = torch.randn(h, n, generator=g) / torch.rand(h, n, generator=g).clamp_min(
            1e-3
        )
    elif kind == "tied":
        x = torch.randint(-3, 4, (h, n), generator=g).float() * 0.5
    elif kind == "constant":
        x = torch.full((h, n), 1.25)
    elif kind == "tiny":  # subnormal-ish magnitudes
        x = torch.randn(h, n, generator=g) * 1e-30
    else:  # per-head very different scales
        x = torch.randn(h, n, generator=g) * torch.logspace(-3, 3, h).unsqueeze(1)
    return x.to(dtype)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["normal", "heavy", "tied", "constant", "tiny", "scaled"]),
    h=st.integers(1, 3),
    n=st.integers(1, 400),
    ratio=st.one_of(
        st.sampled_from([1.0, 0.9999, 0.999, 0.99, 0.9, 0.5]),
        st.floats(0.01, 1.0, exclude_min=True),
    ),
    dtype=st.sampled_from(DTYPES),
    chunk=st.sampled_from([None, 0, 1, 2, 3, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_brute_force(kind, h, n, ratio, dtype, chunk, seed):
    x = make_samples(kind, h, n, seed, dtype)
    if int(ratio * n) < 1:
        with pytest.raises(ValueError, match=r"T = int\(ratio \* N\)"):
            recall_window(x, ratio, chunk=chunk)
        return
    check_against_brute(x, ratio, chunk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio", [0.9999, 0.999, 0.9, 0.3])
@pytest.mark.parametrize("chunk", [None, 0, 4, 64])
def test_large_rows_match_sort_reference(dtype, ratio, chunk):
    # N large enough that the automatic choice takes the two-level chunk path, with
    # a leftover (N not a multiple of the chunk length) and heavy tails.
    x = make_samples("heavy", 3, 20_011, 7, dtype)
    lo, hi = recall_window(x, ratio, chunk=chunk)
    ref_lo, ref_hi = recall_window_sort_ref(x, ratio)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    if chunk is None and ratio == 0.9999:
        # spot-check the vectorized sort reference against the literal loop
        assert (lo[0].item(), hi[0].item()) == brute_window(rows_of(x)[0], ratio)


def test_ratio_one_is_exact_min_max():
    x = make_samples("heavy", 5, 3001, 3, torch.float32)
    lo, hi = recall_window(x, 1.0)
    assert torch.equal(lo, x.amin(1)) and torch.equal(hi, x.amax(1))
    assert torch.equal(abs_quantile(x, 1.0), x.abs().amax(1))


def test_leftmost_window_wins_ties():
    # Widths 1, 1, 1: the first window.
    lo, hi = recall_window(torch.tensor([[3.0, 0.0, 2.0, 1.0]]), 0.5)
    assert (lo.item(), hi.item()) == (0.0, 1.0)
    # torch.argmin's documented first-minimum rule, which the scan relies on.
    assert (
        int(torch.argmin(torch.tensor([2.0, 1.0, 1.0, 1.0], dtype=torch.float64))) == 1
    )


def test_widths_compared_in_float64():
    # Windows [-1e-8, 1] and [0.5, 1.5] (T = 3 of 4): both widths round to 1.0 in
    # fp32, so an fp32 scan with leftmost-on-ties would pick the first; exactly the
    # first is 1 + 1e-8 wide, so the second is the narrowest.
    a = torch.tensor(-1e-8, dtype=torch.float32)
    x = torch.stack([a, torch.tensor(0.5), torch.tensor(1.0), torch.tensor(1.5)])[None]
    assert float(torch.tensor(1.0) - a) == float(torch.tensor(1.5) - torch.tensor(0.5))
    lo, hi = recall_window(x, 0.75)
    assert (lo.item(), hi.item()) == (0.5, 1.5)


def test_public_lazy_name():
    assert ascend_fa.recall_window is recall_window


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("chunk", [None, 0, 5])
def test_head_tails_many_batches(b, chunk):
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(b, 4, 1003, generator=g)
        * torch.tensor([1.0, 10, 100, 1000])[:, None]
    )
    k = 17
    low, high = head_tails(x, k, chunk=chunk)
    for h in range(4):
        s = torch.sort(x[:, h].reshape(-1)).values
        assert torch.equal(low[h], s[:k]) and torch.equal(high[h], s[-k:])


@pytest.mark.parametrize(
    ("ratio", "match"),
    [
        (0.0, r"ratio must be in \(0, 1\], got 0.0"),
        (1.5, r"ratio must be in \(0, 1\], got 1.5"),
        (float("nan"), r"ratio must be in \(0, 1\], got nan"),
        (-0.1, r"ratio must be in \(0, 1\]"),
        ("0.9", r"ratio must be a number in \(0, 1\], got '0.9'"),
        (True, r"ratio must be a number"),
    ],
)
def test_bad_ratio(ratio, match):
    with pytest.raises(ValueError, match=match):
        recall_window(torch.randn(2, 10), ratio)
    with pytest.raises(ValueError, match=match):
        abs_quantile(torch.randn(2, 10), ratio)


def test_t_below_one():
    with pytest.raises(ValueError, match=r"int\(0.5 \* 1\) = 0 < 1"):
        recall_window(torch.randn(3, 1), 0.5)


@pytest.mark.parametrize("chunk", [None, 0, 16])
@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        (float("nan"), 0, "NaN"),
        (float("nan"), 5000, "NaN"),
        (float("inf"), 77, "inf"),
        (float("-inf"), 9999, "inf"),
    ],
)
def test_non_finite_names_the_head(value, where, what, chunk):
    x = torch.randn(4, 10_000)
    x[2, where] = value
    with pytest.raises(ValueError, match=rf"head 2 contains {what}"):
        recall_window(x, 0.999, chunk=chunk)
    with pytest.raises(ValueError, match=rf"head 2 contains {what}"):
        abs_quantile(x.bfloat16(), 0.999, chunk=chunk)


def test_non_finite_with_ratio_one_and_all_nan():
    x = torch.zeros(3, 50)
    x[1] = float("nan")
    with pytest.raises(ValueError, match="head 1 contains NaN"):
        recall_window(x, 1.0)
    x = torch.zeros(3, 50)
    x[2, 3] = float("-inf")
    with pytest.raises(ValueError, match="head 2 contains inf"):
        recall_window(x, 1.0)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        ([[1.0, 2.0]], r"x must be a tensor \[H, N\], got list"),
        (torch.randn(10), r"x must be 2-D \[H, N\], got shape \(10,\)"),
        (torch.randn(2, 3, 4), r"x must be 2-D"),
        (torch.randn(2, 10, dtype=torch.float64), "got torch.float64"),
        (torch.ones(2, 10, dtype=torch.int32), "got torch.int32"),
        (torch.randn(2, 0), r"at least one head and one sample, got shape \(2, 0\)"),
        (torch.randn(0, 5), r"at least one head and one sample, got shape \(0, 5\)"),
    ],
)
def test_bad_input(x, match):
    with pytest.raises(ValueError, match=match):
        recall_window(x)


def test_head_tails_bad_k():
    with pytest.raises(ValueError, match=r"need 1 <= k <= n = 10, got k = 11"):
        head_tails(torch.randn(1, 2, 10), 11)
    with pytest.raises(ValueError, match=r"x must be \[B, H, R\]"):
        head_tails(torch.randn(2, 10), 1)


def test_sort_reference_checks_finite():
    x = torch.randn(9, 100)
    x[8, 3] = float("nan")
    with pytest.raises(ValueError, match="head 8 contains NaN or inf"):
        recall_window_sort_ref(x, 0.99, heads_per_chunk=4)


def test_tail_size_is_monotone():
    # The pooled observer sizes its kept tails for max_samples; that covers every
    # smaller count only because k(n) = n - int(ratio * n) + 1 never decreases.
    from ascend_fa.calibration.recall import tail_size

    for n in [1, 2, 3, 10, 9999, 10_000, 10_001, 123_457]:
        for r in [0.9999, 0.5, 0.1234, 1.0]:
            if int(r * n) >= 1:
                assert tail_size(r, n) == n - int(r * n) + 1
                assert tail_size(r, n + 1) >= tail_size(r, n)
    assert tail_size(0.9999, 2**20) == 106


def test_benchmark_smoke(tmp_path, monkeypatch, capsys):
    import argparse
    import json

    from ascend_fa.benchmarks import calibration as bench

    monkeypatch.setattr(bench, "QUICK_CASES", [(2, 5000)])
    monkeypatch.setattr(bench, "QUICK_OBSERVER", (2, 2, 16, 32))
    out = tmp_path / "b.json"
    args = argparse.Namespace(
        quick=True, json=str(out), ratio=0.999, repeats=1, no_memory=True
    )
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "identical in every case: yes" in text
    payload = json.loads(out.read_text())
    first = payload["records"][0]
    assert first["extra"]["identical"] is True and first["verdict"] in ("ok", "miss")
    assert first["params"]["N"] == 5000 and first["mode"] == "recall_window"
    # the in-process memory probe returns a byte count (or None without /proc)
    extra = bench._measure_extra(2, 5000, 0.999, "fast")
    assert extra is None or 0 <= extra < 64 << 20
