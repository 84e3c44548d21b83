"""The requester's side of the one-dim fp32 exchange (:mod:`~flexshard.runtime.relay` is the rail peer's):
its rows of every table in one buffer in the wire order the stage that delivers them uses
(:class:`WireRows`), the outputs read through the layout and the gradients sent from it as they lie.

Where every table is cold and group fetched (each lookup *by rail*) and ``grads`` runs in the group,
``scatter`` receives into the buffer in place (:func:`scatter_wire`), ``grads`` sends the gradients from
the same layout (:func:`grads_wire`) and the rail peer sums them in three adds (:func:`rail_sums_wire`):
no per-table copy of a requested row or gradient either side. On the CPU the rows a requester relays for
itself are not gathered into a block of their own either: ``rows``' receive buffer is the tail of the
same allocation, laid out as :class:`~flexshard.runtime.relay.RelaySums` lays the sums, so its own ids
read them where they arrived (:func:`wire_rows_in_relay`) and its gradients land summed per distinct row
where the group's sums are made (:func:`rail_sums_wire` with ``own_summed``).

Where every table is cold and fetched flat (each lookup *by owner*), ``rows``' receive buffer already has
that layout (the owners' blocks by (rank, table), its own last): the requester's rows stay in it
(:func:`received_rows`) and ``grads`` sends the gradients from it as they lie (:func:`grads_flat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.arrays import block_bounds
from flexshard.runtime.awaitable import Pending, all_to_all
from flexshard.runtime.group_dedup import FLAT, GIDS, ROW_COLUMNS
from flexshard.runtime.placing import place_rows
from flexshard.runtime.relay import (
    RelayRows,
    RelaySums,
    distinct_rows_at,
    own_last_rows,
    per_table_views,
    send_head,
)


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
    # per distinct row, laid out as :class:`RelaySums` (:func:`rail_sums_wire` with ``own_summed``)
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
    at = own_last_rows(per_block, me, device)  # per unique id, table-major: the other peers', then its own
    mapped = _per_input_id(at, per_block, inverse)
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
    them (:func:`rail_sums_wire` with ``own_summed``)."""
    per_block = np.asarray(per_block, dtype=np.int64)
    received = int(per_block.sum() - per_block[me].sum())
    # each unique id's row laid out as wire_rows lays it (the others' blocks, then its own by table),
    # its own then moved to its distinct row behind the head: one lookup over the laid-out rows
    moved = np.concatenate([np.arange(received, dtype=np.int64), own_rows.numpy() + received])
    at = torch.from_numpy(moved[own_last_rows(per_block, me, own_rows.device).numpy()])
    mapped = _per_input_id(at, per_block, inverse)
    return WireRows(relay.lead, mapped, received, per_block.sum(axis=1), own_in_relay=True)


def _per_input_id(at: torch.Tensor, per_block: np.ndarray, inverse: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per table, the buffer row of each input id: ``at`` (int64: each unique id's row, table-major;
    ``per_block[:, t].sum()`` unique ids of table t) read through ``inverse[t]``."""
    starts = block_bounds(per_block.sum(axis=0)).tolist()
    return [at[starts[t] : starts[t + 1]].index_select(0, inverse[t]) for t in range(per_block.shape[1])]


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
    own_summed: bool = False,
) -> RelaySums:
    """:func:`~flexshard.runtime.relay.rail_sums` of gradients in wire order: ``wire_inverse`` each
    received group id's distinct number in wire order (group peer, table), ``recv[p]`` of them from peer
    p (``me`` this rank's place in the group, ``rail_me`` in the rail); ``received`` the other peers'
    gradients in that order, ``own`` this rank's. Each row's terms in peer order, the per-table sums bit
    for bit: three adds (the peers before this rank, its own, the peers after it). ``own_summed``: its
    terms are already summed per distinct row, laid out as :class:`RelaySums` (the tail of a
    :attr:`WireRows.own_in_relay` gradient, float32[distinct rows, dim], zero where it asked for no
    row): where this rank is first or second in its group (``me`` 0 or 1) they start the sum and the
    other peers' are added to them (``x + y == y + x`` in floating point; no zeroing and none of its own
    adds); further on, the peers before it, then its terms (one add over the rows, ``x + 0 == x``), then
    the peers after it."""
    fetch = np.asarray(fetch, dtype=np.int64)
    recv = np.asarray(recv, dtype=np.int64)
    distinct = int(fetch.sum())
    index = own_last_rows(fetch, rail_me, device).index_select(0, wire_inverse)
    lo, hi = int(recv[:me].sum()), int(recv[: me + 1].sum())
    before, after = (index[:lo], received[:lo]), (index[hi:], received[lo:])
    if not own_summed:
        total = torch.zeros(distinct, int(own.shape[1]), device=device)
        parts: tuple = (before, (index[lo:hi], own), after)
    elif own.shape[0] != distinct:
        raise ValueError(f"own: {own.shape[0]} rows, {distinct} distinct rows wanted")
    elif me <= 1:
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
