"""Awaitable collectives: a stage of the exchange protocol is issued with ``async_op=True`` and returns a
:class:`Pending`, whose :meth:`Pending.wait` waits for the work and finishes the stage locally (splits,
casts, scatters). A caller may overlap other work between issuing a stage and waiting for it; the plain
forward waits at once.

:func:`issued_on` sends the world-wide stages issued inside it (``group=None``) on another process group
with the same ranks: a pipelined step's next-batch ``meta`` and ``ids`` go there, so they never interleave
with the current step's stages on the default group."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from flexshard.runtime.collective_count import stage

T = TypeVar("T")

_world = threading.local()


@contextlib.contextmanager
def issued_on(group) -> Iterator[None]:
    """Collectives issued in the block with ``group=None`` go on ``group`` (a process group of every rank,
    in rank order); ``group=None`` leaves them on the default group. This thread only."""
    previous = getattr(_world, "group", None)
    _world.group = group
    try:
        yield
    finally:
        _world.group = previous


def _group(group):
    """``group``, or the world group of :func:`issued_on` when ``group`` is None."""
    return group if group is not None else getattr(_world, "group", None)


class Pending(Generic[T]):
    """Collective work in flight and the local step that turns its buffers into the stage's result."""

    def __init__(self, works: list, finish: Callable[[], T]) -> None:
        self._works, self._finish = works, finish
        self._done, self._value = False, None

    def wait(self) -> T:
        """Wait for the work (once) and return the finished result."""
        if not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()
            self._value, self._done = self._finish(), True
            self._works = []
        return self._value  # type: ignore[return-value]


def ready(value: T) -> Pending[T]:
    """A stage with nothing on the wire (a group of one rank: a local copy)."""
    return Pending([], lambda: value)


def all_to_all(
    name: str, recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group
):
    """``dist.all_to_all_single`` issued asynchronously as step stage ``name``; returns the work."""
    with stage(name):
        return dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=_group(group), async_op=True)


def all_reduce(name: str, x: torch.Tensor, op: dist.ReduceOp, group):
    """``dist.all_reduce`` of ``x`` in place, issued asynchronously as step stage ``name``."""
    with stage(name):
        return dist.all_reduce(x, op=op, group=_group(group), async_op=True)
