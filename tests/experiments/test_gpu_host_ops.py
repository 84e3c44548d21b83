"""experiments/gpu_host_ops.py: the measured GPU host terms are its fit of the committed op counts, the
fit prices every fetch mode's count within 20 ops where the earlier terms (no term per table outside the
collectives) missed them by up to 68, and the fit is the non-negative least-squares one (brute force on
a small case)."""

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
    assert np.abs(priced - counted).max() <= 20 * H100_HOST_S_PER_OP
    # the earlier terms (167.6 a step, 9.67 per table per collective): 1 table's flat fetch 68 high,
    # 9 tables' 58 low
    flat = {r["tables"]: r["ops"] for r in fitted if r["strategy"] == "row_wise" and r["ranks"] == 4}
    assert ops.earlier_ops(1, 3) - flat[1] == pytest.approx(67.6, abs=0.1)
    assert ops.earlier_ops(9, 3) - flat[9] == pytest.approx(-58.3, abs=0.1)


def test_the_fit_is_the_non_negative_least_squares_one():
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
    # a term that least squares makes negative is held at 0: ops = 5 tables x collectives - 20 (the
    # step's -20 ops unconstrained) fits with step 0 and the slope refitted (brute force again)
    falling = [{"tables": t, "collectives": c, "ops": 5 * t * c - 20} for t in (2, 4, 8) for c in (3, 5)]
    coef, res = ops.fit(falling, ("step", "table_stage"))
    assert coef["step"] == 0.0 and coef["table_stage"] > 0
    slopes = np.linspace(4.0, 5.0, 100_001)
    x = np.array([r["tables"] * r["collectives"] for r in falling], dtype=float)
    y = np.array([r["ops"] for r in falling], dtype=float)
    sse = ((y[None, :] - slopes[:, None] * x[None, :]) ** 2).sum(axis=1)
    assert coef["table_stage"] == pytest.approx(slopes[np.argmin(sse)], abs=2e-5)
