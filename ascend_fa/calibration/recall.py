"""Exact recall window and exact ``|x|`` quantile per head, without a full sort.

Definitions (seed 001, restated in the design notes §3.1). For one head with ``N``
samples sorted ascending as ``s[0] <= ... <= s[N-1]`` and ``T = int(ratio * N)``
(the Python float product, truncated):

* **recall window** — among the windows ``[s[i], s[i+T-1]]``, ``i = 0 .. N-T``,
  the narrowest; widths ``s[i+T-1] - s[i]`` are compared in float64 (an fp32
  difference can round two different widths to the same value) and the leftmost
  window wins a tie.
* **abs quantile** — ``a[T-1]`` where ``a`` is ``|x|`` sorted ascending: the
  smallest value ``v`` among the ``|x|`` such that at least ``T`` samples satisfy
  ``|x| <= v``. ``[-v, v]`` is the best symmetric range that covers ``T`` samples,
  the same count the recall window covers. ``ratio = 1`` gives ``max |x|``.

Why it is cheap. A window starts at one of ``s[0 .. N-T]`` — the ``k = N-T+1``
smallest values — and ends at one of ``s[T-1 .. N-1]`` — the ``k`` largest. With
both tails sorted, window ``i`` is ``[low[i], high[i]]`` (``high`` ascending), so
the search is one vectorized ``argmin`` over ``k`` float64 widths. Likewise the
``k`` largest ``|x|`` all sit in the union of the two tails (when the tails
overlap, ``2k > N``, the union is the whole row).

The tails themselves (:func:`head_tails`) come from a two-level selection: split
each head into chunks of ``L`` contiguous samples, reduce each chunk to its
min (max), pick the ``k`` chunks with the smallest minima (largest maxima), and
``topk`` only over those ``k·L`` samples. This is exact: if a value among the
``k`` smallest lived in a chunk that was not picked, each of the ``k`` picked
chunks has a minimum no larger than it, so the picked chunks already hold ``k``
values that small. Chunk reductions stream through memory once at vector speed;
``torch.topk`` over a whole row is a scalar partial sort that is 5-10x slower and
allocates a ``(value, index)`` pair buffer of 16 bytes per sample per thread.

Validation rides on the selection: NaN is ordered above everything by both the
chunk ``amax`` (it propagates) and ``topk`` (NaN is "largest"), so any NaN of a
head lands in its high tail; ``+inf`` lands in the high tail and ``-inf`` in the
low tail. Checking the ``2k`` selected values is therefore a complete finiteness
check without another pass over ``x``.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "recall_window",
    "abs_quantile",
    "recall_window_sort_ref",
    "head_tails",
    "window_from_tails",
    "abs_kth_largest",
    "target_count",
    "tail_size",
    "check_ratio",
    "check_finite_tails",
    "SUPPORTED_DTYPES",
]

#: Input dtypes whose values are exactly representable in fp32 (so fp32 copies of the
#: selected tails are exact and the answer does not depend on the input dtype path).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Chunk lengths tried by head_tails; a power of two keeps the chunk reduction on the
# vectorized inner loop. Below 64 the per-chunk overhead dominates the reduction.
_MIN_CHUNK = 64
_MAX_CHUNK = 4096


def check_ratio(ratio: object, fn: str) -> float:
    """``ratio`` as a float in ``(0, 1]`` or ``ValueError`` naming ``fn``."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise ValueError(f"{fn}: ratio must be a number in (0, 1], got {ratio!r}")
    r = float(ratio)
    if not (0.0 < r <= 1.0):  # also rejects NaN
        raise ValueError(f"{fn}: ratio must be in (0, 1], got {ratio!r}")
    return r


def target_count(ratio: float, n: int, fn: str = "recall_window") -> int:
    """``T = int(ratio * n)``: samples a window must cover; ``ValueError`` if < 1."""
    t = int(ratio * n)
    if t < 1:
        raise ValueError(
            f"{fn}: T = int(ratio * N) = int({ratio!r} * {n}) = {t} < 1; "
            "need more samples or a larger ratio"
        )
    return t


def tail_size(ratio: float, n: int) -> int:
    """``k = n - int(ratio * n) + 1``: candidate window starts (and ends).

    Non-decreasing in ``n`` (``int(ratio * n)`` grows by at most 1 per sample), so
    the tails kept for ``n_max`` samples cover every ``n <= n_max``.
    """
    return n - int(ratio * n) + 1


def check_finite_tails(
    low: torch.Tensor, high: torch.Tensor, fn: str, head_names: str = "head"
) -> None:
    """Raise ``ValueError`` naming the first head whose tails hold NaN or inf.

    ``low``/``high`` ``[H, k]`` are the selected tails; see the module docstring for
    why checking them is a complete check of the head's samples.
    """
    bad = ~(torch.isfinite(low).all(dim=1) & torch.isfinite(high).all(dim=1))
    if bool(bad.any()):
        h = int(bad.nonzero()[0, 0])
        what = (
            "NaN"
            if bool(torch.isnan(high[h]).any() | torch.isnan(low[h]).any())
            else "inf"
        )
        raise ValueError(
            f"{fn}: {head_names} {h} contains {what}; samples must be finite"
        )


def _chunk_len(n_per_row: int, k: int) -> int:
    # Balance the chunk-reduction output (n/L values per head, then a topk over
    # them) against the gathered candidates (k·L per head): L ~ sqrt(n / k).
    ideal = math.sqrt(max(n_per_row, 1) / max(k, 1))
    length = 1 << max(0, round(math.log2(max(ideal, 1.0))))
    return min(max(length, _MIN_CHUNK), _MAX_CHUNK)


def _direct_tails(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[1]
    if 8 * k > n:
        # k is a large fraction of the row (small ratio): a partial sort buys little,
        # so sort once and slice both tails (NaN sorts last, like topk's order).
        s = torch.sort(rows, dim=1).values
        return s[:, :k], s[:, n - k :]
    low = torch.topk(rows, k, dim=1, largest=False, sorted=True).values
    high = torch.topk(rows, k, dim=1, largest=True, sorted=True).values.flip(1)
    return low, high


def head_tails(
    x: torch.Tensor, k: int, *, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` smallest and ``k`` largest samples of each head, sorted ascending.

    ``x`` ``[B, H, R]`` (any strides, floating): head ``h``'s samples are
    ``x[:, h, :]`` (``n = B·R`` of them). Returns ``low``, ``high`` ``[H, k]`` fp32,
    both ascending: ``low = s[0 .. k-1]``, ``high = s[n-k .. n-1]``. Needs
    ``1 <= k <= n``. ``chunk`` forces the chunk length (``0`` forces the direct
    path); the result does not depend on it.

    Ordering follows ``torch.topk``: NaN counts as larger than ``+inf``.
    """
    if x.dim() != 3:
        raise ValueError(f"head_tails: x must be [B, H, R], got shape {tuple(x.shape)}")
    b, h, r = x.shape
    n = b * r
    if not 1 <= k <= n:
        raise ValueError(f"head_tails: need 1 <= k <= n = {n}, got k = {k}")
    if k == 1:
        # amin/amax propagate NaN, so a NaN head still fails the finiteness check.
        low = x.amin(dim=(0, 2)).unsqueeze(1)
        high = x.amax(dim=(0, 2)).unsqueeze(1)
        return low.float(), high.float()
    length = _chunk_len(r, k) if chunk is None else chunk
    n_chunks = r // length if length > 0 else 0
    # The two-level selection only pays off when the k picked chunks are a small part
    # of the head (and there are at least k chunks to pick from).
    if length <= 0 or b * n_chunks < k or 4 * k * length > n:
        rows = x.transpose(0, 1).reshape(h, n)  # a view when B == 1
        low, high = _direct_tails(rows, k)
        return low.float(), high.float()

    main = x[..., : n_chunks * length].unflatten(-1, (n_chunks, length))  # [B,H,C,L]
    rest = r - n_chunks * length
    leftover = (
        x[..., n_chunks * length :].transpose(0, 1).reshape(h, b * rest)
        if rest
        else None
    )
    heads = torch.arange(h, device=x.device).unsqueeze(1)  # [H, 1]

    def one_side(largest: bool) -> torch.Tensor:
        red = main.amax(dim=-1) if largest else main.amin(dim=-1)  # [B, H, C]
        red = red.transpose(0, 1).reshape(h, b * n_chunks)
        idx = torch.topk(red, k, dim=1, largest=largest, sorted=False).indices  # [H, k]
        cand = main[idx // n_chunks, heads, idx % n_chunks].reshape(h, k * length)
        if leftover is not None:
            # The partial last chunk of each row is never reduced: always a candidate.
            cand = torch.cat([cand, leftover], dim=1)
        vals = torch.topk(cand, k, dim=1, largest=largest, sorted=True).values
        return vals.flip(1) if largest else vals

    return one_side(False).float(), one_side(True).float()


def window_from_tails(
    low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Narrowest window given the sorted tails.

    ``low`` ``[H, k]`` = ``s[0 .. k-1]`` and ``high`` ``[H, k]`` = ``s[n-k .. n-1]``
    (both ascending, fp32) with ``k = n - T + 1``: window ``i`` is
    ``[low[i], high[i]]``. Widths in float64 as the definition says (an fp32
    difference would merge widths that differ in the last bits), first minimum on
    ties (``torch.argmin`` returns the first index). Returns ``lo``, ``hi`` ``[H]``
    fp32.
    """
    widths = high.double() - low.double()
    i = torch.argmin(widths, dim=1, keepdim=True)
    return low.gather(1, i).squeeze(1), high.gather(1, i).squeeze(1)


def abs_kth_largest(
    low: torch.Tensor, high: torch.Tensor, n: int, k: int
) -> torch.Tensor:
    """The ``k``-th largest ``|x|`` per head from sorted tails.

    ``low``/``high`` ``[H, m]`` ascending are the ``m`` smallest / largest of ``n``
    samples, ``k <= m <= n``. When the tails overlap (``2m > n``) the shared
    samples are dropped from ``high`` so nothing is counted twice. Returns ``[H]``.
    """
    m = low.shape[1]
    overlap = max(0, 2 * m - n)
    cand = torch.cat([low, high[:, overlap:]], dim=1).abs()
    return torch.topk(cand, k, dim=1, largest=True, sorted=True).values[:, k - 1]


def _check_rows(x: object, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn}: x must be a tensor [H, N], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be 2-D [H, N], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{fn}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(
            f"{fn}: x must have at least one head and one sample, "
            f"got shape {tuple(x.shape)}"
        )
    return x


def recall_window(
    x: torch.Tensor, ratio: float = 0.9999, *, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head narrowest window covering ``T = int(ratio * N)`` samples.

    ``x`` ``[H, N]`` bf16/fp16/fp32 (values are compared exactly; results are the
    fp32 images of samples). Returns ``lo``, ``hi`` ``[H]`` fp32 with
    ``hi - lo`` minimal over windows ``[s[i], s[i+T-1]]``, leftmost on ties; see
    the module docstring. ``ratio = 1`` gives the exact min/max. Extra memory is
    ``O(H·k·L)`` for ``k = N-T+1`` (chunk length ``L``), not ``O(H·N)``.

    ``ValueError`` for a ratio outside ``(0, 1]``, ``T < 1``, or NaN/inf in a head
    (naming the head).
    """
    fn = "recall_window"
    x = _check_rows(x, fn)
    r = check_ratio(ratio, fn)
    n = x.shape[1]
    t = target_count(r, n, fn)
    with torch.no_grad():
        low, high = head_tails(x.unsqueeze(0), n - t + 1, chunk=chunk)
        check_finite_tails(low, high, fn)
        return window_from_tails(low, high)


def abs_quantile(
    x: torch.Tensor, ratio: float = 0.9999, *, chunk: int | None = None
) -> torch.Tensor:
    """Per-head exact ``|x|`` quantile: ``sorted(|x_h|)[T-1]``, ``T = int(ratio*N)``.

    ``x`` ``[H, N]`` bf16/fp16/fp32 -> ``[H]`` fp32. Same validation as
    :func:`recall_window`.
    """
    fn = "abs_quantile"
    x = _check_rows(x, fn)
    r = check_ratio(ratio, fn)
    n = x.shape[1]
    t = target_count(r, n, fn)
    k = n - t + 1
    with torch.no_grad():
        low, high = head_tails(x.unsqueeze(0), k, chunk=chunk)
        check_finite_tails(low, high, fn)
        return abs_kth_largest(low, high, n, k)


def recall_window_sort_ref(
    x: torch.Tensor, ratio: float = 0.9999, *, heads_per_chunk: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-sort reference: ``torch.sort`` each head, then a vectorized float64 scan
    over all ``N-T+1`` windows (first minimum on ties). Same answer as
    :func:`recall_window` by definition; used as the benchmark baseline.

    Heads are sorted ``heads_per_chunk`` at a time so the baseline's sort buffers
    (values plus int64 indices, 3x the rows sorted) stay bounded.
    """
    fn = "recall_window_sort_ref"
    x = _check_rows(x, fn)
    r = check_ratio(ratio, fn)
    n = x.shape[1]
    t = target_count(r, n, fn)
    los, his = [], []
    with torch.no_grad():
        for start in range(0, x.shape[0], heads_per_chunk):
            s = torch.sort(x[start : start + heads_per_chunk].float(), dim=1).values
            if not bool(torch.isfinite(s).all()):
                bad = ~torch.isfinite(s).all(dim=1)
                raise ValueError(
                    f"{fn}: head {start + int(bad.nonzero()[0, 0])} contains NaN or inf"
                )
            widths = s[:, t - 1 :].double() - s[:, : n - t + 1].double()
            i = torch.argmin(widths, dim=1, keepdim=True)
            los.append(s.gather(1, i).squeeze(1))
            his.append(s.gather(1, i + t - 1).squeeze(1))
    return torch.cat(los), torch.cat(his)
