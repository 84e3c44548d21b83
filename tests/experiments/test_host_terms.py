"""experiments/host_terms.py: the stored host terms are its fit of the committed records, and the fit
prices the tables' sweep without the per-table growth the earlier terms had."""

from __future__ import annotations

import json

import numpy as np
import pytest
from experiment_module import load_experiment

from solvers.time_types import DEFAULT_RATES, LocalRates


def test_the_stored_host_terms_are_the_fit_of_the_committed_records():
    ht = load_experiment("host_terms")
    records = json.loads(ht.RECORDS.read_text())
    stored = LocalRates.load(ht.PRICED_WITH)
    study = [r for r in json.loads(ht.STUDY.read_text()) if r.get("plan_tables")]
    study = [r for r in study if ht.priced_with(r, stored)]  # the runs priced with the earlier terms
    assert len(study) == 144
    fitted, table = ht.fit_host_to_bench([*records, *study], stored)
    assert fitted.step_s == pytest.approx(DEFAULT_RATES.step_s, rel=1e-3)
    assert fitted.stage_s == pytest.approx(DEFAULT_RATES.stage_s, rel=1e-3)
    assert DEFAULT_RATES.table_stage_s == fitted.table_stage_s == 0.0
    # the sweep of 1 to 9 tables (the same lookups and rows): every row within 20% after the fit, where
    # the per-table term had 9 tables' up to 31% high
    sweep = [r for r in records if r.get("plan_tables") and r["workload"].endswith("tables")]
    rows = table[: len([r for r in records if r.get("plan_tables")])]
    by_tables = {}
    for r, (*_, measured, before, after) in zip(
        [r for r in records if r.get("plan_tables")], rows, strict=True
    ):
        if r in sweep:
            by_tables.setdefault(len(r["plan_tables"]), []).append(
                (before / measured - 1, after / measured - 1)
            )
    assert sorted(by_tables) == [1, 2, 3, 6, 9]
    before, after = (np.array([e[i] for errs in by_tables.values() for e in errs]) for i in (0, 1))
    assert np.abs(after).max() <= 0.2 < before.max()


def test_the_sweeps_workloads_share_their_lookups_and_rows(tmp_path):
    """Part 1's workloads: n tables of 225 / n ids per sample and 150,000 / n rows each, dim 64."""
    from flexshard.workloads import load_stats

    ht = load_experiment("host_terms")
    for n in (1, 6):
        ht.tables_workload(tmp_path / f"t{n}.npz", n)
        workload, orders = load_stats(tmp_path / f"t{n}.npz")
        assert [t.name for t in workload.tables] == [f"t{i}" for i in range(n)] and sorted(orders) == sorted(
            t.name for t in workload.tables
        )
        assert sum(t.ids_per_sample for t in workload.tables) == pytest.approx(225.0)
        assert sum(t.num_rows for t in workload.tables) == 150_000 and {t.dim for t in workload.tables} == {
            64
        }
