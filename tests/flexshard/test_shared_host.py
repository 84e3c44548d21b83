"""The exchange's bandwidth on a host whose ranks share its cores (flexshard/bench/shared_host.py)."""

from __future__ import annotations

import math

import numpy as np

from flexshard.bench.plans import h100_view
from flexshard.bench.shared_host import concurrent_all_to_all_Bps, shared_bandwidth_view
from flexshard.runtime.local import run_on_ranks


def test_the_shared_bandwidth_caps_every_link_class_of_every_rank():
    view = h100_view(4, 2)  # 450 GB/s intra, 50 GB/s inter per rank
    capped = shared_bandwidth_view(view, 100e9)
    assert capped.intra_bw_Bps.tolist() == [100e9] * 4
    assert capped.inter_bw_Bps.tolist() == view.inter_bw_Bps.tolist() == [50e9] * 4  # already below
    low = shared_bandwidth_view(view, 1e9)
    assert low.intra_bw_Bps.tolist() == low.inter_bw_Bps.tolist() == [1e9] * 4
    one = shared_bandwidth_view(h100_view(2, 1), 1e9)  # one group: no inter-group class
    assert one.intra_bw_Bps.tolist() == [1e9] * 2 and not one.inter_bw_Bps.any()
    assert view.intra_bw_Bps.tolist() == [450e9] * 4  # the view given is not changed


def _measure(rank: int, world: int, nbytes: int) -> float:
    return concurrent_all_to_all_Bps(nbytes, repeats=2)


def test_every_rank_gets_the_same_concurrent_bandwidth():
    """Fitted on the slowest rank's time at each size (an all-reduce of it), so every rank prices the
    same figure; a finite rate of at least a megabyte per second on loopback."""
    got = run_on_ranks(_measure, 3, 1 << 20, timeout_s=90)
    assert len(got) == 3 and len(set(got)) == 1, got
    assert math.isfinite(got[0]) and got[0] > 1e6
    assert np.isfinite(got).all()
