"""Keeping replicas equal: the gradient of every replicated row summed over its copies before the step.

Hot rows have a copy on every rank (summed over the global group), warm shards one per group (summed
over the replica group: the ranks at the same position of every group). Every copy then receives the
same summed gradient and the same update, so copies stay bitwise equal. Bytes are the cost model's
all-reduce formulas (:mod:`solvers.wire`) applied to the realised payload.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.vocabulary import FLOAT32_BYTES, SyncMode
from flexshard.runtime.shards import Shard
from solvers import wire


def sync_gradients(shards: list[Shard], group, group_size: int, sync: SyncMode) -> float:
    """All-reduce (sum) the gradients of ``shards`` (the replicated rows of one tier, every table) over
    ``group`` of ``group_size`` ranks. Returns the payload bytes of one replica
    (:func:`solvers.wire.sync_payload`): touched rows' vectors plus the touched mask (``sparse``: the mask
    is all-reduced first, then only rows touched on some rank), or every row (``dense``)."""
    shards = [s for s in shards if s.num_rows > 0]
    if not shards:
        return 0.0
    if sync is SyncMode.DENSE:
        flat = torch.cat([s.grads.reshape(-1) for s in shards])
        if group_size > 1:
            dist.all_reduce(flat, group=group)
        for s, part in zip(shards, flat.split([s.grads.numel() for s in shards]), strict=True):
            s.grads.copy_(part.view_as(s.grads))
            # every replicated row is updated; a row without gradient is unchanged by SGD and by row-wise
            # Adagrad (g = 0)
            s.touched.fill_(1)
        return float(sum(wire.sync_payload(0, s.num_rows, s.dim * FLOAT32_BYTES, sync) for s in shards))
    mask = torch.cat([s.touched for s in shards])
    if group_size > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    rows_of = []
    for s, part in zip(shards, mask.split([s.num_rows for s in shards]), strict=True):
        s.touched.copy_(part)
        rows_of.append(torch.nonzero(part).flatten())
    flat = torch.cat([s.grads.index_select(0, r).reshape(-1) for s, r in zip(shards, rows_of, strict=True)])
    if group_size > 1:
        dist.all_reduce(flat, group=group)
    sizes = [r.numel() * s.dim for s, r in zip(shards, rows_of, strict=True)]
    for s, r, part in zip(shards, rows_of, flat.split(sizes), strict=True):
        s.grads.index_copy_(0, r, part.view(-1, s.dim))
    return float(
        sum(
            wire.sync_payload(r.numel(), s.num_rows, s.dim * FLOAT32_BYTES, sync)
            for s, r in zip(shards, rows_of, strict=True)
        )
    )
