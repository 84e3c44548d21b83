"""``flexshard.bench.rotation``: the Williams design, checked by counting on every size up to 9."""

from __future__ import annotations

from collections import Counter

import pytest

from flexshard.bench.rotation import round_order, williams_orders


def test_four_strategies_by_hand():
    assert williams_orders(4) == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert williams_orders(1) == [[0]] and williams_orders(2) == [[0, 1], [1, 0]]
    assert [round_order(r, 4) for r in (0, 4, 5)] == [[0, 1, 3, 2], [0, 1, 3, 2], [1, 2, 0, 3]]


@pytest.mark.parametrize("n", range(1, 10))
def test_every_position_once_and_every_predecessor_equally_often(n):
    rows = williams_orders(n)
    assert len(rows) == (2 * n if n % 2 and n > 1 else n)
    assert all(sorted(row) == list(range(n)) for row in rows)  # each round runs every strategy once
    for position in range(n):  # each strategy at each position equally often
        assert Counter(row[position] for row in rows) == {s: len(rows) // n for s in range(n)}
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:], strict=False))
    times = 1 if n % 2 == 0 else 2
    assert follows == {(a, b): times for a in range(n) for b in range(n) if a != b}


def test_the_old_rotation_fails_the_count():  # the check above sees an unbalanced design
    rows = [[(x + r) % 4 for x in range(4)] for r in range(4)]  # A B C D, B C D A, ...
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:], strict=False))
    assert follows[(3, 0)] == 3 and follows[(0, 3)] == 0


def test_n_must_be_positive():
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        williams_orders(0)
