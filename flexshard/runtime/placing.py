"""Where the exchange protocol's received vectors go (:mod:`~flexshard.runtime.exchange_protocol`): rows
into the requesters' lookups, gradients into the owners' shards and the rail peer's sums, in the order
that keeps every row's float sums the same whichever rank owns it.

A received column is one tensor, or per-peer views of a receive buffer in peer order (what
:func:`~flexshard.runtime.transfer.exchange_gathered_async` gives): every function here takes either and
copies or adds block by block, never joining blocks it does not have to. Columns are numbered
``ROW_COLUMNS * t + k`` for table ``t`` and ``k`` in ``ROW_KINDS`` (WARM, FLAT, GIDS). The one-dim
float32 relay, which works in the stages' own buffers, is :mod:`~flexshard.runtime.relay`.
"""

from __future__ import annotations

import numpy as np
import torch

from core.vocabulary import Tier, WireDtype
from flexshard.runtime.group_dedup import FLAT, GIDS, ROW_COLUMNS, WARM, Asked
from flexshard.runtime.lookups import TableLookup
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import add_blocks, copy_blocks, joined_blocks, round_like_wire

Column = torch.Tensor | list[torch.Tensor]  # one tensor, or per-peer views in peer order
Shards = dict[tuple[int, Tier], Shard]


def joined(got: Column) -> torch.Tensor:
    """A received column as one tensor: itself, or its per-peer views in peer order (no copy when at
    most one is not empty)."""
    return got if isinstance(got, torch.Tensor) else joined_blocks(got)


def blocks(got: Column) -> list[torch.Tensor]:
    """A received column as a list of blocks in peer order."""
    return [got] if isinstance(got, torch.Tensor) else got


def place_rows(
    lookups: list[TableLookup], index: list[list[torch.Tensor]], in_order: set, got: list[Column]
) -> None:
    """``rows``' warm and flat rows into the requesters' lookups: a table whose flat column is every
    unique id in order takes the rows as received; else each column's rows go to its lookups'
    positions (``index[t][k]``)."""
    for t, lk in enumerate(lookups):
        if (t, FLAT) in in_order:
            lk.rows = joined(got[ROW_COLUMNS * t + FLAT])
            continue
        for k in (WARM, FLAT):
            copy_blocks(lk.rows, index[t][k], blocks(got[ROW_COLUMNS * t + k]))


def place_scattered(
    lookups: list[TableLookup], index: list[list[torch.Tensor]], in_order: set, per_table: list[list]
) -> None:
    """``scatter``'s rows (per table, per-peer blocks) into the requesters' lookups: in peer order where
    the group-fetch column is every unique id in order, else at its lookups' positions."""
    for t, views in enumerate(per_table):
        if (t, GIDS) in in_order:
            torch.cat(views, out=lookups[t].rows)
        else:
            copy_blocks(lookups[t].rows, index[t][GIDS], views)


def place_around_own(
    lookups: list[TableLookup], per_peer: list[list[torch.Tensor]], first: np.ndarray, me: int
) -> None:
    """``scatter``'s rows where this rank's own are already in its lookups (its group-fetch columns
    every unique id in order): each other peer's block of table ``t`` (``per_peer[p][t]``) copied to
    its place, from row ``first[p, t]`` on."""
    for p, by_table in enumerate(per_peer):
        for t, block in enumerate(by_table):
            if p != me and block.shape[0]:
                lo = int(first[p, t])
                lookups[t].rows[lo : lo + block.shape[0]].copy_(block)


def add_owned_gradients(shards: Shards, asked: Asked, got: list[Column]) -> None:
    """``grads``' warm and flat gradients added into the owner's shards, block by block as received (a
    row's terms added in peer order; no join of the blocks)."""
    for t in range(len(got) // ROW_COLUMNS):
        for k, tier in ((WARM, Tier.WARM), (FLAT, Tier.COLD)):
            if asked.slots[t][k].numel():
                shards[(t, tier)].add_gradient(asked.slots[t][k], got[ROW_COLUMNS * t + k])


def rail_peer_sums(
    asked: Asked, got: list[Column], dims: np.ndarray, device: torch.device
) -> list[torch.Tensor]:
    """The rail peer's float32 sum of its group's gradients per distinct group-fetch row, per table (empty
    for a flat table), each row's terms added in peer order."""
    out = []
    for t in range(len(dims)):
        total = torch.zeros(int(asked.num_distinct[t]), int(dims[t]), device=device)
        if asked.inverse[t].numel():
            add_blocks(total, asked.inverse[t], got[ROW_COLUMNS * t + GIDS])
        out.append(total)
    return out


def own_group_first(peers: int, own_at: int) -> list[int]:
    """Rail peers in the order owners add their gradient blocks: its own group's (``own_at``) first, then
    the others in rail order (each row's gradient summed in the same order whichever rank owns it)."""
    return [own_at, *(j for j in range(peers) if j != own_at)]


def peer_runs(peers: list[int]) -> list[tuple[int, int]]:
    """``peers`` as runs of consecutive peers, ``(first, last + 1)`` each, in order: ``[2, 0, 1, 3]``
    is ``[(2, 3), (0, 2), (3, 4)]`` (an own-group-first order is at most three runs)."""
    out: list[tuple[int, int]] = []
    for j in peers:
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


def add_rail_views(
    shards: Shards,
    slots: list[torch.Tensor],
    recv_counts: np.ndarray,
    peers: list[int],
    per_table: list[list],
) -> None:
    """``rail_grads``' sums received as per-peer views (``recv_counts[p, t]`` rows from rail peer ``p``),
    each block added into the owner's cold shard where it lies, peers in the order ``peers``; or per
    table one tensor, its blocks joined in that order (:mod:`~flexshard.runtime.column_joins`), added
    at once with its slots in the same order."""
    for t, views in enumerate(per_table):
        ends = np.cumsum(recv_counts[:, t])
        if isinstance(views, torch.Tensor):
            if views.shape[0]:  # the slots of each run of consecutive peers at once
                starts = ends - recv_counts[:, t]
                parts = [slots[t][int(starts[a]) : int(ends[b - 1])] for a, b in peer_runs(peers)]
                shards[(t, Tier.COLD)].add_gradient(parts[0] if len(parts) == 1 else torch.cat(parts), views)
            continue
        for j in peers:
            if views[j].shape[0]:
                lo, hi = int(ends[j] - recv_counts[j, t]), int(ends[j])
                shards[(t, Tier.COLD)].add_gradient(slots[t][lo:hi], views[j])


def keep_own_sums(
    shards: Shards, asked: Asked, sums: list[torch.Tensor], wire_dtype: WireDtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On a 16-bit wire whose gradients are scaled by the sender's largest (fp16): the sums of the rows
    this rank owns itself added now, rounded as if sent with their own scale; returns the other sums and
    their slots, to be sent."""
    cols, slots = [], []
    for t in range(len(sums)):
        (lo, hi), (a, b) = asked.local[t], asked.own[t]
        if hi > lo:
            kept = round_like_wire(sums[t][lo:hi], wire_dtype, scaled=True)
            shards[(t, Tier.COLD)].add_gradient(asked.owner_slots[t][a:b], kept)
        cols.append(torch.cat([sums[t][:lo], sums[t][hi:]]))
        slots.append(torch.cat([asked.owner_slots[t][:a], asked.owner_slots[t][b:]]))
    return cols, slots


def add_received_sums(
    shards: Shards, own: list[tuple[int, int]], slots: list[torch.Tensor], got: list[torch.Tensor]
) -> None:
    """``rail_grads``' received sums (one tensor per table, in rail order) added into the owner's cold
    shard: its own group's block (``own[t]``) first, then the others, so each row's gradient is summed in
    the same order whichever rank owns it."""
    for t, received in enumerate(got):
        (a, b), n = own[t], int(received.shape[0])
        for lo, hi in ((a, b), (0, a), (b, n)):
            if hi > lo:
                shards[(t, Tier.COLD)].add_gradient(slots[t][lo:hi], received[lo:hi])
