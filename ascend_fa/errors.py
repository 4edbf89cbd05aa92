"""The error contract of the library: typed exceptions that name the file concerned.

Library code raises these; the CLI (:mod:`ascend_fa.cli`) maps every one of them to
exit status 2 and a single line on stderr (``ascend-fa VERB: error: MESSAGE``), never
a traceback unless ``-v``/``--debug``. Each class also derives from the built-in
exception a caller would naturally catch (``ValueError``, ``FileNotFoundError``,
``FileExistsError``), so code written against the built-ins keeps working.

===========================  ==================================================
exception                    raised when
===========================  ==================================================
:class:`InputError`          an argument or option is invalid
:class:`FileFormatError`     a file we read is malformed: JSON of the wrong
                             shape, a truncated or corrupt safetensors file, a
                             pickled checkpoint, a recipe that breaks its schema
:class:`UnsafePathError`     a path read from a file (or given) would leave its
                             directory, or a write would follow a symlink
:class:`OutputExistsError`   an output exists and may not be replaced
:class:`NotFoundError`       an input file, directory or package is missing
:class:`UnsupportedError`    the model, target or device cannot express a request
===========================  ==================================================

``path`` (optional) is the file the problem is in; ``str(exc)`` leads with it unless
the message already names it.
"""

from __future__ import annotations

import os

__all__ = [
    "AscendFAError",
    "InputError",
    "FileFormatError",
    "UnsafePathError",
    "OutputExistsError",
    "NotFoundError",
    "UnsupportedError",
    "MAX_WORD",
    "cut_long_words",
]

#: Longest run of non-space characters an error line shows whole (a path, a
#: value); longer ones (a 100,000-character argument) are cut.
MAX_WORD = 300


def cut_long_words(text: str, limit: int = MAX_WORD) -> str:
    """``text`` with every run of non-space characters longer than ``limit``
    cut to its start and its length, so that an echoed value cannot flood the
    one error line."""
    words = text.split(" ")
    return " ".join(
        w if len(w) <= limit else f"{w[: limit // 2]}...({len(w)} characters)"
        for w in words
    )


class AscendFAError(Exception):
    """Base class of every error the library raises on purpose.

    ``message`` is one line; ``path`` the file concerned, when there is one.
    """

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None
    ) -> None:
        self.message = " ".join(str(message).split("\n"))
        self.path = None if path is None else os.fspath(path)
        text = self.message
        if self.path is not None and self.path not in text:
            text = f"{self.path}: {text}"
        super().__init__(text)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InputError(AscendFAError, ValueError):
    """An argument or option is invalid."""


class FileFormatError(AscendFAError, ValueError):
    """A file we read is malformed (wrong JSON shape, corrupt or truncated weights,
    a pickled checkpoint, a recipe that breaks its schema)."""


class UnsafePathError(AscendFAError, ValueError):
    """A path would leave its directory, or a write would follow a symlink."""


class OutputExistsError(AscendFAError, FileExistsError):
    """An output exists and may not be replaced."""


class NotFoundError(AscendFAError, FileNotFoundError):
    """An input file, directory or package is missing."""


class UnsupportedError(AscendFAError, ValueError):
    """The model, target or device cannot express what was asked."""
