"""The group fetch's relay where every table has one dim and the wire is float32: the rail peer's
distinct rows stay in the receive buffer of ``rows`` (no per-table join), and ``scatter`` gathers every
requester's rows of every table from it with one index, in wire order (requester, table), straight into
the send buffer (:mod:`~flexshard.runtime.exchange_protocol`). Backward, the rail peer sums its group's
gradients straight into ``rail_grads``' send buffer (by owner, then table), sent as it is. The same rows
and sums in the same places as the per-table path, bit for bit, with two copies of the distinct rows
fewer each way and one op per (peer, table) fewer.

Distinct rows are numbered as ``compute`` numbers them (:class:`~flexshard.runtime.group_dedup.Asked`'s
``joined_inverse``): table-major, each table's rows by owner (rank order), then slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flexshard.runtime.awaitable import Pending
from flexshard.runtime.transfer import add_blocks, exchange_columns_async


@dataclass
class RelayRows:
    """The rail peer's distinct rows as ``rows`` delivered them: ``buffer`` (float32[rows, dim], blocks
    in (peer, column) order) and ``row_of`` (int64[distinct rows]: each distinct row's row in it)."""

    buffer: torch.Tensor
    row_of: torch.Tensor


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
        first_row = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    start = np.asarray(first_row, dtype=np.int64)
    per_block = counts[:, distinct_column].T.reshape(-1)  # [table, peer], table-major
    first = np.concatenate([[0], np.cumsum(per_block)[:-1]])  # each block's first distinct number
    delta = start[:, distinct_column].T.reshape(-1) - first  # a block's buffer row less its number
    total = int(per_block.sum())
    delta_t, per_block_t = torch.as_tensor(np.stack([delta, per_block]), device=device)  # one host copy
    shift = torch.repeat_interleave(delta_t, per_block_t, output_size=total)
    return shift + torch.arange(total, device=device)


def scatter_index(
    joined_inverse: torch.Tensor, ids_per_peer: np.ndarray, to: np.ndarray, row_of: torch.Tensor
) -> torch.Tensor:
    """int64: the buffer rows ``scatter`` sends, in wire order (peer of ``to``, table).
    ``joined_inverse``: each received group id's distinct number (table-major, each table in peer
    order); ``ids_per_peer[p, t]``: ids received from peer p of table t (int64[world, tables]);
    ``to``: the peers sent to, in group order; ``row_of``: :func:`distinct_rows_at`."""
    counts = np.asarray(ids_per_peer, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(counts.T.reshape(-1))[:-1]]).reshape(counts.T.shape)  # [t, p]
    parts = [
        joined_inverse[int(start[t, p]) : int(start[t, p] + counts[p, t])]
        for p in to
        for t in range(counts.shape[1])
        if counts[p, t]
    ]
    if not parts:
        return joined_inverse[:0]
    wire = parts[0] if len(parts) == 1 else torch.cat(parts)
    return row_of.index_select(0, wire)


def gather_own_rows(
    buffer: torch.Tensor,
    index: torch.Tensor,
    sent: np.ndarray,
    me: int,
    rows: list[torch.Tensor],
    first: np.ndarray,
) -> torch.Tensor:
    """The rows ``scatter`` would send this rank itself, gathered straight into its lookups: ``index``
    (:func:`scatter_index`, wire order (peer, table), ``sent[p, t]`` rows each) read from ``buffer``,
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


@dataclass
class RelaySums:
    """The rail peer's gradient sums per distinct row (float32[rows, dim]) laid out as ``rail_grads``
    sends them: by owner (rail order), then table (``fetch[j, t]`` rows each)."""

    joined: torch.Tensor
    fetch: np.ndarray  # int64[rail peers, tables]


def rail_sums(
    fetch: np.ndarray,
    joined_inverse: torch.Tensor,
    ids: np.ndarray,
    got: list,
    dim: int,
    device: torch.device,
) -> RelaySums:
    """The sums of the group's gradients per distinct row, added straight into ``rail_grads``' send
    order: ``fetch[j, t]`` distinct rows of table t from rail owner j; ``joined_inverse`` as in
    :func:`scatter_index`, ``ids[t]`` of them per table; ``got[t]``: table t's received gradients
    (a tensor, or per-peer blocks in peer order). Each row's terms are added in peer order, as the
    per-table sums add them."""
    fetch = np.asarray(fetch, dtype=np.int64)
    total = torch.zeros(int(fetch.sum()), dim, device=device)
    if joined_inverse.numel():
        index = distinct_rows_at(fetch, np.arange(fetch.shape[1]), device).index_select(0, joined_inverse)
        off = 0
        for t, n in enumerate(np.asarray(ids, dtype=np.int64).tolist()):
            if n:
                add_blocks(total, index[off : off + n], got[t])
            off += n
    return RelaySums(total, fetch)


def exchange_sums(
    name: str, sums: RelaySums, recv: np.ndarray, group: Any
) -> Pending[list[list[torch.Tensor]]]:
    """``rail_grads`` of :func:`rail_sums`: the joined sums are the send buffer (no copy); ``recv[j, t]``
    rows of table t come from rail peer j. Waits to the received sums as views of the receive buffer,
    per table a list over rail peers (what :func:`~flexshard.runtime.transfer.exchange_gathered_async`
    gives)."""
    recv = np.asarray(recv, dtype=np.int64)
    dim = np.array([int(sums.joined.shape[1])])
    pending = exchange_columns_async(
        name, [sums.joined], sums.fetch.sum(axis=1)[:, None], recv.sum(axis=1)[:, None], dim, group
    )
    peers, tables = recv.shape

    def views() -> list[list[torch.Tensor]]:
        blocks = pending.wait()[0][0].split(recv.reshape(-1).tolist())  # (peer, table) order
        return [[blocks[j * tables + t] for j in range(peers)] for t in range(tables)]

    return Pending([pending], views)
