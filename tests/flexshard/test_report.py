"""Reports: the notes on points where FlexShard moves more bytes across groups than a baseline."""

from __future__ import annotations

from flexshard.report import tradeoffs


def _rec(strategy: str, inter: float, intra: float, time_s: float, feasible: bool = True) -> dict:
    return {
        "budget_x": 2.0,
        "dedup": False,
        "strategy": strategy,
        "feasible": feasible,
        "inter_group_bytes": inter,
        "intra_group_bytes": intra,
        "modeled_time_s": time_s,
    }


def test_a_baseline_with_fewer_inter_group_bytes_is_explained():
    records = [
        _rec("flexshard", 11.93e6, 2.0e6, 0.61e-3),
        _rec("2d", 11.49e6, 9.5e6, 0.80e-3),  # fewer NIC bytes, more NVLink bytes, slower
        _rec("row_wise", 40.0e6, 5.0e6, 1.2e-3),  # more of both: no note
        _rec("table_wise", 0.0, 0.0, 0.0, feasible=False),  # infeasible: no note
    ]
    assert tradeoffs(records) == [
        "budget_x 2x, dedup off: 2d moves 11.49 MB across groups, FlexShard 11.93 MB; it trades 440.00 kB "
        "more across groups for 7.50 MB less within groups, and its modeled time is lower (0.61 vs 0.8 ms)"
    ]


def test_a_baseline_that_beats_flexshard_on_time_is_called_a_miss():
    records = [_rec("flexshard", 2.0e6, 1.0e6, 1.0e-3), _rec("hybrid", 1.0e6, 1.0e6, 0.9e-3)]
    (line,) = tradeoffs(records)
    assert line.endswith("and is not faster in modeled time: the planner missed a better plan")


def test_more_bytes_on_both_links_yet_faster_is_not_called_a_miss():
    """On links of unequal speed a balanced plan loads the fast ranks more: its busiest rank's bytes may
    exceed a baseline's on both link classes while its slowest rank, and so its modeled time, is lower
    (a probed 2x2 fabric at 2x with dedup: 87.92 MB across groups against row-wise's 58.70 MB)."""
    records = [_rec("flexshard", 87.92e6, 30.24e6, 27.84e-3), _rec("row_wise", 58.70e6, 29.35e6, 39.73e-3)]
    assert tradeoffs(records) == [
        "budget_x 2x, dedup off: row_wise moves 58.70 MB across groups, FlexShard 87.92 MB; its modeled time "
        "is lower all the same (27.84 vs 39.73 ms): the bytes are each link class's busiest rank, not its "
        "slowest one (on links of unequal speed a plan loads the fast ranks more)"
    ]


def test_nothing_to_say_when_flexshard_is_lowest():
    records = [_rec("flexshard", 1.0e6, 1.0e6, 1.0e-3), _rec("row_wise", 2.0e6, 1.0e6, 2.0e-3)]
    assert tradeoffs(records) == []
