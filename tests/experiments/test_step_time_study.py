"""experiments/step_time.py's summary of the model's error and its steps per batch (hand-computed rows)."""

from __future__ import annotations

from experiment_module import load_experiment


def test_the_error_summary_gives_each_strategys_range_and_count_within_20_percent():
    summary = load_experiment("step_time").error_summary
    rows = [
        {"label": "FlexShard", "predicted_step_ms": 9.0, "step_ms_median": 10.0},  # -10%
        {"label": "TorchRec row-wise", "predicted_step_ms": 5.0, "step_ms_median": 10.0},  # -50%
        {"label": "FlexShard", "predicted_step_ms": 12.5, "step_ms_median": 10.0},  # +25%
        {"label": "TorchRec row-wise", "predicted_step_ms": 8.0, "step_ms_median": 10.0},  # -20%
    ]
    assert summary(rows).splitlines() == [
        "- FlexShard: model error -10% to +25%; within 20% in 1 of 2 rows",
        "- TorchRec row-wise: model error -50% to -20%; within 20% in 1 of 2 rows",
        "- every strategy: within 20% in 2 of 4 rows",
    ]


def test_smaller_batches_time_more_steps_up_to_four_times():
    steps_at = load_experiment("step_time").steps_at
    assert [steps_at(b, 4) for b in (64, 256, 512, 1024, 2048)] == [16, 16, 8, 4, 4]
