"""The local part of a forward pass: each table's ids (deduplicated per rank when the plan says so), the
tier, owner and slot of every one, and the hot rows read from the local replica.

The exchange protocol (:mod:`~flexshard.runtime.exchange_protocol`) then fills the remote rows of
:attr:`TableLookup.rows`; the module puts the rows back in input order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.vocabulary import Tier
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.features import Features
from flexshard.runtime.indexing import flat_nonzero
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import count_per_peer


@dataclass
class TableLookup:
    """One table's lookups on this rank: the ids it asks for (unique ids with dedup, else every input id)
    and where each one lives."""

    inverse: torch.Tensor | None  # position of each input id among the unique ids (None without dedup)
    ids: torch.Tensor  # int64[num_unique]
    tier: torch.Tensor | None  # int64[num_unique]: a Tier (None: the table has only cold rows)
    owner: torch.Tensor  # int64[num_unique]: -1 (hot), a group position (warm) or a rank (cold)
    slot: torch.Tensor  # int64[num_unique]: the row's index in the owner's shard
    hot_index: torch.Tensor  # positions (among the unique ids) of hot rows
    hot_slot: torch.Tensor  # their slots in the local hot replica
    rows: torch.Tensor  # float32[num_unique, dim]: the ids' embeddings, hot ones filled here
    by_owner: bool = False  # every id cold, sorted by owner then id (else by id, or input order)
    by_rail: bool = False  # every id cold, sorted by the group fetch's owner key, then id
    # the positions of each tier's lookups (HOT, WARM, COLD), made at once (:func:`tier_positions`)
    by_tier: tuple[torch.Tensor, ...] | None = None

    @property
    def num_unique(self) -> int:
        return int(self.ids.numel())

    def positions(self, tier: Tier) -> torch.Tensor | None:
        """Positions (among the unique ids) of the lookups of ``tier``, ascending; None when they are
        all the lookups (a table with only cold rows, asked for ``COLD``)."""
        if self.tier is None:
            return None if tier == Tier.COLD else self.hot_index  # hot_index: empty here
        if self.by_tier is not None:
            return self.by_tier[int(tier)]
        return flat_nonzero(self.tier == tier)

    def output(self) -> torch.Tensor:
        """The rows in input order."""
        return self.rows.index_select(0, self.inverse) if self.inverse is not None else self.rows

    def unique_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The output gradient summed per unique id (the gradient of :attr:`rows`)."""
        if self.inverse is None:
            return grad
        out = torch.zeros(self.num_unique, grad.shape[1], device=grad.device, dtype=grad.dtype)
        return out.index_add_(0, self.inverse, grad)


def local_lookups(
    parsed: Features,
    routing: list,
    dedup: bool,
    hot: list[Shard],
    device: torch.device,
    unique_order: list[tuple[torch.Tensor | None, torch.Tensor | None] | None] | None = None,
) -> list[TableLookup]:
    """Per table: dedup, routing and the hot rows (``hot[t]``: the local hot replica). No collective.
    ``unique_order[t]`` (a table with every row cold and exact routing; None: by id): with dedup, list
    its unique ids by owner, then id, as ``(None, None)``, or by ``owner_key[owner]``, then id, as
    ``(owner_key, key_owner)`` (:meth:`~flexshard.runtime.routing.TableRouting.unique_by_owner`; the
    group fetch's :attr:`~flexshard.runtime.exchange_protocol.ExchangeProtocol.owner_key` and its
    inverse): the exchange's columns then need no sort by destination."""
    out = []
    none = torch.zeros(0, dtype=torch.int64, device=device)
    for t, (values, _lengths) in enumerate(parsed):
        order = unique_order[t] if unique_order is not None else None
        if dedup and order is not None:
            ids, inverse, owner, slot = routing[t].unique_by_owner(values, *order)
            rows = torch.empty(ids.numel(), hot[t].dim, device=device)
            rail = order[0] is not None
            lookup = TableLookup(inverse, ids, None, owner, slot, none, none, rows, not rail, rail)
            out.append(lookup)
            continue
        if dedup:
            ids, inverse = torch.unique(values, return_inverse=True)
        else:
            ids, inverse = values, None
        rows = torch.empty(ids.numel(), hot[t].dim, device=device)
        r = routing[t]
        if r.hot_rows + r.warm_rows == 0:  # every row cold: no tier to look up, no hot row to read
            owner, slot = r.lookup_cold(ids)
            out.append(TableLookup(inverse, ids, None, owner, slot, none, none, rows))
            continue
        tier, owner, slot = r.lookup(ids)
        out.append(TableLookup(inverse, ids, tier, owner, slot, none, none, rows))
    tiered = [t for t, lk in enumerate(out) if lk.tier is not None]
    for t, by_tier in zip(tiered, tier_positions([out[t].tier for t in tiered]), strict=True):
        lk = out[t]
        lk.by_tier, lk.hot_index = by_tier, by_tier[Tier.HOT]
        lk.hot_slot = lk.slot.index_select(0, lk.hot_index)
        lk.rows.index_copy_(0, lk.hot_index, hot[t].weights.index_select(0, lk.hot_slot))
    return out


def tier_positions(tiers: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Per table (``tiers[t]``: each lookup's :class:`~core.vocabulary.Tier`) the positions of its hot,
    warm and cold lookups, each ascending. With the GPU's op choices
    (:func:`~flexshard.runtime.device_rules.gpu_paths`), one stable sort per table and one host copy of
    every table's counts (where ``torch.nonzero`` per tier and table is a device sync each); on the CPU,
    :func:`~flexshard.runtime.indexing.flat_nonzero` per tier (no sort). The same positions either way."""
    if not tiers:
        return []
    if not gpu_paths(tiers[0].device):
        return [tuple(flat_nonzero(tier == k) for k in Tier) for tier in tiers]
    orders = [torch.argsort(tier, stable=True) for tier in tiers]
    counts = torch.stack([count_per_peer(tier, len(Tier)) for tier in tiers]).cpu().tolist()  # one sync
    return [tuple(order.split(n)) for order, n in zip(orders, counts, strict=True)]
