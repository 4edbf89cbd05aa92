"""``cuda`` backend: the PyTorch reference kernels on an NVIDIA GPU.

Available only when ``torch.cuda.is_available()``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Availability
from .reference import ReferenceBackend

__all__ = ["CUDABackend"]


class CUDABackend(ReferenceBackend):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    priority: ClassVar[int] = 200

    @classmethod
    def is_available(cls) -> Availability:
        if not torch.cuda.is_available():
            return Availability(
                False,
                "torch.cuda.is_available() is False (no CUDA device "
                "or a CPU-only torch build)",
            )
        return Availability(True)
