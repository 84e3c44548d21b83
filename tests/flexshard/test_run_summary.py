"""train's end-of-run summary on hand-made steps: the figures worked by hand, the prediction beside
them, and what the summary says when the prediction does not apply."""

from __future__ import annotations

from types import SimpleNamespace

from flexshard.training.summary import RunSummary

PLAN = SimpleNamespace(
    overrides={}, left_out=(), predicted={"intra_group_bytes": 1000.0, "inter_group_bytes": 0.0}
)


def _two_steps(start: int = 0) -> RunSummary:
    summary = RunSummary(world=4, batch_size=16, start=start)
    summary.add(2.5, 0.25, {"intra_group": 900.0, "inter_group": 0.0})
    summary.add(1.25, 0.75, {"intra_group": 1300.0, "inter_group": 0.0})
    return summary


def test_figures_worked_by_hand():
    # 2 steps x 4 ranks x 16 = 128 samples in 0.25 + 0.75 s; intra (900 + 1300) / 2 = 1,100 B, +10.0%
    assert _two_steps(start=10).lines(PLAN) == [
        "summary: 2 steps (steps 11-12), final loss 1.250000, 128 samples/s (128 samples in 1.000 s of "
        "steps, the slowest rank's)",
        "bytes per step  measured (busiest rank, mean)  plan's prediction  measured vs plan",
        "--------------  -----------------------------  -----------------  ----------------",
        "intra_group                           1,100 B            1,000 B            +10.0%",
        "inter_group                               0 B                0 B                 -",
    ]


def test_what_the_prediction_cannot_say():
    summary = _two_steps()
    summary.link_bytes["inter_group"] = 50.0  # measured where nothing was predicted
    lines = summary.lines(PLAN, sample_placement="regroup")
    assert lines[4] == "inter_group                              25 B                0 B    none predicted"
    assert lines[5] == (
        "measured bytes include moving samples (sample placement regroup), which the plan does not price"
    )
    overridden = SimpleNamespace(overrides={"dedup": (True, False)}, left_out=(), predicted=PLAN.predicted)
    lines = _two_steps().lines(overridden)
    assert lines[3].split()[-2:] == ["-", "-"] and lines[4].split()[-2:] == ["-", "-"]
    assert lines[-1] == "the plan's prediction does not apply: this run overrides its dedup"


def test_a_plan_of_more_tables_than_the_run():
    """A plan restricted to the run's tables still carries the whole plan's prediction: not compared."""
    tables = (SimpleNamespace(name="item_id"), SimpleNamespace(name="user_id"))
    cut = SimpleNamespace(overrides={}, left_out=("age", "genre"), tables=tables, predicted=PLAN.predicted)
    lines = _two_steps().lines(cut)
    assert lines[3].split()[-2:] == ["-", "-"] and lines[4].split()[-2:] == ["-", "-"]
    assert lines[-1] == (
        "the plan's prediction does not apply: it also prices the tables age, genre, which this run does "
        "not look up (make the plan with --tables item_id,user_id to price these alone)"
    )


def test_a_resumed_run_with_nothing_left():
    assert RunSummary(world=2, batch_size=8, start=20).lines(PLAN) == [
        "summary: no steps run (resumed at step 20, already --steps)"
    ]
