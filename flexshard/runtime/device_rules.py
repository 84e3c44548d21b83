"""Which of its op choices the runtime makes on a device. On a GPU an op costs tens of microseconds of host
time (dispatch, kernel launch) and a copy of the rows microseconds of memory bandwidth, so the runtime
issues fewer ops there: two-pass gathers (:func:`~flexshard.runtime.transfer.staged_gathers`), received
blocks joined per column (:func:`~flexshard.runtime.column_joins.joins_columns`), ``torch.nonzero`` and a
gather before a host copy. On the CPU, where the second copy costs more than the ops it saves, the other
way. Both give the same values.

:func:`counted_as_gpu` makes the CPU take the GPU's choices for the duration of a ``with`` block, so that
a GPU's op count can be counted on a machine without one (``experiments/profile_step.py --as-gpu``,
``experiments/gpu_host_ops.py``) and the GPU's paths run in tests here. Process-wide (every thread), not
re-entrant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_as_gpu = False  # set by counted_as_gpu


def gpu_paths(device: torch.device) -> bool:
    """Whether work on ``device`` takes the runtime's GPU choices (fewer ops): on any device but the CPU,
    and on the CPU inside :func:`counted_as_gpu`."""
    return device.type != "cpu" or _as_gpu


@contextmanager
def counted_as_gpu() -> Iterator[None]:
    """Within the block the CPU takes the runtime's GPU choices (:func:`gpu_paths` is true everywhere)."""
    global _as_gpu
    previous, _as_gpu = _as_gpu, True
    try:
        yield
    finally:
        _as_gpu = previous
