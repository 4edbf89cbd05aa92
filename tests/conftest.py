"""Shared test configuration."""

from __future__ import annotations

import os

# torch autoloads an installed torch_npu at import; CPU CI must never do that.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    """Each test starts with no forced backend and a fresh selection cache."""
    monkeypatch.delenv("ASCEND_FA_BACKEND", raising=False)
    from ascend_fa.backends import clear_backend_cache

    clear_backend_cache()
    yield
    clear_backend_cache()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
