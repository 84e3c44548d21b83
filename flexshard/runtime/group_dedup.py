"""The ``compute`` phase of the exchange protocol (:mod:`~flexshard.runtime.exchange_protocol`): owners
list the warm and flat slots asked of them, and both ends of the group fetch deduplicate without an
exchange of sizes.

The group fetch's rows are numbered in one key space for every table at once, the same on every rank:
table ``t`` takes ``G * S_t`` keys (``G`` the ranks at one position, a *rail*, one per group; ``S_t``
the largest cold shard of table t), the key of slot ``s`` of the rank ``j``-th in its rail (ascending)
is ``base_t + j * S_t + s`` (:meth:`GroupDedup.key`). A rail peer receives keys of its own rail's
owners only, so sorted keys are sorted by (table, owner or rail peer, slot), the order a per-table
``torch.unique`` of ``owner * rows + slot`` gives, and one dedup serves every table:

* the rail peer deduplicates its group's keys (received in ``GIDS``; requesters send the keys, so it
  decodes nothing) with the inverse indices, per owner of its rail;
* the owner deduplicates the slots the other groups asked of it (``GSLOTS``) per requesting group's
  rail peer, and adds its own group's distinct rows (the rail peer's bucket of its own rank), which it
  sends itself in ``rows`` (a local copy, never counted as bytes) so that the rail peer receives every
  distinct row in order and reads none apart.

A dedup is a mark over the key range where that range is at most :data:`DENSE_PER_KEY` times the
keys (no sort), else ``torch.unique``: the same distinct keys and inverse either way. On the mark, the
rail peer's inverse and bucket sizes are the count of marks below each key and each bucket's edge (one
cumulative sum, no list of the distinct keys), and the owner's own bucket joins its asked keys as marks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.arrays import block_bounds
from flexshard.runtime.indexing import flat_nonzero, repeated_on
from flexshard.runtime.transfer import joined_blocks

WARM, FLAT, GIDS, GSLOTS = range(4)  # the id columns of a table
# the kinds whose vectors come back (WARM, FLAT rows; the group's distinct rows in GIDS): a stage's row
# columns are numbered ``ROW_COLUMNS * t + k`` for table t and k in ROW_KINDS (each kind is its own place)
ROW_KINDS = (WARM, FLAT, GIDS)
ROW_COLUMNS = len(ROW_KINDS)
DENSE_PER_KEY = 8  # a mark over the key range when the range is at most this many times the keys


@dataclass
class Asked:
    """What the ``ids`` stage delivered to this rank, and the rows it serves (``compute``)."""

    recv_counts: np.ndarray  # int64[world, tables, KINDS] received from each rank
    slots: list[list[torch.Tensor]]  # per table, WARM / FLAT: slots asked of this rank, peer order
    owner_slots: list[torch.Tensor]  # per table: distinct group-fetch slots served, by rail peer rank
    owner_counts: np.ndarray  # int64[world, tables]: distinct rows served to each rail peer (itself too)
    inverse: list[torch.Tensor]  # per table: each received group id's position among the distinct rows
    fetch_counts: np.ndarray  # int64[world, tables]: distinct rows this rail peer gets from each owner
    local: np.ndarray  # int64[tables, 2]: [lo, hi) of the distinct rows this rail peer owns (by owner)
    own: np.ndarray  # int64[tables, 2]: [lo, hi) of this rank's own group's rows in ``owner_slots``
    # every received group id's distinct number over all tables (table-major: ``inverse`` plus the
    # table's first distinct row), the tables' ids joined in order; None without a group fetch
    joined_inverse: torch.Tensor | None = None
    # ``joined_inverse`` in wire order (group peer, table): what ``scatter`` sends and ``grads`` brings
    # back; set by the one-dim fp32 relay's ``compute``, else None
    wire_inverse: torch.Tensor | None = None
    # ``owner_slots`` joined (table-major, by rail peer) as rows of the one bank holding every table's
    # cold shard (GroupDedup's ``bank_start``), else None
    owner_rows: torch.Tensor | None = None

    @property
    def num_distinct(self) -> np.ndarray:
        """int64[tables]: the rail peer's distinct rows per table."""
        return self.fetch_counts.sum(axis=0)


def distinct_keys(keys: torch.Tensor, key_range: int) -> torch.Tensor:
    """``torch.unique(keys, sorted=True)`` of int64 ``keys`` in ``[0, key_range)``: by a mark over the
    range where it is at most :data:`DENSE_PER_KEY` times the keys, else by ``torch.unique``. The same
    tensor either way."""
    if key_range > DENSE_PER_KEY * keys.numel():
        return torch.unique(keys, sorted=True)
    mark = torch.zeros(key_range, dtype=torch.bool, device=keys.device)
    mark.index_fill_(0, keys, True)
    return flat_nonzero(mark)


class GroupDedup:
    """This rank's ``compute`` (module docstring). ``rail_peer_of_requester[p]``: the rank of requester
    p's group at this rank's position; ``position_of_rank``: every rank's position in its group."""

    def __init__(
        self,
        me: int,
        position_of_rank: np.ndarray,
        rail_peer_of_requester: np.ndarray,
        routing: list,
        group_fetch: np.ndarray,
        device: torch.device,
        bank_start: np.ndarray | None = None,
    ) -> None:
        self.device, self.me = device, me
        pos = np.asarray(position_of_rank)
        self.rail = np.flatnonzero(pos == pos[me])  # ascending ranks
        j_of_rank = np.zeros(pos.size, dtype=np.int64)  # every rank's place in its rail
        for p in np.unique(pos):
            j_of_rank[pos == p] = np.arange(int(np.sum(pos == p)))
        self.j_me = int(j_of_rank[me])
        self.group_fetch = np.asarray(group_fetch, dtype=bool)
        self.tables = int(self.group_fetch.size)
        g = self.rail.size
        # S_t: the largest cold shard of a group-fetched table (0: the table takes no keys)
        shards = [int(np.max(r.cold_rows_per_rank, initial=0)) for r in routing]
        self.span = np.where(self.group_fetch, shards, 0).astype(np.int64)
        self.base = block_bounds(g * self.span)
        self.key_range = int(self.base[-1])
        # the first key of every bucket (table, j) and the end of the key range
        self.edges = (self.base[:-1, None] + np.arange(g)[None, :] * self.span[:, None]).reshape(-1)
        self._edges = torch.as_tensor(np.append(self.edges, self.key_range), device=device)
        # requester p's GSLOTS go to bucket j of its rail peer (a requester in a group without this
        # rank's position sends no GSLOTS to it: its bucket is never used)
        peer = np.asarray(rail_peer_of_requester, dtype=np.int64)
        self.j_req = np.where(peer >= 0, j_of_rank[np.maximum(peer, 0)], 0)
        self._j_of_rank = torch.as_tensor(j_of_rank, device=device)
        self._own_mask: torch.Tensor | None = None  # _own_buckets, made when first needed
        # bank_start[t]: the row of table t's cold shard in the one bank holding them all (None: not
        # banked so); a served key less its bucket's ``bank_shift`` is its bank row
        self.bank_shift = None
        if bank_start is not None:
            self.bank_shift = self.edges - np.repeat(np.asarray(bank_start, dtype=np.int64), g)
        self._none = torch.zeros(0, dtype=torch.int64, device=device)

    def key(self, t: int, owner: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The keys of slots ``slot`` at ranks ``owner`` of group-fetched table ``t`` (a requester's
        ``GIDS``)."""
        return self.j_of(owner) * int(self.span[t]) + (slot + int(self.base[t]))

    def j_of(self, rank: torch.Tensor) -> torch.Tensor:
        """int64: each rank's place in its rail (ascending ranks)."""
        return self._j_of_rank.index_select(0, rank)

    def _per_key(self, values: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """``values[i]`` repeated ``counts[i]`` times, on the device."""
        return repeated_on(values, counts, self.device)

    def _own_buckets(self) -> torch.Tensor:
        """bool[key_range]: the keys of this rank's own buckets (table t's bucket ``(t, j_me)``), made at
        the first dense dedup (whose key range is at most :data:`DENSE_PER_KEY` times its keys)."""
        if self._own_mask is None:
            mask = np.zeros(self.key_range, dtype=bool)
            own_keys = self.edges.reshape(self.tables, -1)[:, self.j_me]  # bucket (t, j_me): [lo, + span)
            for lo, span in zip(own_keys.tolist(), self.span.tolist(), strict=True):
                mask[lo : lo + span] = True
            self._own_mask = torch.as_tensor(mask, device=self.device)
        return self._own_mask

    def _buckets(self, distinct: torch.Tensor) -> np.ndarray:
        """Distinct keys per bucket (int64[tables, G])."""
        ends = torch.searchsorted(distinct, self._edges).cpu().numpy()
        return np.diff(ends).reshape(self.tables, self.rail.size)

    def compute(self, received: list[list[torch.Tensor]], recv_counts: np.ndarray) -> Asked:
        """The owners' and rail peers' local work (no collective); see the module docstring."""
        n_t, world = self.tables, recv_counts.shape[0]
        slots = [[received[t][WARM], received[t][FLAT]] for t in range(n_t)]
        zeros = np.zeros((world, n_t), dtype=np.int64)
        if not self.group_fetch.any():
            none = [self._none] * n_t
            span = np.zeros((n_t, 2), dtype=np.int64)
            return Asked(recv_counts, slots, none, zeros, none, zeros.copy(), span, span.copy())
        # rail peer: the group's keys, distinct per (table, owner)
        n_ids = recv_counts[:, :, GIDS].sum(axis=0)
        keys = joined_blocks([received[t][GIDS] for t in range(n_t)])
        # owner: the other groups' slots per rail peer, and its own group's distinct rows (bucket j_me)
        asked_slots = recv_counts[:, :, GSLOTS].T  # [t, p]
        offset = self.base[:-1, None] + self.j_req[None, :] * self.span[:, None]
        asked_keys = joined_blocks([received[t][GSLOTS] for t in range(n_t)]) + self._per_key(
            offset, asked_slots
        )
        if self.key_range > DENSE_PER_KEY * keys.numel():  # sparse: by sorts
            distinct, inverse = torch.unique(keys, sorted=True, return_inverse=True)
            fetch = self._buckets(distinct)
            first = block_bounds(fetch.sum(axis=1))  # each table's first distinct row
            local = _bucket_span(fetch, self.j_me)
            mine = torch.cat([distinct[int(a) : int(b)] for a, b in first[:-1, None] + local])
            served = distinct_keys(torch.cat([asked_keys, mine]), self.key_range)
        else:  # a mark over the key range: a key's place is the marks before it (no sort, no search)
            mark = torch.zeros(self.key_range, dtype=torch.bool, device=self.device)
            mark.index_fill_(0, keys, True)
            before = torch.zeros(self.key_range + 1, dtype=torch.int64, device=self.device)
            torch.cumsum(mark, 0, out=before[1:])
            inverse = before.index_select(0, keys)
            fetch = np.diff(before.index_select(0, self._edges).cpu().numpy()).reshape(n_t, -1)
            first = block_bounds(fetch.sum(axis=1))
            local = _bucket_span(fetch, self.j_me)
            served_mark = torch.zeros_like(mark).index_fill_(0, asked_keys, True)
            served_mark |= mark & self._own_buckets()  # its own group's distinct rows (no op per table)
            served = flat_nonzero(served_mark)
        fetch_counts = zeros.copy()
        fetch_counts[self.rail] = fetch.T
        joined_inverse = inverse
        inverse = [x - int(f) if f else x for x, f in zip(inverse.split(n_ids.tolist()), first, strict=False)]
        served_counts = self._buckets(served)
        owner_slots = served - self._per_key(self.edges, served_counts)  # a key less its bucket's first
        owner_counts = zeros.copy()
        owner_counts[self.rail] = served_counts.T
        owner_rows = None
        if self.bank_shift is not None:  # a key less its bucket's shift: its row in the bank
            owner_rows = served - self._per_key(self.bank_shift, served_counts)
        return Asked(
            recv_counts,
            slots,
            list(owner_slots.split(served_counts.sum(axis=1).tolist())),
            owner_counts,
            inverse,
            fetch_counts,
            local,
            _bucket_span(served_counts, self.j_me),
            joined_inverse,
            owner_rows=owner_rows,
        )


def _bucket_span(counts: np.ndarray, j: int) -> np.ndarray:
    """int64[tables, 2]: per table ``[lo, hi)`` of bucket ``j`` among the table's keys (``counts``:
    keys per bucket, int64[tables, G])."""
    lo = counts[:, :j].sum(axis=1)
    return np.stack([lo, lo + counts[:, j]], axis=1).astype(np.int64)
