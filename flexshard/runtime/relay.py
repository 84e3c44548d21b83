"""The group fetch's relay where every table has one dim and the wire is float32: the rail peer's
distinct rows stay in the receive buffer of ``rows`` (no per-table join), and ``scatter`` gathers every
requester's rows of every table from it with one index, in wire order (requester, table), straight into
the send buffer (:mod:`~flexshard.runtime.exchange_protocol`). Backward, the rail peer sums its group's
gradients straight into ``rail_grads``' send buffer (by owner, then table), sent as it is. The same rows
and sums in the same places as the per-table path, bit for bit, with two copies of the distinct rows
fewer each way and one op per (peer, table) fewer.

Where every table is cold and group fetched (each lookup *by rail*) and ``grads`` runs in the group, the
requester keeps its rows of every table in one buffer in ``scatter``'s wire order (:class:`WireRows`):
``scatter`` receives into it in place, the outputs read through the layout, ``grads`` sends the
gradients from the same layout as they lie, and the rail peer sums them in three adds
(:func:`rail_sums_wire`): no per-table copy of a requested row or gradient either side. On the CPU the
rows it relays for itself are not gathered into a block of their own either: ``rows``' receive buffer
is the tail of the same allocation, which lays the distinct rows out as :class:`RelaySums` lays their
sums, so its own ids read them where they arrived (:func:`wire_rows_in_relay`) and its gradients land
summed per distinct row where the group's sums are made (:func:`rail_sums_in_place`).

Where every table is cold and fetched flat (each lookup *by owner*), ``rows``' receive buffer already has
that layout (the owners' blocks by (rank, table), its own last): the requester's rows stay in it
(:func:`received_rows`) and ``grads`` sends the gradients from it as they lie (:func:`grads_flat`).

Distinct rows are numbered as ``compute`` numbers them (:class:`~flexshard.runtime.group_dedup.Asked`'s
``joined_inverse``): table-major, each table's rows by owner (rank order), then slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.arrays import block_bounds, exclusive_cumsum
from flexshard.runtime.awaitable import Pending, all_to_all
from flexshard.runtime.column_joins import join_columns, joins_columns
from flexshard.runtime.group_dedup import FLAT, GIDS, ROW_COLUMNS
from flexshard.runtime.indexing import block_rows
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.placing import place_around_own, place_rows, place_scattered
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


def received_rows(
    routed: Any, got: tuple[list, torch.Tensor, np.ndarray], rc: np.ndarray, dim: int, joint: bool, me: int
) -> RelayRows:
    """``rows``' float32 rows of one dim as ``exchange_gathered_async`` delivered them (``got``: views,
    buffer, first element of each (peer, column) block; ``rc[p, c]`` rows of column c, (table, row kind),
    from rank p). ``joint`` (every table fetched flat and its lookups by owner: the buffer's layout is a
    :class:`WireRows`'): the requester's rows stay in the buffer as ``routed.joint``; else the warm and
    flat rows are put in its lookups. Returns the group fetch's distinct rows as they lie
    (:class:`RelayRows`)."""
    views, buffer, first = got
    rows = buffer.view(-1, dim) if rc.shape[1] else buffer.view(0, 0)
    if joint:
        inverse = [lk.inverse for lk in routed.lookups]
        routed.joint = wire_rows(inverse, rc[:, FLAT::ROW_COLUMNS], me, dim, rows.device, rows)
    else:
        place_rows(routed.lookups, routed.index, routed.in_order, views)
    # the group fetch's column of every table
    distinct = np.arange(rc.shape[1] // ROW_COLUMNS) * ROW_COLUMNS + GIDS
    if not rc[:, distinct].any():  # no group fetch: no distinct row to find
        return RelayRows(rows, torch.zeros(0, dtype=torch.int64, device=rows.device))
    return RelayRows(rows, distinct_rows_at(rc, distinct, rows.device, first // dim))


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


@dataclass
class WireRows:
    """A requester's group-fetched rows of every table in one buffer, laid out as ``scatter`` delivers
    them and ``grads`` sends their gradients back: the other group peers' blocks in (peer, table) order
    as received, then its own blocks (by table). ``inverse[t]``: the buffer row of each of table t's
    input ids (its lookups' ``inverse`` read through the layout)."""

    buffer: torch.Tensor  # float32[rows, dim]
    inverse: list[torch.Tensor]
    received: int  # rows from the other peers: the buffer's head
    per_peer: np.ndarray  # int64[group peers]: rows from each (its own included)
    # its own rows are not a block of their own but the rail peer's distinct rows after the head, as
    # ``rows`` delivered them (:func:`wire_rows_in_relay`): the gradients' tail is then its own terms
    # per distinct row, laid out as :class:`RelaySums` (:func:`rail_sums_in_place`)
    own_in_relay: bool = False

    def other_peers(self, me: int) -> np.ndarray:
        """int64[group peers]: the rows of each peer through the wire (none from ``me``, this rank)."""
        rows = self.per_peer.copy()
        rows[me] = 0
        return rows

    def output(self, t: int) -> torch.Tensor:
        """Table t's rows in input order."""
        return self.buffer.index_select(0, self.inverse[t])

    def gradient(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """float32[rows, dim]: the output gradients (float32, per table in input order) summed per buffer
        row, each row's terms in input order as :meth:`~flexshard.runtime.lookups.TableLookup.unique_gradient`
        adds them; laid out as ``grads`` sends them."""
        total = torch.zeros_like(self.buffer)
        for inverse, grad in zip(self.inverse, grads, strict=True):
            if inverse.numel():
                total.index_add_(0, inverse, grad)
        return total


def wire_rows(
    inverse: list[torch.Tensor],
    per_block: np.ndarray,
    me: int,
    dim: int,
    device: torch.device,
    buffer: torch.Tensor | None = None,
) -> WireRows:
    """The :class:`WireRows` of a requester whose every table's unique ids are sorted by peer (a by-rail
    lookup and its group peers; a flat by-owner one and its owners): ``per_block[p, t]`` unique ids of
    table t from peer p (int64[peers, tables]), ``me`` this rank's place among the peers, ``inverse[t]``
    each input id's unique id. ``buffer``: the rows already laid out so (``rows``' receive buffer of a
    flat fetch); by default one is allocated, not filled."""
    per_block = np.asarray(per_block, dtype=np.int64)
    tables = per_block.shape[1]
    at = own_last_rows(per_block, me, device)  # per unique id, table-major: the other peers', then its own
    starts = block_bounds(per_block.sum(axis=0)).tolist()
    mapped = [at[starts[t] : starts[t + 1]].index_select(0, inverse[t]) for t in range(tables)]
    total = int(per_block.sum())
    received = total - int(per_block[me].sum())
    buffer = torch.empty(total, dim, device=device) if buffer is None else buffer
    return WireRows(buffer, mapped, received, per_block.sum(axis=1))


def wire_rows_in_relay(
    inverse: list[torch.Tensor], per_block: np.ndarray, me: int, relay: RelayRows, own_rows: torch.Tensor
) -> WireRows:
    """The :class:`WireRows` of a requester that is also the rail peer of its own rows (every table by
    rail), in ``relay.lead``: the head receives ``scatter``'s rows from the other group peers, and its own
    rows are read where ``rows`` left them, the distinct rows after the head (``own_rows``: each of its
    own unique ids' row in ``relay.buffer``, wire order: by table), not gathered into a block of their
    own. ``inverse``, ``per_block`` and ``me`` as in :func:`wire_rows`. The same output rows; per step
    one gather of its own rows fewer, and its gradients summed per distinct row where the rail peer sums
    them (:func:`rail_sums_in_place`)."""
    per_block = np.asarray(per_block, dtype=np.int64)
    received = int(per_block.sum() - per_block[me].sum())
    # each unique id's row laid out as wire_rows lays it (the others' blocks, then its own by table),
    # its own then moved to its distinct row behind the head: one lookup over the laid-out rows
    moved = np.concatenate([np.arange(received, dtype=np.int64), own_rows.numpy() + received])
    at = torch.from_numpy(moved[own_last_rows(per_block, me, own_rows.device).numpy()])
    starts = block_bounds(per_block.sum(axis=0)).tolist()
    mapped = [at[starts[t] : starts[t + 1]].index_select(0, inverse[t]) for t in range(per_block.shape[1])]
    return WireRows(relay.lead, mapped, received, per_block.sum(axis=1), own_in_relay=True)


def scatter_wire(
    buffer: torch.Tensor, index: torch.Tensor, sent: np.ndarray, me: int, rows: WireRows, group: Any
) -> Pending[None]:
    """``scatter`` into a :class:`WireRows`: ``index`` (the buffer rows sent to every group peer, wire
    order; ``sent[p]`` rows to peer p) read from the rail peer's ``buffer``; its own block gathered
    straight into the tail of ``rows.buffer`` (none where :attr:`WireRows.own_in_relay`: its rows are
    read where they lie), the others sent in one all-to-all whose receive buffer is the head of
    ``rows.buffer`` (no copy either side of the wire)."""
    sent = np.asarray(sent, dtype=np.int64)
    lo, hi = int(sent[:me].sum()), int(sent[: me + 1].sum())
    dim = int(buffer.shape[1])
    if not rows.own_in_relay:
        torch.index_select(buffer, 0, index[lo:hi], out=rows.buffer[rows.received :])
    send = torch.empty(int(sent.sum()) - (hi - lo), dim, device=buffer.device)
    if lo:
        torch.index_select(buffer, 0, index[:lo], out=send[:lo])
    if index.numel() > hi:
        torch.index_select(buffer, 0, index[hi:], out=send[lo:])
    send_rows = sent.copy()
    send_rows[me] = 0
    recv_rows = rows.other_peers(me)
    work = all_to_all(
        "scatter",
        rows.buffer[: rows.received].view(-1),
        send.view(-1),
        (recv_rows * dim).tolist(),
        (send_rows * dim).tolist(),
        group,
    )
    return Pending([work], lambda: None)


def grads_wire(
    rows: WireRows, gradient: torch.Tensor, recv: np.ndarray, me: int, group: Any
) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
    """``grads`` from a :class:`WireRows`' ``gradient``: its head sent as it lies (the blocks of the
    other group peers, their rail peers), its tail (this rank's own, to itself) kept; ``recv[p]`` rows
    come from peer p. Waits to ``(received, own)``: the received rows in (peer, table) order without
    this rank's own, and its own (:func:`rail_sums_wire`'s inputs)."""
    work, received = send_head("grads", gradient[: rows.received], rows.per_peer, recv, me, group)
    return Pending([work], lambda: (received, gradient[rows.received :]))


def grads_flat(
    rows: WireRows, gradient: torch.Tensor, recv: np.ndarray, me: int, group: Any
) -> Pending[list[torch.Tensor | list[torch.Tensor]]]:
    """``grads`` of a flat fetch whose rows are a :class:`WireRows` (every table flat, its lookups by
    owner): :func:`grads_wire` to the owners; ``recv[p, t]`` gradients of table t come from rank p.
    Waits to ``grads``' columns (warm, flat, group ids per table; only flat ones hold rows), each a list
    over peers of views, or one tensor in peer order where :func:`per_table_views` joins them."""
    recv = np.asarray(recv, dtype=np.int64)
    pending = grads_wire(rows, gradient, recv.sum(axis=1), me, group)

    def columns() -> list[torch.Tensor | list[torch.Tensor]]:
        flat = per_table_views(*pending.wait(), recv, me, range(recv.shape[0]))
        return [column for views in flat for column in ([], views, [])]

    return Pending([pending], columns)


def rail_sums_wire(
    fetch: np.ndarray,
    wire_inverse: torch.Tensor,
    recv: np.ndarray,
    me: int,
    rail_me: int,
    received: torch.Tensor,
    own: torch.Tensor,
    device: torch.device,
) -> RelaySums:
    """:func:`rail_sums` of gradients in wire order: ``wire_inverse`` each received group id's distinct
    number in wire order (group peer, table), ``recv[p]`` of them from peer p (``me`` this rank's place
    in the group, ``rail_me`` in the rail); ``received`` the other peers' gradients in that order,
    ``own`` this rank's. Three adds (the peers before this rank, its
    own, the peers after it): each row's terms in peer order, the per-table sums bit for bit."""
    fetch = np.asarray(fetch, dtype=np.int64)
    recv = np.asarray(recv, dtype=np.int64)
    total = torch.zeros(int(fetch.sum()), int(own.shape[1]), device=device)
    index = own_last_rows(fetch, rail_me, device).index_select(0, wire_inverse)
    lo, hi = int(recv[:me].sum()), int(recv[: me + 1].sum())
    for part, rows in ((index[:lo], received[:lo]), (index[lo:hi], own), (index[hi:], received[lo:])):
        if part.numel():
            total.index_add_(0, part, rows)
    return RelaySums(total, fetch, rail_me)


def rail_sums_in_place(
    fetch: np.ndarray,
    wire_inverse: torch.Tensor,
    recv: np.ndarray,
    me: int,
    rail_me: int,
    received: torch.Tensor,
    own: torch.Tensor,
    device: torch.device,
) -> RelaySums:
    """:func:`rail_sums_wire` where this rank's own terms are already summed per distinct row, laid out as
    :class:`RelaySums` (``own``: the tail of a :attr:`WireRows.own_in_relay` gradient, float32[distinct
    rows, dim], zero where it asked for no row). Each row's terms in peer order, as the per-table sums
    add them, bit for bit: where this rank is first or second in its group (``me`` 0 or 1) its terms
    start the sum and the other peers' are added to them (``x + y == y + x`` in floating point; no
    zeroing, none of its own adds); further on, the peers before it, then its terms (one add over the
    rows, ``x + 0 == x``), then the peers after it."""
    fetch = np.asarray(fetch, dtype=np.int64)
    recv = np.asarray(recv, dtype=np.int64)
    if own.shape[0] != int(fetch.sum()):
        raise ValueError(f"own: {own.shape[0]} rows, {int(fetch.sum())} distinct rows wanted")
    index = own_last_rows(fetch, rail_me, device).index_select(0, wire_inverse)
    lo, hi = int(recv[:me].sum()), int(recv[: me + 1].sum())
    before, after = (index[:lo], received[:lo]), (index[hi:], received[lo:])
    if me <= 1:
        total, parts = own, (before, after)
    else:
        total = torch.zeros_like(own)
        if lo:
            total.index_add_(0, *before)
        total.add_(own)
        parts = (after,)
    for part, rows in parts:
        if part.numel():
            total.index_add_(0, part, rows)
    return RelaySums(total, fetch, rail_me)
