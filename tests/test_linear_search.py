"""W8A8's smoothing / range choice (and W8A8_DYNAMIC's smoothing) is scored on rows
held out of the fit.

The reference below re-derives the two-fold rule from its description (module doc of
``ascend_fa.linear.search``) with plain loops over the candidates; the library's
choice must be the reference's, and the rule must leave headroom where one fold's
range is well beyond the other's (what a static range needs for unseen tokens).
"""

from __future__ import annotations

import pytest
import torch

from ascend_fa.linear.modules import activation_qparams, quantize_weight
from ascend_fa.linear.search import InputStats, decide_group

ALPHAS = (None, 0.3, 0.5, 0.8)
CLIPS = (1.0, 0.8, 0.5, 1.5, 2.0, 3.0)
DT = torch.float32


def _stats(batches: list[torch.Tensor], rows: int = 64) -> InputStats:
    st = InputStats(batches[0].shape[1], rows=rows, top=4)
    for b in batches:
        st.update(b)
    return st


def _ref_fq_static(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    scale, offset = activation_qparams(lo, hi, DT)
    recip = torch.tensor([scale], dtype=DT).reciprocal().float()
    out = torch.empty_like(x)
    for i in range(x.shape[0]):  # row by row: an independent spelling
        q = torch.clamp(torch.round(x[i] * recip + float(offset)), -128, 127)
        out[i] = (q - offset) * scale
    return out


def _ref_fq_dynamic(x: torch.Tensor) -> torch.Tensor:
    """Per token: scale max|x| / 127, codes round(x / scale) (0 for a zero row)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        scale = x[i].abs().max() / 127.0
        if scale > 0:
            out[i] = torch.round(x[i] / scale) * scale
    return out


def _ref_choice(
    w: torch.Tensor,
    batches: list[torch.Tensor],
    dynamic: bool = False,
    alphas: tuple[float | None, ...] = ALPHAS,
    clips: tuple[float, ...] = CLIPS,
) -> tuple[float | None, float]:
    """Brute force over the grid, exactly as described: fold k = updates k, k+2..;
    each fold's own per-channel absmax smooths (s = a^α / w^(1-α), 1 where either
    side is 0, clamped to [1e-4, 1e4]) and its own min/max times c is the range; the
    other fold's rows are scored, each token's squared output error over its own
    squared output; α at c = 1 first, then c."""
    folds = [torch.cat(batches[0::2]), torch.cat(batches[1::2])]  # every row kept
    wa = w.abs().amax(dim=0)

    def err(alpha: float | None, clip: float) -> float:
        total = 0.0
        for k in (0, 1):
            fit, held = folds[k], folds[1 - k]
            s = torch.ones(w.shape[1])
            if alpha is not None:
                a = fit.abs().amax(dim=0)
                for j in range(w.shape[1]):
                    if a[j] > 0 and wa[j] > 0:
                        s[j] = min(max(a[j] ** alpha / wa[j] ** (1 - alpha), 1e-4), 1e4)
            codes, ws = quantize_weight(w * s, DT)
            wq = codes.float() * ws[:, None]
            xf, xh = fit / s, held / s
            lo, hi = clip * float(xf.min()), clip * float(xf.max())
            xq = _ref_fq_dynamic(xh) if dynamic else _ref_fq_static(xh, lo, hi)
            y = xq @ wq.t()
            ref = held @ w.t()
            for t in range(held.shape[0]):  # every token's error relative to its own
                total += float((y[t] - ref[t]).square().sum() / ref[t].square().sum())
        return total

    alpha = min(alphas, key=lambda a: err(a, 1.0))
    if dynamic:  # per-token ranges: nothing to clip
        return alpha, 1.0
    return alpha, min(clips, key=lambda c: err(alpha, c))


def _rows(gen: torch.Generator, n: int, k: int, loud: int, size: float) -> torch.Tensor:
    x = torch.randn(n, k, generator=gen)
    x[: n // 8, loud] *= size  # a few tokens with one loud channel
    return x


@pytest.mark.parametrize("dynamic", [False, True], ids=["w8a8", "w8a8_dynamic"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_equals_brute_force_reference(seed, dynamic):
    gen = torch.Generator().manual_seed(seed)
    k, n = 24, 40
    w = torch.randn(16, k, generator=gen)
    batches = [
        _rows(gen, n, k, loud=3, size=4.0),
        _rows(gen, n, k, loud=7, size=12.0),
        _rows(gen, n, k, loud=3, size=5.0),
        _rows(gen, n, k, loud=11, size=9.0),
    ]
    st = _stats(batches)
    got = decide_group(w, st, dynamic=dynamic, dtype=DT, alphas=ALPHAS, clips=CLIPS)
    assert all(p.shape[0] == n for p in st.parts)  # the sample holds every row
    alpha, clip = _ref_choice(w, batches, dynamic)
    assert (got.alpha, got.clip) == (alpha, clip)
    if dynamic:
        return
    # the choice is applied to the statistics of all rows
    s = torch.ones(k) if got.smooth is None else got.smooth
    lo = clip * float((st.cmin / s).min())
    hi = clip * float((st.cmax / s).max())
    assert got.lo == pytest.approx(lo, rel=1e-6) and got.hi == pytest.approx(
        hi, rel=1e-6
    )


@pytest.mark.parametrize("dynamic", [False, True], ids=["w8a8", "w8a8_dynamic"])
def test_stopped_candidates_change_nothing_on_the_default_grids(monkeypatch, dynamic):
    """With the default grids (10 α, 12 c) the chunked scoring stops most
    candidates early, and the choice is still the brute-force reference's."""
    from ascend_fa.linear import search
    from ascend_fa.linear.engine import DEFAULT_ALPHAS, DEFAULT_CLIPS

    calls = []
    real = search._HeldOutScorer.chunk_errors

    def spy(self, alpha, clip, i, k):
        calls.append((alpha, clip, i, k))
        return real(self, alpha, clip, i, k)

    monkeypatch.setattr(search._HeldOutScorer, "chunk_errors", spy)
    gen = torch.Generator().manual_seed(5)
    k, n = 24, 64
    w = torch.randn(16, k, generator=gen)
    batches = [_rows(gen, n, k, loud=j % 5, size=3.0 + 2 * j) for j in range(4)]
    st = _stats(batches, rows=n)
    got = decide_group(
        w, st, dynamic=dynamic, dtype=DT, alphas=DEFAULT_ALPHAS, clips=DEFAULT_CLIPS
    )
    ref = _ref_choice(w, batches, dynamic, DEFAULT_ALPHAS, DEFAULT_CLIPS)
    assert (got.alpha, got.clip) == ref
    candidates = len(DEFAULT_ALPHAS) + (0 if dynamic else len(DEFAULT_CLIPS) - 1)
    full = candidates * 2 * search._CHUNKS
    assert len(set(calls)) == len(calls)  # no chunk scored twice
    assert len(calls) < 0.75 * full


def test_a_fold_beyond_the_other_leaves_headroom():
    """Fold 1's tokens reach 3x fold 0's range: scored on held-out rows the rule
    leaves headroom (c > 1); scored on the rows that set the range (one update,
    nothing held out) it never does."""
    gen = torch.Generator().manual_seed(0)
    k = 16
    w = torch.randn(8, k, generator=gen)
    quiet = torch.randn(64, k, generator=gen)
    loud = 3.0 * torch.randn(64, k, generator=gen)
    held_out = decide_group(
        w, _stats([quiet, loud]), dynamic=False, dtype=DT, alphas=(None,), clips=CLIPS
    )
    assert held_out.clip > 1.0
    in_sample = decide_group(
        w,
        _stats([torch.cat([quiet, loud])]),
        dynamic=False,
        dtype=DT,
        alphas=(None,),
        clips=CLIPS,
    )
    assert in_sample.clip <= 1.0


def test_folds_do_not_touch_the_statistics_random_stream():
    """Choosing on held-out rows draws nothing from the statistics' generator: the
    sample (and a data-parallel rank's skips) stay what they were."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(300, 8, generator=gen) for _ in range(3)]
    a, b = _stats(batches, rows=32), _stats(batches, rows=32)
    w = torch.randn(4, 8, generator=gen)
    decide_group(w, a, dynamic=False, dtype=DT, alphas=ALPHAS, clips=CLIPS)
    b.sample()  # the one sample decide_group itself draws
    assert torch.equal(a.sample(), b.sample())


def test_folds_fit_on_every_row_of_their_batches():
    """Each fold's range is fitted on the per-channel extremes of all its batches'
    rows (as the final range on all rows), not on the sampled rows: bit-exact
    against the batches themselves; the scored rows are a capped sample."""
    from ascend_fa.linear.search import _folds

    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(500, 6, generator=gen) * (i + 1) for i in range(5)]
    st = _stats(batches, rows=32)
    folds = _folds(st.parts, st.bounds, st.rows + st.top)
    assert folds is not None
    for k, (rows, lo, hi) in enumerate(folds):
        mine = torch.cat(batches[k::2])
        assert torch.equal(lo, mine.amin(dim=0)) and torch.equal(hi, mine.amax(dim=0))
        assert rows.shape[0] == st.rows + st.top  # the cap given
        # the fold's largest row is always scored
        assert float(rows.abs().amax()) == float(mine.abs().amax())
    assert _folds(st.parts[:1], st.bounds[:1], 36) is None
    bad = InputStats(6)
    with pytest.raises(ValueError, match="2 row sets but 1 bounds"):
        bad.adopt(st.parts[:2], st.cmin, st.cmax, 10, st.bounds[:1])


def _naive_growth(batches, s):
    """Fold extremes from the raw batches (even / odd updates), per side."""
    ext = []
    for k in (0, 1):
        rows = torch.cat(batches[k::2]) / s
        ext.append((-float(rows.min()), float(rows.max())))
    growth = 1.0
    for side in (0, 1):
        a, b = ext[0][side], ext[1][side]
        if a > 0 and b > 0:
            growth = max(growth, max(a, b) / min(a, b))
    return growth


@pytest.mark.parametrize("folds", [4, 1], ids=["held_out", "in_sample"])
def test_headroom_widens_the_searched_static_range_only(folds):
    """``doublings`` widens the searched static range by the fold growth to that
    power and changes nothing else: the same α and clip as without it, the
    headroom that of the raw batches' fold extremes (recomputed here), ``[lo,
    hi]`` exactly that times the searched range, the sample error that of the
    widened range. One update: no folds, no growth, no headroom. W8A8_DYNAMIC has
    no range and ignores it."""
    gen = torch.Generator().manual_seed(5)
    k = 24
    w = torch.randn(16, k, generator=gen)
    batches = [_rows(gen, 40, k, loud=3 + i, size=4.0 + 3 * i) for i in range(4)]
    if folds == 1:
        batches = [torch.cat(batches)]

    def decide(**kw):
        return decide_group(
            w, _stats(batches), dtype=DT, alphas=ALPHAS, clips=CLIPS, **kw
        )

    plain, wide = decide(dynamic=False), decide(dynamic=False, doublings=2.0)
    assert (wide.alpha, wide.clip) == (plain.alpha, plain.clip)
    s = torch.ones(k) if wide.smooth is None else wide.smooth
    growth = _naive_growth(batches, s) if folds > 1 else 1.0
    assert plain.headroom == 1.0
    assert wide.headroom == pytest.approx(growth**2, rel=1e-6)
    if folds > 1:
        assert wide.headroom > 1.2  # the loud later batches: a real growth
    st = _stats(batches)
    lo = wide.headroom * plain.clip * float((st.cmin / s).min())
    hi = wide.headroom * plain.clip * float((st.cmax / s).max())
    assert wide.lo == pytest.approx(lo, rel=1e-6)
    assert wide.hi == pytest.approx(hi, rel=1e-6)
    if folds > 1:
        assert wide.rel_error != plain.rel_error
    dyn = [decide(dynamic=True, doublings=d) for d in (0.0, 2.0)]
    assert dyn[1].headroom == 1.0
    assert (dyn[0].alpha, dyn[0].lo, dyn[0].hi) == (dyn[1].alpha, dyn[1].lo, dyn[1].hi)


def test_fold_growth_is_the_larger_folds_extreme_over_the_smaller():
    """A fold whose maximum is 3x the other's grows 3x; a side where a fold has
    no value of that sign (all positive inputs: no minimum below 0) is skipped;
    one update has no growth."""
    from ascend_fa.linear.search import fold_growth

    quiet = torch.tensor([[1.0, 0.5], [0.2, 0.1]])
    loud = torch.tensor([[3.0, 0.5], [0.2, 0.1]])
    st = _stats([quiet, loud, quiet])
    assert fold_growth(st.bounds, None) == pytest.approx(3.0)
    assert fold_growth(st.bounds, torch.tensor([1.0, 1.0])) == pytest.approx(3.0)
    # smoothing divides the channels first: channel 0 / 10 leaves channel 1's
    # extremes (0.5 and 0.5) as the maximum of both folds
    assert fold_growth(st.bounds, torch.tensor([10.0, 1.0])) == pytest.approx(1.0)
    assert fold_growth(_stats([loud]).bounds, None) == 1.0
    neg = _stats([-quiet, -loud])
    assert fold_growth(neg.bounds, None) == pytest.approx(3.0)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), 11.0])
def test_bad_doublings_are_refused(bad):
    w = torch.randn(4, 8)
    st = _stats([torch.randn(16, 8), torch.randn(16, 8)])
    with pytest.raises(ValueError, match="doublings"):
        decide_group(
            w, st, dynamic=False, dtype=DT, alphas=(None,), clips=(1.0,), doublings=bad
        )


def test_headroom_is_capped():
    """A fold whose extremes are a third of the other's grows 3x: two doublings
    would widen 9x, the cap keeps MAX_HEADROOM (and the range follows it)."""
    from ascend_fa.linear.search import MAX_HEADROOM

    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 8, generator=gen)
    quiet = torch.randn(32, 8, generator=gen).clamp(-1, 1)
    loud = 3.0 * quiet
    st = _stats([quiet, loud])
    one = decide_group(
        w, st, dynamic=False, dtype=DT, alphas=(None,), clips=(1.0,), doublings=1.0
    )
    assert one.headroom == pytest.approx(3.0)
    two = decide_group(
        w, st, dynamic=False, dtype=DT, alphas=(None,), clips=(1.0,), doublings=2.0
    )
    assert two.headroom == MAX_HEADROOM == 4.0
    assert two.hi == pytest.approx(MAX_HEADROOM * float(st.cmax.max()), rel=1e-6)
