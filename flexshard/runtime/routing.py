"""Row routing of a plan: which tier, owner and local slot every row id of a table has.

Rows are ranked by hotness (a permutation of the ids, hottest first). Hotness rank ``r`` is hot
when ``r < hot_rows``, warm when ``r < hot_rows + warm_rows``, cold otherwise. Warm rows (warm index
``j = r - hot_rows``) are dealt to *positions* inside a group and cold rows (cold index ``c``) to
*ranks* of the cluster by the owner pattern of :mod:`solvers.dealing` (the weighted interleave over
``period`` rows, rotated to the tier's start position in the plan):

    owner = pattern[j % P]
    slot  = (j // P) * count(pattern == owner) + #{i < j % P : pattern[i] == owner}

so the rows an owner holds are numbered 0, 1, 2, ... in hotness order. A table whose plan deals its rows
by ``ranges`` (TorchRec's row-wise layout; every row cold) has ``owner = id // B`` and ``slot = id % B``
with ``B = ceil(rows / N)``. Two layouts implement it:

* ``exact`` (:class:`TableRouting`): cold rows dealt in hotness order, as the cost model prices them,
  so a rank's share of the cold rows is exactly its share of their accesses; each owner numbers its
  cold rows by ascending id (not hotness), as the ``ranges`` deal and the compact layout do, so the
  slots a requester asks of an owner (its unique ids, ascending) ascend too and the owner's gathers
  and gradient adds run through its shard in order (measured: a gather of 19k random rows of a 25k x
  64 shard 2.5x slower than in ascending order on this CPU). It keeps per-row arrays:
  tier (int8), owner (int32) and slot (int32, int64 from 2^31 rows), 9 bytes per row.
* ``compact`` (:class:`CompactTableRouting`): only the replicated (hot and warm) rows are listed, as
  sorted ids with their hotness ranks; cold rows are dealt by *id* (``owner = pattern[id % P]``), so
  their owner and slot are arithmetic. 20 bytes per replicated row and nothing per cold row, for
  tables of 10^9 rows. A rank's cold access share equals its row share only in expectation (ids
  that are hashed or unrelated to hotness).

Everything is vectorised over rows (no Python loop per row); lookups are torch ops on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.arrays import exclusive_cumsum
from core.errors import DataError
from core.vocabulary import Deal, Tier
from solvers.dealing import owner_pattern, range_rows, range_size
from solvers.types import TablePlan

LAYOUTS = ("exact", "compact")
_OWNER_SHIFT = 40  # hole keys of the compact layout: owner << 40 | raw slot (slots < 2^40)


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
        raise DataError(f"order of table {table!r}: id {int(bad)} outside [0, {num_rows})")
    seen = np.zeros(num_rows, dtype=bool)
    seen[order] = True
    if int(seen.sum()) != order.size:
        values, counts = np.unique(order, return_counts=True)
        raise DataError(f"order of table {table!r}: id {int(values[counts > 1][0])} listed twice")
    return np.concatenate([order, np.flatnonzero(~seen)]).astype(np.int64)


@dataclass(frozen=True)
class Dealer:
    """The weighted interleave of :func:`deal` as arithmetic: item ``j`` goes to ``pattern[j % P]`` at
    slot ``(j // P) * per_period[owner] + prefix[j % P]``. Arrays of ``period`` and owners, not items."""

    pattern: np.ndarray  # int64[P]: owner of each pattern position
    per_period: np.ndarray  # int64[K]: positions of each owner in one period
    prefix: np.ndarray  # int64[P]: earlier positions of the same owner in the period

    @classmethod
    def of(cls, shares: np.ndarray, period: int, start: int = 0) -> Dealer:
        shares = np.asarray(shares, dtype=np.float64)
        pattern = owner_pattern(shares, period, start).copy()
        per_period = np.bincount(pattern, minlength=shares.size).astype(np.int64)
        by_owner = np.argsort(pattern, kind="stable")
        first = exclusive_cumsum(per_period)
        prefix = np.empty(period, dtype=np.int64)
        prefix[by_owner] = np.arange(period) - first[pattern[by_owner]]
        return cls(pattern, per_period, prefix)

    def owner_slot(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        period = self.pattern.size
        phase = j % period
        owner = self.pattern[phase]
        return owner, (j // period) * self.per_period[owner] + self.prefix[phase]

    def count(self, num_items: int) -> np.ndarray:
        """Items of ``0..num_items-1`` each owner gets (int64[K])."""
        full, rest = divmod(int(num_items), self.pattern.size)
        return full * self.per_period + np.bincount(self.pattern[:rest], minlength=self.per_period.size)

    def items_of(self, owner: int, num_items: int) -> np.ndarray:
        """The items of ``0..num_items-1`` that ``owner`` gets, ascending (= slot order)."""
        period = self.pattern.size
        mine = np.flatnonzero(self.pattern == owner)
        starts = np.arange(0, int(num_items), period, dtype=np.int64)
        items = (starts[:, None] + mine[None, :]).reshape(-1)
        return items[items < num_items]


def deal(
    num_items: int, shares: np.ndarray, period: int, start: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner int64[n], slot int64[n], rows per owner int64[K]) of items 0..n-1 dealt by the weighted
    interleave of ``shares`` (K owners) repeating every ``period`` items, item 0 at position ``start``."""
    shares = np.asarray(shares, dtype=np.float64)
    if num_items == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(shares.size, np.int64)
    dealer = Dealer.of(shares, period, start)
    owner, slot = dealer.owner_slot(np.arange(num_items, dtype=np.int64))
    return owner, slot, dealer.count(num_items)


@dataclass
class TableRouting:
    """Per-id routing of one table.

    ``tier[id]``: a :class:`~core.vocabulary.Tier`; ``owner[id]``: -1 (hot), the group position (warm) or the
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

    layout = "exact"

    def ids_of(self, tier: int, owner: int = -1) -> np.ndarray:
        """Ids (int64) of ``tier`` held by ``owner`` (a position for warm, a rank for cold), in slot
        order."""
        if tier == Tier.HOT:
            return self.hot_ids.copy()
        sel = np.flatnonzero((self.tier == tier) & (self.owner == owner))
        return sel[np.argsort(self.slot[sel], kind="stable")].astype(np.int64)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays this routing keeps (its memory, and what a checkpoint's layout hash covers)."""
        return self.hot_ids, self.tier, self.owner, self.slot

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tier, owner, slot) of ``ids`` (int64 on any device) as int64 tensors on that device."""
        maps = _on_device(self, ids.device, lambda: (self.tier, self.owner, self.slot))
        return tuple(m.index_select(0, ids).long() for m in maps)  # type: ignore[return-value]

    def lookup_cold(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, slot) of ``ids`` as :meth:`lookup` gives them, for a table with every row cold (its
        tier needs no lookup)."""
        maps = _on_device(self, ids.device, lambda: (self.tier, self.owner, self.slot))
        return maps[1].index_select(0, ids).long(), maps[2].index_select(0, ids).long()

    def unique_by_owner(
        self,
        values: torch.Tensor,
        owner_key: torch.Tensor | None = None,
        key_owner: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """(ids, inverse, owner, slot): the distinct ``values`` of a table with every row cold, sorted by
        owner and then id (the order the exchange sends them in, so no sort by destination follows),
        ``inverse`` the position of each value among them. One sort (``torch.unique`` of
        ``owner * rows + id``) where dedup by id and a stable sort by owner took two. ``owner_key``
        (int64[ranks], a permutation of the ranks): sort owners by ``owner_key[owner]`` instead (the
        group fetch's rail-peer order); ``key_owner``: its inverse permutation (computed when not given).
        Within an owner, id order is slot order (slots by ascending id)."""
        maps = _on_device(self, values.device, lambda: (self.tier, self.owner, self.slot))
        owner = maps[1].index_select(0, values).long()
        if owner_key is not None:
            owner = owner_key.index_select(0, owner)
        distinct, inverse = torch.unique(owner * self.num_rows + values, return_inverse=True)
        owner = torch.div(distinct, self.num_rows, rounding_mode="floor")
        ids = distinct - owner * self.num_rows
        if owner_key is not None:
            key_owner = torch.argsort(owner_key) if key_owner is None else key_owner
            owner = key_owner.index_select(0, owner)
        return ids, inverse, owner, maps[2].index_select(0, ids).long()


def _on_device(routing, device: torch.device, arrays) -> tuple[torch.Tensor, ...]:
    """``arrays()`` as tensors on ``device``, made once per device (shared with numpy on the CPU)."""
    cache = routing.__dict__.setdefault("_device_maps", {})
    if device not in cache:
        cache[device] = tuple(torch.as_tensor(a, device=device) for a in arrays())
    return cache[device]


@dataclass
class CompactTableRouting:
    """The ``compact`` layout (module docstring): replicated rows listed, cold rows by arithmetic.

    ``rep_ids``: the hot and warm ids sorted (int64); ``rep_rank``: each one's hotness rank (int32);
    ``holes``: sorted ``cold owner << 40 | raw cold slot`` of the replicated ids, the places the id
    deal would have given them (int64); cold slots skip them. ``warm`` / ``cold``: the two deals.
    """

    name: str
    num_rows: int
    hot_rows: int
    warm_rows: int
    cold_rows: int
    rep_ids: np.ndarray
    rep_rank: np.ndarray
    holes: np.ndarray
    hole_start: np.ndarray  # int64[N]: first hole of each cold owner in ``holes``
    warm: Dealer | None
    cold: Dealer | None
    warm_rows_per_position: np.ndarray
    cold_rows_per_rank: np.ndarray
    range_ids: int = 0  # ids per rank of the ``ranges`` deal (0: cold rows by ``cold``)

    layout = "compact"

    def ids_of(self, tier: int, owner: int = -1) -> np.ndarray:
        """Ids (int64) of ``tier`` held by ``owner`` (a position for warm, a rank for cold), in slot
        order; the cold ones are enumerated from the deal (memory of the shard, not of the table)."""
        h = self.hot_rows
        if tier == Tier.HOT:
            sel = np.flatnonzero(self.rep_rank < h)
            return self.rep_ids[sel[np.argsort(self.rep_rank[sel])]]
        if tier == Tier.WARM:
            sel = np.flatnonzero(self.rep_rank >= h)
            if self.warm is None or not sel.size:
                return np.zeros(0, np.int64)
            j = self.rep_rank[sel].astype(np.int64) - h
            mine = self.warm.owner_slot(j)[0] == owner
            return self.rep_ids[sel[mine][np.argsort(j[mine])]]
        if self.range_ids:
            return np.arange(owner * self.range_ids, min((owner + 1) * self.range_ids, self.num_rows))
        if self.cold is None or not self.cold_rows:
            return np.zeros(0, np.int64)
        ids = self.cold.items_of(owner, self.num_rows)
        if self.rep_ids.size:
            pos = np.minimum(np.searchsorted(self.rep_ids, ids), self.rep_ids.size - 1)
            ids = ids[self.rep_ids[pos] != ids]
        return ids

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays this routing keeps (its memory, and what a checkpoint's layout hash covers)."""
        deals = [a for d in (self.warm, self.cold) if d is not None for a in (d.pattern, d.prefix)]
        ranges = [np.array([self.range_ids], dtype=np.int64)] if self.range_ids else []
        return (self.rep_ids, self.rep_rank, self.holes, self.hole_start, *deals, *ranges)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tier, owner, slot) of ``ids`` (int64 on any device) as int64 tensors on that device."""
        dev = ids.device
        rep_ids, rep_rank, holes, hole_start = _on_device(
            self, dev, lambda: (self.rep_ids, self.rep_rank, self.holes, self.hole_start)
        )
        tier = torch.full_like(ids, int(Tier.COLD))
        owner = torch.zeros_like(ids)
        slot = torch.zeros_like(ids)
        if rep_ids.numel():
            pos = torch.searchsorted(rep_ids, ids).clamp_(max=rep_ids.numel() - 1)
            rep = rep_ids.index_select(0, pos) == ids
            rank = rep_rank.index_select(0, pos).long()
            hot = rep & (rank < self.hot_rows)
            tier = torch.where(hot, int(Tier.HOT), torch.where(rep, int(Tier.WARM), tier))
            owner = torch.where(hot, -1, owner)
            slot = torch.where(hot, rank, slot)
            if self.warm is not None:
                w_owner, w_slot = _deal_torch(self, "warm", (rank - self.hot_rows).clamp_(min=0))
                warm = rep & ~hot
                owner = torch.where(warm, w_owner, owner)
                slot = torch.where(warm, w_slot, slot)
        if self.range_ids:
            owner = torch.div(ids, self.range_ids, rounding_mode="floor")
            slot = ids - owner * self.range_ids
        elif self.cold is not None:
            c_owner, raw = _deal_torch(self, "cold", ids)
            before = torch.searchsorted(holes, (c_owner << _OWNER_SHIFT) | raw) - hole_start.index_select(
                0, c_owner
            )
            cold = tier == Tier.COLD
            owner = torch.where(cold, c_owner, owner)
            slot = torch.where(cold, raw - before, slot)
        return tier, owner, slot

    def lookup_cold(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner, slot) of ``ids`` as :meth:`lookup` gives them, for a table with every row cold."""
        return self.lookup(ids)[1:]


def _deal_torch(routing, which: str, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Dealer.owner_slot` in torch, with the dealer's arrays cached on ``j``'s device."""
    dealer: Dealer = getattr(routing, which)
    pattern, per_period, prefix = _on_device(
        dealer, j.device, lambda: (dealer.pattern, dealer.per_period, dealer.prefix)
    )
    period = pattern.numel()
    phase = torch.remainder(j, period)
    owner = pattern.index_select(0, phase)
    return owner, torch.div(j, period, rounding_mode="floor") * per_period.index_select(
        0, owner
    ) + prefix.index_select(0, phase)


def build_routing(
    plan: TablePlan, groups: list[list[int]], order: np.ndarray | None, period: int
) -> TableRouting:
    """Routing of one table of a plan on ``groups`` (ranks of each group, same order on every rank)."""
    num_rows = plan.hot_rows + plan.warm_rows + plan.cold_rows
    order = complete_order(order, num_rows, plan.name)
    h, w = plan.hot_rows, plan.warm_rows
    warm_by_position = np.asarray(plan.warm_share, dtype=np.float64)[list(groups[0])]
    w_owner, w_slot, w_sizes = deal(w, warm_by_position, period, plan.warm_start)
    if plan.deal is Deal.RANGES:  # every row cold, dealt by id
        c_owner, c_slot = np.divmod(order[h + w :], range_size(num_rows, len(plan.cold_share)))
        c_sizes = range_rows(num_rows, len(plan.cold_share))
    else:
        c_owner, _hotness_slot, c_sizes = deal(plan.cold_rows, plan.cold_share, period, plan.cold_start)
        c_slot = _slots_by_id(order[h + w :], c_owner)
    tier = np.empty(num_rows, dtype=np.int8)
    owner = np.empty(num_rows, dtype=np.int32)
    slot = np.empty(num_rows, dtype=np.int32 if num_rows < 2**31 else np.int64)
    tier[order[:h]] = Tier.HOT
    owner[order[:h]] = -1
    slot[order[:h]] = np.arange(h)
    tier[order[h : h + w]] = Tier.WARM
    owner[order[h : h + w]] = w_owner
    slot[order[h : h + w]] = w_slot
    tier[order[h + w :]] = Tier.COLD
    owner[order[h + w :]] = c_owner
    slot[order[h + w :]] = c_slot
    hot_ids = order[:h].copy()
    return TableRouting(
        plan.name, num_rows, h, w, plan.cold_rows, hot_ids, tier, owner, slot, w_sizes, c_sizes
    )


def _slots_by_id(ids: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Each row's slot when every owner numbers its rows ``0, 1, 2, ...`` by ascending id (int64)."""
    if not ids.size:
        return np.zeros(0, np.int64)
    by = np.lexsort((ids, owner))  # by owner, then id
    start = exclusive_cumsum(np.bincount(owner))
    slot = np.empty(ids.size, np.int64)
    slot[by] = np.arange(ids.size, dtype=np.int64) - start[owner[by]]
    return slot


def build_compact_routing(
    plan: TablePlan, groups: list[list[int]], order: np.ndarray | None, period: int
) -> CompactTableRouting:
    """The ``compact`` routing of one table (same arguments as :func:`build_routing`). Memory: the
    replicated rows and the deals' patterns; the hotness order is read only up to the replicated rows
    (completed, as :func:`complete_order` does, only when it lists fewer)."""
    num_rows = plan.hot_rows + plan.warm_rows + plan.cold_rows
    h, w = plan.hot_rows, plan.warm_rows
    given = np.zeros(0, np.int64) if order is None else np.asarray(order, dtype=np.int64).reshape(-1)
    if given.size >= h + w:
        rep = given[: h + w]
        if rep.size and (rep.min() < 0 or rep.max() >= num_rows or np.unique(rep).size != rep.size):
            complete_order(given, num_rows, plan.name)  # raises the same error as the exact layout
    else:
        rep = complete_order(order, num_rows, plan.name)[: h + w]
    by_id = np.argsort(rep, kind="stable")
    rep_ids = rep[by_id]
    rep_rank = by_id.astype(np.int32 if h + w < 2**31 else np.int64)
    warm_by_position = np.asarray(plan.warm_share, dtype=np.float64)[list(groups[0])]
    warm = Dealer.of(warm_by_position, period, plan.warm_start) if w else None
    n = len(plan.cold_share)
    ranges = plan.deal is Deal.RANGES
    cold = Dealer.of(plan.cold_share, period, plan.cold_start) if plan.cold_rows and not ranges else None
    range_ids = range_size(num_rows, n) if ranges else 0
    if ranges:  # every row cold, dealt by id: no holes
        holes, hole_start = np.zeros(0, np.int64), np.zeros(n, np.int64)
        cold_sizes = range_rows(num_rows, n)
    elif cold is not None:
        c_owner, raw = cold.owner_slot(rep_ids)
        holes = np.sort((c_owner << _OWNER_SHIFT) | raw)
        hole_start = np.searchsorted(holes, np.arange(n, dtype=np.int64) << _OWNER_SHIFT)
        cold_sizes = cold.count(num_rows) - np.bincount(c_owner, minlength=n)
    else:
        holes, hole_start, cold_sizes = np.zeros(0, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    w_sizes = warm.count(w) if warm is not None else np.zeros(len(groups[0]), np.int64)
    return CompactTableRouting(
        plan.name,
        num_rows,
        h,
        w,
        plan.cold_rows,
        rep_ids,
        rep_rank,
        holes,
        hole_start,
        warm,
        cold,
        w_sizes,
        cold_sizes,
        range_ids,
    )
