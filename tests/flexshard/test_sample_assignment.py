"""Sample placement's local parts by hand: wanted moves, symmetric swaps between rail peers, destinations,
scores (a row's bytes shared by its lookups in the batch) and the bytes of a moved sample."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import ConfigError
from core.ranks import RankLayout
from core.vocabulary import WireDtype
from flexshard.batching.assign import SwapPlan, destinations, want_counts, wanted_moves
from flexshard.batching.scores import group_scores, hashed_group, lookup_bytes, sample_bytes, sample_lookups
from flexshard.model import Batch


def test_wanted_moves_take_the_best_other_group_and_its_gain():
    score = np.array([[5.0, 1, 0], [0, 2, 9], [3, 8, 1], [7, 7, 7]])
    best, gain = wanted_moves(score, home=0)
    assert best.tolist() == [1, 2, 1, 1] and gain.tolist() == [-4, 9, 5, 0]
    assert want_counts(best, gain, 3).tolist() == [0, 1, 1]  # gain 0 or less: stays


def test_swaps_between_rail_peers_are_symmetric_and_keep_every_batch_whole():
    layout = RankLayout.consecutive(6, 3)  # groups [0, 1], [2, 3], [4, 5]; rail peers share a position
    wants = np.array([[0, 3, 1], [0, 0, 0], [2, 0, 5], [4, 0, 1], [0, 1, 0], [0, 2, 0]])
    counts = SwapPlan.between_rail_peers(wants, layout, 10).counts
    assert np.array_equal(counts, counts.T)
    assert (counts.sum(axis=1) == 10).all() and (counts.sum(axis=0) == 10).all()
    # rank 0 (group 0, position 0) with rank 2 (group 1): min(3, 2); with rank 4 (group 2): min(1, 0);
    # rank 2 with rank 4: min(5, 1)
    assert counts[0, 2] == 2 and counts[0, 4] == 0 and counts[2, 4] == 1
    assert counts[1, 3] == 0 and counts[3, 5] == min(1, 2) and counts[0, 1] == 0  # no moves inside a group
    assert counts[0, 0] == 8
    with pytest.raises(ConfigError, match="groups of unequal size have no rail peers"):
        SwapPlan.between_rail_peers(np.zeros((3, 2), np.int64), RankLayout.of([[0, 1], [2]]), 4)


def test_destinations_send_the_largest_gains():
    layout = RankLayout.consecutive(4, 2)
    best = np.array([1, 1, 1, 0, 1])
    gain = np.array([5.0, 9, -1, 3, 2])
    sends = np.array([0, 0, 2, 0])  # rank 0 swaps two samples with rank 2
    assert destinations(best, gain, sends, layout, 0).tolist() == [2, 2, 0, 0, 0]
    with pytest.raises(ValueError, match="rank 2: 4 swaps agreed, 3 samples want its group"):
        destinations(best, gain, np.array([0, 0, 4, 0]), layout, 0)


def _batch() -> Batch:
    return Batch(
        lengths=np.array([2, 1, 3]),
        history={"item": np.array([10, 11, 12, 13, 14, 15]), "creator": np.array([1, 1, 1, 1, 1, 1])},
        candidates={"item": np.array([[20, 21], [22, 23], [24, 25]]), "creator": np.array([[2, 2]] * 3)},
        users=np.array([7, 8, 9]),
    )


def test_sample_lookups_and_sample_bytes_by_hand():
    lookups = sample_lookups(_batch(), "user")
    assert lookups["item"][0].tolist() == [10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 25]
    assert lookups["item"][1].tolist() == [0, 0, 1, 2, 2, 2, 0, 0, 1, 1, 2, 2]
    assert lookups["user"][1].tolist() == [0, 1, 2]
    # a sample moves its length, L ids per sequence table, 2 candidates per table and its user: int64 each
    assert sample_bytes(_batch()).tolist() == [
        8 * (1 + 2 * 2 + 4 + 1),
        8 * (1 + 2 + 4 + 1),
        8 * (1 + 6 + 4 + 1),
    ]


def test_group_scores_sum_the_lookup_bytes_per_group():
    assert lookup_bytes(16, WireDtype.FP32) == 8 + 2 * 64 and lookup_bytes(16, WireDtype.BF16) == 8 + 2 * 32
    cold = {  # (ids, sample, group): row 5 looked up twice (samples 0 and 2) shares its 10 bytes
        "item": (np.array([5, 6, 7, 5]), np.array([0, 0, 1, 2]), np.array([1, 1, 0, 1])),
        "user": (np.array([9]), np.array([2]), np.array([0])),
    }
    got = group_scores(3, cold, {"item": 10, "user": 3}, 2)
    assert got.tolist() == [[0, 15], [10, 0], [3, 5]]


def test_hashed_groups_are_spread_and_the_same_everywhere():
    ids = np.arange(100_000)
    g = hashed_group("item", ids, 4)
    assert np.array_equal(g, hashed_group("item", ids.copy(), 4))
    counts = np.bincount(g, minlength=4)
    assert counts.min() > 0.24 * ids.size  # consecutive ids spread evenly
    assert not np.array_equal(g, hashed_group("creator", ids, 4))  # each table its own hash
