"""Awaitable collectives: a stage of the exchange protocol is issued with ``async_op=True`` and returns a
:class:`Pending`, whose :meth:`Pending.wait` waits for the work and finishes the stage locally (splits,
casts, scatters). A caller may overlap other work between issuing a stage and waiting for it; the plain
forward waits at once. A pipelined step issues its next batch's ``ids`` on a second process
group of every rank (their ``group`` argument), so they never interleave with the current step's stages
on the default group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from flexshard.runtime.collective_count import stage

T = TypeVar("T")


class Pending(Generic[T]):
    """Collective work in flight and the local step that turns its buffers into the stage's result."""

    def __init__(self, works: list, finish: Callable[[], T]) -> None:
        self._works, self._finish = works, finish
        self._done, self._value = False, None

    def wait(self) -> T:
        """Wait for the work (once) and return the finished result. The work and the finishing step are
        dropped once done: a finishing step that refers to its own Pending (a subclass's bound method)
        would otherwise keep the stage's buffers in a reference cycle until Python's cyclic collector
        ran, which the training loop keeps out of its steps (:mod:`flexshard.training.garbage`)."""
        if not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()
            self._value, self._done = self._finish(), True
            self._works, self._finish = [], _finished
        return self._value  # type: ignore[return-value]


def _finished() -> None:
    raise AssertionError("a Pending's finishing step ran twice")


def ready(value: T) -> Pending[T]:
    """A stage with nothing on the wire (a group of one rank: a local copy)."""
    return Pending([], lambda: value)


def all_to_all(
    name: str, recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group
):
    """``dist.all_to_all_single`` issued asynchronously as step stage ``name``; returns the work."""
    with stage(name):
        return dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)


def all_reduce(name: str, x: torch.Tensor, op: dist.ReduceOp, group):
    """``dist.all_reduce`` of ``x`` in place, issued asynchronously as step stage ``name``."""
    with stage(name):
        return dist.all_reduce(x, op=op, group=group, async_op=True)
