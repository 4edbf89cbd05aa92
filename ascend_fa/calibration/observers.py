"""Per-head range observers for FA calibration.

Every update first brings the activation to one canonical shape ``[B', H, R]``
(heads on axis 1, head ``h``'s samples are ``x[:, h]`` — never a ``view(H, -1)`` of
``[B, H, ...]``, which mixes heads when ``B > 1``), so each method below is only a
reduction over axes 0 and 2.

=================  ==============  ==================================================
method             accumulate      range after all updates
=================  ==============  ==================================================
``recall_window``  ``union``       per update the recall window of that batch, then
                                   ``lo = min(lo, batch_lo)``, ``hi = max(hi,
                                   batch_hi)`` (seed 001; the default)
``recall_window``  ``pooled``      the recall window of all samples seen, exactly as
                                   if every batch had been concatenated
``abs_quantile``   ``union``       ``v = max over batches of the batch's |x|
                                   quantile``; range ``[-v, v]``
``abs_quantile``   ``pooled``      the ``|x|`` quantile of all samples seen
``minmax``         either          exact min / max of all samples seen
=================  ==============  ==================================================

Padding: with ``token_mask`` ``[B, S]`` only real tokens are observed (values at
padded positions are never read, so garbage there cannot fail a finiteness check).
Rows padded on the left or right are observed as views, one run per row, and the
per-run tails merged exactly; masks with holes gather the real tokens (a copy).

``pooled`` keeps, per head, the ``k_max`` smallest and ``k_max`` largest samples
seen, ``k_max = n_max - int(ratio * n_max) + 1`` for the declared bound
``n_max = max_samples``. Since ``k(n) = n - int(ratio * n) + 1`` never decreases
with ``n``, these tails contain every candidate window of any ``n <= n_max``, so
the final window is exact; more than ``max_samples`` samples is an error, not a
silent approximation. Memory: ``2 · H · k_max`` fp32 (``k_max ~ (1 - ratio) ·
n_max``).
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_fa.atb_ops import per_head_qparams

from .recall import (
    SUPPORTED_DTYPES,
    abs_kth_largest,
    check_finite_tails,
    check_ratio,
    head_tails,
    tail_size,
    target_count,
    window_from_tails,
)

__all__ = ["PerHeadObserver", "METHODS", "ACCUMULATE_MODES"]

METHODS = ("recall_window", "minmax", "abs_quantile")
ACCUMULATE_MODES = ("union", "pooled")

_META_KEYS = ("num_heads", "method", "ratio", "accumulate", "max_samples")


def _segment_tails(
    segments: list[torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_tails` of the concatenation of ``segments`` (each ``[B', H, R]``),
    without concatenating: the ``k`` smallest of a union are among the ``k``
    smallest of its parts (all of a part smaller than ``k``)."""
    if len(segments) == 1:
        return head_tails(segments[0], k)
    lows, highs = [], []
    for seg in segments:
        low, high = head_tails(seg, min(k, seg.shape[0] * seg.shape[2]))
        lows.append(low)
        highs.append(high)
    low = torch.topk(torch.cat(lows, 1), k, dim=1, largest=False, sorted=True).values
    high = torch.topk(torch.cat(highs, 1), k, dim=1, largest=True, sorted=True).values
    return low, high.flip(1)


class PerHeadObserver:
    """Running per-head statistics of one FA quantization point.

    ``num_heads`` is the size of the head axis; ``head_axis`` says where it is in
    the tensors given to :meth:`update` (1 for ``[B, H, S, D]``, 0 for ``[H, N]``).
    ``name`` (e.g. ``"model.layers.3.self_attn.fa_k"``) is used in error messages.
    ``max_samples`` bounds the samples per head: required for ``pooled``, enforced
    whenever set.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        method: str = "recall_window",
        ratio: float = 0.9999,
        accumulate: str = "union",
        max_samples: int | None = None,
        name: str = "",
        head_axis: int = 1,
    ) -> None:
        self.name = name
        #: ranks whose samples the state holds (set by ``all_reduce_observer``; a
        #: reduced observer is never reduced again)
        self.reduced_ranks = 1
        who = self._who()
        if (
            isinstance(num_heads, bool)
            or not isinstance(num_heads, int)
            or num_heads < 1
        ):
            raise ValueError(
                f"{who}: num_heads must be a positive int, got {num_heads!r}"
            )
        if method not in METHODS:
            raise ValueError(
                f"{who}: unknown method {method!r}; expected one of {METHODS}"
            )
        if accumulate not in ACCUMULATE_MODES:
            raise ValueError(
                f"{who}: unknown accumulate {accumulate!r}; expected one of "
                f"{ACCUMULATE_MODES}"
            )
        if max_samples is not None and (
            isinstance(max_samples, bool)
            or not isinstance(max_samples, int)
            or max_samples < 1
        ):
            raise ValueError(
                f"{who}: max_samples must be a positive int or None, "
                f"got {max_samples!r}"
            )
        if isinstance(head_axis, bool) or not isinstance(head_axis, int):
            raise ValueError(f"{who}: head_axis must be an int, got {head_axis!r}")
        self.num_heads = num_heads
        self.method = method
        self.ratio = check_ratio(ratio, who)
        self.accumulate = accumulate
        self.max_samples = max_samples
        self.head_axis = head_axis
        if self._keeps_tails():
            if max_samples is None:
                raise ValueError(
                    f"{who}: accumulate='pooled' needs max_samples (an upper bound on "
                    "the samples per head) so that the kept tails provably hold the "
                    "exact answer"
                )
            self.k_max = tail_size(self.ratio, max_samples)
        else:
            self.k_max = 0
        self.reset()

    # ------------------------------------------------------------------ state
    def _who(self) -> str:
        return f"observer {self.name!r}" if self.name else "observer"

    def _keeps_tails(self) -> bool:
        return self.accumulate == "pooled" and self.method != "minmax"

    def reset(self, device: torch.device | str | None = None) -> None:
        """Forget all samples (state tensors on ``device``, default CPU)."""
        h = self.num_heads
        self.num_samples = torch.zeros(h, dtype=torch.int64, device=device)
        if self._keeps_tails():
            # Padding that any real (finite) sample displaces: +inf at the end of the
            # ascending low tail, -inf at the start of the ascending high tail.
            self.low_tail = torch.full((h, self.k_max), float("inf"), device=device)
            self.high_tail = torch.full((h, self.k_max), float("-inf"), device=device)
        else:
            self.lo = torch.full((h,), float("inf"), device=device)
            self.hi = torch.full((h,), float("-inf"), device=device)

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        if self._keeps_tails():
            return {
                "num_samples": self.num_samples,
                "low_tail": self.low_tail,
                "high_tail": self.high_tail,
            }
        return {"num_samples": self.num_samples, "lo": self.lo, "hi": self.hi}

    def meta(self) -> dict[str, Any]:
        """The configuration that must agree for two states to be combined."""
        return {key: getattr(self, key) for key in _META_KEYS}

    def state_dict(self) -> dict[str, Any]:
        """Configuration plus cloned state tensors (resume with load_state_dict)."""
        state: dict[str, Any] = {
            k: v.detach().clone() for k, v in self._state_tensors().items()
        }
        state.update(self.meta())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the configuration must match."""
        who = self._who()
        for key in _META_KEYS:
            if key not in state:
                raise ValueError(f"{who}: state is missing {key!r}")
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"{who}: state has {key}={state[key]!r} but this observer has "
                    f"{key}={getattr(self, key)!r}"
                )
        for key, cur in self._state_tensors().items():
            if key not in state:
                raise ValueError(f"{who}: state is missing {key!r}")
            val = state[key]
            if not isinstance(val, torch.Tensor) or val.shape != cur.shape:
                got = (
                    tuple(val.shape)
                    if isinstance(val, torch.Tensor)
                    else type(val).__name__
                )
                raise ValueError(
                    f"{who}: state {key!r} must be a tensor of shape "
                    f"{tuple(cur.shape)}, "
                    f"got {got}"
                )
            setattr(self, key, val.detach().clone().to(dtype=cur.dtype))

    # ----------------------------------------------------------------- update
    def _canonical(
        self, x: torch.Tensor, token_mask: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """``x`` -> segments ``[B', H, R]`` that together hold every real token."""
        who = self._who()
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{who}: x must be a tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{who}: x must be float32, float16 or bfloat16, got {x.dtype}"
            )
        if x.dim() < 1 or not -x.dim() <= self.head_axis < x.dim():
            raise ValueError(
                f"{who}: head_axis {self.head_axis} out of range for shape "
                f"{tuple(x.shape)}"
            )
        axis = self.head_axis % x.dim()
        if x.shape[axis] != self.num_heads:
            raise ValueError(
                f"{who}: expected {self.num_heads} heads on axis {axis}, got shape "
                f"{tuple(x.shape)}"
            )
        if token_mask is None:
            if axis == 0:
                return [x.reshape(1, self.num_heads, -1)]
            lead = x.movedim(axis, 1)
            return [lead.reshape(lead.shape[0], self.num_heads, -1)]
        if x.dim() != 4 or axis != 1:
            raise ValueError(
                f"{who}: token_mask needs x as [B, H, S, D] with heads on axis 1, got "
                f"shape {tuple(x.shape)} with head_axis {self.head_axis}"
            )
        b, _, s, _ = x.shape
        if (
            not isinstance(token_mask, torch.Tensor)
            or token_mask.dtype != torch.bool
            or tuple(token_mask.shape) != (b, s)
        ):
            got = (
                f"{token_mask.dtype} {tuple(token_mask.shape)}"
                if isinstance(token_mask, torch.Tensor)
                else type(token_mask).__name__
            )
            raise ValueError(
                f"{who}: token_mask must be bool [B, S] = [{b}, {s}], got {got}"
            )
        token_mask = token_mask.to(x.device)
        if bool(token_mask.all()):
            return [x.reshape(b, self.num_heads, -1)]
        # Left or right padding leaves one run of real tokens per row: observe each
        # run as a view [1, H, len·D] instead of copying the real tokens out.
        count = token_mask.sum(dim=1)
        first = token_mask.int().argmax(dim=1)
        pos = torch.arange(s, device=x.device)
        run = (pos >= first[:, None]) & (pos < (first + count)[:, None])
        if bool((run == token_mask).all()):
            return [
                x[i : i + 1, :, f : f + c].reshape(1, self.num_heads, -1)
                for i, (f, c) in enumerate(zip(first.tolist(), count.tolist()))
                if c > 0
            ]
        # Holes inside rows: gather the real tokens, [H, M, D] -> [1, H, M·D].
        kept = x.transpose(0, 1)[:, token_mask]
        return [kept.reshape(1, self.num_heads, -1)]

    def _to_state_device(self, device: torch.device) -> None:
        if self.num_samples.device != device and int(self.num_samples.sum()) == 0:
            self.reset(device)

    @torch.no_grad()
    def update(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Observe one batch. ``x`` has ``num_heads`` on ``head_axis`` (``[B, H, S,
        D]`` by default); ``token_mask`` ``[B, S]`` bool marks real tokens."""
        who = self._who()
        segments = self._canonical(x, token_mask)
        n = sum(seg.shape[0] * seg.shape[2] for seg in segments)
        if n == 0:
            return
        self._to_state_device(segments[0].device)
        seen = int(self.num_samples[0])
        if self.max_samples is not None and seen + n > self.max_samples:
            raise ValueError(
                f"{who}: {seen} + {n} samples per head exceed max_samples="
                f"{self.max_samples}; raise max_samples (pooled tails are sized for it)"
            )
        dev = self.num_samples.device
        if self.method == "minmax":
            low, high = _segment_tails(segments, 1)
            check_finite_tails(low, high, who)
            self.lo = torch.minimum(self.lo, low[:, 0].to(dev))
            self.hi = torch.maximum(self.hi, high[:, 0].to(dev))
        elif self.accumulate == "union":
            k = n - target_count(self.ratio, n, who) + 1
            low, high = _segment_tails(segments, k)
            check_finite_tails(low, high, who)
            if self.method == "recall_window":
                b_lo, b_hi = window_from_tails(low, high)
            else:
                v = abs_kth_largest(low, high, n, k)
                b_lo, b_hi = -v, v
            self.lo = torch.minimum(self.lo, b_lo.to(dev))
            self.hi = torch.maximum(self.hi, b_hi.to(dev))
        else:
            low, high = _segment_tails(segments, min(self.k_max, n))
            check_finite_tails(low, high, who)
            self._merge_tails(low.to(dev), high.to(dev))
        self.num_samples += n

    def _merge_tails(self, low: torch.Tensor, high: torch.Tensor) -> None:
        k = self.k_max
        self.low_tail = torch.topk(
            torch.cat([self.low_tail, low], dim=1), k, dim=1, largest=False, sorted=True
        ).values
        self.high_tail = torch.topk(
            torch.cat([self.high_tail, high], dim=1),
            k,
            dim=1,
            largest=True,
            sorted=True,
        ).values.flip(1)

    def merge(self, other: PerHeadObserver) -> PerHeadObserver:
        """Fold ``other``'s samples into this observer (batches or ranks); exact for
        every mode. Returns ``self``."""
        who = self._who()
        if not isinstance(other, PerHeadObserver):
            raise ValueError(
                f"{who}: can only merge a PerHeadObserver, got {type(other).__name__}"
            )
        if other.meta() != self.meta():
            diff = {
                k: (v, other.meta()[k])
                for k, v in self.meta().items()
                if other.meta()[k] != v
            }
            raise ValueError(
                f"{who}: cannot merge observers with different settings "
                f"(this, other): {diff}"
            )
        total = int(self.num_samples[0]) + int(other.num_samples[0])
        if self.max_samples is not None and total > self.max_samples:
            raise ValueError(
                f"{who}: merged samples per head {total} exceed "
                f"max_samples={self.max_samples}"
            )
        if int(other.num_samples[0]) == 0:
            return self
        self._to_state_device(other.num_samples.device)
        dev = self.num_samples.device
        if self._keeps_tails():
            self._merge_tails(other.low_tail.to(dev), other.high_tail.to(dev))
        else:
            self.lo = torch.minimum(self.lo, other.lo.to(dev))
            self.hi = torch.maximum(self.hi, other.hi.to(dev))
        self.num_samples = self.num_samples + other.num_samples.to(dev)
        return self

    # ----------------------------------------------------------------- results
    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lo``, ``hi`` ``[H]`` fp32 per the table in the module docstring."""
        empty = self.num_samples == 0
        if bool(empty.any()):
            h = int(empty.nonzero()[0, 0])
            raise ValueError(
                f"{self._who()}: head {h} saw no data; run calibration forwards "
                "through this point (with at least one unpadded token) before asking "
                "for a range"
            )
        if not self._keeps_tails():
            return self.lo.clone(), self.hi.clone()
        n = int(self.num_samples[0])
        k = n - target_count(self.ratio, n, self._who()) + 1
        low = self.low_tail[:, :k]
        high = self.high_tail[:, self.k_max - k :]
        if self.method == "recall_window":
            return window_from_tails(low, high)
        m = min(n, self.k_max)
        v = abs_kth_largest(
            self.low_tail[:, :m], self.high_tail[:, self.k_max - m :], n, k
        )
        return -v, v.clone()

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale`` ``[H]`` fp32 and ``offset`` ``[H]`` int8 zeros (symmetric INT8)."""
        lo, hi = self.range()
        return per_head_qparams(lo, hi)

    def __repr__(self) -> str:
        return (
            f"PerHeadObserver(name={self.name!r}, num_heads={self.num_heads}, "
            f"method={self.method!r}, ratio={self.ratio}, accumulate="
            f"{self.accumulate!r}, samples={int(self.num_samples[0])})"
        )
