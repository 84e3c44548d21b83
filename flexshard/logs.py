"""Messages of the command-line programs through :mod:`logging`, as users of PyTorch tools expect.

Results (tables, reports, JSON, the end-of-run summary) go to stdout with ``print``; everything said
about the work on the way (what was read and written, notes, per-step lines, progress) goes to the
``flexshard`` logger (and ``core``, ``topology``, ``solvers``: every module logs to
``logging.getLogger(__name__)``), which :func:`configure` sends to stderr. INFO lines are the plain
message, as the programs printed them before; DEBUG, WARNING and ERROR lines carry their level
(``warning: ...``). ``--log-level`` (debug, info, warning, error; default info) picks the threshold on
``flexshard``, ``flexshard train`` and ``flexshard probe``; ``train --quiet`` is ``--log-level warning``.
Error lines of bad input stay one ``print`` to stderr (exit status 2), whatever the level.
"""

from __future__ import annotations

import argparse
import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"
PACKAGES = ("flexshard", "core", "topology", "solvers")  # the loggers configure() sets up

LOG_LEVEL_HELP = (
    "which messages go to stderr: debug (more detail), info (what the program does), warning, or error "
    "(results on stdout are always printed)"
)


class _Format(logging.Formatter):
    """INFO as the plain message; other levels prefixed with their name in lower case."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno == logging.INFO:
            return message
        return f"{record.levelname.lower()}: {message}"


class _CurrentStderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (not the one at set-up), so redirections (pytest's
    capture, ``contextlib.redirect_stderr``) see the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never end the program
            self.handleError(record)


def add_log_level(parser: argparse.ArgumentParser, default: str | None = DEFAULT_LOG_LEVEL) -> None:
    """Add ``--log-level`` to ``parser``; ``default=None`` leaves the value to an enclosing parser (a
    subcommand's flag then overrides the top-level one only when given)."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS if default is None else default,
        help=LOG_LEVEL_HELP + (f" (default {default})" if default else " (default: the top-level flag's)"),
    )


def configure(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Send the packages' loggers to stderr at ``level`` (one of :data:`LOG_LEVELS`); idempotent (a
    second call replaces the first one's handler and level)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LOG_LEVELS)}")
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, _CurrentStderr)]:
            logger.removeHandler(handler)
        handler = _CurrentStderr()
        handler.setFormatter(_Format())
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False  # one line per message, whatever the root logger has


def effective_level(log_level: str, quiet: bool) -> str:
    """``log_level``, raised to warning by ``--quiet``."""
    if quiet and LOG_LEVELS.index(log_level) < LOG_LEVELS.index("warning"):
        return "warning"
    return log_level
