"""``input_dist``'s local part (:class:`Router`): every remote lookup of a batch in its id column, sorted by
destination rank, and what that gives (:class:`Routed`). No collective; the exchange protocol
(:mod:`~flexshard.runtime.exchange_protocol`) sends the columns and their split sizes in ``ids``
(:mod:`~flexshard.runtime.headed_ids`).

A table's four id columns: ``WARM`` (warm slots to their owner in this rank's group), ``FLAT`` (flat cold
slots to their owner), ``GIDS`` (group-fetch keys, :meth:`~flexshard.runtime.group_dedup.GroupDedup.key`,
to the *rail peer*: the rank of this group at the owner's position) and ``GSLOTS`` (for owners in other
groups, the same lookups' slots straight to the owner). An all-cold group-fetched table whose lookups are
sorted in :attr:`Router.owner_key` order needs no sort for either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core.ranks import RankLayout
from core.vocabulary import Tier
from flexshard.runtime.group_dedup import FLAT, GIDS, GSLOTS, WARM, GroupDedup
from flexshard.runtime.indexing import flat_nonzero, repeated_columns
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.transfer import count_per_peer
from flexshard.runtime.wire_rows import WireRows

KINDS = 4  # the id columns of a table: WARM, FLAT, GIDS, GSLOTS


@dataclass
class Routed:
    """This rank's remote lookups (``input_dist``'s local part). Per table and kind: positions among
    the table's unique ids, and what is sent (slots, or the rows' keys for ``GIDS``), sorted by
    destination."""

    lookups: list[TableLookup]
    # per table and kind the positions of the column's lookups (empty for a by-rail table, whose GIDS is
    # in order and whose GSLOTS rows come back through the rail peer)
    index: list[list[torch.Tensor]]
    send: list[list[torch.Tensor]]
    counts: np.ndarray  # int64[world, tables, KINDS]: entries sent to each rank
    # (table, kind) of the columns that are every unique id in order (FLAT of an all-cold by-owner table,
    # GIDS of a by-rail one): rows and gradients travel without a gather or scatter
    in_order: set[tuple[int, int]] = field(default_factory=set)
    # every table's rows in the exchange's wire order (set by ``scatter`` where every table is by rail, by
    # ``rows`` where every table is flat and by owner; the lookups' ``rows`` are then unused)
    joint: WireRows | None = None

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """Every table's rows in input order."""
        joint = self.joint
        return tuple(lk.output() if joint is None else joint.output(t) for t, lk in enumerate(self.lookups))


class Router:
    """This rank's ``input_dist`` local part (module docstring). ``routing``: every table's routing;
    ``group_fetch[t]``: table t's cold rows are fetched once per group; ``dedup``: the group fetch's key
    space."""

    def __init__(
        self,
        layout: RankLayout,
        me: int,
        routing: list,
        group_fetch: np.ndarray,
        dedup: GroupDedup,
        device: torch.device,
    ) -> None:
        self.routing, self.group_fetch, self.dedup, self.device = routing, group_fetch, dedup, device
        self.world = layout.num_ranks
        pos_of = layout.position_of_rank
        mine = np.asarray(layout.group_of(me), dtype=np.int64)
        same = layout.same_group(me)
        # rank -> the rank of this group at its position (a warm owner's / cold owner's rail peer)
        self.warm_rank = torch.as_tensor(mine, device=device)
        rail_peer = np.full(self.world, -1, dtype=np.int64)
        ok = pos_of < mine.size
        rail_peer[ok] = mine[pos_of[ok]]
        self.rail_peer_of_owner = torch.as_tensor(rail_peer, device=device)
        self.same_group = torch.as_tensor(same, device=device)
        # owner_key[o]: owner o's place in the order (rail peer of o, o). Lookups sorted by (owner_key,
        # slot) send GIDS in destination order; GSLOTS too (its owners ascending) where ``gslots_sorted``
        by_rail = np.lexsort((np.arange(self.world), rail_peer))
        self.owner_key = torch.as_tensor(np.argsort(by_rail), device=device)
        self.key_owner = torch.as_tensor(by_rail, device=device)  # its inverse: the owner at each key
        away = by_rail[~same[by_rail]]
        self.gslots_sorted = bool(np.all(np.diff(away) > 0))
        self._rail_owners = torch.as_tensor(np.flatnonzero(ok), device=device)  # owners with a rail peer
        self._rail_dest = torch.as_tensor(rail_peer[ok], device=device)
        self._away = torch.as_tensor(~same, dtype=torch.int64, device=device)
        # read-only stand-ins for a column a table does not use (no tensor made per step)
        self._none = torch.zeros(0, dtype=torch.int64, device=device)
        self._no_bins = torch.zeros(self.world, dtype=torch.int64, device=device)

    def route(self, lookups: list[TableLookup]) -> Routed:
        """Every remote lookup in its column, sorted by destination rank. No collective. A column a
        table cannot use (no warm rows; the other fetch mode) is empty without work. The tables whose
        lookups are in the group fetch's destination order (``by_rail``) are routed together
        (:meth:`_route_by_rail`)."""
        none, no_bins = self._none, self._no_bins
        index, send, bins, in_order = [], [], [], set()
        rail = [t for t, lk in enumerate(lookups) if lk.by_rail]
        routed_by_rail, rail_counts = self._route_by_rail(rail, lookups)
        for t, lk in enumerate(lookups):
            if lk.by_rail:  # already in the group fetch's destination order: GIDS needs no index
                gids, gslots = routed_by_rail[t]
                index.append([none, none, none, none])
                send.append([none, none, gids, gslots])
                bins += [no_bins] * KINDS  # the counts are rail_counts'
                in_order.add((t, GIDS))
                continue
            grouped = bool(self.group_fetch[t])
            cold = lk.positions(Tier.COLD)  # None: every lookup
            owner = lk.owner if cold is None else lk.owner.index_select(0, cold)
            columns: list = [None] * KINDS  # (positions or None for all, destination rank, keys or slots)
            key = None
            if lk.tier is not None and self.routing[t].warm_rows:
                warm = lk.positions(Tier.WARM)
                dest = self.warm_rank.index_select(0, lk.owner.index_select(0, warm))
                columns[WARM] = (warm, dest, lk.slot)
            if not grouped:
                columns[FLAT] = (cold, owner, lk.slot)
            else:
                # GIDS: the row's key (the rail peer looks up nothing)
                key = self.dedup.key(t, owner, lk.slot if cold is None else lk.slot.index_select(0, cold))
                dest = self.rail_peer_of_owner.index_select(0, owner)
                columns[GIDS] = (cold, dest, key)
                away = ~self.same_group.index_select(0, owner)
                other = flat_nonzero(away) if cold is None else cold[away]
                columns[GSLOTS] = (other, lk.owner.index_select(0, other), lk.slot)
            index.append([])
            send.append([])
            for column in columns:
                if column is None:
                    index[t].append(none)
                    send[t].append(none)
                    bins.append(no_bins)
                    continue
                sel, dest, values = column
                if sel is None and lk.by_owner and values is lk.slot:  # already in destination order
                    index[t].append(torch.arange(dest.numel(), device=self.device))
                    in_order.add((t, FLAT))  # the only column taking every unique id
                    send[t].append(values)
                    bins.append(count_per_peer(dest, self.world))
                    continue
                order = torch.argsort(dest, stable=True)
                index[t].append(order if sel is None else sel.index_select(0, order))
                # GIDS's key is already one per selected lookup (others: one per unique id)
                send[t].append(values.index_select(0, order if values is key else index[t][-1]))
                bins.append(count_per_peer(dest, self.world))
        n_t = len(lookups)
        if len(rail) == n_t:  # every table by rail: its counts came over with the GSLOTS split sizes
            counts = np.zeros((n_t, KINDS, self.world), dtype=np.int64)
        else:
            counts = torch.stack(bins).cpu().numpy().reshape(n_t, KINDS, self.world)
        if rail:
            counts[rail, GIDS], counts[rail, GSLOTS] = rail_counts
        counts = counts.transpose(2, 0, 1)
        return Routed(lookups, index, send, np.ascontiguousarray(counts, dtype=np.int64), in_order)

    def _route_by_rail(
        self, tables: list[int], lookups: list[TableLookup]
    ) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], np.ndarray]:
        """:meth:`route`'s GIDS and GSLOTS columns of the all-cold tables ``tables`` whose lookups are
        sorted by (:attr:`owner_key` of the owner, slot), every table at once (a fixed number of ops,
        none per table): GIDS is every lookup's key in order, GSLOTS the slots of the lookups owned in
        other groups in order (a stable sort by (table, owner) of these alone where not
        ``gslots_sorted``). Returns per table ``(GIDS keys, GSLOTS slots)`` and the counts sent to each
        rank, int64[2 (GIDS, GSLOTS), tables, world] (on the host: GSLOTS is cut per table by them)."""
        if not tables:
            return {}, np.zeros((2, 0, self.world), dtype=np.int64)
        dev, world, n_r = self.device, self.world, len(tables)
        sizes = [lookups[t].owner.numel() for t in tables]
        spans, bases = self.dedup.span[tables], self.dedup.base[tables]
        if n_r == 1:
            owner, slot = lookups[tables[0]].owner, lookups[tables[0]].slot
            span, base, cell = int(spans[0]), int(bases[0]), owner
        else:
            owner = torch.cat([lookups[t].owner for t in tables])
            slot = torch.cat([lookups[t].slot for t in tables])
            # per lookup its table's key span and base and its table's first count cell
            span, base, cell0 = repeated_columns(np.stack([spans, bases, np.arange(n_r) * world]), sizes, dev)
            cell = owner + cell0
        keys = self.dedup.j_of(owner) * span + (slot + base)  # GroupDedup.key of every table at once
        per_owner = count_per_peer(cell, n_r * world).view(n_r, world)
        per_rail = torch.zeros_like(per_owner).index_add_(
            1, self._rail_dest, per_owner.index_select(1, self._rail_owners)
        )
        away = per_owner * self._away
        counts = torch.stack([per_rail, away]).cpu().numpy()
        other = flat_nonzero(self._away.index_select(0, owner))
        if not self.gslots_sorted:  # by (table, owner): a stable sort of the count cells
            other = other.index_select(0, torch.argsort(cell.index_select(0, other), stable=True))
        gslots = slot.index_select(0, other).split(counts[1].sum(axis=1).tolist())
        gids = keys.split(sizes)
        return {t: (gids[i], gslots[i]) for i, t in enumerate(tables)}, counts
