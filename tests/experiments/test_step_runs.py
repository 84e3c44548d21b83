"""experiments/step_runs.py: the step-time study over several runs (medians over runs, each run's ratio
taken within the run) and the issue's marks judged per run and on the medians (hand-computed records)."""

from __future__ import annotations

import json

import pytest
from experiment_module import load_experiment

runs_mod = load_experiment("step_runs")


def _rec(run, nproc, batch, planned, label, step, vs_ablation, predicted, collectives=4.0):
    return {
        "run": run,
        "nproc": nproc,
        "batch": batch,
        "planned_for": planned,
        "label": label,
        "step_ms_median": step,
        "vs_ablation": vs_ablation,
        "predicted_step_ms": predicted,
        "collectives_per_step": collectives,
        "predicted_parts_ms": {"local": predicted / 2},
    }


def _config(run, nproc, batch, planned, flexshard_step, ablation_step, torchrec_step, collectives=6.0):
    """FlexShard, the ablation and TorchRec on one configuration of one run; the model exact but for
    FlexShard's, 10% low."""
    return [
        _rec(run, nproc, batch, planned, "FlexShard", flexshard_step, flexshard_step / ablation_step,
             0.9 * flexshard_step, collectives),
        _rec(run, nproc, batch, planned, "row-wise ablation (dedup)", ablation_step, 1.0, ablation_step),
        _rec(run, nproc, batch, planned, "TorchRec row-wise", torchrec_step, torchrec_step / ablation_step,
             torchrec_step, 5.0),
    ]  # fmt: skip


def test_rows_take_the_median_over_runs_of_ratios_taken_within_each_run():
    records = _config(0, 4, 512, "h100", 116.0, 100.0, 200.0) + _config(1, 4, 512, "h100", 60.0, 50.0, 150.0)
    records += _config(2, 4, 512, "h100", 113.0, 100.0, 100.0)
    flex = runs_mod.rows(records)[0]
    assert (flex.nproc, flex.batch, flex.planned_for, flex.label) == (4, 512, "h100", "FlexShard")
    assert flex.step_ms == [116.0, 60.0, 113.0]
    assert flex.vs_ablation == pytest.approx([1.16, 1.2, 1.13])
    assert flex.median("vs_ablation") == pytest.approx(1.16)
    # against the same run's TorchRec: 116/200, 60/150, 113/100 (not 116/100 across runs)
    assert flex.vs_torchrec == pytest.approx([0.58, 0.4, 1.13])
    assert flex.median("vs_torchrec") == pytest.approx(0.58)
    assert flex.errors == pytest.approx([-0.1, -0.1, -0.1])
    assert flex.median("local_ms") == pytest.approx(0.45 * 113.0)
    assert [r.label for r in runs_mod.rows(records)] == [
        "FlexShard",
        "row-wise ablation (dedup)",
        "TorchRec row-wise",
    ]


def _cells(marks):
    return [m.cell() for m in marks]


def test_marks_name_the_worst_point_of_each_plan_and_whether_it_is_met():
    records = _config(0, 4, 512, "h100", 116.0, 100.0, 200.0)  # 1.16 of the ablation: missed
    records += _config(0, 8, 256, "h100", 112.0, 100.0, 150.0, collectives=6.0)
    records += _config(0, 4, 512, "probed", 104.0, 100.0, 131.0, collectives=4.0)  # 104/131 = 0.794
    marks = runs_mod.marks(runs_mod.rows(records))
    assert [m.name for m in marks] == [
        "FlexShard's collectives per step, 8 ranks",
        "plan for the probed machine vs ablation",
        "plan for the H100 shape vs ablation",
        "either plan vs TorchRec",
        "model within 20%",
    ]
    assert _cells(marks) == [
        "6: met",
        "1.040 at 4r/512: met",
        "1.160 at 4r/512: missed",
        "0.79 at 4r/512: met",
        "9 of 9 rows: met",
    ]


def test_a_row_the_model_misses_by_more_than_20_percent_fails_the_model_mark():
    records = _config(0, 4, 64, "probed", 100.0, 100.0, 200.0)
    records[1]["predicted_step_ms"] = 79.0  # the ablation's model 21% low
    assert runs_mod.marks(runs_mod.rows(records))[-1].cell() == "2 of 3 rows: missed"


def test_the_medians_over_runs_can_meet_a_mark_one_run_misses():
    records = []
    for run, step in enumerate((116.0, 114.0, 115.0)):
        records += _config(run, 4, 512, "h100", step, 100.0, 200.0)
    per_run = [runs_mod.marks(runs_mod.rows(r))[2].cell() for r in runs_mod.runs(records)]
    assert per_run == ["1.160 at 4r/512: missed", "1.140 at 4r/512: met", "1.150 at 4r/512: met"]
    assert runs_mod.marks(runs_mod.rows(records))[2].cell() == "1.150 at 4r/512: met"


def test_the_marks_table_has_a_column_per_run_and_one_for_the_medians():
    records = []
    for run, step in enumerate((116.0, 114.0)):
        one = _config(0, 4, 512, "h100", step, 100.0, 200.0)
        records += runs_mod.tagged(one, run, f"2026-11-27 1{run}:00 UTC", f"abc{run}")
    lines = runs_mod.marks_table(records).splitlines()
    assert lines[0] == (
        "| mark | bound | run 1: 2026-11-27 10:00 UTC (abc0) | run 2: 2026-11-27 11:00 UTC (abc1) "
        "| median of the runs |"
    )
    assert lines[4] == (
        "| plan for the H100 shape vs ablation | <= 1.150 | 1.160 at 4r/512: missed | 1.140 at 4r/512: met "
        "| 1.150 at 4r/512: met |"
    )
    one_run = runs_mod.marks_table(records[:3]).splitlines()[0]
    assert one_run == "| mark | bound | run 1: 2026-11-27 10:00 UTC (abc0) |"


def test_spread_gives_the_median_and_over_several_runs_the_lowest_and_highest():
    assert runs_mod.spread([1.16], ".2f") == "1.16"
    assert runs_mod.spread([1.16, 1.12, 1.20], ".2f") == "1.16 (1.12 to 1.20)"
    assert runs_mod.spread([-0.21, 0.05], "+.0%") == "-8% (-21% to +5%)"


def test_runs_read_from_several_files_are_numbered_one_after_the_other(tmp_path):
    read_runs = load_experiment("step_time").read_runs
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(
        json.dumps(_config(0, 4, 64, "h100", 1.0, 1.0, 1.0) + _config(1, 4, 64, "h100", 2.0, 2.0, 2.0))
    )
    b.write_text(
        json.dumps(
            [{k: v for k, v in r.items() if k != "run"} for r in _config(0, 4, 64, "h100", 3.0, 3.0, 3.0)]
        )
    )
    records = read_runs([str(a), str(b)])
    assert [r["run"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["step_ms_median"] for r in runs_mod.runs(records)[2]] == [3.0, 3.0, 3.0]


def test_a_file_that_is_not_a_list_of_records_is_refused_by_name(tmp_path):
    read_runs = load_experiment("step_time").read_runs
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"step_ms_median": 1.0}))
    with pytest.raises(SystemExit, match=r"--from .*bad\.json: expected a list of step_time.json records"):
        read_runs([str(bad)])
    with pytest.raises(SystemExit, match=r"--from .*missing\.json"):
        read_runs([str(tmp_path / "missing.json")])
