"""Layer-local decisions for one linear group: smoothing strength and activation range.

Statistics of a group's input (:class:`InputStats`, real tokens only): per-channel
minimum and maximum over all calibration tokens, and a sample of rows ``[R, K]`` that
always holds the rows with the largest ``max |x|`` (the outlier tokens that set the
range) plus random others.

:func:`decide_group` searches, on the sample, the choice with the smallest squared
error of the group's outputs against the float outputs ``X @ W^T``:

1. SmoothQuant (Xiao et al., 2023): ``s_j = max|X_j|^α / max|W_j|^(1-α)`` over the
   group's stacked weights; ``X / s`` and ``W * s`` give the same product in float.
   ``α`` from ``config.alphas`` (``None`` = no smoothing) with the full range.
2. Static W8A8 only: the per-tensor range ``[c·lo, c·hi]`` for ``c`` in
   ``config.clips`` (``1.0`` = min/max of all calibration tokens; ``c < 1`` clips,
   ``c > 1`` leaves headroom) with the chosen α.

Both types score their choices on rows held out of the fit (two folds: the
updates' row sets alternate between them; each fold's own smoothing factors, and
for static W8A8 its range, quantize the other fold's rows, and the two errors add
up), because a static range and a smoothing must hold for tokens the calibration
never saw. The held-out score is the sum over tokens of each token's squared
output error relative to its own squared output, so that every token counts alike
(as in the model's mean per-token error) instead of the few massive-activation
tokens whose outputs dwarf the rest. Scored on the rows that set the range, the
search chooses what fits those rows: on SmolLM2 it picked α 0.8-0.9 and no
headroom for ``down_proj``, and held-out inputs then reached 5-20x the smoothed
calibration range. W8A8_DYNAMIC (per-token ranges, only α to choose) scored in
sample by the plain squared error reached code KL 0.032 and prose top-1 0.928 at
the default 32 x 512 (1022 held-out tokens each); held out and per token, 0.014 and
0.932. The chosen α and
``c`` are then applied to the statistics of all rows. With a single update there
is nothing to hold out and the rows that fit also score, by the plain squared
error.

Static W8A8 only, after the search: **headroom** for what the calibration set did
not show. Held-out folds of one domain cannot see what another domain brings, and
they score the narrowest range that fits their own: after a prose-only calibration
of SmolLM2 (residual stream rotated), code's ``down_proj`` inputs are clipped by
every layer's searched range (widening those 9 quantized ranges 1.5x afterwards
took code KL from 0.0463 to 0.0294). A fixed factor costs the ranges that already
cover every domain: with the packaged set's three domains, 1.5x on every
``down_proj`` took prose KL from 0.0155 to 0.0206. So the factor is measured per
group from the calibration data itself (:func:`fold_growth`): how far the
extremes of the smoothed input grow from one fold to both, i.e. when the data
doubles, raised to ``doublings`` (the number of further doublings the range is
extrapolated to), at most :data:`MAX_HEADROOM`. Heavy-tailed inputs, whose
extremes keep growing with more data, get more room; inputs whose extremes the
calibration set has already found get little. With 2 doublings (the default):
code KL 0.0343 after the prose-only calibration, prose 0.0155 after the all-domain
one (docs/accuracy/linears.md, "Across domains"). The searched ``clip`` is
reported as chosen; ``headroom``, ``lo`` / ``hi`` and ``rel_error`` are the
widened range's. The caller chooses which groups (``LinearConfig.headroom_doublings``
for those that read an MLP's gated product).

The held-out products are exact integer products, as the device's int8 GEMM with
int32 accumulation (:func:`~ascend_fa.atb_ops.linear.int_gemm_float`): ``(q -
offset) @ codes^T = q @ codes^T - offset * rowsum(codes)``, scaled afterwards.
Candidates are scored chunk by chunk of rows and a candidate stops as soon as its
partial error exceeds the best complete one (:func:`_held_out_choice`): the
decisions are the full search's, bit for bit, and on SmolLM2's layers 0-2 at the
default 32 x 512 about half of the rows are scored (static W8A8 0.47,
W8A8_DYNAMIC 0.57).

Everything here depends only on the group's own inputs and weights, so a streaming
calibration can take the same decisions one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_fa.atb_ops.linear import dynamic_quant, int_gemm_float

from .modules import activation_qparams, quantize_weight

__all__ = [
    "MAX_DOUBLINGS",
    "MAX_HEADROOM",
    "GroupDecision",
    "InputStats",
    "decide_group",
    "fold_growth",
    "smooth_factors",
]

#: Bounds of a smoothing factor: a channel that is all zero on one side keeps 1,
#: and no factor moves a channel by more than 1e4 either way.
_S_MIN, _S_MAX = 1e-4, 1e4
#: Rows a fold scores, in multiples of the sample (``rows + top``). SmolLM2 at 32 x
#: 512 calibration tokens (4 batches a fold): with 1x the held-out choice gave code
#: KL 0.038 / ppl +4.0 %, with 4x 0.018 / +1.3 % (prose 0.019 -> 0.016).
_FOLD_ROWS = 4


class InputStats:
    """Running per-channel range and a row sample of one group's input ``[*, K]``."""

    def __init__(self, in_features: int, rows: int = 256, top: int = 16, seed: int = 0):
        self.k = in_features
        self.rows = rows
        self.top = top
        self.cmin = torch.full((in_features,), float("inf"))
        self.cmax = torch.full((in_features,), float("-inf"))
        self.tokens = 0
        self._parts: list[torch.Tensor] = []
        #: per update, the per-channel (min, max) of all its rows (the held-out
        #: choice fits each fold's range on them, as the final range is fitted)
        self._bounds: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._gen = torch.Generator().manual_seed(seed)

    def update(self, x: torch.Tensor) -> None:
        """Add the real-token rows ``x`` ``[T, K]``."""
        x = x.detach().float().cpu()
        if x.numel() == 0:
            return
        # amin / amax, not aminmax: on the CPU the fused op measured 10x slower
        lo, hi = x.amin(dim=0), x.amax(dim=0)
        self.cmin = torch.minimum(self.cmin, lo)
        self.cmax = torch.maximum(self.cmax, hi)
        self._bounds.append((lo, hi))
        self.tokens += x.shape[0]
        amax = torch.maximum(x.amax(dim=1), -x.amin(dim=1))  # max |x| per row
        top = torch.topk(amax, min(self.top, x.shape[0])).indices
        pick = torch.randperm(x.shape[0], generator=self._gen)[: self.rows]
        self._parts.append(x[torch.unique(torch.cat([top, pick]))])

    def skip(self, rows: int) -> None:
        """Draw what an update of ``rows`` real-token rows draws, adding nothing: a
        data-parallel rank skips the other ranks' batches this way, so that every
        rank's random picks are those of one process seeing all batches."""
        if rows > 0:
            torch.randperm(rows, generator=self._gen)

    @property
    def parts(self) -> list[torch.Tensor]:
        """The row sets kept so far, one per update with data (in update order)."""
        return list(self._parts)

    @property
    def bounds(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per update with data (in update order): the per-channel minimum and
        maximum ``[K]`` of all its rows."""
        return list(self._bounds)

    def adopt(
        self,
        parts: list[torch.Tensor],
        cmin: torch.Tensor,
        cmax: torch.Tensor,
        tokens: int,
        bounds: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Replace the running state with ``parts`` and ``bounds`` (update order),
        the per-channel ``cmin`` / ``cmax`` ``[K]`` and the token count of all data
        (the union of every rank's updates); the random state is kept."""
        if len(bounds) != len(parts):
            raise ValueError(
                f"InputStats.adopt: {len(parts)} row sets but {len(bounds)} bounds"
            )
        self._parts = [p.float().cpu() for p in parts]
        self._bounds = [(lo.float().cpu(), hi.float().cpu()) for lo, hi in bounds]
        self.cmin, self.cmax = cmin.float().cpu(), cmax.float().cpu()
        self.tokens = int(tokens)

    def sample(self) -> torch.Tensor:
        """``[R', K]``: the ``top`` rows of largest ``max |x|`` and random others,
        at most ``rows + top`` rows."""
        if not self._parts:
            return torch.zeros(0, self.k)
        allx = torch.cat(self._parts)
        if allx.shape[0] <= self.rows + self.top:
            return allx
        amax = allx.abs().amax(dim=1)
        top = torch.topk(amax, self.top).indices
        rest = torch.ones(allx.shape[0], dtype=torch.bool)
        rest[top] = False
        others = rest.nonzero().flatten()
        others = others[
            torch.randperm(others.numel(), generator=self._gen)[: self.rows]
        ]
        return allx[torch.cat([top, others])]

    @property
    def absmax(self) -> torch.Tensor:
        """Per-channel ``max |x|`` ``[K]`` (zeros before any update)."""
        if self.tokens == 0:
            return torch.zeros(self.k)
        return torch.maximum(self.cmin.abs(), self.cmax.abs())


@dataclass
class GroupDecision:
    """What :func:`decide_group` chose: ``alpha`` (None = no smoothing), the
    factors ``smooth`` ``[K]`` (None when not smoothed), the clip factor, the
    activation range ``[lo, hi]`` after smoothing, clipping and ``headroom`` (the
    factor applied to the searched range; 1 for W8A8_DYNAMIC), and ``rel_error`` =
    squared output error / squared float output on the sample."""

    alpha: float | None
    smooth: torch.Tensor | None
    clip: float
    lo: float
    hi: float
    rel_error: float
    headroom: float = 1.0


def smooth_factors(
    act_absmax: torch.Tensor,
    w_absmax: torch.Tensor,
    alpha: float,
    *,
    tie: int = 1,
    head_dim: int = 0,
) -> torch.Tensor:
    """``s = a^α / w^(1-α)`` per input channel ``[K]``; with ``tie > 1`` the ``K =
    H * D`` channels are grouped ``[Hkv, tie, D]`` and share one factor per KV head
    channel (max over the ``tie`` query heads). Channels where either side is zero
    keep 1 (an all-zero activation channel or weight column: the documented safe
    value)."""
    a, w = act_absmax.float(), w_absmax.float()
    if tie > 1:
        d = head_dim
        a = a.view(-1, tie, d).amax(dim=1)
        w = w.view(-1, tie, d).amax(dim=1)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((a > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
    s = s.clamp(_S_MIN, _S_MAX)
    if tie > 1:
        s = s[:, None, :].expand(-1, tie, -1).reshape(-1)
    return s


def _fq_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes, scale = quantize_weight(w, dtype)
    return codes.float() * scale[:, None]


def _codes_static(
    x: torch.Tensor, lo: float, hi: float, dtype: torch.dtype
) -> tuple[torch.Tensor, float, int]:
    """``(codes, scale, offset)`` of ``x`` in the range ``[lo, hi]``, as
    W8A8Linear.quantize_input: times ``1 / scale`` computed in the dtype; the int8
    codes held in float."""
    scale, offset = activation_qparams(lo, hi, dtype)
    recip = torch.tensor([scale], dtype=dtype).reciprocal().float()
    q = (x * recip).add_(float(offset)).round_().clamp_(-128, 127)
    return q, scale, offset


def _fq_static(
    x: torch.Tensor, lo: float, hi: float, dtype: torch.dtype
) -> torch.Tensor:
    q, scale, offset = _codes_static(x, lo, hi, dtype)
    return (q - offset) * scale


def _fq_dynamic(x: torch.Tensor) -> torch.Tensor:
    q, pts = dynamic_quant(x)
    return q.float() * pts[:, None]


def decide_group(
    weight: torch.Tensor,
    stats: InputStats,
    *,
    dynamic: bool,
    dtype: torch.dtype,
    alphas: tuple[float | None, ...],
    clips: tuple[float, ...],
    tie: int = 1,
    head_dim: int = 0,
    doublings: float = 0.0,
) -> GroupDecision:
    """Choose smoothing and range for the group whose stacked float weights are
    ``weight`` ``[N, K]`` (see the module doc); a static range then gets the
    headroom ``fold_growth ** doublings``."""
    if not 0.0 <= doublings <= MAX_DOUBLINGS:
        raise ValueError(
            f"decide_group: doublings must be in [0, {MAX_DOUBLINGS}], got {doublings}"
        )
    exponent = 0.0 if dynamic else float(doublings)
    x = stats.sample()
    lo_all = float(stats.cmin.min()) if stats.tokens else 0.0
    hi_all = float(stats.cmax.max()) if stats.tokens else 0.0
    if x.shape[0] == 0:
        return GroupDecision(None, None, 1.0, lo_all, hi_all, 0.0)
    w = weight.detach().float().cpu()
    ref = x @ w.t()
    norm = float(ref.square().sum()) or 1.0
    w_absmax = w.abs().amax(dim=0)

    def error(
        s: torch.Tensor | None, wq_t: torch.Tensor, clip: float
    ) -> tuple[float, float, float]:
        xs = x if s is None else x / s
        if s is None:
            lo, hi = lo_all, hi_all
        else:
            lo, hi = float((stats.cmin / s).min()), float((stats.cmax / s).max())
        lo, hi = clip * lo, clip * hi
        xq = _fq_dynamic(xs) if dynamic else _fq_static(xs, lo, hi, dtype)
        err = float((xq @ wq_t - ref).square().sum())
        return err, lo, hi

    def smoothed(alpha: float | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        # The weights' fake-quant depends on the smoothing only: made once per
        # alpha and reused by the whole clip grid (same decisions, less time).
        s = None
        if alpha is not None:
            s = smooth_factors(
                stats.absmax, w_absmax, alpha, tie=tie, head_dim=head_dim
            )
        return s, _fq_weight(w if s is None else w * s, dtype).t()

    cap = _FOLD_ROWS * (stats.rows + stats.top)
    choices = len(alphas) * (1 if dynamic else len(clips))
    # one candidate (round-to-nearest): nothing to choose, nothing to score
    folds = _folds(stats.parts, stats.bounds, cap) if choices > 1 else None
    if folds is not None:
        alpha, clip = _held_out_choice(
            w,
            w_absmax,
            folds,
            dtype,
            alphas,
            (1.0,) if dynamic else clips,
            tie,
            head_dim,
            dynamic=dynamic,
        )
        s, wq_t = smoothed(alpha)
        widen = _headroom(stats, s, exponent)
        err, lo, hi = error(s, wq_t, clip * widen)
        return GroupDecision(alpha, s, clip, lo, hi, err / norm, widen)
    best: tuple[float, float | None, torch.Tensor | None, float, float, float] | None
    best = None
    best_wq: torch.Tensor | None = None
    for alpha in alphas:
        s, wq_t = smoothed(alpha)
        err, lo, hi = error(s, wq_t, 1.0)
        if best is None or err < best[0]:
            best, best_wq = (err, alpha, s, 1.0, lo, hi), wq_t
    assert best is not None and best_wq is not None
    if not dynamic:
        for clip in clips:
            if clip == 1.0:
                continue
            err, lo, hi = error(best[2], best_wq, clip)
            if err < best[0]:
                best = (err, best[1], best[2], clip, lo, hi)
    err, alpha, s, clip, lo, hi = best
    widen = _headroom(stats, s, exponent)
    if widen != 1.0:
        err, lo, hi = error(s, best_wq, clip * widen)
    return GroupDecision(alpha, s, clip, lo, hi, err / norm, widen)


#: Most doublings a range is extrapolated to (a bound on the headroom's exponent).
MAX_DOUBLINGS = 10.0
#: Most a range is widened: a fold whose extremes happen to be tiny (few tokens,
#: one odd batch) must not blow the range up until every code rounds to the
#: offset. SmolLM2's ``down_proj`` headrooms at 2 doublings: at most 1.88 / 2.25 /
#: 2.79 calibrated on all / code / prose (medians 1.28 / 1.42 / 1.34).
MAX_HEADROOM = 4.0


def _headroom(stats: InputStats, s: torch.Tensor | None, doublings: float) -> float:
    if not doublings:
        return 1.0
    return min(MAX_HEADROOM, fold_growth(stats.bounds, s) ** doublings)


def _fold_bounds(
    bounds: list[tuple[torch.Tensor, torch.Tensor]], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``k``'s per-channel minimum and maximum ``[K]`` (its updates: every
    other one, from the ``k``-th)."""
    lo = torch.stack([b[0] for b in bounds[k::2]]).amin(dim=0)
    hi = torch.stack([b[1] for b in bounds[k::2]]).amax(dim=0)
    return lo, hi


def fold_growth(
    bounds: list[tuple[torch.Tensor, torch.Tensor]], smooth: torch.Tensor | None
) -> float:
    """How far the extremes of a group's input (divided by ``smooth`` ``[K]``
    when smoothed) grow when the data doubles: per side (the minimum, the
    maximum), the larger fold's extreme over the smaller's (the folds of the
    held-out choice: even and odd updates; ``bounds`` per update, see
    :attr:`InputStats.bounds`), the larger of the two sides. 1 below two updates,
    and for a side where either fold's extreme is 0 or of the other sign."""
    if len(bounds) < 2:
        return 1.0
    ext = []
    for k in (0, 1):
        lo, hi = _fold_bounds(bounds, k)
        if smooth is not None:
            lo, hi = lo / smooth, hi / smooth
        ext.append((float(lo.min()), float(hi.max())))
    growth = 1.0
    for side, sign in ((0, -1.0), (1, 1.0)):
        a, b = sign * ext[0][side], sign * ext[1][side]
        if a > 0 and b > 0:
            growth = max(growth, max(a, b) / min(a, b))
    return growth


_Fold = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: A fitted weight: smoothing factors (or None), the int8 codes ``[N, K]`` held in
#: float (:func:`~ascend_fa.atb_ops.linear.int_gemm_float`), scales
#: ``[N]`` and the codes' row sums ``[N]`` (int32).
_Codes = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]


def _folds(
    parts: list[torch.Tensor],
    bounds: list[tuple[torch.Tensor, torch.Tensor]],
    cap: int,
) -> tuple[_Fold, _Fold] | None:
    """Two folds ``(rows, lo, hi)``: the even and the odd updates (whole batches,
    so one sample's tokens stay in one fold). ``lo`` / ``hi`` ``[K]``: the
    per-channel minimum and maximum of all the fold's rows (what its range and
    smoothing are fitted on, as the final ones on all rows); ``rows``: its sampled
    rows cut to ``cap`` (the largest-``max |x|`` rows first, then a fixed-seed
    draw that leaves the statistics' own random stream alone). ``None`` below two
    updates."""
    if len(parts) < 2:
        return None
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in (0, 1):
        rows = torch.cat(parts[k::2])
        if rows.shape[0] > cap:
            top = max(1, cap // 16)
            order = torch.argsort(rows.abs().amax(dim=1), descending=True, stable=True)
            rest = order[top:][torch.randperm(order.numel() - top, generator=gen)]
            rows = rows[torch.cat([order[:top], rest[: cap - top]])]
        lo, hi = _fold_bounds(bounds, k)
        out.append((rows, lo, hi))
    return out[0], out[1]


#: Row chunks per fold of the held-out scoring: a candidate's error is summed chunk
#: by chunk and its scoring stops once the partial sum exceeds the best complete
#: score (:func:`_held_out_choice`).
_CHUNKS = 8
#: Margin of that stop: a partial sum (float64 over the chunks' fp32 sums) must
#: exceed the best total by this factor, far above the rounding of fp32 sums of
#: non-negative terms, so a stopped candidate's own total is strictly larger.
_PRUNE_MARGIN = 1e-4


def _held_out_choice(
    w: torch.Tensor,
    w_absmax: torch.Tensor,
    folds: tuple[_Fold, _Fold],
    dtype: torch.dtype,
    alphas: tuple[float | None, ...],
    clips: tuple[float, ...],
    tie: int,
    head_dim: int,
    *,
    dynamic: bool = False,
) -> tuple[float | None, float]:
    """``(alpha, clip)`` with the smallest held-out error (see the module doc):
    α first at ``clip = 1``, then the clip with that α, as the in-sample search.

    Every candidate scores its rows exactly as a full scoring would, but chunk by
    chunk (:class:`_HeldOutScorer`): all candidates score the first chunk, then in
    the order of those partial errors each one goes on until it is complete or its
    partial error (a lower bound of its total: the terms are non-negative) exceeds
    the best complete total. The choice is the full search's: a stopped candidate
    cannot win, a complete one has the full search's total (same rows, same
    products, same sums), ties go to the first in grid order."""
    scorer = _HeldOutScorer(w, w_absmax, folds, dtype, tie, head_dim, dynamic)
    alpha = alphas[scorer.argmin([(al, 1.0) for al in alphas])]
    clip = clips[scorer.argmin([(alpha, c) for c in clips])]
    return alpha, clip


class _HeldOutScorer:
    """The held-out error of ``(alpha, clip)`` candidates of one group, memoised
    per candidate and chunk (see :func:`_held_out_choice`)."""

    def __init__(
        self,
        w: torch.Tensor,
        w_absmax: torch.Tensor,
        folds: tuple[_Fold, _Fold],
        dtype: torch.dtype,
        tie: int,
        head_dim: int,
        dynamic: bool,
    ) -> None:
        self.w, self.w_absmax, self.dtype = w, w_absmax, dtype
        self.tie, self.head_dim, self.dynamic = tie, head_dim, dynamic
        self.pairs = ((folds[0], folds[1]), (folds[1], folds[0]))
        refs = [held[0] @ w.t() for _fit, held in self.pairs]
        # Each held-out token's squared output error relative to its own output:
        # the model's error is a mean over tokens, and a plain sum of squares is
        # the few massive-activation tokens' alone (their outputs are 100x the
        # others').
        tiny = torch.finfo(torch.float32).tiny
        self.refs = refs
        self.norms = [r.square().sum(dim=1).clamp_min(tiny) for r in refs]
        # row bounds of each chunk, per fold
        self.bounds = [
            [(m * k // _CHUNKS, m * (k + 1) // _CHUNKS) for k in range(_CHUNKS)]
            for m in (held[0].shape[0] for _fit, held in self.pairs)
        ]
        self.weights: dict[tuple[float | None, int], _Codes] = {}
        #: per candidate, per fold, the per-row errors of its chunks so far
        self.rows: dict[tuple[float | None, float], list[list[torch.Tensor]]] = {}
        self.partial: dict[tuple[float | None, float], float] = {}
        self.totals: dict[tuple[float | None, float], float] = {}
        self._smoothed: dict[tuple[float | None, int, int], torch.Tensor] = {}

    def fitted(self, alpha: float | None, i: int) -> _Codes:
        if (alpha, i) not in self.weights:
            _rows, lo, hi = self.pairs[i][0]
            s = None
            if alpha is not None:
                absmax = torch.maximum(lo.abs(), hi.abs())
                s = smooth_factors(
                    absmax,
                    self.w_absmax,
                    alpha,
                    tie=self.tie,
                    head_dim=self.head_dim,
                )
            w = self.w if s is None else self.w * s
            codes, scale = quantize_weight(w, self.dtype)
            rowsum = codes.sum(dim=1, dtype=torch.int32)
            self.weights[alpha, i] = (s, codes.float(), scale, rowsum)
        return self.weights[alpha, i]

    def _held(self, alpha: float | None, i: int, k: int) -> torch.Tensor:
        """Fold ``i``'s held-out rows of chunk ``k``, smoothed by the fit's
        factors (kept for the last α only: the clip pass reuses them)."""
        key = (alpha, i, k)
        if key not in self._smoothed:
            if self._smoothed and next(iter(self._smoothed))[0] != alpha:
                self._smoothed.clear()
            a, b = self.bounds[i][k]
            held = self.pairs[i][1][0][a:b]
            s = self.fitted(alpha, i)[0]
            self._smoothed[key] = held if s is None else held / s
        return self._smoothed[key]

    def chunk_errors(
        self, alpha: float | None, clip: float, i: int, k: int
    ) -> torch.Tensor:
        """Per-row relative errors of fold ``i``'s chunk ``k`` (each row's value
        does not depend on which other rows are scored with it)."""
        a, b = self.bounds[i][k]
        if a == b:
            return torch.zeros(0)
        s, codes, w_scale, rowsum = self.fitted(alpha, i)
        held = self._held(alpha, i, k)
        if self.dynamic:
            q, pts = dynamic_quant(held)
            out = int_gemm_float(q, codes).mul_(pts[:, None]).mul_(w_scale)
        else:
            lo_c, hi_c = self.pairs[i][0][1], self.pairs[i][0][2]
            if s is not None:
                lo_c, hi_c = lo_c / s, hi_c / s
            lo, hi = clip * float(lo_c.min()), clip * float(hi_c.max())
            q, scale, offset = _codes_static(held, lo, hi, self.dtype)
            # (q - offset) @ codes^T = q @ codes^T - offset * rowsum(codes), the
            # first an exact integer product (the device's int8 GEMM).
            out = int_gemm_float(q, codes).sub_(float(offset) * rowsum.float())
            out.mul_(scale * w_scale)
        e = out.sub_(self.refs[i][a:b]).square_().sum(dim=1)
        return e / self.norms[i][a:b]

    def step(self, cand: tuple[float | None, float]) -> bool:
        """Score ``cand``'s next chunk (both folds); True once it is complete."""
        done = self.rows.setdefault(cand, [[], []])
        k = len(done[0])
        for i in (0, 1):
            part = self.chunk_errors(cand[0], cand[1], i, k)
            done[i].append(part)
            self.partial[cand] = self.partial.get(cand, 0.0) + float(part.sum())
        if k + 1 < _CHUNKS:
            return False
        # the total exactly as one scoring of all rows: per fold, one sum
        total = 0.0
        for i in (0, 1):
            total += float(torch.cat(done[i]).sum())
        self.totals[cand] = total
        del self.rows[cand]
        return True

    def argmin(self, cands: list[tuple[float | None, float]]) -> int:
        """Index of the candidate with the smallest total (the first on ties)."""
        for c in cands:
            if c not in self.totals and c not in self.rows:
                self.step(c)
        best = min((self.totals[c] for c in cands if c in self.totals), default=None)
        open_ = [c for c in cands if c not in self.totals]
        for c in sorted(open_, key=lambda c: self.partial[c]):
            while c not in self.totals:
                if best is not None and self.partial[c] > best * (1 + _PRUNE_MARGIN):
                    break
                if self.step(c):
                    best = self.totals[c] if best is None else min(best, self.totals[c])
        inf = float("inf")
        return min(range(len(cands)), key=lambda j: self.totals.get(cands[j], inf))
