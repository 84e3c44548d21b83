"""experiments/step_time.py's summary of the model's error and its steps per batch (hand-computed rows)."""

from __future__ import annotations

import json

import pytest
from experiment_module import load_experiment


def test_the_error_summary_gives_each_strategys_range_and_count_within_20_percent():
    summary = load_experiment("step_time").error_summary
    rows = load_experiment("step_runs").rows

    def rec(batch, label, predicted, step=10.0):
        return {
            "nproc": 4,
            "batch": batch,
            "planned_for": "h100",
            "label": label,
            "step_ms_median": step,
            "vs_ablation": 1.0,
            "predicted_step_ms": predicted,
            "collectives_per_step": 4.0,
        }

    records = [
        rec(64, "FlexShard", 9.0),  # -10%
        rec(64, "TorchRec row-wise", 5.0),  # -50%
        rec(256, "FlexShard", 12.5),  # +25%
        rec(256, "TorchRec row-wise", 8.0),  # -20%
    ]
    assert summary(rows(records)).splitlines() == [
        "- FlexShard: model error -10% to +25%; within 20% in 1 of 2 rows",
        "- TorchRec row-wise: model error -50% to -20%; within 20% in 1 of 2 rows",
        "- every strategy: within 20% in 2 of 4 rows",
    ]
    # over runs, each row's median error: FlexShard at batch 64 -10%, +30%, -5% -> -5%
    runs = [{**rec(64, "FlexShard", p), "run": i} for i, p in enumerate((9.0, 13.0, 9.5))]
    assert (
        summary(rows(runs)).splitlines()[0]
        == "- FlexShard: model error -5% to -5%; within 20% in 1 of 1 rows"
    )


def test_smaller_batches_time_more_steps_up_to_four_times_and_more_rounds_below_256():
    steps_at = load_experiment("step_time").steps_at
    assert [steps_at(b, 4) for b in (64, 256, 512, 1024, 2048)] == [16, 16, 8, 4, 4]
    rounds_at = load_experiment("step_time").rounds_at
    assert [rounds_at(b, 4) for b in (64, 128, 255, 256, 1024)] == [8, 8, 8, 4, 4]


def test_a_stopped_study_keeps_the_records_of_its_finished_runs(tmp_path, monkeypatch):
    """step_time.json is written as each run ends: a study stopped in its second run leaves the first
    run's records, tagged, for ``--from``."""
    module = load_experiment("step_time")
    calls = []

    def measure_run(batches, steps, rounds):
        calls.append(batches)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped during the second run
        return [{"nproc": 4, "batch": 64, "strategy": "row_wise"}]

    monkeypatch.setattr(module, "measure_run", measure_run)
    monkeypatch.setattr(module, "modeled", lambda: "")
    monkeypatch.setattr(module.study, "RESULTS", tmp_path)
    monkeypatch.setattr(module.study, "commit", lambda: "abc1234")
    monkeypatch.setattr("sys.argv", ["step_time.py", "--runs", "3", "--batches", "64"])
    with pytest.raises(KeyboardInterrupt):
        module.main()
    assert calls == [(64,), (64,)]
    got = json.loads((tmp_path / "step_time.json").read_text())
    assert len(got) == 1 and got[0]["run"] == 0 and got[0]["run_commit"] == "abc1234"
    assert not (tmp_path / "step_time.md").exists()  # the tables only when every run has ended
