"""experiments/lastfm_plans.py: the report's cuts against row-wise, from hand-made runs (the torchrun
runs themselves are what the script does; docs/results/lastfm_plans.md holds their figures)."""

from __future__ import annotations

from experiment_module import load_experiment

lp = load_experiment("lastfm_plans")


def _run(label: str, predicted: float, busiest: list[float], row_wise_predicted: float):
    plan = {
        "predicted": {"inter_group_bytes": predicted},
        "tables": [{"name": "t", "hot_rows": 1, "warm_rows": 2, "cold_rows": 3}],
    }
    steps = [{"bytes": {"inter_group": {"max": b, "mean": b / 2}}} for b in busiest]
    return lp.Run(label, plan, steps, 1.0, row_wise_predicted)


def test_cuts_compare_each_plan_with_row_wise_on_its_own_statistics():
    runs = [
        _run("row-wise", 100.0, [90.0, 110.0], 100.0),  # measured busiest: mean of steps = 100
        _run("independent", 300.0, [120.0, 140.0], 500.0),  # promised 1 - 300/500 = 40%, realised -30%
        _run("measured", 99.0, [97.0, 99.0], 100.0),  # promised 1%, realised 2%
    ]
    text = lp.report(runs, 2, 1.0, quick=True)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "KB" not in line]
    assert rows[1].split(" | ")[-2:] == ["40.0%", "-30.0% |"]
    assert rows[2].split(" | ")[-2:] == ["1.0%", "2.0% |"]
    assert "promised a 40.0% cut" in text and "realised -30.0%" in text
    assert "row-wise itself is priced at 5x what it moves" in text
    assert "t 1/2/3" in text
