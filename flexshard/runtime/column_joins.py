"""Received blocks joined per column on a GPU, so that the adds after an exchange stop growing with its
peers.

An exchange delivers each column's rows as per-peer blocks (:func:`~flexshard.runtime.transfer.
exchange_gathered_async`, :func:`~flexshard.runtime.relay.per_table_views`): the other peers' blocks in
one receive buffer in (peer, column) order, this rank's own apart. The owners add each block into their
shards, one ``index_add_`` per (peer, column). On a GPU an op costs tens of microseconds of host time
and a copy of the rows microseconds of memory bandwidth, so where that is fewer ops the blocks are put
into (column, peer) order at once (:func:`join_columns`: one ``index_copy_`` for the receive buffer, one
for the own blocks) and each column is added once, its rows' terms in the same peer order. Never on the
CPU, where the copy costs more than the ops it saves (:func:`joins_columns`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from core.arrays import exclusive_cumsum
from flexshard.runtime.device_rules import gpu_paths
from flexshard.runtime.indexing import STAGED_INDEX_OPS, block_rows

JOIN_OPS = 2  # the joined buffer's allocation and its split into columns


def joins_columns(device: torch.device, recv: np.ndarray, me: int) -> bool:
    """Whether the blocks received as ``recv[p, c]`` rows of column c from peer p (``me`` this rank) are
    joined per column (:func:`join_columns`) before they are added: on a GPU, where its ops
    (:data:`JOIN_OPS` and :data:`~flexshard.runtime.indexing.STAGED_INDEX_OPS` per part: the received
    blocks, this rank's own) are fewer than the adds it saves (one per non-empty block, against one per
    non-empty column after it)."""
    if not gpu_paths(device):
        return False
    recv = np.asarray(recv)
    others = np.arange(recv.shape[0]) != me
    parts = int(recv[others].any()) + int(recv[me].any())
    saved = int(np.count_nonzero(recv)) - int(np.count_nonzero(recv.any(axis=0)))
    return JOIN_OPS + STAGED_INDEX_OPS * parts < saved


def join_columns(
    received: torch.Tensor,
    own: torch.Tensor,
    recv: np.ndarray,
    me: int,
    order: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Per column, its rows from every peer in one tensor, the peers' blocks in ``order`` (default: peer
    order). ``received``: the other peers' blocks in (peer, column) order; ``own``: this rank's (``me``)
    by column; ``recv[p, c]``: rows of column c from peer p. The same rows as joining each column's
    blocks in that order, in two copies whatever the peers and columns."""
    recv = np.asarray(recv, dtype=np.int64)
    peers = recv.shape[0]
    order = list(range(peers)) if order is None else list(order)
    per_column = recv.sum(axis=0)
    column_start = exclusive_cumsum(per_column)
    ranked = recv[order]
    before = exclusive_cumsum(ranked, axis=0)
    at = np.empty_like(recv)  # [peer, column]: each block's first row in the joined buffer
    at[order] = column_start[None, :] + before
    out = torch.empty(
        int(per_column.sum()), *received.shape[1:], dtype=received.dtype, device=received.device
    )
    others = np.arange(peers) != me
    if received.shape[0]:
        out.index_copy_(0, block_rows(recv[others].reshape(-1), at[others].reshape(-1), out.device), received)
    if recv[me].any():
        out.index_copy_(0, block_rows(recv[me], at[me], out.device), own)
    return list(out.split(per_column.tolist()))
