"""The local-work calibration's fits (experiments/calibrate_local.py, calibrate_host.py) on synthetic
timings: they recover the rates the timings were made from."""

from __future__ import annotations

import pytest
from experiment_module import load_experiment

from solvers.time_types import LocalRates


def test_slope_recovers_a_line_and_is_not_set_by_the_largest_size():
    slope = load_experiment("calibrate_local")._slope
    x = [1e5, 2e5, 4e5, 8e5, 1.6e6]
    assert slope(x, [2e-9 * v + 1e-4 for v in x]) == pytest.approx((2e-9, 1e-4), rel=1e-9)
    # the largest size 10x slower per unit (past the caches): an absolute fit would take its slope
    # (about 1.6e-8); the relative fit stays near the others' 2e-9
    y = [2e-9 * v for v in x[:-1]] + [2e-8 * x[-1]]
    got, _ = slope(x, y)
    assert 1e-9 < got < 5e-9


def test_host_fit_recovers_step_and_table_stage_costs_per_rank_share():
    fit_host = load_experiment("calibrate_host").fit_host
    step_s, table_stage_s, tables, factor = 2e-3, 3e-4, 3, 2.0
    rows = [
        (key, c, factor * (step_s + table_stage_s * tables * c) + bare + model, bare, model)
        for key, c, bare, model in (("a", 4, 4e-3, 1e-3), ("b", 6, 6e-3, 2e-3), ("c", 10, 9e-3, 1e-3))
    ]
    got = fit_host(LocalRates.default(), rows, tables, factor)
    assert got.step_s == pytest.approx(step_s, rel=1e-9)
    assert got.table_stage_s == pytest.approx(table_stage_s, rel=1e-9)
    assert got.gather_s_per_value == LocalRates.default().gather_s_per_value  # the rest unchanged
