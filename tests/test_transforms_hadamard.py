"""Hadamard and random orthogonal matrices (ascend_fa.transforms.hadamard)."""

from __future__ import annotations

import math

import pytest
import torch

from ascend_fa.errors import InputError, UnsupportedError
from ascend_fa.transforms.hadamard import (
    MAX_ORDER,
    hadamard_matrix,
    has_hadamard,
    random_hadamard,
    random_orthogonal,
)

# Sylvester, Paley I (12, 20, 44), Paley II (28, 36), Kronecker (576 = 72 * 8,
# 896 = 28 * 32, 240 = 60 * 4) and the head sizes.
ORDERS = [1, 2, 4, 12, 20, 28, 36, 44, 64, 128, 240, 576, 896]


def _naive_is_hadamard(h: torch.Tensor) -> bool:
    """Every entry ±1 and every pair of distinct rows orthogonal, row by row."""
    rows = [[int(v) for v in r] for r in h.tolist()]
    n = len(rows)
    if any(v not in (1, -1) for r in rows for v in r):
        return False
    for i in range(n):
        for j in range(i + 1, n):
            if sum(a * b for a, b in zip(rows[i], rows[j])) != 0:
                return False
    return True


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 44, 72])
def test_hadamard_rows_orthogonal_naive(n: int) -> None:
    assert _naive_is_hadamard(hadamard_matrix(n))


@pytest.mark.parametrize("n", ORDERS)
def test_hadamard_matrix_exact(n: int) -> None:
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and h.dtype == torch.float64
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


def test_orders_without_construction() -> None:
    for n in (3, 6, 10, 52, 92):
        assert not has_hadamard(n)
        with pytest.raises(UnsupportedError, match=f"order {n}"):
            hadamard_matrix(n)
    assert not has_hadamard(0) and not has_hadamard(MAX_ORDER + 4)


@pytest.mark.parametrize("n", [12, 52, 64, 576])
def test_random_hadamard_orthogonal_and_seeded(n: int) -> None:
    q = random_hadamard(n, 7, torch.float64)
    assert q.shape == (n, n) and q.dtype == torch.float64
    err = (q @ q.t() - torch.eye(n, dtype=torch.float64)).abs().max()
    assert float(err) < 1e-12
    assert torch.equal(q, random_hadamard(n, 7, torch.float64))
    assert not torch.equal(q, random_hadamard(n, 8, torch.float64))
    assert random_hadamard(n, 7).dtype == torch.float32
    assert torch.equal(random_hadamard(n, 7), q.float())


def test_random_hadamard_flattens_one_hot() -> None:
    """A vector with all its energy in one channel comes out flat."""
    n = 576
    q = random_hadamard(n, 0, torch.float64)
    x = torch.zeros(n, dtype=torch.float64)
    x[123] = 5.0
    y = x @ q
    assert torch.allclose(y.abs(), torch.full((n,), 5.0 / math.sqrt(n)).double())


def test_random_hadamard_is_signed_hadamard() -> None:
    n = 20
    q = random_hadamard(n, 3, torch.float64) * math.sqrt(n)
    h = hadamard_matrix(n)
    signs = torch.sign(q[0] / h[0])
    assert torch.allclose(q, h * signs[None, :])


def test_random_orthogonal() -> None:
    q = random_orthogonal(50, 1, torch.float64)
    assert float((q.t() @ q - torch.eye(50, dtype=torch.float64)).abs().max()) < 1e-12
    assert torch.equal(q, random_orthogonal(50, 1, torch.float64))


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, "8"])
def test_bad_order(bad: object) -> None:
    with pytest.raises(InputError, match="order"):
        random_hadamard(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="order"):
        hadamard_matrix(bad)  # type: ignore[arg-type]


def test_bad_seed_and_huge_order() -> None:
    with pytest.raises(InputError, match="seed"):
        random_hadamard(8, 1.5)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedError, match="larger than"):
        random_orthogonal(MAX_ORDER + 1, 0)
