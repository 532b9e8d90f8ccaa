"""The command-line convention shared by every k3jax entry point (train, generate, convert, …).

- A user error (bad flag, bad ``--set`` value, missing path, a checkpoint of another model: any
  ``ValueError``, ``FileNotFoundError`` or `UserError`) is printed as **one** ``error: …`` line on
  stderr and the exit status is 2; argparse's own errors follow the same form.
- ``--debug`` (or ``K3JAX_DEBUG=1``) shows the full traceback instead.
- k3jax's progress messages (``resumed from step 30 (…)``) and warnings (a corrupt checkpoint
  moved aside) are one line each on stderr, the warnings after ``warning:``.

Use::

    parser = cli.make_parser("python -m k3jax.NAME", __doc__)
    parser.add_argument(...)
    def main(argv=None) -> int:
        args = parser.parse_args(argv)
        return cli.run(lambda: _main(args), debug=args.debug)

``cli.run`` returns the body's exit status (``None`` counts as 0), so ``sys.exit(main())`` works.
Typed ``--set KEY=VALUE`` overrides of a config dataclass: `k3jax.overrides.apply_overrides`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, NoReturn

USER_ERROR = 2
DEBUG_ENV = "K3JAX_DEBUG"


class UserError(Exception):
    """A mistake in what the user asked for, reported as one line (for errors that are not ``ValueError``)."""


class Parser(argparse.ArgumentParser):
    """argparse with a ``--debug`` flag whose errors are one ``error: …`` line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USER_ERROR)


def make_parser(prog: str, doc: str | None) -> Parser:
    """A `Parser` described by the first line of ``doc``, with ``--debug`` already added."""
    parser = Parser(prog=prog, description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")
    return parser


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(err: BaseException) -> str:
    """The error's message on one line (a multi-line message is joined with "; ")."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


def run(body: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run ``body`` and return its exit status; user errors become one ``error:`` line and 2."""
    show_messages_as_lines()
    try:
        status = body()
    except (ValueError, FileNotFoundError, UserError) as err:
        if debug_requested(debug):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        if debug_requested(debug):
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)


class _LineHandler(logging.Handler):
    """One line per record on whatever ``sys.stderr`` is at the time (pytest swaps it per test):
    progress as it is, warnings and errors after ``warning:`` / ``error:``."""

    def emit(self, record: logging.LogRecord) -> None:
        prefix = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        print(prefix + record.getMessage(), file=sys.stderr, flush=True)


def show_messages_as_lines() -> None:
    """k3jax's progress messages ("resumed from step 30 (…)") and warnings go to stderr, one line each."""
    logger = logging.getLogger("k3jax")
    if any(isinstance(h, _LineHandler) for h in logger.handlers):
        return
    logger.addHandler(_LineHandler(logging.INFO))
    logger.setLevel(logging.INFO)
    logger.propagate = False
