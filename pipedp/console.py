"""What pipedp's console scripts share: help that shows defaults, ``--version``, one-line failures.

A console script's ``main(argv) -> int`` returns the exit status (0 on
success); the script wrapper hands that to ``sys.exit``, so it must never
return anything else. Expected failures (bad input, a missing optional
extra, a file that cannot be read) end with one line on stderr naming the
problem and a non-zero status; ``PIPEDP_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Callable, NoReturn, Sequence

__all__ = ["HelpFormatter", "make_parser", "run", "run_job", "require", "MissingExtra"]


class MissingExtra(ImportError):
    """An optional dependency group of pipedp is not installed."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring kept as written, and every option's default shown."""


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad value, an unknown option) in one line, with its exit status 2."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def make_parser(prog: str, description: str | None, epilog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with pipedp's help format, one-line usage errors and ``--version``."""
    from . import __version__

    p = _Parser(prog=prog, description=description, epilog=epilog, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s (pipedp) {__version__}")
    return p


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(
            f"{what} needs the '{extra}' extra ({module} is not importable: {e}); "
            f"install it with: pip install 'pipedp[{extra}]'"
        ) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None, prog: str) -> int:
    """Call ``main(argv)``; expected failures become one line on stderr and exit status 1 (130 on Ctrl-C)."""
    try:
        status = main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        if os.environ.get("PIPEDP_DEBUG"):
            raise
        print(f"{prog}: error: {_first_line(e)} (PIPEDP_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    if not isinstance(status, int) or isinstance(status, bool):
        raise TypeError(f"{prog}: main returned {type(status).__name__}, not an exit status")
    return status


def run_job(job: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None, prog: str) -> int:
    """:func:`run` for a ``job(argv)`` that returns its results, not an exit status: 0 once it returns.

    The results are for callers in Python; a console script must not hand them to ``sys.exit``.
    """

    def status(a: Sequence[str] | None) -> int:
        job(a)
        return 0

    return run(status, argv, prog)
