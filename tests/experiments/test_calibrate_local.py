"""The local-work calibration's fits (experiments/calibrate_local.py, calibrate_host.py) on synthetic
timings: they recover the rates the timings were made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

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


def test_host_fit_recovers_step_and_stage_costs_per_rank_share():
    fit_host = load_experiment("calibrate_host").fit_host
    step_s, stage_s, factor = 2e-3, 9e-4, 2.0
    rows = [
        (key, c, factor * (step_s + stage_s * c) + bare + model, bare, model)
        for key, c, bare, model in (("a", 4, 4e-3, 1e-3), ("b", 6, 6e-3, 2e-3), ("c", 10, 9e-3, 1e-3))
    ]
    got = fit_host(replace(LocalRates.default(), table_stage_s=1e-4), rows, factor)
    assert got.step_s == pytest.approx(step_s, rel=1e-9)
    assert got.stage_s == pytest.approx(stage_s, rel=1e-9)
    assert got.table_stage_s == 0.0  # no term per table
    assert got.gather_s_per_value == LocalRates.default().gather_s_per_value  # the rest unchanged


def _bench_record(strategy, stages, measured, rest_ms, unit, stored, host_part=True):
    """A bench record of a 3-table plan with ``stages`` collectives, priced with ``stored``'s host terms
    at ``unit`` (ranks per core x shared-core factor) plus ``rest_ms`` of everything else."""
    tables = [{"name": n} for n in ("a", "b", "c")]
    host_ms = unit * stored.host_s(3, stages) * 1e3
    return {
        "strategy": strategy,
        "step_ms_median": measured,
        "collectives_per_step": float(stages),
        "plan_tables": tables,
        "predicted_step_ms": rest_ms + host_ms,
        "predicted_parts_ms": {"host": host_ms} if host_part else {},
        "local_rates": {
            "step_s": unit * stored.step_s,
            "stage_s": unit * stored.stage_s,
            "table_stage_s": unit * stored.table_stage_s,
        },
    }


def test_host_fit_to_bench_records_recovers_the_terms_the_steps_were_made_with():
    """Steps made from known host terms (2.5 ms a step, 1.8 ms a collective) at 2 and 4 ranks per core,
    3 and 5 collectives, on top of a prediction's other parts, priced with terms of the other shape (a
    term per table and collective): the fit recovers the terms, and every record's modeled step after it
    is its measured one; TorchRec's record (no plan) is left out."""
    fit = load_experiment("calibrate_host").fit_host_to_bench
    stored = replace(LocalRates.default(), step_s=1e-3, stage_s=0.0, table_stage_s=3e-4)
    step_s, stage_s = 2.5e-3, 1.8e-3
    records = []
    for i, (unit, stages, rest) in enumerate(((2, 3, 20.0), (2, 5, 25.0), (4, 3, 60.0), (4, 5, 70.0))):
        measured = rest + unit * (step_s + stage_s * stages) * 1e3
        records.append(_bench_record(f"s{i}", stages, measured, rest, unit, stored, host_part=i % 2 == 0))
    records.append({"strategy": "torchrec_row_wise", "step_ms_median": 90.0, "plan_tables": []})
    got, table = fit(records, stored)
    assert got.step_s == pytest.approx(step_s, rel=1e-9)
    assert got.stage_s == pytest.approx(stage_s, rel=1e-9) and got.table_stage_s == 0.0
    assert got.gather_s_per_value == stored.gather_s_per_value
    assert len(table) == 4
    for row, r in zip(table, records, strict=False):
        assert row[4] == r["step_ms_median"] and row[5] == r["predicted_step_ms"]
        assert row[6] == pytest.approx(r["step_ms_median"], rel=1e-9)


def test_host_fit_to_bench_records_refuses_records_priced_with_other_terms():
    fit = load_experiment("calibrate_host").fit_host_to_bench
    stored = replace(LocalRates.default(), step_s=1e-3, stage_s=0.0, table_stage_s=3e-4)
    other = replace(stored, table_stage_s=4e-4)
    records = [_bench_record("a", 3, 30.0, 20.0, 2, other), _bench_record("b", 5, 40.0, 25.0, 2, other)]
    with pytest.raises(ValueError, match="local_rates: record a was priced with other host terms"):
        fit(records, stored)
    with pytest.raises(ValueError, match="records: 1 runtime strategies"):
        fit(records[:1], other)
    with pytest.raises(ValueError, match="step_s, stage_s, table_stage_s: the rates .* have no host terms"):
        fit(records, replace(other, step_s=0.0))


def _host_from(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(root / "experiments" / "calibrate_local.py"), "--host-from", *args],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_host_from_cli_writes_the_fitted_terms_and_refuses_a_bad_file_in_one_line(tmp_path):
    """``calibrate_local.py --host-from records.json --priced-with rates.json --out fitted.json``: the
    terms the steps were made with, written where asked and printed with each record's error (0 after);
    a record without its rates is one line, exit 1, and nothing written."""
    priced = replace(LocalRates.default(), step_s=1e-3, stage_s=0.0, table_stage_s=3e-4)
    priced.save(tmp_path / "priced.json")
    records = []
    for i, (unit, stages, rest) in enumerate(((2, 3, 20.0), (4, 5, 70.0), (2, 5, 25.0))):
        measured = rest + unit * (2.5e-3 + 1.8e-3 * stages) * 1e3
        records.append(_bench_record(f"s{i}", stages, measured, rest, unit, priced))
    (tmp_path / "records.json").write_text(json.dumps(records))
    out = tmp_path / "fitted.json"
    done = _host_from(
        str(tmp_path / "records.json"), "--priced-with", str(tmp_path / "priced.json"), "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    fitted = LocalRates.load(out)
    assert fitted.step_s == pytest.approx(2.5e-3, rel=1e-9)
    assert fitted.stage_s == pytest.approx(1.8e-3, rel=1e-9) and fitted.table_stage_s == 0.0
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["s0"], ["s1"], ["s2"])]
    assert [float(r[-2].rstrip("%")) for r in rows] == pytest.approx([-23.5, -20.7, -25.0], abs=0.05)
    assert [float(r[-1].rstrip("%")) for r in rows] == pytest.approx([0, 0, 0], abs=1e-9)  # after the fit
    assert "within 20%: 0 of 3 before, 3 after" in done.stdout
    del records[1]["local_rates"]
    (tmp_path / "bad.json").write_text(json.dumps(records))
    bad = _host_from(str(tmp_path / "bad.json"), "--out", str(tmp_path / "bad_out.json"))
    assert bad.returncode == 1  # priced with other terms than the stored ones, which it was not told
    assert "record s0 was priced with other host terms" in bad.stderr and "--priced-with" in bad.stderr
    bad = _host_from(
        str(tmp_path / "bad.json"),
        "--priced-with",
        str(tmp_path / "priced.json"),
        "--out",
        str(tmp_path / "bad_out.json"),
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "calibrate_local --host-from: a record has no field 'local_rates'; bench --json writes it"
    ]
    assert not (tmp_path / "bad_out.json").exists()
