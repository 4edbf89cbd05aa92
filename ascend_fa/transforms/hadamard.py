"""Hadamard and random orthogonal matrices for offline rotations (seeded, exact).

A rotation ``Q`` ``[n, n]`` (``Q @ Q.T = I``) folded into the weights on both sides
of an activation leaves the float model unchanged while spreading an outlier
channel over all ``n`` channels (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et
al. 2024), which is what per-tensor INT8 needs. Every matrix here is a pure
function of ``(n, seed)``: two processes (a whole-model and a streaming
calibration, say) build the same matrix bit for bit.

==========================  ===================================================
function                    returns
==========================  ===================================================
:func:`has_hadamard`        whether a Hadamard matrix of order ``n`` is built here
:func:`hadamard_matrix`     ``[n, n]`` float64 with entries ``±1``, ``H @ H.T = n I``
:func:`random_hadamard`     ``[n, n]`` orthogonal: ``H diag(d) / sqrt(n)`` with seeded
                            random signs ``d``; a seeded random orthogonal matrix
                            when ``n`` has no construction here
:func:`random_orthogonal`   ``[n, n]`` Haar-random orthogonal (seeded QR)
==========================  ===================================================

Constructions (a Paley matrix is checked ``H @ H.T == n I`` exactly when built;
Sylvester and Kronecker products of Hadamard matrices are Hadamard):

* Sylvester: ``H_2n = [[H_n, H_n], [H_n, -H_n]]``;
* Paley I: ``n = q + 1``, ``q`` a prime ``≡ 3 (mod 4)``;
* Paley II: ``n = 2 (q + 1)``, ``q`` a prime ``≡ 1 (mod 4)``;
* Kronecker products ``H_a ⊗ H_b``.

This covers the orders of common hidden and head sizes: 64, 128, 576 (``72 · 8``),
896 (``28 · 32``), 1536 (``12 · 128``), 3584 (``28 · 128``), 5120 (``20 · 256``),
7168 (``28 · 256``) and every power of two. Orders other than 1, 2 and multiples
of 4 have no Hadamard matrix at all.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache

import torch

from ascend_fa.errors import InputError, UnsupportedError

__all__ = [
    "has_hadamard",
    "hadamard_matrix",
    "random_hadamard",
    "random_orthogonal",
]

#: Largest order built (a ``[n, n]`` float64 matrix of this order is 512 MiB).
MAX_ORDER = 8192


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``[q, q]`` ``Q[i, j] = χ(j - i)`` with ``χ`` the quadratic character mod the
    prime ``q`` (``χ(0) = 0``)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor(
        [0.0] + [1.0 if r in squares else -1.0 for r in range(1, q)],
        dtype=torch.float64,
    )
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order ``q + 1`` for a prime ``q ≡ 3 (mod 4)``: ``I + S`` with the skew
    ``S = [[0, 1ᵀ], [-1, Q]]``."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.float64)


def _paley2(q: int) -> torch.Tensor:
    """Order ``2 (q + 1)`` for a prime ``q ≡ 1 (mod 4)``: in the symmetric
    ``S = [[0, 1ᵀ], [1, Q]]`` each 0 becomes ``[[1, -1], [-1, -1]]`` and each
    ``±1`` becomes ``±[[1, 1], [1, -1]]``."""
    m = q + 1
    s = torch.zeros(m, m, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = 1.0
    s[1:, 1:] = _jacobsthal(q)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(s, one) + torch.kron((s == 0).double(), zero)


@cache
def _plan(n: int) -> tuple | None:
    """How to build order ``n``: ``("one",)``, ``("two",)``, ``("paley1", q)``,
    ``("paley2", q)``, ``("kron", a, b)``, or None."""
    if n == 1:
        return ("one",)
    if n == 2:
        return ("two",)
    if n % 4:
        return None
    # Sylvester first (powers of two never need a Paley matrix), then Paley, then
    # any split into two buildable orders.
    if _plan(n // 2) is not None:
        return ("kron", n // 2, 2)
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return ("paley1", n - 1)
    if _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return ("paley2", n // 2 - 1)
    for a in range(4, math.isqrt(n) + 1, 4):
        if n % a == 0 and _plan(a) and _plan(n // a):
            return ("kron", a, n // a)
    return None


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard_matrix` builds order ``n`` (``1 <= n <=``
    :data:`MAX_ORDER`)."""
    return isinstance(n, int) and 1 <= n <= MAX_ORDER and _plan(n) is not None


@lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    plan = _plan(n)
    assert plan is not None
    kind = plan[0]
    if kind == "one":
        return torch.ones(1, 1, dtype=torch.float64)
    if kind == "two":
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if kind == "kron":
        return torch.kron(_hadamard(plan[1]), _hadamard(plan[2]))
    h = _paley1(plan[1]) if kind == "paley1" else _paley2(plan[1])
    # Entries are ±1 and every dot product an integer below 2**53: exact check.
    if not torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64)):
        raise AssertionError(f"Paley construction of order {n} is not Hadamard")
    return h


def _check_order(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"matrix order must be an integer >= 1, got {n!r}")
    if n > MAX_ORDER:
        raise UnsupportedError(
            f"matrix order {n} is larger than {MAX_ORDER} (a dense rotation of this "
            "size is not built here)"
        )


def hadamard_matrix(n: int) -> torch.Tensor:
    """``[n, n]`` float64 Hadamard matrix (entries ``±1``, ``H @ H.T = n I``).

    Raises :class:`~ascend_fa.errors.UnsupportedError` when ``n`` has no
    construction here (see the module doc; :func:`has_hadamard` asks first)."""
    _check_order(n)
    if _plan(n) is None:
        raise UnsupportedError(
            f"no Hadamard matrix of order {n} is built here (orders 1, 2 and "
            "multiples of 4 whose factors are powers of two or Paley orders)"
        )
    return _hadamard(n).clone()


def _generator(seed: int) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be an integer, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def random_orthogonal(
    n: int, seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[n, n]`` Haar-random orthogonal matrix from ``seed``: the Q factor of a
    seeded standard normal matrix (float64 QR on the CPU), with its columns'
    signs fixed by ``diag(R) > 0`` so the result is unique. Returned in
    ``dtype``."""
    _check_order(n)
    g = torch.randn(n, n, dtype=torch.float64, generator=_generator(seed))
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.to(dtype)


def random_hadamard(
    n: int, seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[n, n]`` orthogonal matrix from ``seed``: ``H diag(d) / sqrt(n)`` with
    ``H`` = :func:`hadamard_matrix` ``(n)`` and ``d`` seeded random signs, or
    :func:`random_orthogonal` ``(n, seed)`` when ``n`` has no Hadamard
    construction here. Built in float64, returned in ``dtype``.

    Every entry of the Hadamard form has magnitude ``1 / sqrt(n)``: a vector with
    all its energy in one channel comes out flat, which is what a per-tensor INT8
    scale needs."""
    _check_order(n)
    if _plan(n) is None:
        return random_orthogonal(n, seed, dtype)
    g = _generator(seed)
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) * 2 - 1
    q = _hadamard(n) * signs.double()[None, :] / math.sqrt(n)
    return q.to(dtype)
