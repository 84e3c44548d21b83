"""Progress of long work on stderr: a bar redrawn in place on a terminal, else a periodic log line.

Either way it shows the steps done, their rate and the time left (``(total - done) / rate``, from the
rate so far). Off a terminal (a log file, a CI job, a pipe) one INFO line of the ``flexshard.progress``
logger every ``every_s`` seconds (10 by default), and a last line when the work took that long at all.
Nothing is shown when the ``flexshard`` logger is above INFO (``--log-level warning``, ``--quiet``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 10.0


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """``with Progress(total, "simulate") as bar: ... bar.advance("flexshard 2x")``.

    ``tty``: draw the bar (default: whether stderr is a terminal), else log periodic lines; ``enabled``:
    show anything (default: whether the logger shows INFO); ``clock``: seconds, monotonic (tests pass a
    fake one); ``every_s``: seconds between periodic lines.
    """

    def __init__(
        self,
        total: int,
        label: str,
        enabled: bool | None = None,
        width: int = 28,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
        every_s: float = DEFAULT_EVERY_S,
    ) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.done = 0
        self.enabled = log.isEnabledFor(logging.INFO) if enabled is None else enabled
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.clock, self.every_s = clock, every_s
        self.start = clock()
        self.last_line = self.start  # when the last periodic line was logged
        self.lines = 0  # periodic lines logged

    def advance(self, note: str = "", steps: int = 1) -> None:
        self.done = min(self.done + steps, self.total)
        self.note(note)

    def rate(self) -> str:
        """Steps per second and the time left, from the rate so far (``''`` before the first step)."""
        elapsed = self.clock() - self.start
        if self.done == 0 or elapsed <= 0:
            return ""
        per_s = self.done / elapsed
        left = (self.total - self.done) / per_s
        return f"{per_s:.3g}/s, {duration(left)} left"

    def note(self, note: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        elapsed = now - self.start
        if self.tty:
            filled = int(self.width * self.done / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            sys.stderr.write(
                f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {self.rate():<22} "
                f"{note[:40]:<40}"
            )
            sys.stderr.flush()
        elif now - self.last_line >= self.every_s and self.done < self.total:
            self.last_line = now
            self.lines += 1
            log.info(self._line(note, elapsed))

    def _line(self, note: str, elapsed: float) -> str:
        rate = self.rate()
        share = self.done / self.total
        return (
            f"{self.label}: {self.done}/{self.total} ({share:.0%}) after {duration(elapsed)}"
            + (f", {rate}" if rate else "")
            + (f" ({note})" if note else "")
        )

    def __enter__(self) -> Progress:
        self.note("")
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif exc[:1] in ((), (None,)) and self.clock() - self.start >= self.every_s:
            done = "done " if self.done == self.total else ""
            log.info(f"{self.label}: {self.done}/{self.total} {done}in {duration(self.clock() - self.start)}")
