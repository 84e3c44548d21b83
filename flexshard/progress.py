"""A minimal progress bar on stderr (drawn only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "simulate") as bar: ... bar.advance("flexshard 2x")``."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, width: int = 28) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.perf_counter()

    def advance(self, note: str = "", steps: int = 1) -> None:
        self.done = min(self.done + steps, self.total)
        self.note(note)

    def note(self, note: str) -> None:
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note[:40]:<40}")
        sys.stderr.flush()

    def __enter__(self) -> Progress:
        self.note("")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
