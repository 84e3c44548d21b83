"""The replica ``sync`` phase: the gradient of every replicated row summed over its copies before the step,
every table and both tiers in one bucket per level (the stages of :func:`solvers.schedule.step_schedule`).

``sync_mask`` (sparse sync only, one world all-reduce MAX): a uint8 buffer ``[hot rows of every table |
the whole warm tier of every table, position by position]``; each rank fills the hot rows it touched and
the positions of its own warm shard, so the one collective gives the hot union over every rank and each
warm shard's union over its copies (the groups). Then only rows touched somewhere travel (dense sync:
every row, no mask).

Equal groups: ``sync_group_reduce`` (group all-to-all): a reduce-scatter of the hot gradients, each rank
summing its ``1/g`` slice in group-rank order; ``sync_rail`` (rail all-reduce) of the bucket
``[this rank's hot slice | its warm shard's touched rows]``; ``sync_group_gather`` (group all-to-all):
the summed hot slices back to every GPU of the group. Groups of unequal size (no warm rows): one world
all-reduce of the hot gradients (``sync_world``). Every copy then receives the same summed gradient and
the same update, so copies stay bitwise equal.

Gradients travel as the plan's :class:`~core.vocabulary.WireDtype`. In float32 the all-reduces are
``dist.all_reduce``. In half precision an all-reduce is a reduce-scatter and an all-gather, both
all-to-alls (``sync_rail_reduce``, ``sync_rail_gather``): slices sent in half precision are summed in
float32 by the rank that owns the slice, whose sum is rounded once and sent back to every copy (itself
included); on fp16 each sender scales by its own power of two, sent with the slice
(:func:`~flexshard.runtime.transfer.exchange_vectors`). Bytes are the cost model's formulas
(:mod:`solvers.wire`) on the realised payload: the vectors, and the mask as a hierarchical all-reduce
of ``hot + warm`` rows of one byte.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from core.arrays import exclusive_cumsum
from core.traffic import Traffic
from core.vocabulary import FLOAT32_BYTES, Component, LinkClass, SyncMode, Tier, WireDtype
from flexshard.runtime.awaitable import Pending, all_reduce, ready
from flexshard.runtime.groups import ProcessGroups
from flexshard.runtime.shards import Shard, touched_rows_of
from flexshard.runtime.transfer import exchange_columns_async, exchange_vectors
from solvers import wire

AllReduce = Callable[[torch.Tensor, dist.ReduceOp], None]  # in place, over the copies of a tier


def _slices(n: int, size: int) -> list[int]:
    """Elements of each of ``size`` near-equal slices of ``n`` (the first ``n % size`` one longer)."""
    return [n // size + (1 if p < n % size else 0) for p in range(size)]


def _exchange(name, x, send, recv, op, group, wire_dtype) -> Pending[torch.Tensor]:
    """One all-to-all of the 1-D ``x`` (``send[p]`` elements to peer ``p``): float sums travel as
    ``wire_dtype`` scaled by the sender, anything else (the mask) as it is."""
    counts, recv_counts = np.asarray(send)[:, None], np.asarray(recv)[:, None]
    if op == dist.ReduceOp.SUM and x.is_floating_point():
        pending = exchange_vectors(name, [x], counts, recv_counts, np.ones(1), wire_dtype, group, scaled=True)
        return Pending([pending], lambda: pending.wait()[0])
    plain = exchange_columns_async(name, [x], counts, recv_counts, np.ones(1), group)
    return Pending([plain], lambda: plain.wait()[0][0])


def reduce_scatter(
    name: str, x: torch.Tensor, op: dist.ReduceOp, group, size: int, me: int, wire_dtype: WireDtype
) -> Pending[torch.Tensor]:
    """This rank's slice (``me`` of ``size``, :func:`_slices`) of ``x`` reduced over ``group``: one
    all-to-all of the slices, combined in group-rank order in ``x``'s dtype."""
    sizes = _slices(x.numel(), size)
    pending = _exchange(name, x, sizes, [sizes[me]] * size, op, group, wire_dtype)

    def finish() -> torch.Tensor:
        slices = pending.wait().view(size, sizes[me]).to(x.dtype)
        part = slices[0].clone()
        for p in range(1, size):
            part = part + slices[p] if op == dist.ReduceOp.SUM else torch.maximum(part, slices[p])
        return part

    return Pending([pending], finish)


def all_gather(
    name: str,
    x: torch.Tensor,
    part: torch.Tensor,
    op: dist.ReduceOp,
    group,
    size: int,
    me: int,
    wire_dtype: WireDtype,
) -> Pending[None]:
    """Every rank's reduced slice into ``x`` (the inverse of :func:`reduce_scatter`): one all-to-all of
    ``part``; this rank's own slice is the sent (rounded) copy too."""
    sizes = _slices(x.numel(), size)
    pending = _exchange(name, part.repeat(size), [sizes[me]] * size, sizes, op, group, wire_dtype)

    def finish() -> None:
        x.copy_(pending.wait())

    return Pending([pending], finish)


def ring_all_reduce(
    group, size: int, me: int = 0, wire_dtype: WireDtype = WireDtype.FP32, name: str = "sync_rail"
) -> AllReduce | None:
    """An all-reduce over ``group`` of ``size`` ranks (``me``: this rank's index in it; None for one rank:
    nothing to sum): ``dist.all_reduce`` in float32 (and for the mask), a reduce-scatter and an all-gather
    in half precision (see the module docstring). Stages ``name`` or ``name_reduce`` / ``name_gather``."""
    if size <= 1:
        return None

    def reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
        if wire_dtype is WireDtype.FP32 or not x.is_floating_point():
            all_reduce(name, x, op, group).wait()
            return
        part = reduce_scatter(f"{name}_reduce", x, op, group, size, me, wire_dtype).wait()
        all_gather(f"{name}_gather", x, part, op, group, size, me, wire_dtype).wait()

    return reduce


def levels_all_reduce(
    pg: ProcessGroups,
    rail: AllReduce | None,
    x: torch.Tensor,
    rail_only: torch.Tensor,
    op: dist.ReduceOp,
    wire_dtype: WireDtype,
    split: bool,
) -> torch.Tensor:
    """``x`` (in place) reduced over every rank of equal groups, level by level: with ``split`` a
    reduce-scatter inside the group (``sync_group_reduce``), then ``rail`` (the all-reduce across the
    groups) of this rank's slice bucketed with ``rail_only`` (reduced over the rail group alone), then
    with ``split`` an all-gather inside the group (``sync_group_gather``), so every rank ends with the
    same bits. Returns ``rail_only`` reduced."""
    g, me = len(pg.intra_ranks), pg.intra_ranks.index(pg.rank)
    part = reduce_scatter("sync_group_reduce", x, op, pg.intra, g, me, wire_dtype).wait() if split else x
    bucket = torch.cat([part, rail_only])
    if rail is not None:
        rail(bucket, op)
    part, rail_only = bucket.split([part.numel(), rail_only.numel()])
    if split:
        all_gather("sync_group_gather", x, part, op, pg.intra, g, me, wire_dtype).wait()
    else:
        x.copy_(part)
    return rail_only


def hierarchical_all_reduce(pg: ProcessGroups, wire_dtype: WireDtype = WireDtype.FP32) -> AllReduce | None:
    """An all-reduce over every rank in three stages (:func:`levels_all_reduce`: a reduce-scatter inside
    the group, an all-reduce of each slice across the groups, an all-gather inside the group), so every
    rank ends with the same bits. Groups of unequal size fall back to one all-reduce over every rank.
    The hot part of :class:`ReplicaSync`, on its own."""
    g, rails = len(pg.intra_ranks), len(pg.replica_ranks)
    if g * rails != pg.layout.num_ranks:
        return ring_all_reduce(None, pg.layout.num_ranks, pg.rank, wire_dtype, "sync_world")
    if g * rails == 1:
        return None
    across = ring_all_reduce(pg.replica, rails, pg.replica_ranks.index(pg.rank), wire_dtype)

    def reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
        levels_all_reduce(pg, across, x, x.new_empty(0), op, wire_dtype, split=g > 1)

    return reduce


class ReplicaSync:
    """The sync phase of one rank (see the module docstring). ``shards``: this rank's rows;
    ``warm_sizes[t, j]``: table t's warm rows at group position j; ``hot_sync`` / ``warm_sync``: whether
    each tier has copies on several ranks (the plan's :func:`solvers.schedule.step_shape`)."""

    def __init__(
        self,
        pg: ProcessGroups,
        shards: dict[tuple[int, Tier], Shard],
        num_tables: int,
        warm_sizes: np.ndarray,
        sync: SyncMode,
        wire_dtype: WireDtype,
        hot_sync: bool,
        warm_sync: bool,
    ) -> None:
        self.pg, self.sync, self.wire_dtype = pg, sync, wire_dtype
        self.hot = [shards[(t, Tier.HOT)] for t in range(num_tables)]
        self.warm = [shards[(t, Tier.WARM)] for t in range(num_tables)]
        self.hot_sync, self.warm_sync = hot_sync, warm_sync
        self.g, self.num_groups = len(pg.intra_ranks), pg.num_groups
        self.equal = self.g * len(pg.replica_ranks) == pg.layout.num_ranks
        hot_rows = sum(s.num_rows for s in self.hot) if hot_sync else 0
        warm_total = int(warm_sizes.sum()) if warm_sync else 0
        self.mask_rows = hot_rows + warm_total
        # where this rank's warm shard of each table sits in the mask
        flat = exclusive_cumsum(warm_sizes)
        self.warm_offset = hot_rows + flat[:, pg.position] if warm_sync else None
        rails = len(pg.replica_ranks)
        self.rail = ring_all_reduce(pg.replica, rails, pg.replica_ranks.index(pg.rank), wire_dtype)
        self.world = ring_all_reduce(None, pg.layout.num_ranks, pg.rank, wire_dtype, "sync_world")

    def _mask(self) -> Pending[None]:
        """``sync_mask``: the touched marks of the synced rows, MAX over every rank; on wait they are in
        the shards."""
        if self.sync is not SyncMode.SPARSE or not self.mask_rows:
            return ready(None)
        hot = [s.touched for s in self.hot] if self.hot_sync else []
        mask = torch.cat(
            [
                *hot,
                torch.zeros(
                    self.mask_rows - sum(m.numel() for m in hot),
                    dtype=torch.uint8,
                    device=self.hot[0].touched.device,
                ),
            ]
        )
        if self.warm_sync:
            for s, off in zip(self.warm, self.warm_offset, strict=True):
                mask[int(off) : int(off) + s.num_rows] = s.touched
        work = all_reduce("sync_mask", mask, dist.ReduceOp.MAX, None)

        def finish() -> None:
            if self.hot_sync:
                hot = mask[: sum(s.num_rows for s in self.hot)]
                for s, part in zip(self.hot, hot.split([s.num_rows for s in self.hot]), strict=True):
                    s.touched.copy_(part)
            if self.warm_sync:
                for s, off in zip(self.warm, self.warm_offset, strict=True):
                    s.touched.copy_(mask[int(off) : int(off) + s.num_rows])

        return Pending([work], finish)

    def step(self, traffic: Traffic) -> None:
        """Sum the replicated gradients over their copies (every copy ends with the same float32 sum and
        touched marks) and add the sync bytes to ``traffic``."""
        if not (self.hot_sync or self.warm_sync):
            return
        self._mask().wait()
        hot = self.hot if self.hot_sync else []
        warm = self.warm if self.warm_sync else []
        rows = self._rows(hot + warm)  # every synced shard's touched rows at once
        hot_rows, warm_rows = rows[: len(hot)], rows[len(hot) :]
        hot_vec = _gather(self.hot, hot_rows)
        warm_vec = _gather(self.warm, warm_rows)
        if not self.equal:  # no warm rows: the hot gradients over every rank
            self.world(hot_vec, dist.ReduceOp.SUM)
        else:
            split = self.hot_sync and self.g > 1
            warm_vec = levels_all_reduce(
                self.pg, self.rail, hot_vec, warm_vec, dist.ReduceOp.SUM, self.wire_dtype, split
            )
        _scatter(self.hot, hot_rows, hot_vec)
        _scatter(self.warm, warm_rows, warm_vec)
        self._count(traffic, hot_rows, warm_rows)

    def _rows(self, shards: list[Shard]) -> list[torch.Tensor]:
        """Per shard the rows that travel: touched somewhere (sparse), or all (dense: marked touched)."""
        if self.sync is SyncMode.DENSE:
            for s in shards:
                s.touched.fill_(1)  # a row without gradient is unchanged by SGD and row-wise Adagrad
        return touched_rows_of(shards)

    def _count(self, traffic: Traffic, hot_rows: list, warm_rows: list) -> None:
        def payload(shards, rows) -> float:
            return float(
                sum(
                    r.numel() * wire.vector_bytes(s.dim, FLOAT32_BYTES, self.wire_dtype)
                    for s, r in zip(shards, rows, strict=False)  # rows: [] for a tier not synced
                )
            )

        mask = wire.sync_mask_bytes(self.mask_rows, self.sync)
        hot = wire.hierarchical_allreduce_bytes(self.g, self.num_groups, payload(self.hot, hot_rows) + mask)
        for link in LinkClass:
            traffic.add(link, Component.SYNC, hot[link], hot[link])
        warm = wire.ring_allreduce_bytes(self.num_groups, payload(self.warm, warm_rows))
        traffic.add(LinkClass.INTER_GROUP, Component.SYNC, warm, warm)


def _gather(shards: list[Shard], rows: list[torch.Tensor]) -> torch.Tensor:
    if not shards or not rows:
        return torch.zeros(0, device=shards[0].grads.device if shards else None)
    return torch.cat([s.grads.index_select(0, r).reshape(-1) for s, r in zip(shards, rows, strict=True)])


def _scatter(shards: list[Shard], rows: list[torch.Tensor], flat: torch.Tensor) -> None:
    if not rows:
        return
    sizes = [r.numel() * s.dim for s, r in zip(shards, rows, strict=True)]
    for s, r, part in zip(shards, rows, flat.split(sizes), strict=True):
        s.grads.index_copy_(0, r, part.view(-1, s.dim))
