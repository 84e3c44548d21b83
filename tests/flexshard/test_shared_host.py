"""The bench on a host whose ranks share its cores: the exchange's bandwidth (flexshard/bench/shared_host.py)
and the shared-core factor of its predictions (flexshard/bench/predict.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flexshard.bench.plans import h100_view
from flexshard.bench.predict import shared_core_factor
from flexshard.bench.shared_host import concurrent_all_to_all_Bps, shared_bandwidth_view
from flexshard.runtime.local import run_on_ranks
from solvers.time_types import StepTime


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


def _step(latency_s: float, per_rank_total_s: list[float]) -> StepTime:
    totals = np.asarray(per_rank_total_s, dtype=np.float64)
    r = int(np.argmax(totals))
    work = float(totals[r] - latency_s)
    return StepTime(latency_s, work / 4, 3 * work / 4, float(totals[r]), 4, (), {}, {}, r, totals)


def test_on_shared_cores_a_step_takes_the_mean_work_or_the_busiest_alone():
    """Work (total less latency) 1.36, 0.64, 0 and 2 ms at 2 ranks a core: mean 1 ms, the busiest alone
    on a core 2 / 2 = 1 ms, so the step's work is 1 ms, half the busiest's 2 (hand-computed); at 4 ranks
    a core the mean still sets it; with a core per rank, or even work, the busiest's is the step's."""
    st = _step(0.5e-3, [1.86e-3, 1.14e-3, 0.5e-3, 2.5e-3])
    assert shared_core_factor(st, 2.0) == pytest.approx(0.5)
    assert shared_core_factor(st, 4.0) == pytest.approx(0.5)
    assert shared_core_factor(st, 1.0) == 1.0
    lopsided = _step(0.0, [4e-3, 0.0, 0.0, 0.0])  # mean 1 ms; alone on a core at 2 a core: 2 ms
    assert shared_core_factor(lopsided, 2.0) == pytest.approx(0.5)
    assert shared_core_factor(lopsided, 8.0) == pytest.approx(0.25)
    assert shared_core_factor(_step(1e-3, [3e-3] * 4), 4.0) == pytest.approx(1.0)


def test_the_prediction_scales_bandwidth_and_local_work_by_the_shared_core_factor():
    """An uneven plan (one rank owns half of every table's cold rows) on 4 ranks at 2 a core: its
    prediction's bandwidth and local work are the busiest rank's times the factor, the latency as is."""
    from dataclasses import replace

    from flexshard.bench.data import default_data
    from flexshard.bench.predict import predicted_parts_ms
    from solvers.planner import budget_bytes, make_plan
    from solvers.time_model import step_time
    from solvers.time_types import LocalRates

    data = default_data(64, 0, 4)
    view = h100_view(4, 2)
    plan = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0)).plan
    uneven = replace(
        plan, tables=tuple(replace(tp, cold_share=np.array([0.34, 0.16, 0.0, 0.5])) for tp in plan.tables)
    )
    rates = replace(LocalRates.default(), source="t")
    st = step_time(data.workload, view, uneven, rates=rates)
    f = shared_core_factor(st, 2.0)
    assert 0.5 <= f < 1.0
    got = predicted_parts_ms(data.workload, view, uneven, rates=rates, threads_per_core=2.0)
    assert got["latency"] == pytest.approx(st.latency_s * 1e3, rel=1e-12)
    assert got["bandwidth"] == pytest.approx(f * st.bandwidth_s * 1e3, rel=1e-12)
    assert got["local"] == pytest.approx(f * st.local_s * 1e3, rel=1e-12)
    assert got["total"] == pytest.approx(got["latency"] + got["bandwidth"] + got["local"], rel=1e-12)
    one = predicted_parts_ms(data.workload, view, uneven, rates=rates)  # a core per rank: the busiest
    assert one["total"] == pytest.approx(st.total_s * 1e3, rel=1e-12)
