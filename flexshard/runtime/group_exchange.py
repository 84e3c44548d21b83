"""The group fetch (:attr:`core.vocabulary.FetchMode.GROUP`): the cold lookups of a table fetched once per
NVLink group, through the *rail peers*.

Every rank sends each cold id of a group-fetch table to the GPU of its own group at the owner's position
(its rail peer) over NVLink. The rail peer deduplicates the ids of the whole group (its own included) and
fetches each row once from its owner, which sits at the same position in some group: across the fabric,
between the ranks at the same position of every group only (the rail process group, ``pg.replica``). A row
owned in the requester's own group is served by its owner directly (the owner is the rail peer of its own
position). The rail peer then scatters the rows back over NVLink.

One forward pass, every table of the exchange in each collective:

1. group stage, on ``pg.intra``: the split sizes (one int64 per table and group peer), then the row ids;
2. at the rail peer: ``torch.unique`` per table, and each distinct row's owner and slot
   (``routing[t].lookup``);
3. rail stage, on ``pg.replica``: the split sizes (one int64 per table and rail peer), the slots to the
   owners, the embeddings back;
4. group stage: the embeddings scattered back to the requesters.

Backward runs the stages in reverse: the requesters' gradients to the rail peer (group stage), summed
there per distinct row (``index_add_``) before one gradient per row crosses to the owner (rail stage),
which adds it into its cold shard. Embeddings and gradients travel as ``wire_dtype``
(:func:`~flexshard.runtime.transfer.exchange_vectors`); the rail peer sums the gradients it receives in
float32 and rounds the sum once more to cross the fabric. Each stage exchanges with this rank itself
too (a local copy, never counted as bytes).

Bytes follow :func:`solvers.wire.group_lookups_by_link` from the realised counts: NVLink asked = ids sent
to the group peers, served = ids received from them; fabric asked = distinct rows fetched from owners in
other groups, served = rows sent to the other groups' rail peers; split sizes for every table to the
``g - 1`` group peers and the ``G - 1`` rail peers (``Exchanges(cold_group=True)`` in
:func:`solvers.cost_model.split_bytes`). Ids and forward bytes are counted at the forward pass, backward
bytes when the gradients travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, LinkClass, Tier, WireDtype
from flexshard.runtime.groups import ProcessGroups
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import (
    add_lookup_bytes,
    count_forward,
    exchange_columns,
    exchange_sizes,
    exchange_vectors,
)
from solvers import wire


@dataclass
class GroupBatch:
    """This rank's cold lookups of the group-fetch tables, per table sorted by the rail peer they go to
    (empty for the other tables)."""

    index: list[torch.Tensor]  # per table: positions among the table's unique ids
    ids: list[torch.Tensor]  # per table: their row ids, same order
    counts: np.ndarray  # int64[g, tables]: ids sent to each group peer (this rank included)


@dataclass
class RailFetch:
    """The rail peer's side: the ids its group asked of its position, deduplicated per table, and the
    fetch of the distinct rows from their owners."""

    recv_counts: np.ndarray  # int64[g, tables]: ids received from each group peer (this rank included)
    inverse: list[torch.Tensor]  # per table: each received id's position among the distinct ids
    order: list[torch.Tensor]  # per table: distinct-id positions sorted by the owner's rail index
    counts: np.ndarray  # int64[G, tables]: distinct ids asked of each rail peer (this rank included)

    def distinct(self, t: int) -> int:
        return int(self.order[t].numel())


@dataclass
class OwnerRequests:
    """The owner's side: the slots of its cold rows asked by each rail peer."""

    counts: np.ndarray  # int64[G, tables]
    slots: list[torch.Tensor]  # per table: slots asked, rail-peer order


@dataclass
class GroupState:
    """What the backward pass needs of a forward group fetch."""

    batch: GroupBatch
    rail: RailFetch
    owner: OwnerRequests
    backward_traffic: Traffic = field(default_factory=Traffic.zeros)


class GroupExchange:
    """The cold lookups of the group-fetch tables (``members[t]``) of one rank, see the module docstring.

    ``routing``: every table's routing (the rail peer routes the ids it receives); ``shards``: this rank's
    rows per (table, tier); ``wire_dtype``: the element type of embeddings and gradients on the wire.
    Groups must have equal sizes (the rail groups span every group).
    """

    def __init__(
        self,
        pg: ProcessGroups,
        members: np.ndarray,
        routing: list,
        dims: list[int],
        shards: dict[tuple[int, Tier], Shard],
        device: torch.device,
        wire_dtype: WireDtype = WireDtype.FP32,
    ) -> None:
        self.pg, self.routing, self.shards, self.device = pg, routing, shards, device
        self.wire_dtype = wire_dtype
        self.members = np.asarray(members, dtype=bool)
        self.dims = np.asarray(dims, dtype=np.int64)
        layout = pg.layout
        world = layout.num_ranks
        intra_index = np.full(world, -1, dtype=np.int64)
        intra_index[pg.intra_ranks] = np.arange(len(pg.intra_ranks))
        rail_index = np.full(world, -1, dtype=np.int64)
        rail_index[pg.replica_ranks] = np.arange(len(pg.replica_ranks))
        group = np.asarray(layout.group_of(pg.rank), dtype=np.int64)
        # for an owner rank: the group-rank of the rail peer it is reached through / its own rail index
        self.peer_of_owner = torch.as_tensor(intra_index[group[layout.position_of_rank]], device=device)
        self.rail_of_owner = torch.as_tensor(rail_index, device=device)
        self.me_intra = int(intra_index[pg.rank])
        self.me_rail = int(rail_index[pg.rank])

    @property
    def group_size(self) -> int:
        return len(self.pg.intra_ranks)

    @property
    def num_rails(self) -> int:
        """Ranks in this rank's rail group: one per group."""
        return len(self.pg.replica_ranks)

    # --- local part ------------------------------------------------------------------------------

    def prepare(self, lookups: list[TableLookup]) -> GroupBatch:
        """The cold lookups of the member tables, per table sorted by rail peer. No collective."""
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        index, ids, bins = [], [], []
        for t, lk in enumerate(lookups):
            sel = lk.positions(Tier.COLD) if self.members[t] else none
            dest = self.peer_of_owner.index_select(0, lk.owner.index_select(0, sel))
            index.append(sel.index_select(0, torch.argsort(dest, stable=True)))
            ids.append(lk.ids.index_select(0, index[-1]))
            bins.append(torch.bincount(dest, minlength=self.group_size))
        counts = torch.stack(bins).cpu().numpy().T
        return GroupBatch(index, ids, np.ascontiguousarray(counts, dtype=np.int64))

    # --- collectives -----------------------------------------------------------------------------

    def forward(self, batch: GroupBatch, lookups: list[TableLookup], traffic: Traffic) -> GroupState:
        """Fetch the rows of ``batch`` into each table's ``rows`` (collective on the group and the rail
        group); adds the ids and forward bytes to ``traffic`` and keeps the backward bytes."""
        pg, n_t = self.pg, len(lookups)
        ones = np.ones(n_t, dtype=np.int64)
        recv_counts = exchange_sizes(batch.counts, self.device, pg.intra)
        asked = exchange_columns(batch.ids, batch.counts, recv_counts, ones, pg.intra)
        rail, slots = self._dedup(asked, recv_counts)
        owner_counts = exchange_sizes(rail.counts, self.device, pg.replica)
        owner = OwnerRequests(
            owner_counts, exchange_columns(slots, rail.counts, owner_counts, ones, pg.replica)
        )
        rows = [self.shards[(t, Tier.COLD)].weights.index_select(0, owner.slots[t]) for t in range(n_t)]
        fetched = exchange_vectors(rows, owner.counts, rail.counts, self.dims, self.wire_dtype, pg.replica)
        back = []
        for t in range(n_t):
            distinct = torch.empty(rail.distinct(t), int(self.dims[t]), device=self.device)
            distinct.index_copy_(0, rail.order[t], fetched[t])
            back.append(distinct.index_select(0, rail.inverse[t]))
        got = exchange_vectors(back, recv_counts, batch.counts, self.dims, self.wire_dtype, pg.intra)
        for t, lk in enumerate(lookups):
            lk.rows.index_copy_(0, batch.index[t], got[t])
        backward = count_forward(self.lookup_traffic(batch, rail, owner), traffic)
        return GroupState(batch, rail, owner, backward)

    def _dedup(
        self, asked: list[torch.Tensor], recv_counts: np.ndarray
    ) -> tuple[RailFetch, list[torch.Tensor]]:
        """The distinct ids of each table the group asked of this position, sorted by their owner's rail
        index, and their slots at the owner in that order."""
        inverse, order, slots, bins = [], [], [], []
        for t, ids in enumerate(asked):
            distinct, inv = torch.unique(ids, return_inverse=True)
            _tier, owner, slot = self.routing[t].lookup(distinct)
            dest = self.rail_of_owner.index_select(0, owner)
            inverse.append(inv)
            order.append(torch.argsort(dest, stable=True))
            slots.append(slot.index_select(0, order[-1]))
            bins.append(torch.bincount(dest, minlength=self.num_rails))
        counts = np.ascontiguousarray(torch.stack(bins).cpu().numpy().T, dtype=np.int64)
        return RailFetch(recv_counts, inverse, order, counts), slots

    def backward(
        self, state: GroupState, unique_grads: list[torch.Tensor], traffic: Traffic, scale: float = 1.0
    ) -> None:
        """Gradients to the rail peers, summed there per distinct row, then to the owners' cold shards
        (times ``scale`` on the wire, :func:`~flexshard.runtime.transfer.gradient_scale`)."""
        pg, batch, rail, owner = self.pg, state.batch, state.rail, state.owner
        grads = [g.index_select(0, batch.index[t]) for t, g in enumerate(unique_grads)]
        got = exchange_vectors(
            grads, batch.counts, rail.recv_counts, self.dims, self.wire_dtype, pg.intra, scale
        )
        summed = []
        for t, g in enumerate(got):
            total = torch.zeros(rail.distinct(t), int(self.dims[t]), device=self.device)
            total.index_add_(0, rail.inverse[t], g)
            summed.append(total.index_select(0, rail.order[t]))
        arrived = exchange_vectors(
            summed, rail.counts, owner.counts, self.dims, self.wire_dtype, pg.replica, scale
        )
        for t, g in enumerate(arrived):
            if owner.slots[t].numel():
                self.shards[(t, Tier.COLD)].add_gradient(owner.slots[t], g)
        traffic += state.backward_traffic

    # --- bytes ------------------------------------------------------------------------------------

    def lookup_traffic(self, batch: GroupBatch, rail: RailFetch, owner: OwnerRequests) -> Traffic:
        """Bytes of one batch's group fetch per link class (see the module docstring)."""
        out = Traffic.zeros()
        vector_bytes = wire.vector_bytes(self.dims, FLOAT32_BYTES, self.wire_dtype)
        stages = (  # (link, lookups asked per peer, served per peer, this rank's index among the peers)
            (LinkClass.INTRA_GROUP, batch.counts, rail.recv_counts, self.me_intra),
            (LinkClass.INTER_GROUP, rail.counts, owner.counts, self.me_rail),
        )
        for link, asked, served, me in stages:
            peers = np.arange(asked.shape[0]) != me
            add_lookup_bytes(
                out, link, asked[peers].sum(axis=0), served[peers].sum(axis=0), vector_bytes, int(peers.sum())
            )
        return out
