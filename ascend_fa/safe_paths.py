"""Path rules for untrusted input and for every write: one place, every reader.

Reading — a file name read *from a file* (a weights index's ``weight_map``, a resume
manifest, a list of shards) is untrusted:

* it must be a **plain name**: a non-empty string without a path separator (``/``
  or ``\\``), not ``.`` or ``..``, not absolute, without NUL or other control
  characters (:func:`plain_name`);
* it is **resolved inside its directory**, and a symlink there must not lead out of
  it (:func:`resolve_inside`).

Both are refused with :class:`~ascend_fa.errors.UnsafePathError` naming the file
the entry came from and the entry, before anything is read or written. The
consumers join these entries to the checkpoint directory as plain file names
(huggingface/transformers ``src/transformers/utils/hub.py``
``get_checkpoint_shard_files`` @ d8cb2e01: ``os.path.join(directory, f)`` for each
``weight_map`` value, without a check), so a name that is not plain would make them
read or write outside the checkpoint.

Writing:

* never through a symlink: an output (or a ``.partial`` / temporary directory) that
  is a symlink is refused or the link itself removed (:func:`refuse_symlink`,
  :func:`fresh_dir`); ``os.mkdir`` never follows a link at the last component;
* an output is never the same as, inside, or around one of the inputs
  (:func:`check_disjoint`): replacing it would destroy the input;
* written files get the plain-file mode of the umask — ``0o666 & ~umask``, 0644
  under umask 022 — whatever mode the library that wrote them chose
  (:func:`apply_plain_modes`);
* the few steps that must not be cut in half by Ctrl-C or SIGTERM (moving an old
  output aside and the new one in) run in :func:`signals_deferred`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ascend_fa.errors import InputError, OutputExistsError, UnsafePathError

__all__ = [
    "plain_name",
    "resolve_inside",
    "is_within",
    "check_disjoint",
    "refuse_symlink",
    "fresh_dir",
    "current_umask",
    "plain_file_mode",
    "plain_dir_mode",
    "apply_plain_modes",
    "check_output_parent",
    "check_output_file",
    "write_file",
    "signals_deferred",
]

_SEPARATORS = ("/", "\\")


def plain_name(
    name: object, *, source: str | os.PathLike[str], what: str = "entry"
) -> str:
    """``name`` when it is a plain file name, else :class:`UnsafePathError`.

    ``source`` is the file the name was read from (it leads the message); ``what``
    says what the name is (``"weight_map entry"``).
    """
    if not isinstance(name, str):
        raise UnsafePathError(
            f"{what} {name!r} is not a file name (a {type(name).__name__})",
            path=source,
        )
    problem = None
    if not name:
        problem = "is empty"
    elif os.path.isabs(name) or name.startswith("\\"):
        problem = "is an absolute path; only a plain file name is allowed"
    elif ".." in name.replace("\\", "/").split("/"):
        problem = "leaves its directory (..); only a plain file name is allowed"
    elif any(sep in name for sep in _SEPARATORS):
        problem = "contains a path separator; only a plain file name is allowed"
    elif name == ".":
        problem = "is not a file name"
    elif any(ord(c) < 32 or c == "\x7f" for c in name):
        problem = "contains control characters"
    if problem is not None:
        raise UnsafePathError(f"{what} {name!r} {problem}", path=source)
    return name


def is_within(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is ``directory`` or below it, after resolving symlinks of
    both (``path`` need not exist)."""
    real = os.path.realpath(path)
    base = os.path.realpath(directory)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def resolve_inside(
    directory: str | os.PathLike[str],
    name: object,
    *,
    source: str | os.PathLike[str],
    what: str = "entry",
    allowed: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """``directory / name`` for a plain ``name`` whose target stays inside
    ``directory`` (a symlink to a file elsewhere is refused, unless it leads into
    one of the ``allowed`` directories); the path returned is the unresolved one.
    :class:`UnsafePathError` names ``source`` and the entry."""
    plain = plain_name(name, source=source, what=what)
    path = Path(directory) / plain
    real = os.path.realpath(path)
    if os.path.islink(path) and (
        real == os.path.realpath(directory)
        or not any(is_within(real, d) for d in (directory, *allowed))
    ):
        raise UnsafePathError(
            f"{what} {plain!r} is a symlink leading out of {Path(directory)} "
            f"(to {os.path.realpath(path)})",
            path=source,
        )
    return path


def check_disjoint(
    output: str | os.PathLike[str],
    inputs: Mapping[str, str | os.PathLike[str] | None],
    *,
    flag: str = "--output",
) -> None:
    """Refuse an ``output`` that is the same as, inside, or contains one of
    ``inputs`` (flag -> path; None entries are skipped); symlinks are resolved
    first, so a link to the input counts as the input."""
    out = os.path.realpath(output)
    for name, value in inputs.items():
        if value is None:
            continue
        src = os.path.realpath(value)
        if out == src:
            relation = "is"
        elif is_within(out, src):
            relation = "is inside"
        elif is_within(src, out):
            relation = "contains"
        else:
            continue
        raise UnsafePathError(
            f"{flag} {os.fspath(output)} {relation} {name} {os.fspath(value)}; "
            f"writing there would destroy the input. Choose another {flag}",
            path=output,
        )


def refuse_symlink(path: str | os.PathLike[str], *, what: str = "output") -> None:
    """:class:`UnsafePathError` when ``path`` is a symlink (dangling or not): a
    write must never follow one."""
    if os.path.islink(path):
        raise UnsafePathError(
            f"{what} is a symlink (to {os.readlink(path)}); refusing to write "
            "through it: remove the link or choose another path",
            path=path,
        )


def fresh_dir(path: str | os.PathLike[str], *, replace: bool = False) -> Path:
    """Create ``path`` as a new empty directory and return it.

    A symlink at ``path`` is removed (the link, never what it points to); an
    existing directory is removed first only when ``replace``, otherwise
    :class:`OutputExistsError`; any other file is refused. ``os.mkdir`` does not
    follow a link, so a link that appears in between fails instead of being
    written through.
    """
    path = Path(path)
    if os.path.islink(path):
        os.unlink(path)
    elif path.is_dir():
        if not replace:
            raise OutputExistsError("directory exists", path=path)
        shutil.rmtree(path)
    elif path.exists():
        raise OutputExistsError("exists and is not a directory", path=path)
    os.mkdir(path, plain_dir_mode())
    os.chmod(path, plain_dir_mode())
    return path


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open(path, "w")`` gives a new file."""
    return 0o666 & ~current_umask()


def plain_dir_mode() -> int:
    """``0o777 & ~umask``: the mode ``mkdir`` gives a new directory."""
    return 0o777 & ~current_umask()


def apply_plain_modes(directory: str | os.PathLike[str]) -> None:
    """Give every regular file below ``directory`` :func:`plain_file_mode` and
    every directory (``directory`` included) :func:`plain_dir_mode`; symlinks are
    left alone (``chmod`` would follow them)."""
    fmode, dmode = plain_file_mode(), plain_dir_mode()
    os.chmod(directory, dmode)
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(p, dmode)
            elif stat.S_ISREG(st.st_mode):
                os.chmod(p, fmode)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the duration of a step that must not be cut in
    half; a signal that arrives meanwhile is delivered (to the handler installed
    before) when the block ends. Only the main thread can install handlers; in any
    other thread this does nothing."""
    pending: list[int] = []

    def hold(signum: int, _frame: Any) -> None:
        pending.append(signum)

    saved: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.signal(sig, hold)
    except ValueError:  # not the main thread
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        yield
        return
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            handler = saved[sig]
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(sig)


def check_output_parent(path: str | os.PathLike[str]) -> None:
    """:class:`InputError` unless the nearest existing ancestor of ``path`` is a
    directory this process may create entries in."""
    path = Path(path).absolute()
    parent = path.parent
    while not parent.exists() and not os.path.islink(parent):
        if parent.parent == parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(
            "is not a directory; cannot create the output in it", path=parent
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError("directory is not writable", path=parent)


def check_output_file(path: str | os.PathLike[str], *, what: str = "output") -> Path:
    """The refusals of :func:`write_file`, made before the work that produces the
    file: ``path`` is not a symlink, not a directory, and its parent can be
    written. Returns ``path``."""
    path = Path(path)
    refuse_symlink(path, what=what)
    if path.is_dir():
        raise InputError(f"{what} is a directory; give a file name", path=path)
    check_output_parent(path)
    return path


def write_file(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file beside it renamed
    over it) with the plain-file mode; never through a symlink. The parent
    directory is created when missing."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.chmod(tmp, plain_file_mode())
        with signals_deferred():
            refuse_symlink(path)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
