"""The exchange's bandwidth on one host whose ranks share its cores (gloo over loopback).

A quick probe times one pair of ranks at a time, so its bandwidth is two cores' worth of copying. In a
training step every rank exchanges at once, and on loopback every byte of every link class is copied by
the same cores (the kernel's socket copies, system time): with 8 ranks on 2 cores the all-to-all moves
about a quarter of the pair's bytes per second per rank, and intra- and inter-group bytes queue for the
same cores instead of travelling side by side. :func:`concurrent_all_to_all_Bps` measures what a rank
sends per second in an all-to-all of every rank at once (the slope of its time over two message sizes,
as the probe fits a link), and :func:`shared_bandwidth_view` prices every link class of a view at it,
where that is slower than the probed links. The bench prices its predictions on that view when the job
runs on gloo (on NCCL the links are the card's and the fabric's, priced as probed).
"""

# ruff: noqa: N802  (unit suffixes such as _Bps keep their case: B = bytes)
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from topology.probe.measurements import fit_latency_bandwidth
from topology.views import ClusterView

MAX_BYTES = 64 << 20  # the largest all-to-all timed, bytes per rank (a GPU-less host's memory and time)
MIN_BYTES = 64 << 10
REPEATS = 5  # timed all-to-alls per size, after one untimed
SIZE_RATIO = 8  # the smaller size timed is the larger over this


def concurrent_all_to_all_Bps(nbytes: int, repeats: int = REPEATS) -> float:
    """Bytes per second each rank sends to the others in an all-to-all of every rank at once: the slope of
    the slowest rank's median time over messages of ``nbytes`` and ``nbytes / 8`` per rank (clipped to
    64 KiB..64 MiB), as :func:`topology.probe.measurements.fit_latency_bandwidth` fits it. Collective:
    every rank calls it with the same ``nbytes``."""
    world = dist.get_world_size()
    large = int(np.clip(nbytes, MIN_BYTES * SIZE_RATIO, MAX_BYTES)) // world * world
    sizes, seconds = [], []
    for size in (large // SIZE_RATIO // world * world, large):
        src = torch.empty(size, dtype=torch.uint8)
        dst = torch.empty_like(src)
        for i in range(1 + repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(dst, src)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
            if i:
                sizes.append(size * (world - 1) // world)  # sent to the others
                seconds.append(float(took))
    return fit_latency_bandwidth(sizes, seconds).bandwidth_Bps


def shared_bandwidth_view(view: ClusterView, bandwidth_Bps: float) -> ClusterView:
    """``view`` with every rank's intra- and inter-group bandwidth at most ``bandwidth_Bps`` (bytes per
    second per rank); a cluster of one group keeps no inter-group class."""
    cap = float(bandwidth_Bps)
    return replace(
        view,
        intra_bw_Bps=np.minimum(view.intra_bw_Bps, cap),
        inter_bw_Bps=np.minimum(view.inter_bw_Bps, cap),
    )
