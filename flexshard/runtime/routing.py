"""Row routing of a plan: which tier, owner and local slot every row id of a table has.

Rows are ranked by hotness (a permutation of the ids, hottest first). Hotness rank ``r`` is hot
when ``r < hot_rows``, warm when ``r < hot_rows + warm_rows``, cold otherwise. Warm rows (warm index
``j = r - hot_rows``) are dealt to *positions* inside a group and cold rows (cold index ``c``) to
*ranks* of the cluster by :func:`solvers.placement.interleave_pattern` over ``period`` rows:

    owner = pattern[j % P]
    slot  = (j // P) * count(pattern == owner) + #{i < j % P : pattern[i] == owner}

so the rows an owner holds are numbered 0, 1, 2, ... in hotness order. Everything here is numpy and
vectorised over rows (no Python loop per row). The per-row arrays kept after the build are tier
(int8), owner (int32) and slot (int32, or int64 for tables of 2^31 rows or more): 9 bytes per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.placement import interleave_pattern
from solvers.types import TablePlan

HOT, WARM, COLD = 0, 1, 2
TIER_NAMES = ("hot", "warm", "cold")


def complete_order(order: np.ndarray | list[int] | None, num_rows: int, table: str = "?") -> np.ndarray:
    """A full hotness order (a permutation of ``0..num_rows-1``, hottest first).

    ``order`` lists touched ids hottest first (as in a stats file's ``orders[table]``); ids it does
    not list follow in ascending id order. ``None`` gives the identity.
    """
    if order is None:
        return np.arange(num_rows, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    if order.size and (order.min() < 0 or order.max() >= num_rows):
        bad = order[(order < 0) | (order >= num_rows)][0]
        raise ValueError(f"order of table {table!r}: id {int(bad)} outside [0, {num_rows})")
    seen = np.zeros(num_rows, dtype=bool)
    seen[order] = True
    if int(seen.sum()) != order.size:
        values, counts = np.unique(order, return_counts=True)
        raise ValueError(f"order of table {table!r}: id {int(values[counts > 1][0])} listed twice")
    return np.concatenate([order, np.flatnonzero(~seen)]).astype(np.int64)


def deal(num_items: int, shares: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner int64[n], slot int64[n], rows per owner int64[K]) of items 0..n-1 dealt by the weighted
    interleave of ``shares`` (K owners) repeating every ``period`` items."""
    shares = np.asarray(shares, dtype=np.float64)
    k = shares.size
    if num_items == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(k, np.int64)
    pattern = interleave_pattern(shares, period)
    per_period = np.bincount(pattern, minlength=k)
    # rank of each pattern entry among the earlier entries with the same owner
    by_owner = np.argsort(pattern, kind="stable")
    first = np.concatenate([[0], np.cumsum(per_period)[:-1]])
    prefix = np.empty(period, dtype=np.int64)
    prefix[by_owner] = np.arange(period) - first[pattern[by_owner]]
    j = np.arange(num_items, dtype=np.int64)
    phase = j % period
    owner = pattern[phase]
    slot = (j // period) * per_period[owner] + prefix[phase]
    return owner, slot, np.bincount(owner, minlength=k).astype(np.int64)


@dataclass
class TableRouting:
    """Per-id routing of one table.

    ``tier[id]`` in {HOT, WARM, COLD}; ``owner[id]``: -1 (hot), the group position (warm) or the
    rank (cold); ``slot[id]``: the row's index in the owner's shard (the hotness rank for hot rows).
    ``hot_ids``: the hot rows' ids, hottest first (slot order).
    """

    name: str
    num_rows: int
    hot_rows: int
    warm_rows: int
    cold_rows: int
    hot_ids: np.ndarray  # int64[hot_rows]
    tier: np.ndarray  # int8[num_rows]
    owner: np.ndarray  # int32[num_rows]
    slot: np.ndarray  # int32[num_rows] (int64 from 2^31 rows)
    warm_rows_per_position: np.ndarray  # int64[g]
    cold_rows_per_rank: np.ndarray  # int64[N]

    def ids_of(self, tier: int, owner: int = -1) -> np.ndarray:
        """Ids (int64) of ``tier`` held by ``owner`` (a position for warm, a rank for cold), in slot
        order."""
        if tier == HOT:
            return self.hot_ids.copy()
        sel = np.flatnonzero((self.tier == tier) & (self.owner == owner))
        return sel[np.argsort(self.slot[sel], kind="stable")].astype(np.int64)


def build_routing(
    plan: TablePlan, groups: list[list[int]], order: np.ndarray | None, period: int
) -> TableRouting:
    """Routing of one table of a plan on ``groups`` (ranks of each group, same order on every rank)."""
    num_rows = plan.hot_rows + plan.warm_rows + plan.cold_rows
    order = complete_order(order, num_rows, plan.name)
    h, w = plan.hot_rows, plan.warm_rows
    warm_by_position = np.asarray(plan.warm_share, dtype=np.float64)[list(groups[0])]
    w_owner, w_slot, w_sizes = deal(w, warm_by_position, period)
    c_owner, c_slot, c_sizes = deal(plan.cold_rows, plan.cold_share, period)
    tier = np.empty(num_rows, dtype=np.int8)
    owner = np.empty(num_rows, dtype=np.int32)
    slot = np.empty(num_rows, dtype=np.int32 if num_rows < 2**31 else np.int64)
    tier[order[:h]] = HOT
    owner[order[:h]] = -1
    slot[order[:h]] = np.arange(h)
    tier[order[h : h + w]] = WARM
    owner[order[h : h + w]] = w_owner
    slot[order[h : h + w]] = w_slot
    tier[order[h + w :]] = COLD
    owner[order[h + w :]] = c_owner
    slot[order[h + w :]] = c_slot
    hot_ids = order[:h].copy()
    return TableRouting(
        plan.name, num_rows, h, w, plan.cold_rows, hot_ids, tier, owner, slot, w_sizes, c_sizes
    )
