"""Where an artifact may be written, and the atomic write itself.

An output is never a symlink, never replaced unless it is an artifact of ours
(``overwrite``) or the caller insists (``force``); files go to a fresh temporary
directory beside it that is renamed over it at the end (signals deferred during the
swap), and leftovers of killed runs are cleaned up on the next run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ascend_fa.errors import AscendFAError, InputError, OutputExistsError
from ascend_fa.safe_files import read_json_object
from ascend_fa.safe_paths import (
    apply_plain_modes,
    check_output_parent,
    plain_dir_mode,
    refuse_symlink,
    signals_deferred,
)

from .format import DESCRIPTION_FILE, REPORT_FILE

__all__ = ["atomic_output_dir", "check_output_dir", "is_own_artifact"]


def is_own_artifact(directory: str | Path) -> bool:
    """Whether ``directory`` holds an artifact this package wrote: its
    ``calibration_report.json`` (a file msModelSlim never writes) is a JSON object
    beside a description. Only such a directory may be replaced by ``--overwrite``
    alone; anything else needs ``force``."""
    directory = Path(directory)
    report, desc = directory / REPORT_FILE, directory / DESCRIPTION_FILE
    if not report.is_file() or not desc.is_file():
        return False
    try:
        read_json_object(report, what="report")
    except AscendFAError:
        return False
    return True


_STALE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[A-Za-z0-9_]{8}$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _clean_stale(output: Path) -> None:
    """Remove what a killed run (SIGKILL, power loss) left beside ``output``: its
    temporary directory, and the moved-aside old output — put back when the new
    one never arrived."""
    siblings: list[Path] = []
    with contextlib.suppress(OSError):
        siblings = list(output.parent.iterdir())
    for entry in sorted(siblings, key=lambda p: p.name):
        m = _STALE.match(entry.name)
        if not m or m["name"] != output.name or _pid_alive(int(m["pid"])):
            continue
        if os.path.islink(entry) or not entry.is_dir():
            continue
        aside = entry / "d"
        if m["kind"] == "old" and aside.is_dir() and not os.path.lexists(output):
            os.replace(aside, output)
        shutil.rmtree(entry, ignore_errors=True)


def check_output_dir(
    output: str | Path, *, overwrite: bool = False, force: bool = False
) -> Path:
    """The refusals of :func:`atomic_output_dir`, made without writing anything
    (verbs call it before the model loads); returns ``output`` made absolute.

    Refused: an ``output`` that is a symlink (dangling or not), that exists and is
    not a directory, a non-empty one without ``overwrite``, one that is not an
    artifact of ours (:func:`is_own_artifact`) without ``force`` as well, and one
    whose parent cannot be written.
    """
    output = Path(output).absolute()
    refuse_symlink(output, what="output")
    if output.exists():
        if not output.is_dir():
            raise OutputExistsError("output exists and is not a directory", path=output)
        if any(output.iterdir()):
            if not overwrite:
                raise OutputExistsError(
                    f"output directory {output} exists and is not "
                    "empty; pass --overwrite to replace it",
                    path=output,
                )
            if not force and not is_own_artifact(output):
                raise OutputExistsError(
                    f"output directory {output} is not an ascend-fa artifact (no "
                    f"{REPORT_FILE}); --overwrite replaces only our own artifacts: "
                    "pass --force as well to replace it",
                    path=output,
                )
    check_output_parent(output)
    return output


@contextlib.contextmanager
def atomic_output_dir(
    output: str | Path, *, overwrite: bool = False, force: bool = False
) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``output`` when the block succeeds.

    Refused before anything is written: an ``output`` that is a symlink (dangling or
    not: a write never follows one), that exists and is not a directory, or whose
    parent cannot be written. An existing non-empty ``output`` is replaced only with
    ``overwrite``, and only when it holds an artifact of ours
    (:func:`is_own_artifact`) unless ``force`` as well. Written files get the
    umask's plain-file mode (0644 under umask 022). On any error — Ctrl-C and
    SIGTERM included — the temporary directory is deleted and ``output`` is
    untouched; the two renames that swap the new output in are not interrupted by
    either signal. What a killed run left behind is cleaned up on the next run.
    """
    output = Path(output).absolute()
    if output.parent.is_dir():
        _clean_stale(output)
    output = check_output_dir(output, overwrite=overwrite, force=force)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create the output's parent directory: {exc.strerror}",
            path=output.parent,
        ) from None
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent)
    )
    try:
        # mkdtemp creates 0700; give the artifact the permissions of a plain mkdir.
        os.chmod(tmp, plain_dir_mode())
        yield tmp
        apply_plain_modes(tmp)
        with signals_deferred():
            refuse_symlink(output, what="output")
            if output.exists():
                # os.replace cannot replace a non-empty directory: move the old one
                # aside first, then drop it once the new one is in place.
                old = Path(
                    tempfile.mkdtemp(
                        prefix=f".{output.name}.old-{os.getpid()}-", dir=output.parent
                    )
                )
                os.replace(output, old / "d")
                os.replace(tmp, output)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, output)
    except BaseException:
        with signals_deferred():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
