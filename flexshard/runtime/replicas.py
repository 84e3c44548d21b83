"""Keeping replicas equal: the gradient of every replicated row summed over its copies before the step.

Hot rows have a copy on every rank, summed by a hierarchical all-reduce (:func:`hierarchical_all_reduce`:
reduce-scatter in the group, all-reduce of each slice across the groups on the rail group, all-gather in
the group), as the cost model assumes. Warm shards have one copy per group, summed over the replica group
(the ranks at the same position of every group). Every copy then receives the same summed gradient and
the same update, so copies stay bitwise equal. Bytes are the cost model's all-reduce formulas
(:mod:`solvers.wire`) applied to the realised payload.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from core.vocabulary import FLOAT32_BYTES, SyncMode
from flexshard.runtime.groups import ProcessGroups
from flexshard.runtime.shards import Shard
from solvers import wire

AllReduce = Callable[[torch.Tensor, dist.ReduceOp], None]  # in place, over the copies of a tier


def ring_all_reduce(group, size: int) -> AllReduce | None:
    """``dist.all_reduce`` on ``group`` of ``size`` ranks (None for one rank: nothing to sum)."""
    if size <= 1:
        return None
    return lambda x, op: dist.all_reduce(x, op=op, group=group)


def hierarchical_all_reduce(pg: ProcessGroups) -> AllReduce | None:
    """An all-reduce over every rank in three stages: a reduce-scatter inside the group (an all-to-all of
    ``1/g`` slices and a local reduction in group-rank order, at the rank that owns the slice), an
    all-reduce of each slice across the groups (on the rail group: the ranks at the same position, which own
    the same slice), and an all-gather inside the group (an all-to-all of the reduced slice). Each slice is
    reduced once per group and all-reduced once, so every rank ends with the same bits. Groups of unequal
    size (no rail groups) fall back to one all-reduce over every rank."""
    g, rails = len(pg.intra_ranks), len(pg.replica_ranks)
    if g * rails != pg.layout.num_ranks:
        return ring_all_reduce(None, pg.layout.num_ranks)
    if g * rails == 1:
        return None
    me = pg.intra_ranks.index(pg.rank)

    def all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
        n = x.numel()
        sizes = [n // g + (1 if p < n % g else 0) for p in range(g)]
        part = x
        if g > 1:
            recv = x.new_empty(g * sizes[me])
            dist.all_to_all_single(recv, x, [sizes[me]] * g, sizes, group=pg.intra)
            slices = recv.view(g, sizes[me])
            part = slices[0].clone()
            for p in range(1, g):
                part = part + slices[p] if op == dist.ReduceOp.SUM else torch.maximum(part, slices[p])
        if rails > 1:
            dist.all_reduce(part, op=op, group=pg.replica)
        if g > 1:
            dist.all_to_all_single(x, part.repeat(g), sizes, [sizes[me]] * g, group=pg.intra)

    return all_reduce


def sync_gradients(shards: list[Shard], all_reduce: AllReduce | None, sync: SyncMode) -> float:
    """Sum the gradients of ``shards`` (the replicated rows of one tier, every table) over their copies
    with ``all_reduce`` (None: a single copy). Returns the payload bytes of one replica
    (:func:`solvers.wire.sync_payload`): touched rows' vectors plus the touched mask (``sparse``: the mask
    is all-reduced first, with MAX, then only rows touched on some rank), or every row (``dense``)."""
    shards = [s for s in shards if s.num_rows > 0]
    if not shards:
        return 0.0
    if sync is SyncMode.DENSE:
        flat = torch.cat([s.grads.reshape(-1) for s in shards])
        if all_reduce is not None:
            all_reduce(flat, dist.ReduceOp.SUM)
        for s, part in zip(shards, flat.split([s.grads.numel() for s in shards]), strict=True):
            s.grads.copy_(part.view_as(s.grads))
            # every replicated row is updated; a row without gradient is unchanged by SGD and by row-wise
            # Adagrad (g = 0)
            s.touched.fill_(1)
        return float(sum(wire.sync_payload(0, s.num_rows, s.dim * FLOAT32_BYTES, sync) for s in shards))
    mask = torch.cat([s.touched for s in shards])
    if all_reduce is not None:
        all_reduce(mask, dist.ReduceOp.MAX)
    rows_of = []
    for s, part in zip(shards, mask.split([s.num_rows for s in shards]), strict=True):
        s.touched.copy_(part)
        rows_of.append(torch.nonzero(part).flatten())
    flat = torch.cat([s.grads.index_select(0, r).reshape(-1) for s, r in zip(shards, rows_of, strict=True)])
    if all_reduce is not None:
        all_reduce(flat, dist.ReduceOp.SUM)
    sizes = [r.numel() * s.dim for s, r in zip(shards, rows_of, strict=True)]
    for s, r, part in zip(shards, rows_of, flat.split(sizes), strict=True):
        s.grads.index_copy_(0, r, part.view(-1, s.dim))
    return float(
        sum(
            wire.sync_payload(r.numel(), s.num_rows, s.dim * FLOAT32_BYTES, sync)
            for s, r in zip(shards, rows_of, strict=True)
        )
    )
