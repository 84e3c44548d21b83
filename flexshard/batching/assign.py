"""Which samples move, and to whom: swaps between rail peers that keep every rank's batch whole.

Each rank scores its samples per group (:mod:`~flexshard.batching.scores`); a sample *wants* the group
where its gain over staying home is largest, if that gain is positive (:func:`wanted_moves`). Ranks
publish how many of their samples want each group (one small all-gather, :class:`SwapPlan`), and every
rank computes the same swaps: rank ``r`` of group ``a`` and its rail peer ``d`` (the rank at the same
position) in group ``b`` swap ``min(wants[r, b], wants[d, a])`` samples, each side sending its samples
of largest gain (:func:`destinations`). Swaps are symmetric, so every rank still trains on ``B`` samples,
and a sample only moves when moving saves bytes by the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import ConfigError
from core.ranks import RankLayout


def wanted_moves(score: np.ndarray, home: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample its best group other than ``home`` and the gain of going there instead of staying
    (``score[s, best] - score[s, home]``; a sample with gain <= 0 stays)."""
    other = np.asarray(score, dtype=np.float64).copy()
    other[:, home] = -np.inf
    best = np.argmax(other, axis=1) if other.shape[1] > 1 else np.full(other.shape[0], home)
    gain = other[np.arange(other.shape[0]), best] - score[:, home] if other.shape[1] > 1 else np.zeros(0)
    return best.astype(np.int64), np.asarray(gain, dtype=np.float64).reshape(-1)


def want_counts(best: np.ndarray, gain: np.ndarray, num_groups: int) -> np.ndarray:
    """int64[G]: this rank's samples that gain by moving to each group."""
    return np.bincount(best[gain > 0], minlength=num_groups).astype(np.int64)


@dataclass(frozen=True)
class SwapPlan:
    """``counts[r, d]``: samples rank ``r`` sends rank ``d`` (symmetric; the diagonal is what a rank
    keeps, so every row and column sums to the batch size)."""

    counts: np.ndarray

    @classmethod
    def between_rail_peers(cls, wants: np.ndarray, layout: RankLayout, batch_size: int) -> SwapPlan:
        """The swaps of every rank with its rail peer in every other group (``wants[r, b]``: rank ``r``'s
        samples that gain by moving to group ``b``). Groups must have equal sizes."""
        size = layout.uniform_group_size
        if size is None:
            raise ConfigError("sample placement: groups of unequal size have no rail peers to swap with")
        groups = np.asarray(layout.to_lists(), dtype=np.int64)  # [G, size]
        home = layout.group_of_rank
        position = layout.position_of_rank
        peer = groups[:, position].T  # [N, G]: rank r's rail peer in each group
        n = layout.num_ranks
        counts = np.zeros((n, n), dtype=np.int64)
        rows = np.repeat(np.arange(n), groups.shape[0])
        cols = peer.reshape(-1)
        swap = np.minimum(wants[rows, np.tile(np.arange(groups.shape[0]), n)], wants[cols, home[rows]])
        counts[rows, cols] = np.where(cols == rows, 0, swap)
        counts[np.arange(n), np.arange(n)] = batch_size - counts.sum(axis=1)
        return cls(counts)


def destinations(
    best: np.ndarray, gain: np.ndarray, sends: np.ndarray, layout: RankLayout, rank: int
) -> np.ndarray:
    """int64[B]: the rank each sample goes to. For every peer ``d`` with ``sends[d] > 0`` (in another
    group), the ``sends[d]`` samples of largest gain that want ``d``'s group go to ``d`` (ties: sample
    order); the rest stay on ``rank``."""
    dest = np.full(best.size, rank, dtype=np.int64)
    for d in np.flatnonzero(sends):
        if d == rank:
            continue
        willing = np.flatnonzero((best == layout.group_of_rank[d]) & (gain > 0))
        chosen = willing[np.argsort(-gain[willing], kind="stable")[: sends[d]]]
        if chosen.size != sends[d]:
            raise ValueError(f"rank {d}: {sends[d]} swaps agreed, {chosen.size} samples want its group")
        dest[chosen] = d
    return dest
