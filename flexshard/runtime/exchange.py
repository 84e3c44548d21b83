"""The flat lookup exchange (:attr:`core.vocabulary.FetchMode.FLAT`): every rank sends its own remote
lookups of all tables to their owners in one all-to-all on the global group.

One forward pass:

1. :meth:`FlatExchange.prepare` (local): sort each table's remote lookups (warm, and cold ones of tables
   fetched flat) by owner rank, per tier exchange;
2. :meth:`FlatExchange.exchange_meta`: one ``all_to_all_single`` carrying every rank's error code (to
   every rank, as an all-gather would) and its split sizes (one int64 per table per tier exchange, to the
   ranks of that exchange: the group for warm, everyone for cold);
3. :meth:`FlatExchange.forward`: the slots of every lookup to their owner, then the embeddings back
   (two ``all_to_all_single``; a warm block goes only to ranks of this group).

:meth:`FlatExchange.backward` sends the gradients back along the same routes and sums them per row at
the owner. Embeddings and gradients travel as ``wire_dtype``
(:func:`~flexshard.runtime.transfer.exchange_vectors`). Bytes are counted with :mod:`solvers.wire`'s
formulas from the realised counts: ids and forward at the forward pass, backward when the gradients
travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, LinkClass, Tier, WireDtype
from flexshard.runtime.features import ERROR_WORDS
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import add_lookup_bytes, count_forward, exchange_columns, exchange_vectors
from solvers import wire


@dataclass
class FlatBatch:
    """This rank's flat lookups. A *column* is one table in one tier exchange (``c = t * exchanges + k``);
    its lookups are sorted by owner rank."""

    index: list[torch.Tensor]  # per column: positions among the table's unique ids
    slots: list[torch.Tensor]  # per column: their slots at the owner, same order
    counts: np.ndarray  # int64[world, tables, exchanges]: lookups of each table sent to each rank


@dataclass
class FlatState:
    """What the backward pass needs of a forward exchange."""

    batch: FlatBatch
    recv_counts: np.ndarray  # int64[world, tables, exchanges] received from each requester
    owner_slots: list[torch.Tensor]  # per column: slots asked of this rank, requester order
    backward_traffic: Traffic = field(default_factory=Traffic.zeros)


class FlatExchange:
    """The flat lookups of one rank, exchanged with their owners in one all-to-all per phase.

    ``tiers``: the remote tiers in use, in exchange order (warm, then cold); ``takes[t, k]``: table t's
    lookups of tier ``tiers[k]`` go through this exchange (a table whose cold rows are fetched per group
    takes no part in the cold one, but still sends its zero split sizes); ``shards``: this rank's rows
    per (table, tier); ``wire_dtype``: the element type of embeddings and gradients on the wire.
    """

    def __init__(
        self,
        layout: RankLayout,
        rank: int,
        tiers: list[Tier],
        takes: np.ndarray,
        dims: list[int],
        shards: dict[tuple[int, Tier], Shard],
        device: torch.device,
        wire_dtype: WireDtype = WireDtype.FP32,
    ) -> None:
        self.layout, self.rank, self.tiers, self.shards, self.device = layout, rank, tiers, shards, device
        self.wire_dtype = wire_dtype
        self.takes = np.asarray(takes, dtype=bool).reshape(len(dims), len(tiers))
        self.dims = np.asarray(dims, dtype=np.int64)
        world = layout.num_ranks
        self.warm_rank = torch.as_tensor(layout.group_of(rank), dtype=torch.int64, device=device)
        in_group = layout.group_of_rank == layout.group_of_rank[rank]
        # active[p, k]: rank p takes part in exchange k (warm: this group only; cold: everyone)
        self.active = np.ones((world, len(tiers)), dtype=bool)
        self.active[:, [tier is Tier.WARM for tier in tiers]] = in_group[:, None]
        self.link_of_peer = layout.link_class(rank, np.arange(world))

    # --- local part ------------------------------------------------------------------------------

    def prepare(self, lookups: list[TableLookup]) -> FlatBatch:
        """Every remote lookup of the exchanges, per column sorted by owner rank. No collective."""
        n_k, world = len(self.tiers), self.layout.num_ranks
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        index, slots, bins = [], [], []
        for t, lk in enumerate(lookups):
            for k, tier in enumerate(self.tiers):
                sel = lk.positions(tier) if self.takes[t, k] else none
                dest = lk.owner.index_select(0, sel)
                if tier is Tier.WARM:
                    dest = self.warm_rank.index_select(0, dest)
                order = torch.argsort(dest, stable=True)
                index.append(sel.index_select(0, order))
                slots.append(lk.slot.index_select(0, index[-1]))
                bins.append(torch.bincount(dest, minlength=world))
        if not bins:
            return FlatBatch(index, slots, self.empty_counts(len(lookups)))
        counts = torch.stack(bins).cpu().numpy().reshape(len(lookups), n_k, world).transpose(2, 0, 1)
        return FlatBatch(index, slots, np.ascontiguousarray(counts, dtype=np.int64))

    def empty_counts(self, num_tables: int) -> np.ndarray:
        """The split sizes of a rank whose batch failed its checks (it asks for nothing)."""
        return np.zeros((self.layout.num_ranks, num_tables, len(self.tiers)), np.int64)

    # --- collectives -----------------------------------------------------------------------------

    def exchange_meta(self, err: torch.Tensor, counts: np.ndarray) -> tuple[np.ndarray, list[torch.Tensor]]:
        """One all-to-all on the global group with every rank's error code and split sizes. Returns the
        received counts ``[p, t, k]`` and every rank's error code."""
        world, n_t, _n_k = counts.shape
        active = self.active
        err_np = err.cpu().numpy().astype(np.int64)
        sizes = [ERROR_WORDS + n_t * int(active[p].sum()) for p in range(world)]
        send = np.concatenate(
            [np.concatenate([err_np, counts[p][:, active[p]].reshape(-1)]) for p in range(world)]
        )
        recv_t = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(recv_t, torch.from_numpy(send).to(self.device), sizes, sizes)
        recv = recv_t.cpu().numpy()
        recv_counts = np.zeros_like(counts)
        codes, off = [], 0
        for p in range(world):
            codes.append(torch.from_numpy(recv[off : off + ERROR_WORDS].copy()))
            m = sizes[p] - ERROR_WORDS
            recv_counts[p][:, active[p]] = recv[off + ERROR_WORDS : off + ERROR_WORDS + m].reshape(n_t, -1)
            off += sizes[p]
        return recv_counts, codes

    def forward(
        self, batch: FlatBatch, recv_counts: np.ndarray, lookups: list[TableLookup], traffic: Traffic
    ) -> FlatState:
        """Slots to the owners, embeddings back into each table's ``rows``; adds the ids and forward
        bytes to ``traffic`` and keeps the backward bytes for :meth:`backward`."""
        world = self.layout.num_ranks
        c, rc = batch.counts.reshape(world, -1), recv_counts.reshape(world, -1)
        owner_slots = exchange_columns(batch.slots, c, rc, np.ones(c.shape[1], np.int64))
        rows = [
            self.shards[(t, tier)].weights.index_select(0, owner_slots[col])
            for col, (t, tier) in enumerate(self._columns())
        ]
        got = exchange_vectors(rows, rc, c, self._widths(), self.wire_dtype)
        for col, (t, _tier) in enumerate(self._columns()):
            lookups[t].rows.index_copy_(0, batch.index[col], got[col])
        backward = count_forward(self.lookup_traffic(batch.counts, recv_counts), traffic)
        return FlatState(batch, recv_counts, owner_slots, backward)

    def backward(
        self, state: FlatState, unique_grads: list[torch.Tensor], traffic: Traffic, scale: float = 1.0
    ) -> None:
        """Send the gradients of the remote lookups to their owners (times ``scale`` on the wire,
        :func:`~flexshard.runtime.transfer.gradient_scale`); add them into the owners' shards."""
        world = self.layout.num_ranks
        c, rc = state.batch.counts.reshape(world, -1), state.recv_counts.reshape(world, -1)
        grads = [
            unique_grads[t].index_select(0, state.batch.index[col])
            for col, (t, _tier) in enumerate(self._columns())
        ]
        got = exchange_vectors(grads, c, rc, self._widths(), self.wire_dtype, scale=scale)
        for col, (t, tier) in enumerate(self._columns()):
            if state.owner_slots[col].numel():
                self.shards[(t, tier)].add_gradient(state.owner_slots[col], got[col])
        traffic += state.backward_traffic

    def _columns(self) -> list[tuple[int, Tier]]:
        """(table, tier) of each column."""
        return [(t, tier) for t in range(self.dims.size) for tier in self.tiers]

    def _widths(self) -> np.ndarray:
        """Floats per row of each column's vectors."""
        return np.repeat(self.dims, len(self.tiers))

    # --- bytes ------------------------------------------------------------------------------------

    def lookup_traffic(self, counts: np.ndarray, recv_counts: np.ndarray) -> Traffic:
        """Bytes of one batch's remote lookups per link class (:func:`solvers.wire.lookup_messages` of
        the lookups sent to and served for each peer, plus the split sizes; this rank itself excluded, and
        each exchange counted only with the ranks it reaches)."""
        out = Traffic.zeros()
        vector_bytes = wire.vector_bytes(self.dims, FLOAT32_BYTES, self.wire_dtype)
        others = np.arange(self.layout.num_ranks) != self.rank
        for k in range(len(self.tiers)):
            for link in LinkClass:
                peers = others & self.active[:, k] & (self.link_of_peer == link)
                asked = counts[peers, :, k].sum(axis=0)  # per table
                served = recv_counts[peers, :, k].sum(axis=0)
                add_lookup_bytes(out, link, asked, served, vector_bytes, int(peers.sum()))
        return out
