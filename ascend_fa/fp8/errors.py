"""Errors of the FP8 conversion: one base class, refined by the problem's kind.

:class:`FP8ConversionError` is what every FP8 refusal is (catch it to catch them
all); each concrete error also derives from the matching class of
:mod:`ascend_fa.errors`, so the CLI maps it to exit status 2 and one line:

==========================  ===================================================
exception                   raised when
==========================  ===================================================
:class:`FP8InputError`      an argument is invalid (block size, dtype, workers,
                            regex, output location)
:class:`FP8FormatError`     a checkpoint, index, config, manifest or tensor is
                            malformed or holds values the format forbids (NaN,
                            a scale_inv <= 0)
:class:`FP8UnsafePathError` a name read from a file would leave its directory,
                            or a write would follow a symbolic link
==========================  ===================================================

A missing input is :class:`ascend_fa.errors.NotFoundError`, an output that may not be
replaced :class:`ascend_fa.errors.OutputExistsError`.
"""

from __future__ import annotations

from ..errors import AscendFAError, FileFormatError, InputError, UnsafePathError

__all__ = [
    "FP8ConversionError",
    "FP8FormatError",
    "FP8InputError",
    "FP8UnsafePathError",
]


class FP8ConversionError(AscendFAError, ValueError):
    """A refused FP8 conversion; the message names the file, tensor and block."""


class FP8InputError(FP8ConversionError, InputError):
    """An argument of the conversion is invalid."""


class FP8FormatError(FP8ConversionError, FileFormatError):
    """A file of the checkpoint is malformed or holds forbidden values."""


class FP8UnsafePathError(FP8ConversionError, UnsafePathError):
    """A name read from a file leaves its directory, or a write would follow a
    symbolic link."""
