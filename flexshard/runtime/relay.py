"""The group fetch's relay where every table has one dim and the wire is float32: the rail peer's
distinct rows stay in the receive buffer of ``rows`` (no per-table join), and ``scatter`` gathers every
requester's rows of every table from it with one index, in wire order (requester, table), straight into
the send buffer (:mod:`~flexshard.runtime.exchange_protocol`). Backward, the rail peer sums its group's
gradients straight into ``rail_grads``' send buffer (by owner, then table), sent as it is. The same rows
and sums in the same places as the per-table path, bit for bit, with two copies of the distinct rows
fewer each way and one op per (peer, table) fewer.

The requester's side, its rows of every table in one buffer in wire order, is
:mod:`~flexshard.runtime.wire_rows`.

Distinct rows are numbered as ``compute`` numbers them (:class:`~flexshard.runtime.group_dedup.Asked`'s
``joined_inverse``): table-major, each table's rows by owner (rank order), then slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.arrays import exclusive_cumsum
from flexshard.runtime.awaitable import Pending, all_to_all
from flexshard.runtime.column_joins import join_columns, joins_columns
from flexshard.runtime.group_dedup import GIDS
from flexshard.runtime.indexing import block_rows
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.placing import place_around_own, place_scattered
from flexshard.runtime.transfer import add_blocks, exchange_gathered_async


@dataclass
class RelayRows:
    """The rail peer's distinct rows as ``rows`` delivered them: ``buffer`` (float32[rows, dim], blocks
    in (peer, column) order) and ``row_of`` (int64[distinct rows]: each distinct row's row in it).
    ``lead``: where ``buffer`` is the tail of a larger allocation whose head is left for ``scatter`` to
    receive into (:func:`wire_rows_in_relay`), that allocation (float32[head + rows, dim]); else None."""

    buffer: torch.Tensor
    row_of: torch.Tensor
    lead: torch.Tensor | None = None


def distinct_rows_at(
    recv_counts: np.ndarray,
    distinct_column: np.ndarray,
    device: torch.device,
    first_row: np.ndarray | None = None,
) -> torch.Tensor:
    """int64[sum of the distinct columns' rows]: the row in a receive buffer of rows (one dim;
    ``recv_counts[p, c]`` rows in block ``(p, c)``, which starts at row ``first_row[p, c]``: by default
    the blocks lie in (peer, column) order) of every row of the columns ``distinct_column`` (one per
    table), numbered table-major, then by peer, then in order."""
    counts = np.asarray(recv_counts, dtype=np.int64)
    if first_row is None:
        first_row = exclusive_cumsum(counts)
    start = np.asarray(first_row, dtype=np.int64)
    sizes, first = (x[:, distinct_column].T.reshape(-1) for x in (counts, start))  # table-major
    return block_rows(sizes, first, device)


def wire_order(ids_per_peer: np.ndarray, to: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64: the positions, among the received group ids numbered table-major then by peer
    (``joined_inverse``'s order; ``ids_per_peer[p, t]`` ids of table t from peer p, int64[world, tables]),
    of the ids of the peers ``to`` in wire order (peer of ``to``, table): what ``scatter`` sends and
    ``grads`` brings back."""
    counts = np.asarray(ids_per_peer, dtype=np.int64)
    start = exclusive_cumsum(counts.T).T  # [p, t], laid table-major
    to = np.asarray(to, dtype=np.int64)
    return block_rows(counts[to].reshape(-1), start[to].reshape(-1), device)


def gather_own_rows(
    buffer: torch.Tensor,
    index: torch.Tensor,
    sent: np.ndarray,
    me: int,
    rows: list[torch.Tensor],
    first: np.ndarray,
) -> torch.Tensor:
    """The rows ``scatter`` would send this rank itself, gathered straight into its lookups: ``index``
    (the buffer rows ``scatter`` sends: :attr:`RelayRows.row_of` of the distinct numbers in wire order
    (peer, table), ``sent[p, t]`` rows each) read from ``buffer``,
    table ``t``'s own block into ``rows[t]`` from row ``first[t]`` on. Returns ``index`` without the
    own block (what the collective still sends)."""
    sent = np.asarray(sent, dtype=np.int64)
    lo = int(sent[:me].sum())
    off = lo
    for t, n in enumerate(sent[me].tolist()):
        if n:
            at = int(first[t])
            torch.index_select(buffer, 0, index[off : off + n], out=rows[t][at : at + n])
        off += n
    return torch.cat([index[:lo], index[off:]])


def scatter_relayed(
    lookups: list[TableLookup],
    index: list[list[torch.Tensor]],
    in_order: set,
    buffer: torch.Tensor,
    rows_sent: torch.Tensor,
    sc: np.ndarray,
    rc: np.ndarray,
    me: int,
    group: Any,
) -> Pending[None]:
    """``scatter`` from ``rows``' ``buffer``: ``rows_sent`` (its rows for every group peer, wire order
    (peer, table); ``sc[p, t]`` rows to peer p of table t, ``rc[p, t]`` from it) in one gather; on wait
    the rows are in the ``lookups`` (the protocol's ``Routed``: ``index``, ``in_order``). Where every
    table's group-fetch column is its unique ids in order, this rank's own rows are gathered straight
    into its lookups (:func:`gather_own_rows`) and each peer's block is copied to its place, so the own
    rows are copied once, not three times (into the send buffer, out of it, into the lookups); ``me``:
    this rank's place in the group."""
    n_t = len(lookups)
    direct = all((t, GIDS) in in_order for t in range(n_t) if rc[:, t].any())
    first = exclusive_cumsum(rc, axis=0)  # [peer, t]
    wire_sc, wire_rc = sc, rc
    if direct and sc[me].any():
        rows_sent = gather_own_rows(buffer, rows_sent, sc, me, [lk.rows for lk in lookups], first[me])
        wire_sc, wire_rc = sc.copy(), rc.copy()
        wire_sc[me], wire_rc[me] = 0, 0
    sent, received = wire_sc.sum(axis=1)[:, None], wire_rc.sum(axis=1)[:, None]
    gathered = exchange_gathered_async("scatter", [buffer], [rows_sent], sent, received, group)

    def place_joined() -> None:
        per_peer = [v.split(n.tolist()) for v, n in zip(gathered.wait()[0], wire_rc, strict=True)]
        if direct:
            place_around_own(lookups, per_peer, first, me)
        else:
            per_table = [[blocks[t] for blocks in per_peer] for t in range(n_t)]
            place_scattered(lookups, index, in_order, per_table)

    return Pending([gathered], place_joined)


@dataclass
class RelaySums:
    """The rail peer's gradient sums per distinct row (float32[rows, dim]) laid out as ``rail_grads``
    sends them: the other rail owners' blocks by owner (rail order), then table (``fetch[j, t]`` rows
    each), then this rank's own (``me``, by table): the head is the send buffer, the tail is added where
    it lies (no copy to itself)."""

    joined: torch.Tensor
    fetch: np.ndarray  # int64[rail peers, tables]
    me: int  # this rank's place in the rail

    @property
    def sent(self) -> int:
        """Rows of the head: the other owners' sums."""
        return int(self.fetch.sum() - self.fetch[self.me].sum())


def own_last_rows(fetch: np.ndarray, me: int, device: torch.device) -> torch.Tensor:
    """int64[distinct rows]: each distinct row's row in a :class:`RelaySums` (distinct rows numbered
    table-major, then by rail owner; ``fetch[j, t]`` of table t from owner j; ``me``'s blocks last)."""
    fetch = np.asarray(fetch, dtype=np.int64)
    order = [j for j in range(fetch.shape[0]) if j != me] + [me]
    first = np.zeros_like(fetch)
    first[order] = exclusive_cumsum(fetch[order])
    return distinct_rows_at(fetch, np.arange(fetch.shape[1]), device, first)


def rail_sums(
    fetch: np.ndarray,
    joined_inverse: torch.Tensor,
    ids: np.ndarray,
    got: list,
    dim: int,
    me: int,
    device: torch.device,
) -> RelaySums:
    """The sums of the group's gradients per distinct row, added straight into ``rail_grads``' layout
    (:class:`RelaySums`): ``fetch[j, t]`` distinct rows of table t from rail owner j, ``me`` this rank's
    place in the rail; ``joined_inverse`` as in :func:`wire_order`, ``ids[t]`` of them per table;
    ``got[t]``: table t's received gradients (a tensor, or per-peer blocks in peer order). Each row's
    terms are added in peer order, as the per-table sums add them."""
    fetch = np.asarray(fetch, dtype=np.int64)
    total = torch.zeros(int(fetch.sum()), dim, device=device)
    if joined_inverse.numel():
        index = own_last_rows(fetch, me, device).index_select(0, joined_inverse)
        off = 0
        for t, n in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
            if n:
                add_blocks(total, index[off : off + n], got[t])
            off += n
    return RelaySums(total, fetch, me)


def exchange_sums(
    name: str, sums: RelaySums, recv: np.ndarray, group: Any, order: Sequence[int] | None = None
) -> Pending[list[list[torch.Tensor]]]:
    """``rail_grads`` of :func:`rail_sums`: the head of the joined sums is the send buffer (no copy), its
    tail (this rank's own rows) stays where it lies; ``recv[j, t]`` rows of table t come from rail peer j
    (``recv[me]`` equals ``sums.fetch[me]``). Waits to the sums as views, per table a list over rail peers
    (what :func:`~flexshard.runtime.transfer.exchange_gathered_async` gives): the received ones in the
    receive buffer, this rank's own in the joined sums; or, with ``order``, per table one tensor where
    :func:`per_table_views` joins them."""
    recv = np.asarray(recv, dtype=np.int64)
    me = sums.me
    work, received = send_head(
        name, sums.joined[: sums.sent], sums.fetch.sum(axis=1), recv.sum(axis=1), me, group
    )
    own = sums.joined[sums.sent :]
    return Pending([work], lambda: per_table_views(received, own, recv, me, order))


def add_sums_to_bank(
    name: str, sums: RelaySums, recv: np.ndarray, owner_rows: torch.Tensor, bank: Any, group: Any
) -> Pending[None]:
    """``rail_grads`` of :func:`rail_sums` where every table's cold shard is a row range of one ``bank``
    (:class:`~flexshard.runtime.shards.ShardBank`): the head of the joined sums sent as it lies, and on
    wait this rank's own sums (the tail, by table) added into the bank's gradients, then the received
    ones (other rail peers in rail order, each by table), each row's terms in the per-table adds' order
    (its own group's first) in two adds and one mark, whatever the tables. ``recv[j, t]``: rows of
    table t from rail peer j (``recv[me]`` its own); ``owner_rows``: the bank rows of the distinct rows
    served, table-major, then by rail peer (:attr:`~flexshard.runtime.group_dedup.Asked.owner_rows`)."""
    recv = np.asarray(recv, dtype=np.int64)
    me = sums.me
    work, received = send_head(
        name, sums.joined[: sums.sent], sums.fetch.sum(axis=1), recv.sum(axis=1), me, group
    )
    # the bank rows in the order the sums lie: the others' blocks (peer, table), then its own (table)
    first = exclusive_cumsum(recv.T).T  # [j, t]: block (t, j)'s first row in owner_rows (table-major)
    order = [j for j in range(recv.shape[0]) if j != me] + [me]
    rows = owner_rows.index_select(
        0, block_rows(recv[order].reshape(-1), first[order].reshape(-1), owner_rows.device)
    )
    sent = int(received.shape[0])

    def add() -> None:
        bank.grads.index_add_(0, rows[sent:], sums.joined[sums.sent :])  # its own group's sums first
        bank.grads.index_add_(0, rows[:sent], received)
        bank.touched.index_fill_(0, rows, 1)

    return Pending([work], add)


def send_head(
    name: str, head: torch.Tensor, send: np.ndarray, recv: np.ndarray, me: int, group: Any
) -> tuple[Any, torch.Tensor]:
    """An all-to-all of rows whose send buffer is ``head`` as it lies (``send[p]`` rows to peer p, in peer
    order; this rank's own, ``send[me]``, kept out) into a new receive buffer (``recv[p]`` rows from peer
    p; none from itself). Returns the work and the receive buffer."""
    dim = int(head.shape[1])
    send_rows, recv_rows = np.asarray(send, dtype=np.int64).copy(), np.asarray(recv, dtype=np.int64).copy()
    send_rows[me], recv_rows[me] = 0, 0
    received = torch.empty(int(recv_rows.sum()), dim, device=head.device)
    sizes = [(recv_rows * dim).tolist(), (send_rows * dim).tolist()]
    return all_to_all(name, received.view(-1), head.reshape(-1), *sizes, group), received


def per_table_views(
    received: torch.Tensor, own: torch.Tensor, recv: np.ndarray, me: int, order: Sequence[int] | None = None
) -> list[list[torch.Tensor]] | list[torch.Tensor]:
    """Per table, a list over peers of its rows: ``received`` holds the other peers' blocks in (peer,
    table) order, ``own`` this rank's (``me``) by table; ``recv[p, t]`` rows of table t from peer p.
    With ``order`` (a peer order), per table one tensor of its blocks in that order where
    :func:`~flexshard.runtime.column_joins.joins_columns` finds that fewer ops (a GPU)."""
    if order is not None and joins_columns(received.device, recv, me):
        return join_columns(received, own, recv, me, order)
    peers, tables = recv.shape
    others = [p for p in range(peers) if p != me]
    blocks = received.split(recv[others].reshape(-1).tolist())
    per_peer = {p: blocks[i * tables : (i + 1) * tables] for i, p in enumerate(others)}
    per_peer[me] = own.split(recv[me].tolist())
    return [[per_peer[p][t] for p in range(peers)] for t in range(tables)]
