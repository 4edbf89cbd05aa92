"""``cpu`` backend: the PyTorch reference kernels on the host. Always available."""

from __future__ import annotations

from typing import ClassVar

from .base import Availability
from .reference import ReferenceBackend

__all__ = ["CPUBackend"]


class CPUBackend(ReferenceBackend):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 100

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True)
