"""The group fetch's relay where every table has one dim and the wire is float32: the rail peer's
distinct rows stay in the receive buffer of ``rows`` (no per-table join), and ``scatter`` gathers every
requester's rows of every table from it with one index, in wire order (requester, table), straight into
the send buffer (:mod:`~flexshard.runtime.exchange_protocol`). The same rows in the same places as the
per-table path, two copies of the distinct rows and one op per (requester, table) fewer.

Distinct rows are numbered as ``compute`` numbers them (:class:`~flexshard.runtime.group_dedup.Asked`'s
``joined_inverse``): table-major, each table's rows by owner (rank order), then slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RelayRows:
    """The rail peer's distinct rows as ``rows`` delivered them: ``buffer`` (float32[rows, dim], blocks
    in (peer, column) order) and ``row_of`` (int64[distinct rows]: each distinct row's row in it)."""

    buffer: torch.Tensor
    row_of: torch.Tensor


def distinct_rows_at(
    recv_counts: np.ndarray, distinct_column: np.ndarray, device: torch.device
) -> torch.Tensor:
    """int64[sum of the distinct columns' rows]: the row in a receive buffer of rows (one dim; blocks
    in (peer, column) order, ``recv_counts[p, c]`` rows each) of every row of the columns
    ``distinct_column`` (one per table), numbered table-major, then by peer, then in order."""
    counts = np.asarray(recv_counts, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    per_block = counts[:, distinct_column].T.reshape(-1)  # [table, peer], table-major
    first = np.concatenate([[0], np.cumsum(per_block)[:-1]])  # each block's first distinct number
    delta = start[:, distinct_column].T.reshape(-1) - first  # a block's buffer row less its number
    total = int(per_block.sum())
    shift = torch.repeat_interleave(
        torch.as_tensor(delta, device=device), torch.as_tensor(per_block, device=device), output_size=total
    )
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
