"""The headline of ``flexshard simulate``: exact lines on hand-made records (percentages worked by hand),
the reasons where FlexShard equals a baseline, clusters without inter-group bytes, and the command's
headline read from its own records."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run

from flexshard.simulate_headline import LEGEND, baseline_keys, headline
from solvers.time_types import GPU_ROOFLINE_RATES

SMALL = ["--workload", "synthetic:6:2e6:1.0", "--topology", "h100:2x2"]


def _rec(
    strategy: str, dedup: bool, inter: float, intra: float, time_s: float, x: float = 2.0, **plan
) -> dict:
    record = {
        "strategy": strategy,
        "budget_x": x,
        "dedup": dedup,
        "feasible": True,
        "inter_group_bytes": inter,
        "intra_group_bytes": intra,
        "modeled_time_s": time_s,
    }
    return {**record, **plan}


def _three(x: float = 2.0) -> list[dict]:
    """FlexShard, row-wise with dedup and TorchRec's default (row-wise, dedup off) at one budget."""
    return [
        _rec("flexshard", True, 59.71e6, 102.70e6, 1.42e-3, x, hot_rows=10, warm_rows=5, cold_rows=85),
        _rec("row_wise", True, 102.78e6, 12.86e6, 2.08e-3, x),
        _rec("row_wise", False, 366.02e6, 51.16e6, 7.43e-3, x),
    ]


def test_flexshard_against_torchrecs_default_and_row_wise_with_dedup():
    # 1 - 59.71/366.02 = 83.69%; 1 - 1.42/7.43 = 80.89%; 1 - 59.71/102.78 = 41.90%; 1 - 1.42/2.08 = 31.73%
    assert headline(_three()) == [
        "FlexShard at 2x, dedup on: 59.71 MB inter-group, 1.420 ms; 83.7% fewer bytes and 80.9% less time "
        "than TorchRec's default (row-wise, dedup off: 366.02 MB, 7.430 ms) and 41.9% fewer bytes and 31.7% "
        "less time than row-wise with dedup (102.78 MB, 2.080 ms)"
    ]


def test_one_line_per_budget_and_the_default_priced_for_the_headline_only():
    """Records of ``--dedup on`` have no TorchRec default: baseline_keys names it, the caller prices it
    (``extra``), and the headline reads it there; budgets in the records' order."""
    records = [r for x in (1.0, 4.0) for r in _three(x) if r["dedup"]]
    assert baseline_keys(records) == {(False, "row_wise"): [1.0, 4.0]}
    assert baseline_keys([r for r in records if r["strategy"] == "flexshard"]) == {
        (False, "row_wise"): [1.0, 4.0],
        (True, "row_wise"): [1.0, 4.0],  # --strategies without row_wise
    }
    extra = [r for x in (1.0, 4.0) for r in _three(x) if not r["dedup"]]
    assert baseline_keys([*records, *extra]) == {}
    lines = headline(records, extra)
    assert [line.split(":")[0] for line in lines] == [
        "FlexShard at 1x, dedup on",
        "FlexShard at 4x, dedup on",
    ]
    assert lines[1] == headline(_three(4.0))[0]  # the same line as with the default among the records
    assert headline(records)[0].endswith(
        "than row-wise with dedup (102.78 MB, 2.080 ms)"
    )  # no default: left out


def test_a_point_without_dedup_is_compared_with_torchrecs_default_only():
    records = [_rec("flexshard", False, 183.01e6, 10e6, 3.715e-3), _three()[2], _three()[1]]
    # 1 - 183.01/366.02 = 50.0%; 1 - 3.715/7.43 = 50.0%
    assert headline(records) == [
        "FlexShard at 2x, dedup off: 183.01 MB inter-group, 3.715 ms; 50.0% fewer bytes and 50.0% less time "
        "than TorchRec's default (row-wise, dedup off: 366.02 MB, 7.430 ms)"
    ]


def _stepped(records: list[dict], steps_ms: tuple[float, ...], torchrec_ms: float) -> list[dict]:
    """``records`` with modeled step times (ms, in order) and TorchRec's default's in its own five
    collectives."""
    out = [{**r, "step_s": ms * 1e-3} for r, ms in zip(records, steps_ms, strict=True)]
    for r in out:
        if (r["strategy"], r["dedup"]) == ("row_wise", False):
            r.update(torchrec_step_s=torchrec_ms * 1e-3, torchrec_collectives=5)
    return out


def test_step_times_and_torchrecs_default_in_its_own_collectives():
    """Where the records carry modeled step times, the line compares those, TorchRec's default in its own
    collectives (not the runtime's step of the same plan, 7.0 ms here)."""
    records = _stepped(_three(), (2.0, 2.7, 7.0), 9.0)
    # 1 - 2.0/9.0 = 77.78%; 1 - 2.0/2.7 = 25.93%
    assert headline(records) == [
        "FlexShard at 2x, dedup on: 59.71 MB inter-group, 2.000 ms a step; 83.7% fewer bytes and 77.8% less "
        "step time than TorchRec's default (row-wise, dedup off, in its 5 collectives: 366.02 MB, 9.000 ms) "
        "and 41.9% fewer bytes and 25.9% less step time than row-wise with dedup (102.78 MB, 2.700 ms)"
    ]
    # equal and near are judged in step time: equal bandwidth time, another step is neither
    others = [
        {**_rec("row_wise_group_dedup", True, 59.71e6, 102.70e6, 1.42e-3), "step_s": 2.0e-3},
        {**_rec("2d", True, 59.71e6, 102.70e6, 1.42e-3), "step_s": 2.01e-3},  # 0.5%: near
        {**_rec("hybrid", True, 59.71e6, 102.70e6, 1.42e-3), "step_s": 2.1e-3},  # 5%: neither
    ]
    assert headline([*records, *others])[1:] == [
        "FlexShard at 2x, dedup on equals row_wise_group_dedup: the plan replicates only 10 hot and 5 warm "
        "of 100 rows, too few to move the figures, and has no cold rows",
        "FlexShard at 2x, dedup on is within 0.5% of 2d in modeled step time",  # 2.01 / 2.0 - 1
    ]
    # a record without a step time (an older run's): bandwidth time for the whole line
    mixed = [*records[:2], {k: v for k, v in records[2].items() if k != "step_s"}]
    assert headline(mixed)[0] == headline(_three())[0]


def test_more_bytes_or_time_and_small_differences_are_said_as_they_are():
    records = [
        _rec("flexshard", True, 110.0e6, 10e6, 2.0799e-3),
        _rec("row_wise", True, 100.0e6, 12.86e6, 2.08e-3),
        _rec("row_wise", False, 100.0e6, 12.86e6, 2.08e-3),
    ]
    # +10.0% bytes; 1 - 2.0799/2.08 = 0.0048% (below 0.05%: two significant digits)
    assert headline(records)[0] == (
        "FlexShard at 2x, dedup on: 110.00 MB inter-group, 2.080 ms; 10.0% more bytes and 0.0048% less time "
        "than TorchRec's default (row-wise, dedup off: 100.00 MB, 2.080 ms) and 10.0% more bytes and 0.0048% "
        "less time than row-wise with dedup (100.00 MB, 2.080 ms)"
    )


def test_one_group_speaks_of_intra_group_bytes_and_never_divides_by_zero():
    """No inter-group links: every inter-group figure 0 (or float residue, or missing): the line is in
    intra-group bytes; a baseline of 0 bytes is not a percentage."""
    records = [
        _rec("flexshard", True, 1e-9, 102.70e6, 0.228e-3),
        _rec("row_wise", True, -0.0, 102.73e6, 0.228e-3),
        {**_rec("row_wise", False, 0.0, 228.12e6, 0.507e-3), "inter_group_bytes": None},
    ]
    # 1 - 102.70/228.12 = 54.98%; 1 - 0.228/0.507 = 55.03%; 1 - 102.70/102.73 = 0.029%
    assert headline(records) == [
        "FlexShard at 2x, dedup on: 102.70 MB intra-group, 0.228 ms (one group: no inter-group links); 55.0% "
        "fewer bytes and 55.0% less time than TorchRec's default (row-wise, dedup off: 228.12 MB, 0.507 ms) "
        "and 0.029% fewer bytes and equal time than row-wise with dedup (102.73 MB, 0.228 ms)",
        "FlexShard at 2x, dedup on matches row_wise in modeled time",  # not equal: other bytes
    ]
    zero = [_rec("flexshard", True, 5e6, 0.0, 1e-3), _rec("row_wise", True, 0.0, 0.0, 1e-3)]
    assert headline(zero)[0].endswith("more bytes and equal time than row-wise with dedup (0 B, 1.000 ms)")


def test_equal_figures_say_why_from_the_plan():
    def point(**plan) -> list[dict]:
        ours = _rec("flexshard", True, 59.74e6, 102.73e6, 1.423e-3, 1.0, **plan)
        return [
            ours,
            _rec("row_wise_group_dedup", True, 59.74e6, 102.73e6, 1.423e-3, 1.0),
            _rec("2d", True, 59.74e6, 102.73e6, 1.423e-3, 1.0),
            _rec("hybrid", True, 75.33e6, 81.15e6, 1.687e-3, 1.0),  # not equal: not named
            {**_rec("table_wise", True, 0.0, 0.0, 0.0, 1.0), "feasible": False},
        ]

    nothing = point(hot_rows=0, warm_rows=0, cold_rows=100, cold_tables=8, group_fetch_tables=8)
    assert headline(nothing)[1] == (
        "FlexShard at 1x, dedup on equals row_wise_group_dedup and 2d: the plan replicates nothing (a 1x "
        "budget leaves no memory to replicate beyond rounding) and fetches every cold row once per group: "
        "the group fetch alone is the bound at this budget"
    )
    flat = point(hot_rows=0, warm_rows=0, cold_rows=100, cold_tables=8, group_fetch_tables=0)
    assert headline(flat)[1].endswith("and fetches every cold row from its owner, as row-wise does")
    mixed = point(hot_rows=0, warm_rows=0, cold_rows=100, cold_tables=8, group_fetch_tables=3)
    assert headline(mixed)[1].endswith("and fetches the cold rows of 3 of 8 tables once per group")
    few = point(hot_rows=3, warm_rows=0, cold_rows=97, cold_tables=8, group_fetch_tables=8)
    assert headline(few)[1].startswith(
        "FlexShard at 1x, dedup on equals row_wise_group_dedup and 2d: the plan replicates only 3 hot and 0 "
        "warm of 100 rows (a 1x budget leaves no memory to replicate beyond rounding), too few to move the "
        "figures, and fetches every cold row once per group"
    )
    kept = point(
        hot_rows=40, warm_rows=2, cold_rows=58, cold_tables=8, group_fetch_tables=8, chosen="2d tiers"
    )
    assert headline(kept)[1] == (
        "FlexShard at 1x, dedup on equals row_wise_group_dedup and 2d: FlexShard's planner kept 2d's tiers, "
        "dealt FlexShard's way (no plan of its optimizer was faster in the model); it fetches every cold row "
        "once per group: the group fetch alone is the bound at this budget"
    )
    assert len(headline(_three())) == 1  # no baseline equal or near: no other line


def test_baselines_within_one_percent_are_named_with_what_the_plan_shares():
    """The embedded default at 2x with dedup: row_wise_group_dedup is 0.07% slower than FlexShard, whose
    plan replicates few rows and fetches every cold row once per group as that baseline does."""
    shape = {"hot_rows": 7126, "warm_rows": 63305, "cold_rows": 362050569, "cold_tables": 8}
    records = [
        *_three(),
        _rec("row_wise_group_dedup", True, 59.74e6, 102.73e6, 1.421e-3),  # 1.421 / 1.420 - 1 = 0.070%: "0.1%"
        _rec("hybrid", True, 59.80e6, 102.80e6, 1.4343e-3),  # 1.01%: not near
    ]
    records[0] = {**records[0], **shape, "group_fetch_tables": 8}
    assert headline(records)[1:] == [
        "FlexShard at 2x, dedup on is within 0.1% of row_wise_group_dedup in modeled time: the plan "
        "replicates 7,126 hot and 63,305 warm of 362,121,000 rows and fetches every cold row once per group"
    ]
    records.append(_rec("2d", True, 59.90e6, 102.00e6, 1.4284e-3))  # 0.59%: the largest gap is named
    records[0] = {**records[0], "chosen": "2d tiers"}
    assert headline(records)[1:] == [
        "FlexShard at 2x, dedup on is within 0.6% of row_wise_group_dedup and 2d in modeled time: "
        "FlexShard's planner kept 2d's tiers, dealt FlexShard's way (no plan of its optimizer was faster in "
        "the model); it fetches every cold row once per group"
    ]


def test_infeasible_points_are_named_not_priced():
    records = _three()
    records[0] = {**records[0], "feasible": False, "error": "budget: below the smallest plan"}
    records[2] = {**records[2], "feasible": False}
    assert headline(records) == ["FlexShard at 2x, dedup on: infeasible (budget: below the smallest plan)"]
    records = _three()
    records[2] = {**records[2], "feasible": False}
    assert headline(records)[0].endswith(
        "1.420 ms; TorchRec's default is infeasible at this budget and 41.9% fewer bytes and 31.7% less time "
        "than row-wise with dedup (102.78 MB, 2.080 ms)"
    )


def test_simulate_prints_the_headline_of_its_own_records(capsys):
    """The table marks FlexShard's rows and says what the mark means; the headline is the one computed
    from the same records (``--json`` with both dedup settings holds every record it reads)."""
    rc, text, _ = run(capsys, "simulate", *SMALL, "--budgets", "1.5,3")
    assert rc == 0
    first = text.split("\n\n")[0]  # the bytes table (the step-time table below marks FlexShard too)
    rows = [ln.split() for ln in first.splitlines() if ln.startswith(("1.5x", "3x"))]
    assert [r[1] for r in rows if r[1].endswith("flexshard")] == ["*flexshard", "*flexshard"]
    assert LEGEND in text.splitlines()
    rc, doc, _ = run(capsys, "simulate", *SMALL, "--budgets", "1.5,3", "--dedup", "both", "--json")
    records = json.loads(doc)
    expected = headline([r for r in records if r["dedup"]], [r for r in records if not r["dedup"]])
    printed = [ln for ln in text.splitlines() if ln.startswith("FlexShard at ")]
    assert printed == expected and len(expected) >= 2
    assert expected[0].startswith("FlexShard at 1.5x, dedup on: ") and "TorchRec's default" in expected[0]
    ours = next(r for r in records if r["strategy"] == "flexshard")
    assert {"hot_rows", "warm_rows", "cold_rows", "cold_tables", "group_fetch_tables"} <= set(ours)
    assert "step time" in expected[0]


def test_simulate_prices_torchrecs_default_in_its_own_collectives(capsys):
    """The row-wise record without dedup carries its plan's step in TorchRec's five world all-to-alls:
    the runtime's step of the same plan plus the latency of two more stages (the split sizes and lengths
    add no bytes; the host terms stay the runtime's), and no other record has it."""
    rc, doc, _ = run(capsys, "simulate", *SMALL, "--budgets", "2", "--dedup", "both", "--json")
    assert rc == 0
    records = json.loads(doc)
    theirs = next(r for r in records if (r["strategy"], r["dedup"]) == ("row_wise", False))
    assert theirs["torchrec_collectives"] == 5 and theirs["collectives"] == 3
    assert all("torchrec_step_s" not in r for r in records if r is not theirs)
    # every stage a world all-to-all of one latency: 5/3 of the runtime's three; on the GPU preset's
    # rates each more stage costs one collective call of host time too (the local work is the same)
    assert theirs["torchrec_latency_s"] == pytest.approx(theirs["latency_s"] * 5 / 3)
    more = theirs["torchrec_latency_s"] - theirs["latency_s"] + 2 * GPU_ROOFLINE_RATES.collective_call_s
    assert theirs["torchrec_step_s"] - theirs["step_s"] == pytest.approx(more)
    assert theirs["torchrec_bandwidth_s"] == theirs["bandwidth_s"]  # the same plan's bytes
    parts = theirs["torchrec_latency_s"] + theirs["torchrec_bandwidth_s"] + theirs["torchrec_local_s"]
    assert theirs["torchrec_step_s"] == pytest.approx(parts, rel=1e-12)
