"""Robust measured rates (flexshard.local_rates, flexshard.bench.worker): interleaved repeats and their
median, the medians over the bench's measurements and the predictions priced again with them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import flexshard.local_rates as lr
from flexshard.bench.data import default_data
from flexshard.bench.plans import TORCHREC, StrategyPlan, h100_view, repriced
from flexshard.bench.predict import predicted_parts_ms
from flexshard.bench.worker import medians
from solvers.planner import budget_bytes, make_plan
from solvers.schedule import torchrec_schedule
from solvers.time_model import step_time
from solvers.time_types import LocalRates

BASE = LocalRates(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, "base", 7.0, 8.0, 9.0, 10.0)


def test_median_rates_is_the_per_field_median():
    a = replace(BASE, gather_s_per_value=1.0, step_s=0.0)
    b = replace(BASE, gather_s_per_value=5.0, step_s=0.3)
    c = replace(BASE, gather_s_per_value=2.0, step_s=0.1)
    got = lr.median_rates([a, b, c], "m")
    assert (got.gather_s_per_value, got.step_s, got.source) == (2.0, 0.1, "m")
    assert got.dedup_s_per_lookup == 1.0  # equal fields stay
    two = lr.median_rates([a, b], "m")
    assert two.gather_s_per_value == 3.0  # an even count: the mean of the middle two


def test_a_rate_is_the_median_over_interleaved_repeats(monkeypatch):
    # each repeat times every piece once; the gather takes 1, 9 then 2 s for 10 values: median 0.2 s per value
    seconds = iter([1.0, 9.0, 2.0])
    calls = []

    def fake(runs, min_s, sync):
        calls.append([(dim, piece, units) for dim, (piece, units, _) in runs])
        return [lr.RatePoint("gather", 2, 10, next(seconds))]

    monkeypatch.setattr(lr, "time_in_turn", fake)
    got = lr.measured_rates([(torch.arange(5), 2, 10)], BASE, repeats=3)
    assert len(calls) == 3 and calls[0] == calls[1] == calls[2]  # the same runs, built once
    assert [piece for _, piece, _ in calls[0]] == list(lr.PIECES)
    assert got.gather_s_per_value == pytest.approx(0.2)
    assert got.dedup_s_per_lookup == BASE.dedup_s_per_lookup  # no points: the base's


def test_medians_over_the_measurements():
    taken = [replace(BASE, step_s=1.0), replace(BASE, step_s=3.0), replace(BASE, step_s=2.0)]
    rates = medians(taken)
    assert rates.step_s == 2.0
    assert rates.source == "base; median of 3 measurements"
    assert medians([BASE]) == BASE


def test_predictions_are_priced_again_with_the_rates_measured_in_the_rounds():
    data = default_data(16, 0, 4)
    view = h100_view(4, 2)
    plan = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0)).plan
    rates = replace(LocalRates.default(), source="t")
    plans = {
        "row_wise": StrategyPlan("row_wise", None, 0.0, 0.0, 1.0, "", plan),
        TORCHREC: StrategyPlan(TORCHREC, None, 0.0, 0.0, 1.0, "", plan),
        "none": StrategyPlan("none", None, 0.0, 0.0, 1.0, ""),
    }
    got = repriced(plans, data.workload, view, rates, torchrec_local_s=0.004)
    st = step_time(data.workload, view, plan, rates=rates)
    assert got["row_wise"].predicted_ms == pytest.approx(st.total_s * 1e3, rel=1e-12)
    # TorchRec: the plan's bandwidth, the latency of TorchRec's own 5 world all-to-alls (the row-wise
    # plan's 3 on the runtime), and its own local step (its buffer copies included) in place of the
    # modeled local work
    expected = (st.latency_s * 5 / 3 + st.bandwidth_s + 0.004) * 1e3
    assert got[TORCHREC].predicted_ms == pytest.approx(expected, rel=1e-12)
    parts = got[TORCHREC].predicted_parts_ms
    stages = torchrec_schedule(view)
    assert parts == predicted_parts_ms(data.workload, view, plan, rates=rates, local_s=0.004, stages=stages)
    assert parts["total"] == pytest.approx(parts["latency"] + parts["bandwidth"] + parts["local"], rel=1e-12)
    assert parts["local"] == pytest.approx(4.0, rel=1e-12) and st.local_s * 1e3 != pytest.approx(4.0)
    assert got["none"].predicted_ms == 1.0  # no plan to price: kept
