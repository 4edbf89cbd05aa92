"""The ``ascend-fa`` command line.

Every module in this package that defines ``COMMAND`` is a subcommand: it provides

* ``COMMAND: str`` — the subcommand name;
* ``HELP: str`` — one line for ``ascend-fa --help``;
* ``add_arguments(parser: argparse.ArgumentParser) -> None``;
* ``run(args: argparse.Namespace) -> int`` — the exit status.

Adding a subcommand is adding one module. Modules import heavy dependencies
(transformers, safetensors) inside ``run`` so ``ascend-fa --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "CLIError"]


class CLIError(Exception):
    """An error to print as one line (no traceback) with a non-zero exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _command_modules():
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "COMMAND"):
            yield module


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
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.COMMAND, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except CLIError as exc:
        print(f"ascend-fa {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"ascend-fa {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
