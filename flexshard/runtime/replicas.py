"""Keeping replicas equal: the gradient of every replicated row summed over its copies before the step.

Hot rows have a copy on every rank, summed by a hierarchical all-reduce (:func:`hierarchical_all_reduce`:
reduce-scatter in the group, all-reduce of each slice across the groups on the rail group, all-gather in
the group), as the cost model assumes. Warm shards have one copy per group, summed over the replica group
(the ranks at the same position of every group). Every copy then receives the same summed gradient and
the same update, so copies stay bitwise equal. Bytes are the cost model's all-reduce formulas
(:mod:`solvers.wire`) applied to the realised payload.

Gradients travel as the plan's :class:`~core.vocabulary.WireDtype`. In float32 the cross-group stage is
``dist.all_reduce``. In half precision every stage is an all-to-all of half-precision slices summed in
float32 by the rank that owns the slice (a reduce-scatter), whose sum is rounded once and sent back to
every copy (an all-gather): sums never accumulate in half precision, every copy (the summing rank
included) gets the same rounded bits, and the bytes are a ring all-reduce's ``2 (k - 1) / k`` of the
payload per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from core.vocabulary import FLOAT32_BYTES, SyncMode, WireDtype
from flexshard.runtime.groups import ProcessGroups
from flexshard.runtime.shards import Shard
from flexshard.runtime.transfer import TORCH_WIRE_DTYPES
from solvers import wire

AllReduce = Callable[[torch.Tensor, dist.ReduceOp], None]  # in place, over the copies of a tier


def _combine(a: torch.Tensor, b: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    return a + b if op == dist.ReduceOp.SUM else torch.maximum(a, b)


def _on_wire(x: torch.Tensor, op: dist.ReduceOp, wire_dtype: WireDtype) -> torch.Tensor:
    """``x`` as sent: float gradients being summed in the wire dtype, anything else (the touched mask) as
    it is."""
    if op == dist.ReduceOp.SUM and x.is_floating_point():
        return x.to(TORCH_WIRE_DTYPES[wire_dtype])
    return x


def _slices(n: int, size: int) -> list[int]:
    """Elements of each of ``size`` near-equal slices of ``n`` (the first ``n % size`` one longer)."""
    return [n // size + (1 if p < n % size else 0) for p in range(size)]


def reduce_scatter(
    x: torch.Tensor, op: dist.ReduceOp, group, size: int, me: int, wire_dtype: WireDtype
) -> torch.Tensor:
    """This rank's slice (``me`` of ``size``, :func:`_slices`) of ``x`` reduced over ``group``: one
    all-to-all of the slices sent as ``wire_dtype``, combined in group-rank order in ``x``'s dtype."""
    sizes = _slices(x.numel(), size)
    sent = _on_wire(x, op, wire_dtype)
    recv = sent.new_empty(size * sizes[me])
    dist.all_to_all_single(recv, sent, [sizes[me]] * size, sizes, group=group)
    slices = recv.view(size, sizes[me]).to(x.dtype)
    part = slices[0].clone()
    for p in range(1, size):
        part = _combine(part, slices[p], op)
    return part


def all_gather(
    x: torch.Tensor, part: torch.Tensor, op: dist.ReduceOp, group, size: int, me: int, wire_dtype: WireDtype
) -> None:
    """Every rank's reduced slice into ``x`` (the inverse of :func:`reduce_scatter`): one all-to-all of
    ``part`` sent as ``wire_dtype``; this rank's own slice is the sent copy too."""
    sizes = _slices(x.numel(), size)
    sent = _on_wire(part, op, wire_dtype).repeat(size)
    recv = sent.new_empty(x.numel())
    dist.all_to_all_single(recv, sent, sizes, [sizes[me]] * size, group=group)
    x.copy_(recv)


def ring_all_reduce(
    group, size: int, me: int = 0, wire_dtype: WireDtype = WireDtype.FP32
) -> AllReduce | None:
    """An all-reduce over ``group`` of ``size`` ranks (``me``: this rank's index in it; None for one rank:
    nothing to sum): ``dist.all_reduce`` in float32, a reduce-scatter and an all-gather in half precision
    (see the module docstring)."""
    if size <= 1:
        return None
    if wire_dtype is WireDtype.FP32:
        return lambda x, op: dist.all_reduce(x, op=op, group=group)

    def all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
        all_gather(x, reduce_scatter(x, op, group, size, me, wire_dtype), op, group, size, me, wire_dtype)

    return all_reduce


def hierarchical_all_reduce(pg: ProcessGroups, wire_dtype: WireDtype = WireDtype.FP32) -> AllReduce | None:
    """An all-reduce over every rank in three stages: a reduce-scatter inside the group (an all-to-all of
    ``1/g`` slices and a local reduction in group-rank order, at the rank that owns the slice), an
    all-reduce of each slice across the groups (:func:`ring_all_reduce` on the rail group: the ranks at the
    same position, which own the same slice), and an all-gather inside the group (an all-to-all of the
    reduced slice). Each slice is reduced once per group and all-reduced once, so every rank ends with the
    same bits. Groups of unequal size (no rail groups) fall back to one all-reduce over every rank."""
    g, rails = len(pg.intra_ranks), len(pg.replica_ranks)
    if g * rails != pg.layout.num_ranks:
        return ring_all_reduce(None, pg.layout.num_ranks, pg.rank, wire_dtype)
    if g * rails == 1:
        return None
    me = pg.intra_ranks.index(pg.rank)
    across = ring_all_reduce(pg.replica, rails, pg.replica_ranks.index(pg.rank), wire_dtype)

    def all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
        part = reduce_scatter(x, op, pg.intra, g, me, wire_dtype) if g > 1 else x
        if across is not None:
            across(part, op)
        if g > 1:
            all_gather(x, part, op, pg.intra, g, me, wire_dtype)

    return all_reduce


def sync_gradients(
    shards: list[Shard],
    all_reduce: AllReduce | None,
    sync: SyncMode,
    wire_dtype: WireDtype = WireDtype.FP32,
    scale: float = 1.0,
) -> float:
    """Sum the gradients of ``shards`` (the replicated rows of one tier, every table) over their copies
    with ``all_reduce`` (None: a single copy). Returns the payload bytes of one replica
    (:func:`solvers.wire.sync_payload`): touched rows' vectors (``wire_dtype`` elements) plus the touched
    mask (``sparse``: the mask is all-reduced first, with MAX, then only rows touched on some rank), or
    every row (``dense``). ``scale``: the power of two gradients travel multiplied by
    (:func:`~flexshard.runtime.transfer.gradient_scale`)."""
    shards = [s for s in shards if s.num_rows > 0]
    if not shards:
        return 0.0
    if sync is SyncMode.DENSE:
        flat = torch.cat([s.grads.reshape(-1) for s in shards])
        _sum_over_copies(flat, all_reduce, scale)
        for s, part in zip(shards, flat.split([s.grads.numel() for s in shards]), strict=True):
            s.grads.copy_(part.view_as(s.grads))
            # every replicated row is updated; a row without gradient is unchanged by SGD and by row-wise
            # Adagrad (g = 0)
            s.touched.fill_(1)
        return float(
            sum(
                wire.sync_payload(0, s.num_rows, wire.vector_bytes(s.dim, FLOAT32_BYTES, wire_dtype), sync)
                for s in shards
            )
        )
    mask = torch.cat([s.touched for s in shards])
    if all_reduce is not None:
        all_reduce(mask, dist.ReduceOp.MAX)
    rows_of = []
    for s, part in zip(shards, mask.split([s.num_rows for s in shards]), strict=True):
        s.touched.copy_(part)
        rows_of.append(torch.nonzero(part).flatten())
    flat = torch.cat([s.grads.index_select(0, r).reshape(-1) for s, r in zip(shards, rows_of, strict=True)])
    _sum_over_copies(flat, all_reduce, scale)
    sizes = [r.numel() * s.dim for s, r in zip(shards, rows_of, strict=True)]
    for s, r, part in zip(shards, rows_of, flat.split(sizes), strict=True):
        s.grads.index_copy_(0, r, part.view(-1, s.dim))
    return float(
        sum(
            wire.sync_payload(
                r.numel(), s.num_rows, wire.vector_bytes(s.dim, FLOAT32_BYTES, wire_dtype), sync
            )
            for s, r in zip(shards, rows_of, strict=True)
        )
    )


def _sum_over_copies(flat: torch.Tensor, all_reduce: AllReduce | None, scale: float) -> None:
    """``all_reduce`` of ``flat`` (float32 gradients, in place) sent multiplied by ``scale`` (exact: a power
    of two)."""
    if all_reduce is None:
        return
    if scale != 1.0:
        flat.mul_(scale)
    all_reduce(flat, dist.ReduceOp.SUM)
    if scale != 1.0:
        flat.div_(scale)
