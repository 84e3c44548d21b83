"""Ctrl-C during training: one line per job instead of a ``KeyboardInterrupt`` traceback per rank.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: under ``torchrun`` the agent
and every worker get it. Each worker notes it (:class:`SigintWatch`), stops where it is, and rank 0
prints ``flexshard train: interrupted at step N; last checkpoint: step M; resume with --resume``;
every worker exits with status 130 (128 + SIGINT, the shell's convention). A worker whose collective
failed because a peer had already stopped on the same Ctrl-C is also counted as interrupted, not as a
failed collective.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from flexshard import checkpoint

INTERRUPTED_STATUS = 130  # 128 + SIGINT


class SigintWatch:
    """Records whether SIGINT arrived while :meth:`watching` is active (the first one raises
    ``KeyboardInterrupt`` as Python's default handler does; later ones only count, so the report and
    the teardown are not interrupted in turn)."""

    def __init__(self) -> None:
        self.seen = 0

    def _handle(self, _signum: int, _frame: FrameType | None) -> None:
        self.seen += 1
        if self.seen == 1:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def watching(self) -> Iterator[SigintWatch]:
        try:
            previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: nothing to watch
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def interrupted_line(step: int, checkpoint_dir: str | None) -> str:
    """The one line of an interrupted run: the step under way (``step``, 1-based; 0 before the first)
    and the newest complete checkpoint in ``checkpoint_dir``."""
    where = f"interrupted at step {step}" if step else "interrupted before the first step"
    if not checkpoint_dir:
        return f"flexshard train: {where}; no checkpoint (no --checkpoint-dir)"
    found = checkpoint.latest(checkpoint_dir)
    if found is None:
        return f"flexshard train: {where}; no checkpoint in {checkpoint_dir}"
    saved = int(found.name.split("-", 1)[1])
    return f"flexshard train: {where}; last checkpoint: step {saved}; resume with --resume"
