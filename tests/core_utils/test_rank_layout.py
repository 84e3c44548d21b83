""":class:`core.ranks.RankLayout`'s relations between ranks on a layout of unequal groups, by hand."""

from __future__ import annotations

from core.ranks import RankLayout

# groups 0: (0, 1, 2), 1: (3, 4), 2: (5,)
LAYOUT = RankLayout.of([[0, 1, 2], [3, 4], [5]])


def test_same_group_marks_every_rank_of_the_ranks_group():
    assert LAYOUT.same_group(1).tolist() == [True, True, True, False, False, False]
    assert LAYOUT.same_group(4).tolist() == [False, False, False, True, True, False]
    assert LAYOUT.same_group(5).tolist() == [False] * 5 + [True]


def test_group_and_rail_of_a_rank():
    assert LAYOUT.group_of(4) == (3, 4)
    assert LAYOUT.replica_group_of(1) == [1, 4]  # position 1: no third group has one
    assert LAYOUT.replica_group_of(2) == [2]
    assert LAYOUT.replica_groups() == [[0, 3, 5], [1, 4]]
