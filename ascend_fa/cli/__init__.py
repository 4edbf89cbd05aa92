"""The ``ascend-fa`` command line: a thin shell over the library's verbs.

Every module in this package that defines ``COMMAND`` is a subcommand: it provides

* ``COMMAND: str`` — the subcommand name;
* ``HELP: str`` — one line for ``ascend-fa --help``;
* ``add_arguments(parser: argparse.ArgumentParser) -> None``;
* ``run(args: argparse.Namespace) -> int`` — parse nothing more, call one library
  function, print its result, return the exit status.

Adding a subcommand is adding one module. Modules import torch and transformers only
inside ``run`` so ``ascend-fa --help`` answers at once.

The error contract (one place): the library raises the typed errors of
:mod:`ascend_fa.errors` (and the built-ins they derive from); :func:`main` prints
one line ``ascend-fa VERB: error: MESSAGE`` on stderr and returns 2 — a traceback
only with ``-v``/``--debug``. SIGINT prints ``interrupted`` and returns 130, SIGTERM
the same with 143; the library's ``finally`` blocks have removed their temporary
files by then.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main", "build_parser", "CLIError", "Terminated"]

#: Exit status of a run stopped by SIGINT (Ctrl-C) and by SIGTERM (128 + signal).
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class CLIError(Exception):
    """An error to print as one line (no traceback) with a non-zero exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM arrives, so that every ``finally``
    (temporary directories, resume state) runs before the process exits. Like
    ``KeyboardInterrupt`` it is not an ``Exception``: library ``except Exception``
    blocks do not swallow it."""


def _command_modules() -> Iterator[Any]:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "COMMAND"):
            yield module


def _add_common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v``/``--debug``/``-q``, accepted before and after the verb (a value given
    after the verb wins; the verb's parser defaults to "not given")."""
    default = False if top else argparse.SUPPRESS
    taken = {s for a in parser._actions for s in a.option_strings}
    if not taken & {"-v", "--verbose", "--debug"}:
        parser.add_argument(
            "-v",
            "--verbose",
            "--debug",
            dest="verbose",
            action="store_true",
            default=default,
            help="debug logging, and tracebacks on errors",
        )
    if not taken & {"-q", "--quiet"}:
        parser.add_argument(
            "-q",
            "--quiet",
            dest="quiet",
            action="store_true",
            default=default,
            help="only warnings and errors; no progress bars",
        )


def build_parser() -> argparse.ArgumentParser:
    from ascend_fa import __version__

    parser = argparse.ArgumentParser(
        prog="ascend-fa",
        description="Attention quantization for Ascend NPUs: calibrate, export, pack, "
        "dispatch.",
    )
    parser.add_argument(
        "--version", action="version", version=f"ascend-fa {__version__}"
    )
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.COMMAND, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        _add_common(p, top=False)
        p.set_defaults(_run=module.run)
    return parser


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """For the duration (main thread only): SIGINT raises ``KeyboardInterrupt`` and
    SIGTERM :class:`Terminated` — the first one only. Later ones are ignored, so a
    second Ctrl-C cannot cut short the ``finally`` blocks that remove temporary
    files."""
    fired: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        if signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt()

    saved: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: leave signals alone
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        yield
        return
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


#: How long (iterations) an idle OpenMP worker of torch's thread pool spins before
#: it sleeps, when the user sets neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT``.
#: libgomp's default spins for about a millisecond at every barrier: on a machine
#: whose cores other processes also run, the spinning workers take the time slices
#: the working ones need (measured on a 2-core AMD EPYC with two busy processes:
#: ``calibrate --num-samples 4 --max-length 64`` 241 s against 53 s idle, 4.5x;
#: with 10000, 136 s busy and 54 s idle, 2.5x; ``OMP_WAIT_POLICY=PASSIVE`` cost
#: 12 % on the idle machine). See docs/guides/cpu-performance.md.
OMP_SPIN_DEFAULT = "10000"


def _short_omp_spin() -> None:
    """Give torch's OpenMP pool a short spin before it is loaded (libgomp reads
    its settings once, when torch loads it); a user's own setting wins."""
    if "torch" in sys.modules:
        return
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_DEFAULT


def main(argv: Sequence[str] | None = None) -> int:
    _short_omp_spin()
    prefix = "ascend-fa"
    verbose = False
    try:
        with _signals_raise():
            parser = build_parser()
            args, extra = parser.parse_known_args(argv)
            run = getattr(args, "_run", None)
            if extra and not getattr(
                sys.modules.get(getattr(run, "__module__", "")),
                "TAKES_EXTRA_ARGS",
                False,
            ):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.extra_args = extra
            verbose = bool(getattr(args, "verbose", False))
            quiet = bool(getattr(args, "quiet", False))
            logging.basicConfig(
                level=logging.DEBUG
                if verbose
                else (logging.WARNING if quiet else logging.INFO),
                format="%(levelname)s %(name)s: %(message)s",
            )
            if not getattr(args, "_run", None):
                parser.print_help()
                return 2
            prefix = f"ascend-fa {args.command}"
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        _say(prefix, "interrupted", peer_quiet=True)
        return EXIT_SIGINT
    except Terminated:
        _say(prefix, "interrupted", peer_quiet=True)
        return EXIT_SIGTERM
    except CLIError as exc:
        if verbose:
            raise
        _say(prefix, f"error: {exc}")
        return exc.status
    except (ValueError, OSError, ImportError) as exc:
        # AscendFAError subclasses derive from ValueError / FileNotFoundError /
        # FileExistsError; other ValueErrors and OSErrors come from argument checks
        # and the file system. Both are the user's to fix: one line, exit 2.
        if verbose:
            raise
        _say(prefix, f"error: {_one_line(exc)}")
        return 2
    except RuntimeError as exc:
        # A data-parallel rank whose peer failed: the collective raises (gloo: the
        # connection closed; or the process group's timeout). One line, exit 1.
        joined = getattr(sys.modules.get("ascend_fa.parallel"), "joined", None)
        if verbose or not (joined and joined()):
            raise
        _say(prefix, f"error: {_one_line(exc)}")
        return 1


def _say(prefix: str, text: str, *, peer_quiet: bool = False) -> None:
    """Print ``prefix: text`` as one line on stderr. A data-parallel rank other
    than 0 (``RANK`` of a torchrun launch) tags the line with its rank, and says
    nothing when every rank says the same: an input error found before the
    process group exists (rank 0 says it), or ``peer_quiet`` (the launcher
    stopping the peers of a failed rank)."""
    import os

    from ascend_fa.errors import cut_long_words

    text = cut_long_words(text)
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if rank in ("", "0") or world in ("", "1"):
        print(f"{prefix}: {text}", file=sys.stderr)
        return
    joined = getattr(sys.modules.get("ascend_fa.parallel"), "joined", None)
    if peer_quiet or not (joined and joined()):
        return
    print(f"{prefix} [rank {rank}/{world}]: {text}", file=sys.stderr)


#: top-level module -> the extra that provides it
EXTRAS = {"transformers": "hf", "accelerate": "hf", "gguf": "hf", "tokenizers": "hf"}


def _one_line(exc: BaseException) -> str:
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    root = (missing or "").split(".")[0]
    if root in EXTRAS:
        extra = EXTRAS[root]
        return (
            f"{root} is not installed; install the '{extra}' extra: "
            f'pip install "ascend-fa[{extra}]" (from a checkout: '
            f'pip install -e ".[{extra}]")'
        )
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
