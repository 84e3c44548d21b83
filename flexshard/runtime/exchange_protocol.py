"""The exchange protocol of a sharded lookup: the phases every caller runs in this order (the runtime's
forward and backward, a pipelined step, a TorchRec sharder), named after TorchRec's sharded-module
contract. Each collective phase is one stage of :func:`solvers.schedule.step_schedule` and returns a
:class:`~flexshard.runtime.awaitable.Pending`; every table and tier travels in the same collectives (a
*column* per table and kind, zero-size blocks for the peers a column does not reach).

``input_dist``
    :meth:`ExchangeProtocol.route` (local, :mod:`~flexshard.runtime.route`): each table's remote lookups
    sorted by destination, in four id columns: warm slots to their owner in the group, flat cold slots to
    their owner, group-fetch keys to the *rail peer* (the rank of this group at the owner's position)
    and, for owners in other groups, the same lookups' slots straight to the owner.
    :meth:`~ExchangeProtocol.input_ids` (``ids``, world all-to-all, int64;
    :mod:`~flexshard.runtime.headed_ids`): the columns, each peer's block headed by the sender's input
    error code (to every rank) and the split sizes of every column to the peers it reaches (warm and
    group ids: the group; flat: everyone; group slots: the other groups), padded to a capacity every
    rank agrees from earlier headers (``ids_overflow``, a second all-to-all, only in a batch past it).
``compute`` (local)
    :meth:`~ExchangeProtocol.compute` (:mod:`~flexshard.runtime.group_dedup`): owners list the warm and
    flat slots asked of them. For the group fetch the owner deduplicates the slots it received per
    requesting group (sorted by the group's rail peer, then slot) and the rail peer its group's keys
    (sorted by owner, then slot; no routing lookup): both know the same distinct rows in the same order
    without an exchange of sizes. Every table in one dedup per side, without a sort where the key range
    is small.
``output_dist``
    :meth:`~ExchangeProtocol.rows` (``rows``, all-to-all): warm and flat rows back to the
    requesters; each distinct group-fetch row once per group, owner to that group's rail peer (the rows
    a rail peer owns itself sent to itself: a local copy, so that it receives every distinct row in
    order).
    :meth:`~ExchangeProtocol.scatter` (``scatter``, group all-to-all): the rail peer hands every id of its
    group its row (inverse indices).
backward
    :meth:`~ExchangeProtocol.grads` (``grads``, all-to-all): warm and flat gradients to the owners,
    group-fetch gradients to the rail peer, which sums them per distinct row in float32;
    :meth:`~ExchangeProtocol.rail_grads` (``rail_grads``, rail all-to-all): the sums to the owners (its
    own to itself, as in ``rows``; on an fp16 wire added apart, scaled by their own largest).

``rows`` and ``grads`` run on the smallest process group that holds every block they carry
(:func:`solvers.schedule.lookup_scopes`: the rail, the group or the world), with the split sizes of its
members only. The replica ``sync`` phase is :mod:`~flexshard.runtime.sync`. A stage on a process group
of one rank is a local copy. With one dim for every table and an fp32 wire, the relay works in the stages' own
buffers (:mod:`~flexshard.runtime.relay`); received rows and gradients are put in place by
:mod:`~flexshard.runtime.placing`. Embeddings and gradients travel as the plan's wire dtype;
on an fp16 wire each sender scales its gradients by its own power of two and sends the exponent with them
(:func:`~flexshard.runtime.transfer.exchange_vectors`). A block a rank keeps for itself is rounded like
a sent one. Bytes: :mod:`~flexshard.runtime.exchange_bytes`.
"""

from __future__ import annotations

import numpy as np
import torch

from core.traffic import Traffic
from core.vocabulary import INDEX_BYTES, Tier, WireDtype
from flexshard.runtime.awaitable import Pending
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.exchange_bytes import ProtocolBytes
from flexshard.runtime.features import ERROR_WORDS
from flexshard.runtime.group_dedup import FLAT, GIDS, GSLOTS, ROW_COLUMNS, ROW_KINDS, WARM, Asked, GroupDedup
from flexshard.runtime.groups import ProcessGroups
from flexshard.runtime.headed_ids import HeadedIds, IdStage
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.placing import (
    add_owned_gradients,
    add_rail_views,
    add_received_sums,
    keep_own_sums,
    own_group_first,
    place_rows,
    place_scattered,
    rail_peer_sums,
)
from flexshard.runtime.relay import (
    RelayRows,
    RelaySums,
    add_sums_to_bank,
    exchange_sums,
    rail_sums,
    scatter_relayed,
    wire_order,
)
from flexshard.runtime.route import KINDS, Routed, Router
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import (
    exchange_gathered_async,
    exchange_vectors,
    rows_at,
)
from flexshard.runtime.wire_rows import (
    grads_flat,
    grads_wire,
    rail_sums_wire,
    received_rows,
    scatter_wire,
    wire_rows,
    wire_rows_in_relay,
)
from solvers.schedule import Scope, lookup_scopes

ROW_TIERS = (Tier.WARM, Tier.COLD, Tier.COLD)  # the shard each of ROW_KINDS' rows is read from


class ExchangeProtocol:
    """The lookup exchange of one rank (see the module docstring). ``group_fetch[t]``: table t's cold
    rows are fetched once per group; ``routing``: every table's routing; ``shards``: this rank's rows."""

    def __init__(
        self,
        pg: ProcessGroups,
        group_fetch: np.ndarray,
        routing: list,
        dims: list[int],
        shards: dict[tuple[int, Tier], Shard],
        device: torch.device,
        wire_dtype: WireDtype,
        uses: tuple[bool, bool, bool],
    ) -> None:
        self.pg, self.routing, self.shards, self.device = pg, routing, shards, device
        self.wire_dtype, self.dims = wire_dtype, np.asarray(dims, dtype=np.int64)
        self.group_fetch = np.asarray(group_fetch, dtype=bool)
        layout, me = pg.layout, pg.rank
        self.me, self.world = me, layout.num_ranks
        group_of, pos_of = layout.group_of_rank, layout.position_of_rank
        same = layout.same_group(me)
        # requester rank -> the rank of its group at this rank's position (where its group's rows go)
        my_pos = int(pos_of[me])
        peer_of = np.array(
            [layout.groups[k][my_pos] if my_pos < len(layout.groups[k]) else -1 for k in group_of]
        )
        # every table's cold shard a row range of one bank (one dim, an fp32 wire): rail_grads adds the
        # sums into the bank at once (relay.add_sums_to_bank)
        cold = [shards[(t, Tier.COLD)] for t in range(len(dims))]
        bank = cold[0].bank if cold else None
        one_bank = wire_dtype is WireDtype.FP32 and bank is not None and all(c.bank is bank for c in cold)
        self.cold_bank = bank if one_bank else None
        bank_start = np.array([c.bank_start for c in cold], dtype=np.int64) if one_bank else None
        self.dedup = GroupDedup(me, pos_of, peer_of, routing, self.group_fetch, device, bank_start)
        self.router = Router(layout, me, routing, self.group_fetch, self.dedup, device)
        # the order in which a by-rail table's lookups arrive sorted (Router.owner_key) and its inverse
        self.owner_key, self.key_owner = self.router.owner_key, self.router.key_owner
        warm, flat, group = uses
        # active[p, k]: column k reaches rank p (its split sizes travel in the headers of ``ids``)
        self.active = np.zeros((self.world, KINDS), dtype=bool)
        self.active[:, WARM] = same & warm
        self.active[:, FLAT] = flat
        self.active[:, GIDS] = same & group
        self.active[:, GSLOTS] = ~same & group
        self.intra = np.asarray(pg.intra_ranks, dtype=np.int64)
        self.rail = np.asarray(pg.replica_ranks, dtype=np.int64)
        self.intra_me = int(np.flatnonzero(self.intra == me)[0])  # this rank's place in its group
        self.rail_me = int(np.flatnonzero(self.rail == me)[0])  # and in its rail
        scopes = lookup_scopes(
            warm,
            flat,
            group,
            layout.num_groups,
            int(layout.group_sizes.max()),
            layout.uniform_group_size is not None,
        )
        members = {
            Scope.WORLD: (np.arange(self.world), None),
            Scope.GROUP: (self.intra, pg.intra),
            Scope.RAIL: (self.rail, pg.replica),
        }
        # (ranks in group order, process group) of ``rows`` and of ``grads``
        self.rows_scope, self.grads_scope = (members[s] for s in scopes)
        self.bytes = ProtocolBytes(layout, me, self.dims, wire_dtype, self.active)
        # ``ids``' headers: to every peer the error code and the split sizes of the columns that reach it
        self.id_stage = IdStage(self._header_mask(len(self.dims)), same, device)
        # one dim and an fp32 wire: rows gathered into the send buffer, the relay from its receive buffer
        self.one_dim_fp32 = wire_dtype is WireDtype.FP32 and np.unique(self.dims).size == 1
        # ``grads`` on the group: a requester's gradients in wire order can be sent as they lie
        self._grads_in_group = np.array_equal(self.grads_scope[0], self.intra) and self.intra.size > 1
        self.flat_wire = self.one_dim_fp32 and not (warm or self.group_fetch.any()) and self.world > 1
        # a requester that relays its own rows reads them where ``rows`` left them (the CPU's choice;
        # wire_rows.wire_rows_in_relay); a switch, so that tests can compare it with the gathered block
        self.own_rows_in_relay = True

    # --- input_dist ----------------------------------------------------------------------------------

    def route(self, lookups: list[TableLookup]) -> Routed:
        """Every remote lookup in its column, sorted by destination rank (:meth:`Router.route
        <flexshard.runtime.route.Router.route>`). No collective."""
        return self.router.route(lookups)

    def input_ids(self, err: torch.Tensor, routed: Routed | None, group=None) -> HeadedIds:
        """``ids``: every rank's error code ``err``, the split sizes of the active columns and the id
        columns of ``routed`` (None: this rank's batch failed its checks and asks for nothing), on
        ``group`` (a process group of every rank in rank order; None: the default group), in one
        all-to-all (:mod:`~flexshard.runtime.headed_ids`; a second one only when some block is past the
        agreed capacity). :meth:`HeadedIds.wait <flexshard.runtime.headed_ids.HeadedIds.wait>` gives the
        received counts ``[peer, table * KINDS + kind]``, every rank's code and the columns."""
        n_t = len(self.dims)
        if routed is None:
            counts, columns = np.zeros((self.world, n_t * KINDS), np.int64), None
        else:
            counts = routed.counts.reshape(self.world, -1)
            columns = [routed.send[t][k] for t in range(n_t) for k in range(KINDS)]
        return self.id_stage.issue(err, counts, columns, group)

    def unpriced_bytes_sent(self) -> np.ndarray:
        """float64[link classes]: bytes the last batch's ``ids`` sent the other ranks that the byte
        counts (:mod:`~flexshard.runtime.exchange_bytes`) leave out: the error codes, the words every
        peer gets and the padding (:mod:`~flexshard.runtime.headed_ids`)."""
        return self.bytes.per_link(self.id_stage.unpriced_words * INDEX_BYTES)

    def _header_mask(self, n_t: int) -> np.ndarray:
        """bool[world, ERROR_WORDS + n_t * KINDS]: per peer the header words of ``ids`` sent to it (the
        error code, then the split sizes ``[t, k]`` of the columns that reach it; the same words come
        back from it)."""
        columns = np.broadcast_to(self.active[:, None, :], (self.world, n_t, KINDS))
        return np.concatenate(
            [np.ones((self.world, ERROR_WORDS), dtype=bool), columns.reshape(self.world, -1)], axis=1
        )

    # --- compute ---------------------------------------------------------------------------------------

    def compute(self, received: list[list[torch.Tensor]], recv_counts: np.ndarray) -> Asked:
        """The owners' and rail peers' local work: dedup of the group fetch on both sides
        (:class:`~flexshard.runtime.group_dedup.GroupDedup`); for the relay, the distinct numbers of the
        received group ids in wire order. No collective."""
        asked = self.dedup.compute(received, recv_counts)
        if self.one_dim_fp32 and asked.joined_inverse is not None:
            wire = wire_order(recv_counts[:, :, GIDS], self.intra, self.device)
            asked.wire_inverse = asked.joined_inverse.index_select(0, wire)
        return asked

    # --- output_dist -----------------------------------------------------------------------------------

    def rows(self, routed: Routed, asked: Asked, traffic: Traffic) -> Pending[list[torch.Tensor]]:
        """``rows``: warm and flat rows to the requesters (written into their lookups on wait), the group's
        distinct rows to its rail peer. Waits to the rail peer's distinct rows per table, in order (its own
        sent to itself, rounded like the wire). Adds the ids and forward bytes to ``traffic``."""
        n_t = len(routed.lookups)
        cols, send_counts, recv_counts = [], [], []
        for t in range(n_t):
            if not self.one_dim_fp32:
                for tier, slots in zip(ROW_TIERS, (*asked.slots[t], asked.owner_slots[t]), strict=True):
                    cols.append(rows_at(self.shards[(t, tier)].weights, slots))
            send_counts.append(
                np.stack(
                    [asked.recv_counts[:, t, WARM], asked.recv_counts[:, t, FLAT], asked.owner_counts[:, t]],
                    1,
                )
            )
            recv_counts.append(
                np.stack([routed.counts[:, t, WARM], routed.counts[:, t, FLAT], asked.fetch_counts[:, t]], 1)
            )
        members, group = self.rows_scope
        sc, rc = np.concatenate(send_counts, 1)[members], np.concatenate(recv_counts, 1)[members]
        if self.one_dim_fp32:  # gathered straight into the send buffer; the distinct rows left in place
            sources = [self.shards[(t, tier)].weights for t in range(n_t) for tier in ROW_TIERS]
            indices = [ix for t in range(n_t) for ix in (*asked.slots[t], asked.owner_slots[t])]
            dim, me = (int(self.dims[0]) if n_t else 1), self.me
            lead = self._scatter_lead(routed, asked, rc, dim)  # scatter's rows before the distinct ones
            into = None if lead is None else lead[lead.shape[0] - int(rc.sum()) :].view(-1)
            gathered = exchange_gathered_async(
                "rows", sources, indices, sc, rc, group, with_buffer=True, into=into
            )
            self.bytes.forward(routed.counts, asked, traffic)

            joint = self.flat_wire and n_t > 0 and all(lk.by_owner for lk in routed.lookups)

            def finish() -> RelayRows:  # joint: the rows stay in the buffer
                relay = received_rows(routed, gathered.wait(), rc, dim, joint, me)
                relay.lead = lead
                return relay

            return Pending([gathered], finish)
        widths = np.repeat(self.dims, len(ROW_KINDS))
        pending = exchange_vectors("rows", cols, sc, rc, widths, self.wire_dtype, group)
        self.bytes.forward(routed.counts, asked, traffic)

        def finish() -> list[torch.Tensor]:
            got = pending.wait()
            place_rows(routed.lookups, routed.index, routed.in_order, got)
            # per table every distinct row in order (its own sent to itself; empty for a flat table)
            return [got[ROW_COLUMNS * t + GIDS] for t in range(n_t)]

        return Pending([pending], finish)

    def _joint_relay(self, routed: Routed) -> bool:
        """Whether ``scatter`` delivers this batch's rows into one
        :class:`~flexshard.runtime.wire_rows.WireRows` (every table by rail, ``grads`` in the group)."""
        return self._grads_in_group and bool(routed.lookups) and all(lk.by_rail for lk in routed.lookups)

    def _scatter_lead(self, routed: Routed, asked: Asked, rc: np.ndarray, dim: int) -> torch.Tensor | None:
        """Where this rank reads its own group-fetched rows where ``rows`` leaves them
        (:func:`~flexshard.runtime.wire_rows.wire_rows_in_relay`: on the CPU, every table by rail, ``rows`` on
        the rail): one float32 allocation of ``scatter``'s rows from the other group peers, then ``rows``'
        receive buffer (``rc.sum()`` rows); else None."""
        if not (
            self.own_rows_in_relay
            and not gpu_paths(self.device)
            and asked.wire_inverse is not None
            and self._joint_relay(routed)
            and np.array_equal(self.rows_scope[0], self.rail)
        ):
            return None
        from_peers = routed.counts[self.intra][:, :, GIDS]
        head = int(from_peers.sum() - from_peers[self.intra_me].sum())
        return torch.empty(head + int(rc.sum()), dim, device=self.device)

    def scatter(self, routed: Routed, asked: Asked, distinct: list[torch.Tensor]) -> Pending[None]:
        """``scatter``: the rail peer gives every id of its group its row (group all-to-all); on wait the
        rows are in the requesters' lookups."""
        n_t = len(routed.lookups)
        sc = asked.recv_counts[self.intra][:, :, GIDS]
        rc = routed.counts[self.intra][:, :, GIDS]

        def place(per_table: list[list[torch.Tensor]]) -> None:
            place_scattered(routed.lookups, routed.index, routed.in_order, per_table)

        if isinstance(distinct, RelayRows):  # gathered from rows' buffer in wire order
            me, buffer = self.intra_me, distinct.buffer
            index = distinct.row_of.index_select(0, asked.wire_inverse)
            if self._joint_relay(routed):
                inverse = [lk.inverse for lk in routed.lookups]  # one buffer for every table (_grads_joint)
                sent = sc.sum(axis=1)
                if distinct.lead is not None:  # its own rows read where rows left them
                    own = index[int(sent[:me].sum()) : int(sent[: me + 1].sum())]
                    routed.joint = wire_rows_in_relay(inverse, rc, me, distinct, own)
                else:
                    routed.joint = wire_rows(inverse, rc, me, int(buffer.shape[1]), self.device)
                return scatter_wire(buffer, index, sent, me, routed.joint, self.pg.intra)
            at = (routed.lookups, routed.index, routed.in_order)
            return scatter_relayed(*at, buffer, index, sc, rc, me, self.pg.intra)
        if self.wire_dtype is WireDtype.FP32:  # rows gathered into the send buffer, copied out per peer
            gathered = exchange_gathered_async("scatter", distinct, asked.inverse, sc, rc, self.pg.intra)
            return Pending([gathered], lambda: place(gathered.wait()))
        cols = [distinct[t].index_select(0, asked.inverse[t]) for t in range(n_t)]
        pending = exchange_vectors("scatter", cols, sc, rc, self.dims, self.wire_dtype, self.pg.intra)
        return Pending([pending], lambda: place([[got] for got in pending.wait()]))

    # --- backward --------------------------------------------------------------------------------------

    def grads(
        self, routed: Routed, asked: Asked, unique_grads: list[torch.Tensor]
    ) -> Pending[list[torch.Tensor]]:
        """``grads``: warm and flat gradients to the owners (added into their shards on wait), group-fetch
        gradients to the rail peer. Waits to the rail peer's per-distinct-row sums (float32) per table.
        With :attr:`Routed.joint`, ``unique_grads`` is its
        :meth:`~flexshard.runtime.wire_rows.WireRows.gradient`."""
        if routed.joint is not None:
            return self._grads_joint(routed, asked, unique_grads)
        n_t = len(unique_grads)
        members, group = self.grads_scope
        sc = routed.counts[members][:, :, list(ROW_KINDS)].reshape(members.size, -1)
        rc = asked.recv_counts[members][:, :, list(ROW_KINDS)].reshape(members.size, -1)
        order = routed.in_order
        indices = [None if (t, k) in order else routed.index[t][k] for t in range(n_t) for k in ROW_KINDS]
        columns = int(np.count_nonzero(sc.any(axis=0) | rc.any(axis=0)))
        if self.wire_dtype is WireDtype.FP32 and (
            columns > 1 or any(i is not None and i.numel() for i in indices)
        ):
            # every column gathered straight into the send buffer and received as per-peer views (the
            # all_to_all of one column in order takes no copy either way)
            sources = [unique_grads[t] for t in range(n_t) for _k in ROW_KINDS]
            pending = exchange_gathered_async(
                "grads", sources, indices, sc, rc, group, joined_in=range(len(sc))
            )
        else:
            cols = [
                unique_grads[t] if i is None else rows_at(unique_grads[t], i)
                for t, i in zip(np.repeat(np.arange(n_t), len(ROW_KINDS)), indices, strict=True)
            ]
            widths = np.repeat(self.dims, len(ROW_KINDS))
            pending = exchange_vectors("grads", cols, sc, rc, widths, self.wire_dtype, group, scaled=True)

        def finish() -> list[torch.Tensor] | RelaySums:
            got = pending.wait()
            add_owned_gradients(self.shards, asked, got)
            if self.one_dim_fp32 and asked.joined_inverse is not None:  # summed in rail_grads' send order
                ids = asked.recv_counts[:, :, GIDS].sum(axis=0)
                rows = [got[ROW_COLUMNS * t + GIDS] for t in range(n_t)]
                fetch, dim = asked.fetch_counts[self.rail], int(self.dims[0])
                return rail_sums(fetch, asked.joined_inverse, ids, rows, dim, self.rail_me, self.device)
            return rail_peer_sums(asked, got, self.dims, self.device)

        return Pending([pending], finish)

    def _grads_joint(self, routed: Routed, asked: Asked, gradient: torch.Tensor) -> Pending[RelaySums | None]:
        """``grads`` of a :attr:`Routed.joint` lookup: every table group fetched (no warm or flat gradients):
        :func:`~flexshard.runtime.wire_rows.grads_wire`, then the rail peer's adds; or every table flat."""
        if self.flat_wire:  # every table flat: wire_rows.grads_flat, then the owners' adds
            recv, scope = asked.recv_counts[:, :, FLAT], self.grads_scope[1]
            got = grads_flat(routed.joint, gradient, recv, self.me, scope)
            return Pending([got], lambda: add_owned_gradients(self.shards, asked, got.wait()))
        recv, me = asked.recv_counts[self.intra][:, :, GIDS].sum(axis=1), self.intra_me
        pending = grads_wire(routed.joint, gradient, recv, me, self.pg.intra)
        fetch, wire, rail, dev = asked.fetch_counts[self.rail], asked.wire_inverse, self.rail_me, self.device
        summed = routed.joint.own_in_relay  # its own terms already summed per distinct row
        return Pending(
            [pending], lambda: rail_sums_wire(fetch, wire, recv, me, rail, *pending.wait(), dev, summed)
        )

    def rail_grads(self, asked: Asked, sums: list[torch.Tensor] | RelaySums) -> Pending[None]:
        """``rail_grads``: the rail peer's sums to the owners (rail all-to-all; its own rows' sums to
        itself, a local copy); on wait every owner has added its gradients, its own group's first, then
        the other groups' in rail order (each row's gradient summed in the same order whichever rank owns
        it). On an fp16 wire, whose gradients are scaled by the sender's largest, the own rows' sums are
        added apart, scaled by their own largest, as sent to no one."""
        sc, rc = asked.fetch_counts[self.rail], asked.owner_counts[self.rail]
        cols, slots, own = sums, asked.owner_slots, asked.own
        peers = own_group_first(self.rail.size, self.rail_me)
        gathered = None  # fp32: received as per-peer views, each added as it lies
        if isinstance(sums, RelaySums) and asked.owner_rows is not None:  # into the one bank at once
            return add_sums_to_bank("rail_grads", sums, rc, asked.owner_rows, self.cold_bank, self.pg.replica)
        if isinstance(sums, RelaySums):  # the relay's joined sums are the send buffer
            gathered = exchange_sums("rail_grads", sums, rc, self.pg.replica, peers)
        elif self.wire_dtype is WireDtype.FP32:
            gathered = exchange_gathered_async(
                "rail_grads", sums, [None] * len(sums), sc, rc, self.pg.replica, joined_in=peers
            )
        if gathered is not None:
            return Pending([gathered], lambda: add_rail_views(self.shards, slots, rc, peers, gathered.wait()))
        if self.wire_dtype is WireDtype.FP16:
            own = np.zeros_like(own)  # none received
            mine = self.rail == self.me
            sc, rc = np.where(mine[:, None], 0, sc), np.where(mine[:, None], 0, rc)
            cols, slots = keep_own_sums(self.shards, asked, sums, self.wire_dtype)
        pending = exchange_vectors(
            "rail_grads", cols, sc, rc, self.dims, self.wire_dtype, self.pg.replica, scaled=True
        )

        return Pending([pending], lambda: add_received_sums(self.shards, own, slots, pending.wait()))
