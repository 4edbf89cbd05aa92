"""Accuracy measures shared by calibration reports, evaluation and emulation.

* :func:`token_nll` — summed next-token negative log-likelihood and the number of
  predicted tokens (real tokens only when a padding mask is given); perplexity is
  ``exp(sum / count)``.
* :class:`OutputError` — running sums that give the cosine and the relative L1 of a
  quantized output against its float reference, accumulated over batches in
  float64: ``cosine = Σab / sqrt(Σaa · Σbb)``, ``rel_l1 = Σ|a - b| / Σ|a|``.
* :func:`token_kl` — summed per-token KL(float ‖ quantized) of next-token
  distributions, and top-1 agreement counts.
* :func:`residual_basis` — the orthogonal ``Q`` of a model that carries the
  residual stream rotated (``h' = h Q``), so that its residual-stream outputs
  are compared in the float model's basis.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "BASIS_TOLERANCE",
    "OutputError",
    "perplexity",
    "residual_basis",
    "token_kl",
    "token_nll",
]


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or float64 when it already is."""
    return t if t.dtype == torch.float64 else t.float()


def token_nll(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[float, int]:
    """``(Σ NLL, count)`` of predicting ``ids[:, 1:]`` from ``logits[:, :-1]``.

    ``logits`` ``[B, S, V]``, ``ids`` ``[B, S]``; ``mask`` ``[B, S]`` (True = real
    token) keeps only pairs whose both tokens are real. The log-softmax runs in fp32
    (float64 for float64 logits) and the sum in float64, so the result does not
    depend on the batch split.
    """
    logp = torch.log_softmax(_at_least_fp32(logits[:, :-1]), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    if mask is None:
        return float(nll.double().sum()), int(nll.numel())
    mask = mask.bool()
    valid = mask[:, 1:] & mask[:, :-1]
    return float(nll[valid].double().sum()), int(valid.sum())


def token_kl(
    ref_logits: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[float, int, int]:
    """``(Σ KL(ref ‖ q), top-1 agreements, count)`` over token positions.

    ``ref_logits``, ``logits`` ``[B, S, V]``; ``mask`` ``[B, S]`` selects the
    positions counted. Per position ``KL = Σ_v p_ref (log p_ref - log p_q)`` in fp32
    (float64 for float64 logits), clamped at 0 and summed in float64. KL is never
    negative; for two equal distributions the fp32 log-softmax roundings leave
    ±1e-8 per position, which would print as a negative KL for a float row.
    """
    lp_ref = torch.log_softmax(_at_least_fp32(ref_logits), dim=-1)
    lp = torch.log_softmax(_at_least_fp32(logits), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1).clamp_min(0.0)
    same = ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)
    if mask is not None:
        keep = mask.bool()
        kl, same = kl[keep], same[keep]
    return float(kl.double().sum()), int(same.sum()), int(same.numel())


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(nll_sum / count)`` (NaN when nothing was counted)."""
    return math.exp(nll_sum / count) if count else float("nan")


class OutputError:
    """Cosine and relative L1 of outputs ``b`` against references ``a``, summed over
    :meth:`add` calls (float64 on the CPU)."""

    def __init__(self) -> None:
        self.sums = torch.zeros(5, dtype=torch.float64)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Accumulate one pair of equally shaped tensors (any float dtype)."""
        a, b = a.double(), b.double()
        self.sums += torch.stack(
            [
                (a * b).sum(),
                (a * a).sum(),
                (b * b).sum(),
                (a - b).abs().sum(),
                a.abs().sum(),
            ]
        ).cpu()

    def cosine(self, *, empty: float | None = None) -> float | None:
        """``Σab / sqrt(Σaa · Σbb)``; ``empty`` when either side is all zero."""
        dot, aa, bb = self.sums[:3].tolist()
        return dot / math.sqrt(aa * bb) if aa and bb else empty

    def rel_l1(self, *, empty: float | None = None) -> float | None:
        """``Σ|a - b| / Σ|a|``; ``empty`` when the reference is all zero."""
        diff, norm = self.sums[3:].tolist()
        return diff / norm if norm else empty


#: Relative Frobenius residual ``|E Q - E'| / |E'|`` under which the
#: embeddings ``E'`` of another model are ``E`` rotated by the orthogonal ``Q``
#: (bf16 rounding of ``E'`` leaves about 4e-3; an unrelated matrix about 1).
BASIS_TOLERANCE = 2e-2


@torch.no_grad()
def residual_basis(reference: nn.Module, other: nn.Module) -> torch.Tensor | None:
    """``Q`` ``[n, n]`` float64 with ``other``'s residual stream ``= reference``'s
    ``· Q`` (the residual rotation), or None when ``other`` carries the stream
    as ``reference`` does. ``Q`` is the orthogonal Procrustes solution between
    the two input embedding matrices (``E' = E Q`` exactly for a rotated model),
    from up to ``8 n`` rows; it counts only where it reproduces ``E'`` within
    :data:`BASIS_TOLERANCE`."""
    if other is reference:
        return None
    a = reference.get_input_embeddings().weight
    b = other.get_input_embeddings().weight
    if a.shape != b.shape or torch.equal(a, b):
        return None
    rows = min(a.shape[0], 8 * a.shape[1])
    e, f = a[:rows].double().cpu(), b[:rows].double().cpu()
    u, _, vh = torch.linalg.svd(e.T @ f)
    q = u @ vh
    if torch.linalg.norm(e @ q - f) > BASIS_TOLERANCE * torch.linalg.norm(f):
        return None
    return q
