"""The weighted owner interleave that the plan file's owner maps expand to."""

from __future__ import annotations

import numpy as np
import pytest

from solvers.dealing import interleave_pattern
from solvers.types import PlannerError


@pytest.mark.parametrize(
    "shares", [[1, 1, 1, 1], [0.5, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1, 0.0], [3, 1], [1e-3, 1 - 1e-3]]
)
def test_every_prefix_within_one_row_of_the_shares(shares):
    w = np.asarray(shares, dtype=float) / np.sum(shares)
    pattern = interleave_pattern(np.asarray(shares, dtype=float), 1000)
    counts = np.zeros((pattern.size + 1, w.size))
    counts[1:] = np.cumsum(np.eye(w.size)[pattern], axis=0)
    expected = np.arange(pattern.size + 1)[:, None] * w[None, :]
    assert np.abs(counts - expected).max() <= 1.0 + 1e-9
    assert (counts[-1][w == 0] == 0).all()


def test_even_shares_give_round_robin():
    assert interleave_pattern(np.full(4, 0.25), 8).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_zero_shares_rejected():
    with pytest.raises(PlannerError, match="shares"):
        interleave_pattern(np.zeros(3), 10)
