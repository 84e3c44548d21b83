"""The flat lookup exchange (:attr:`core.vocabulary.FetchMode.FLAT`): every rank sends its own remote
lookups of all tables to their owners in one all-to-all on the global group.

One forward pass:

1. :meth:`FlatExchange.prepare` (local): optionally deduplicate each table's ids, read hot rows from
   the local replica, sort the remote (warm and cold) lookups by (owner rank, tier);
2. :meth:`FlatExchange.exchange_meta`: one ``all_to_all_single`` carrying every rank's error code (to
   every rank, as an all-gather would) and its split sizes (one int64 per table per tier exchange, to the
   ranks of that exchange: the group for warm, everyone for cold);
3. :meth:`FlatExchange.forward`: the slots of every lookup to their owner, then the embeddings back
   (two ``all_to_all_single``; a warm block goes only to ranks of this group).

:meth:`FlatExchange.backward` sends the gradients back along the same routes and sums them per row at
the owner. Bytes are counted with :mod:`solvers.wire`'s formulas from the realised counts: ids and
forward at the forward pass, backward when the gradients travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from core.ranks import RankLayout
from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, Component, LinkClass, Tier
from flexshard.runtime.features import ERROR_WORDS, Features
from flexshard.runtime.shards import Shard
from solvers import wire


@dataclass
class TableLookup:
    """One table's part of this rank's forward pass."""

    inverse: torch.Tensor | None  # position of each input id among the unique ids (None without dedup)
    num_unique: int
    hot_index: torch.Tensor  # positions (among the unique ids) of hot rows
    hot_slot: torch.Tensor  # their slots in the local hot replica
    remote_index: torch.Tensor  # positions of remote lookups, sorted by (owner rank, tier)
    remote_slot: torch.Tensor  # their slots at the owner, same order
    rows: torch.Tensor  # float32[num_unique, dim]: the unique ids' embeddings, filled by the exchange


@dataclass
class PreparedBatch:
    """The local part of a forward pass: per table its lookups, and the requests to every rank."""

    tables: list[TableLookup]
    counts: np.ndarray  # int64[world, tables, exchanges]: lookups of each table sent to each rank


@dataclass
class ExchangeState:
    """What the backward pass needs of a forward exchange."""

    counts: np.ndarray  # int64[world, tables, exchanges] sent to each owner
    recv_counts: np.ndarray  # int64[world, tables, exchanges] received from each requester
    remote_index: list[torch.Tensor]  # per table, as in TableLookup
    owner_slots: dict[tuple[int, int], torch.Tensor]  # (table, exchange) -> slots asked, requester order
    owner_floats: np.ndarray  # int64[world]: floats sent to each requester
    requester_floats: np.ndarray  # int64[world]: floats received from each owner
    backward_traffic: Traffic = field(default_factory=Traffic.zeros)


class FlatExchange:
    """The lookups of one rank, exchanged with their owners in one all-to-all per phase.

    ``tiers``: the remote tiers in use, in exchange order (warm, then cold); ``shards``: this rank's rows
    per (table, tier); ``warm_rank``: the global rank of each position of this rank's group.
    """

    def __init__(
        self,
        layout: RankLayout,
        rank: int,
        tiers: list[Tier],
        dims: list[int],
        shards: dict[tuple[int, Tier], Shard],
        device: torch.device,
    ) -> None:
        self.layout, self.rank, self.tiers, self.shards, self.device = layout, rank, tiers, shards, device
        self.dims = np.asarray(dims, dtype=np.int64)
        world = layout.num_ranks
        self.warm_rank = torch.as_tensor(layout.group_of(rank), dtype=torch.int64, device=device)
        in_group = layout.group_of_rank == layout.group_of_rank[rank]
        # active[p, k]: rank p takes part in exchange k (warm: this group only; cold: everyone)
        self.active = np.stack(
            [in_group if tier is Tier.WARM else np.ones(world, dtype=bool) for tier in tiers], axis=1
        ).reshape(world, len(tiers))
        self.link_of_peer = layout.link_class(rank, np.arange(world))

    # --- local part ------------------------------------------------------------------------------

    def prepare(self, parsed: Features, routing: list, dedup: bool) -> PreparedBatch:
        """Dedup, hot rows from the local replica, and every remote lookup sorted by (owner, tier).
        No collective."""
        n_k, world = len(self.tiers), self.layout.num_ranks
        tables, counts = [], []
        for t, (values, _lengths) in enumerate(parsed):
            if dedup:
                uniq, inverse = torch.unique(values, return_inverse=True)
            else:
                uniq, inverse = values, None
            tier, owner, slot = routing[t].lookup(uniq)
            rows = torch.empty(uniq.numel(), int(self.dims[t]), device=self.device)
            hot_index = torch.nonzero(tier == Tier.HOT).flatten()
            hot_slot = slot.index_select(0, hot_index)
            rows.index_copy_(0, hot_index, self.shards[(t, Tier.HOT)].weights.index_select(0, hot_slot))
            remote_index = remote_slot = torch.zeros(0, dtype=torch.int64, device=self.device)
            if n_k:
                idx_parts, key_parts, slot_parts = [], [], []
                for k, tr in enumerate(self.tiers):
                    sel = torch.nonzero(tier == tr).flatten()
                    dest = owner.index_select(0, sel)
                    if tr is Tier.WARM:
                        dest = self.warm_rank.index_select(0, dest)
                    idx_parts.append(sel)
                    key_parts.append(dest * n_k + k)
                    slot_parts.append(slot.index_select(0, sel))
                key = torch.cat(key_parts)
                order = torch.argsort(key, stable=True)
                remote_index = torch.cat(idx_parts).index_select(0, order)
                remote_slot = torch.cat(slot_parts).index_select(0, order)
                counts.append(torch.bincount(key, minlength=world * n_k))
            tables.append(
                TableLookup(inverse, uniq.numel(), hot_index, hot_slot, remote_index, remote_slot, rows)
            )
        if n_k:
            stacked = torch.stack(counts).cpu().numpy().reshape(len(parsed), world, n_k).transpose(1, 0, 2)
            return PreparedBatch(tables, np.ascontiguousarray(stacked, dtype=np.int64))
        return PreparedBatch(tables, np.zeros((world, len(parsed), 0), np.int64))

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

    def forward(self, prep: PreparedBatch, recv_counts: np.ndarray, traffic: Traffic) -> ExchangeState:
        """Slots to the owners, embeddings back into each table's ``rows``; adds the ids and forward
        bytes to ``traffic`` and keeps the backward bytes for :meth:`backward`."""
        c, rc = prep.counts, recv_counts
        world, n_t, n_k = c.shape
        dims, tiers = self.dims, self.tiers
        slot_blocks = [
            tb.remote_slot.split(c[:, t, :].reshape(-1).tolist()) for t, tb in enumerate(prep.tables)
        ]
        send_slots = torch.cat(
            [slot_blocks[t][p * n_k + k] for p in range(world) for t in range(n_t) for k in range(n_k)]
        )
        recv_slots = torch.empty(int(rc.sum()), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(
            recv_slots, send_slots, rc.sum(axis=(1, 2)).tolist(), c.sum(axis=(1, 2)).tolist()
        )
        # owner side: per (table, exchange) the slots asked by every rank, in rank order
        blocks = recv_slots.split(rc.reshape(-1).tolist())
        owner_slots, row_blocks = {}, {}
        for t in range(n_t):
            for k in range(n_k):
                sl = torch.cat([blocks[(p * n_t + t) * n_k + k] for p in range(world)])
                owner_slots[(t, k)] = sl
                rows = self.shards[(t, tiers[k])].weights.index_select(0, sl)
                row_blocks[(t, k)] = rows.split(rc[:, t, k].tolist())
        send_f = torch.cat(
            [row_blocks[(t, k)][p].reshape(-1) for p in range(world) for t in range(n_t) for k in range(n_k)]
        )
        owner_floats = (rc * dims[None, :, None]).sum(axis=(1, 2))
        requester_floats = (c * dims[None, :, None]).sum(axis=(1, 2))
        recv_f = torch.empty(int(requester_floats.sum()), device=self.device)
        dist.all_to_all_single(recv_f, send_f, requester_floats.tolist(), owner_floats.tolist())
        fblocks = recv_f.split((c * dims[None, :, None]).reshape(-1).tolist())
        for t, tb in enumerate(prep.tables):
            rows = torch.cat(
                [
                    fblocks[(p * n_t + t) * n_k + k].view(-1, int(dims[t]))
                    for p in range(world)
                    for k in range(n_k)
                ]
            )
            tb.rows.index_copy_(0, tb.remote_index, rows)
        batch_traffic = self.lookup_traffic(c, rc)
        for component in (Component.IDS, Component.FORWARD):
            traffic.bytes[:, component, :] += batch_traffic.bytes[:, component, :]
        backward = Traffic.zeros()
        backward.bytes[:, Component.BACKWARD, :] = batch_traffic.bytes[:, Component.BACKWARD, :]
        return ExchangeState(
            c,
            rc,
            [tb.remote_index for tb in prep.tables],
            owner_slots,
            owner_floats,
            requester_floats,
            backward,
        )

    def backward(self, state: ExchangeState, unique_grads: list[torch.Tensor], traffic: Traffic) -> None:
        """Send the gradients of the remote lookups to their owners; add them into the owners' shards."""
        c, rc = state.counts, state.recv_counts
        world, n_t, n_k = c.shape
        dims, tiers = self.dims, self.tiers
        gblocks = [
            unique_grads[t].index_select(0, state.remote_index[t]).split(c[:, t, :].reshape(-1).tolist())
            for t in range(n_t)
        ]
        send_f = torch.cat(
            [
                gblocks[t][p * n_k + k].reshape(-1)
                for p in range(world)
                for t in range(n_t)
                for k in range(n_k)
            ]
        )
        recv_f = torch.empty(int(state.owner_floats.sum()), device=self.device)
        dist.all_to_all_single(recv_f, send_f, state.owner_floats.tolist(), state.requester_floats.tolist())
        got = recv_f.split((rc * dims[None, :, None]).reshape(-1).tolist())
        for t in range(n_t):
            for k in range(n_k):
                slots = state.owner_slots[(t, k)]
                if slots.numel():
                    g = torch.cat([got[(p * n_t + t) * n_k + k].view(-1, int(dims[t])) for p in range(world)])
                    self.shards[(t, tiers[k])].add_gradient(slots, g)
        traffic += state.backward_traffic

    # --- bytes ------------------------------------------------------------------------------------

    def lookup_traffic(self, counts: np.ndarray, recv_counts: np.ndarray) -> Traffic:
        """Bytes of one batch's remote lookups per link class (:func:`solvers.wire.lookup_messages` of
        the lookups sent to and served for each peer, plus the split sizes; this rank itself excluded, and
        each exchange counted only with the ranks it reaches)."""
        out = Traffic.zeros()
        n_t = counts.shape[1]
        vector_bytes = self.dims * FLOAT32_BYTES
        others = np.arange(self.layout.num_ranks) != self.rank
        for k in range(len(self.tiers)):
            for link in LinkClass:
                peers = others & self.active[:, k] & (self.link_of_peer == link)
                asked = counts[peers, :, k].sum(axis=0)  # per table
                served = recv_counts[peers, :, k].sum(axis=0)
                for (component, direction), nbytes in wire.lookup_messages(
                    asked, served, vector_bytes
                ).items():
                    out.bytes[link, component, direction] += float(np.sum(nbytes))
                split = wire.split_bytes(int(peers.sum()), n_t)
                out.add(link, Component.IDS, split, split)
        return out
