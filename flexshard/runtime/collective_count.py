"""Counting the collectives a rank issues: :func:`count_collectives` wraps ``torch.distributed``'s
collectives for the duration of a ``with`` block and records each call's kind and the name of the step
stage it belongs to (:func:`stage`, set by the runtime as it issues each stage of
:func:`solvers.schedule.step_schedule`).

Used by the tests that check a step issues exactly its schedule, and by the step benchmarks.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

KINDS = {  # torch.distributed function -> the kind counted (solvers.schedule.CollectiveKind values)
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "barrier": "barrier",
}

_local = threading.local()


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Tag the collectives issued inside the block with the stage ``name``."""
    previous = getattr(_local, "stage", None)
    _local.stage = name
    try:
        yield
    finally:
        _local.stage = previous


@dataclass
class CollectiveCount:
    """What :func:`count_collectives` saw: ``calls`` in issue order as ``(stage name or "", kind)``, and
    ``ranks``: the ranks of each call's process group, in the same order."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @property
    def per_kind(self) -> dict[str, int]:
        """Calls per kind."""
        return dict(Counter(kind for _name, kind in self.calls))

    @property
    def names(self) -> list[str]:
        """The stage names in issue order."""
        return [name for name, _kind in self.calls]

    def __len__(self) -> int:
        return len(self.calls)


@contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Count the ``torch.distributed`` collectives this process issues inside the block (every thread;
    not re-entrant)."""
    out = CollectiveCount()
    originals = {name: getattr(dist, name) for name in KINDS if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            out.calls.append((getattr(_local, "stage", None) or "", KINDS[name]))
            out.ranks.append(dist.get_world_size(kwargs.get("group")))
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield out
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
