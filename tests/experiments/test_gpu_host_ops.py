"""experiments/gpu_host_ops.py: the measured GPU host terms are its fit of the committed op counts, the
fit prices every fetch mode's count within 13 ops where the earlier terms (no term per table outside the
collectives) missed 9 tables' by up to 119, and the fit is least squares (brute force on a small case)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from experiment_module import load_experiment

from solvers.time_types import H100_HOST_S_PER_OP, H100_RUNTIME_RATES


def test_the_measured_gpu_host_terms_are_the_fit_of_the_committed_counts():
    ops = load_experiment("gpu_host_ops")
    records = json.loads((ops.RESULTS / "gpu_host_ops.json").read_text())["records"]
    terms = ops.fitted_terms(records)
    stored = {
        "step": H100_RUNTIME_RATES.step_s,
        "table": H100_RUNTIME_RATES.table_s,
        "stage": H100_RUNTIME_RATES.stage_s,
        "table_stage": H100_RUNTIME_RATES.table_stage_s,
    }
    for name, seconds in stored.items():
        assert seconds / H100_HOST_S_PER_OP == pytest.approx(terms[name], abs=0.005), name
    fitted = ops.fitted_records(records)
    assert {(r["tables"], r["strategy"]) for r in fitted} == {
        (t, s) for t in (1, 2, 3, 6, 9) for s in ops.STRATEGIES
    }
    assert all(r["ranks"] > 1 for r in fitted)
    priced = np.array([H100_RUNTIME_RATES.host_s(r["tables"], int(r["collectives"])) for r in fitted])
    counted = np.array([r["ops"] for r in fitted]) * H100_HOST_S_PER_OP
    assert np.abs(priced - counted).max() <= 13 * H100_HOST_S_PER_OP
    # the earlier terms (167.6 a step, 9.67 per table per collective): 9 tables' group fetch 119 low
    nine = [r["ops"] for r in fitted if r["tables"] == 9 and r["strategy"] == "row_wise_group_dedup"]
    assert nine[0] - (167.6 + 9.67 * 9 * 5) == pytest.approx(119.2, abs=0.1)


def test_the_fit_is_least_squares():
    ops = load_experiment("gpu_host_ops")
    exact = [  # ops = 10 + 2 tables + (3 + 1 tables) x collectives, then one count 4 ops high
        {"tables": t, "collectives": c, "ops": 10 + 2 * t + (3 + t) * c} for t in (1, 2, 5) for c in (3, 5)
    ]
    coef, res = ops.fit(exact, ops.TERMS[list(ops.TERMS)[-1]])
    assert coef == pytest.approx({"step": 10, "table": 2, "stage": 3, "table_stage": 1}, abs=1e-9)
    assert np.abs(res).max() < 1e-9
    exact[0]["ops"] += 4
    coef, res = ops.fit(exact, ("step", "table_stage"))
    grid = np.linspace(-20, 60, 161)  # brute force: no (step, table_stage) on the grid does better
    best = min(
        sum((r["ops"] - a - b * r["tables"] * r["collectives"]) ** 2 for r in exact)
        for a in grid
        for b in np.linspace(0, 6, 121)
    )
    assert float(np.sum(res**2)) <= best + 1e-9
