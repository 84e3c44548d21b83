"""Warm-up until the ranks' host heaps stop growing, so that no strategy's timed steps pay for it.

A CPU rank keeps its freed host memory (:mod:`flexshard.runtime.host_memory`), but steps of similar,
unequal sizes leave the heap fragmented, and it keeps growing for a while after the first steps: at 4
ranks and batch 1,024 a rank's resident memory grew 20-60 MB a step for 10-15 steps (about 5,000 page
faults and 7 ms of CPU a step) before it settled. Whichever strategy runs while it grows pays those
faults. :func:`settle` runs passes of one untimed step per strategy until no rank's peak resident
memory grew by more than :data:`GROWTH_BYTES` in a pass (or ``max_passes`` ran).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

GROWTH_BYTES = 1 << 20  # a pass in which no rank's peak resident memory grew by more: settled
DEFAULT_MAX_PASSES = 20


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far, bytes (``getrusage``'s ``ru_maxrss``: KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``'s ``ru_minflt``, every thread): each a page
    the kernel maps on first touch, as a growing heap's new pages are."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def settle(
    one_pass: Callable[[int], None],
    max_passes: int = DEFAULT_MAX_PASSES,
    measure: Callable[[], int] = peak_resident_bytes,
) -> int:
    """Run ``one_pass(i)`` (one untimed step of every strategy; collective) for i = 0, 1, ... until a
    pass in which no rank's peak resident memory (``measure()``, bytes) grew by more than
    :data:`GROWTH_BYTES`, at most ``max_passes`` times; returns the passes run (0 when ``max_passes``
    is 0). Collective: every rank calls it (one process: no collective)."""
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for i in range(max(0, max_passes)):
        before = measure()
        one_pass(i)
        grew = torch.tensor([float(measure() - before)], dtype=torch.float64)
        if several:
            dist.all_reduce(grew, op=dist.ReduceOp.MAX)
        if grew.item() <= GROWTH_BYTES:
            return i + 1
    return max(0, max_passes)
