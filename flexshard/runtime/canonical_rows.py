"""Rows of a :class:`~flexshard.runtime.ShardedSequenceEmbedding` moved between its plan's placement and a
*canonical layout*: every table, and every optimizer state tensor of it, as one logical ``[num_rows, ...]``
tensor split in contiguous row blocks over the world (rank ``r`` holds rows ``[min(r*B, n),
min((r+1)*B, n))`` with ``B = ceil(n / world)``, as ``torch.chunk`` and DTensor ``Shard(0)`` split them).
:mod:`flexshard.runtime.dcp_state` exposes the blocks to ``torch.distributed.checkpoint``.

Moving rows (:func:`to_canonical`, :func:`from_canonical`): ONE ``all_to_all_single`` each way carries every
table's weights and states (rows flattened to float32 columns, buffers ordered by peer then table); split
sizes are not exchanged, since both ends compute them from the plan's routing. Saving, every row is sent
exactly once: a hot row by its block owner itself (every rank holds it), a warm row by the rank of the
block owner's group at the row's warm position (so warm rows stay inside the group), a cold row by its
owner. Loading, a block owner sends each row to every rank that holds a copy (hot: all ranks; warm: the
rank at its position in every group; cold: its owner), so every replica gets the same bits. Rows travel in
ascending id order, which is also block order, so each side places them with one vectorised index per
(peer, table) slice: no Python loop per row. Memory per rank: the canonical blocks, the send buffer (the
rows it sends; on load hot rows once per rank; filled one table at a time, so one table's rows more while
it is) and a receive buffer of what it receives (on save: its block).

``names`` (:func:`to_canonical`, :func:`from_canonical`): only those tensors of a row move (``"weight"``
and state names), so weights and optimizer state can move separately (TorchRec exposes them from two
methods, the module's ``state_dict`` and its fused optimizer's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.arrays import exclusive_cumsum
from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.runtime.agreement import agreed_message
from flexshard.runtime.indexing import flat_nonzero
from flexshard.runtime.shards import Shard as RowShard

# a flexshard.runtime.ShardedSequenceEmbedding, which imports this module (so not imported here)
ShardedSequenceEmbedding = Any

WEIGHT = "weight"
TIERS = (Tier.HOT, Tier.WARM, Tier.COLD)


def _row_states(shard: RowShard) -> dict[str, torch.Tensor]:
    """The optimizer state tensors of ``shard``'s rows by TorchRec state name, each with a leading rows
    dimension (the one accessor of optimizer state here)."""
    return dict(shard.states)


def block_bounds(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``rank``'s canonical block (``torch.chunk`` / DTensor ``Shard(0)`` split)."""
    size = -(-num_rows // world) if num_rows else 0
    lo = min(rank * size, num_rows)
    return lo, min(lo + size, num_rows)


def block_owner(ids: torch.Tensor, num_rows: int, world: int) -> torch.Tensor:
    """The rank whose canonical block holds each of ``ids`` (int64)."""
    size = max(-(-num_rows // world), 1)
    return torch.div(ids, size, rounding_mode="floor")


@dataclass
class Canonical:
    """This rank's canonical blocks: per table ``{"weight": [hi - lo, dim], <state>: [hi - lo, ...]}``,
    rows ``lo..hi-1`` of the logical tensors of ``num_rows`` rows."""

    tables: list[str]
    num_rows: list[int]
    lo: list[int]
    blocks: dict[str, dict[str, torch.Tensor]]


Names = frozenset[str] | None  # which tensors of a row move: None every one (weight and states)


def _tensors_of(
    module: ShardedSequenceEmbedding, t: int, tier: Tier, names: Names = None
) -> dict[str, torch.Tensor]:
    shard = module.shards[(t, tier)]
    out = {WEIGHT: shard.weights, **_row_states(shard)}
    return out if names is None else {k: v for k, v in out.items() if k in names}


def state_names(module: ShardedSequenceEmbedding) -> frozenset[str]:
    """The optimizer state names of ``module``'s rows (no weight)."""
    return frozenset(_row_states(module.shards[(0, Tier.HOT)])) if module.shards else frozenset()


def _row_shapes(module: ShardedSequenceEmbedding, t: int, names: Names = None) -> dict[str, tuple[int, ...]]:
    """Per tensor name, the shape of one row (``(dim,)`` for weights, ``()`` for a row-wise state)."""
    return {k: tuple(v.shape[1:]) for k, v in _tensors_of(module, t, Tier.HOT, names).items()}


def _width(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())


def _flat(
    module: ShardedSequenceEmbedding, t: int, tier: Tier, rows: torch.Tensor, names: Names = None
) -> torch.Tensor:
    """``rows`` of a shard as float32 ``[len(rows), width]`` (weights, then each state flattened)."""
    tensors = _tensors_of(module, t, tier, names).values()
    return torch.cat([_as_rows(v.index_select(0, rows)) for v in tensors], dim=1)


def _as_rows(v: torch.Tensor) -> torch.Tensor:
    """``v [n, ...]`` as ``[n, prod(...)]`` (also for n = 0)."""
    return v.reshape(v.shape[0], int(np.prod(v.shape[1:], dtype=np.int64)))


def _unflat(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Views of ``flat [n, width]`` column ranges, one per tensor, shaped ``[n, *row shape]``."""
    out, at = {}, 0
    for name, shape in shapes.items():
        w = int(np.prod(shape, dtype=np.int64))
        out[name] = flat[:, at : at + w].reshape(flat.shape[0], *shape)
        at += w
    return out


def _members(module: ShardedSequenceEmbedding) -> torch.Tensor:
    """int64[groups, max group size]: the rank at each position of each group (-1 past a group's end)."""
    groups = module.pg.groups
    out = torch.full((len(groups), max(len(g) for g in groups)), -1, dtype=torch.int64)
    for g, members in enumerate(groups):
        out[g, : len(members)] = torch.tensor(members, dtype=torch.int64)
    return out.to(module.device)


def _send_buffer(send_rows: np.ndarray, widths: np.ndarray, rows_of, device: torch.device) -> torch.Tensor:
    """The float32 send buffer, peer-major then table: ``rows_of(t)`` gives table ``t``'s rows ``[n, width]``
    and the order to send them in (grouped by peer, ``send_rows[peer, t]`` each); made one table at a
    time and copied straight into the buffer (peak: the buffer and one table's rows)."""
    elems = send_rows * widths
    starts = exclusive_cumsum(elems)
    send = torch.empty(int(elems.sum()), dtype=torch.float32, device=device)
    for t in range(send_rows.shape[1]):
        if not send_rows[:, t].any():
            continue
        flat, order = rows_of(t)
        at, w = 0, int(widths[t])
        for p in range(send_rows.shape[0]):
            k = int(send_rows[p, t])
            out = send[int(starts[p, t]) : int(starts[p, t]) + k * w].view(k, w)
            torch.index_select(flat, 0, order[at : at + k], out=out)
            at += k
        del flat
    return send


def _exchange(send: torch.Tensor, send_rows: np.ndarray, recv_rows: np.ndarray, widths: np.ndarray):
    """One all_to_all_single of float32 rows: ``send_rows[peer, table]`` rows of ``widths[table]`` columns
    to each peer, ``recv_rows[peer, table]`` from each. Returns the receive buffer and element offsets."""
    send_elems = (send_rows * widths).sum(axis=1)
    recv_elems = recv_rows * widths
    recv = torch.empty(int(recv_elems.sum()), dtype=torch.float32, device=send.device)
    dist.all_to_all_single(recv, send, recv_elems.sum(axis=1).tolist(), send_elems.tolist())
    starts = exclusive_cumsum(recv_elems)
    return recv, starts


def _check_float32(module: ShardedSequenceEmbedding, names: Names = None) -> str:
    for t, name in enumerate(module.table_names):
        for key, v in _tensors_of(module, t, Tier.HOT, names).items():
            if v.dtype != torch.float32:
                return f"table {name!r}: {key} is {v.dtype}, the DCP state supports float32 only"
    return ""


def _move_setup(module: ShardedSequenceEmbedding, names: Names):
    """What both moves start from: each group's members, per table the row shapes of the moved tensors
    and their flat width, and zeroed [world, tables] counts of rows sent and received."""
    n_tables = len(module.table_names)
    shapes = [_row_shapes(module, t, names) for t in range(n_tables)]
    widths = np.array([_width(s) for s in shapes], dtype=np.int64)
    counts = np.zeros((module.world_size, n_tables), dtype=np.int64)
    return _members(module), shapes, widths, counts, counts.copy()


def to_canonical(module: ShardedSequenceEmbedding, names: Names = None) -> Canonical:
    """Every row of every table (weights and optimizer states; ``names``: only those tensors) moved into
    the canonical blocks, each row taken from exactly one copy (module docstring). Collective: one
    all-to-all."""
    _agree(_check_float32(module, names), module.device)
    world, me, dev = module.world_size, module.rank, module.device
    group_of = torch.as_tensor(module.pg.layout.group_of_rank, dtype=torch.int64, device=dev)
    members, shapes, widths, send_rows, recv_rows = _move_setup(module, names)
    outgoing, incoming = [], []
    for t, r in enumerate(module.routing):
        n = r.num_rows
        # what this rank sends: hot rows of its own block, warm rows of blocks in its group, its cold rows
        payload, dests = [], []
        for tier in TIERS:
            ids = torch.as_tensor(module.shards[(t, tier)].ids, dtype=torch.int64, device=dev)
            dest = block_owner(ids, n, world)
            keep = dest == me if tier is Tier.HOT else group_of.index_select(0, dest) == module.pg.group
            if tier is Tier.COLD:
                keep = torch.ones_like(keep)
            slots = flat_nonzero(keep)
            payload.append((tier, slots, ids.index_select(0, slots)))
            dests.append(dest.index_select(0, slots))
        order = torch.argsort(torch.cat([p[2] for p in payload]), stable=True)  # ascending: by destination
        send_rows[:, t] = torch.bincount(torch.cat(dests), minlength=world).cpu().numpy()
        outgoing.append(([(tier, slots) for tier, slots, _ in payload], order))
        # what this rank receives: its block, each row from the copy chosen for it
        lo, hi = block_bounds(n, world, me)
        ids = torch.arange(lo, hi, dtype=torch.int64, device=dev)
        tier, owner, _slot = r.lookup(ids)
        position = torch.where(tier == int(Tier.WARM), owner, 0)
        warm_sender = members[module.pg.group].index_select(0, position)
        sender = torch.where(
            tier == int(Tier.HOT), me, torch.where(tier == int(Tier.WARM), warm_sender, owner)
        )
        by_sender = torch.argsort(sender, stable=True)  # per sender: ascending ids
        recv_rows[:, t] = torch.bincount(sender, minlength=world).cpu().numpy()
        incoming.append(by_sender)

    def rows_of(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts, order = outgoing[t]
        return torch.cat([_flat(module, t, tier, slots, names) for tier, slots in parts]), order

    send = _send_buffer(send_rows, widths, rows_of, dev)
    recv, starts = _exchange(send, send_rows, recv_rows, widths)
    del send
    blocks = {}
    for t, name in enumerate(module.table_names):
        lo, hi = block_bounds(module.routing[t].num_rows, world, me)
        canon = {k: torch.empty((hi - lo, *s), dtype=torch.float32, device=dev) for k, s in shapes[t].items()}
        at = 0
        for p in range(world):
            k = int(recv_rows[p, t])
            rows = recv[int(starts[p, t]) : int(starts[p, t]) + k * int(widths[t])].view(k, int(widths[t]))
            pos = incoming[t][at : at + k]
            for key, part in _unflat(rows, shapes[t]).items():
                canon[key].index_copy_(0, pos, part)
            at += k
        blocks[name] = canon
    return Canonical(
        list(module.table_names),
        [r.num_rows for r in module.routing],
        [block_bounds(r.num_rows, world, me)[0] for r in module.routing],
        blocks,
    )


def from_canonical(module: ShardedSequenceEmbedding, canonical: Canonical, names: Names = None) -> None:
    """Every row ``module`` holds (in any tier) set from the canonical blocks (``names``: only those
    tensors), each replica from the same block row (module docstring). Checks the blocks' tables, tensors
    and shapes first (one agreed :class:`~core.errors.CheckpointError`). Clears gradients. Collective: one
    all-to-all."""
    world, me, dev = module.world_size, module.rank, module.device
    _agree(_check_float32(module, names) or _blocks_problem(module, canonical, names), dev)
    members, shapes, widths, send_rows, recv_rows = _move_setup(module, names)
    outgoing, incoming = [], []
    ranks = torch.arange(world, dtype=torch.int64, device=dev)
    for t, r in enumerate(module.routing):
        n = r.num_rows
        lo, hi = block_bounds(n, world, me)
        ids = torch.arange(lo, hi, dtype=torch.int64, device=dev)
        tier, owner, _slot = r.lookup(ids)
        idx = torch.arange(hi - lo, dtype=torch.int64, device=dev)
        hot, warm, cold = (tier == int(v) for v in TIERS)
        # (destination, block row) pairs: hot rows to every rank, warm rows to their position in every group
        hot_idx = idx[hot]
        warm_idx = idx[warm]
        warm_dest = members[:, owner[warm]].T  # [warm rows, groups]
        pairs_dest = torch.cat([
            ranks.repeat(hot_idx.numel()), warm_dest.reshape(-1), owner[cold]
        ])  # fmt: skip
        pairs_idx = torch.cat([
            hot_idx.repeat_interleave(world),
            warm_idx.repeat_interleave(members.shape[0]),
            idx[cold],
        ])  # fmt: skip
        key = pairs_dest * max(hi - lo, 1) + pairs_idx
        order = torch.argsort(key)  # by destination, then ascending row
        outgoing.append(pairs_idx.index_select(0, order))
        send_rows[:, t] = torch.bincount(pairs_dest, minlength=world).cpu().numpy()
        # what this rank receives: every row it holds, ascending ids (= by source block)
        held = [torch.as_tensor(module.shards[(t, k)].ids, dtype=torch.int64, device=dev) for k in TIERS]
        tier_of = torch.cat(
            [torch.full((h.numel(),), i, dtype=torch.int64, device=dev) for i, h in enumerate(held)]
        )
        slot_of = torch.cat([torch.arange(h.numel(), dtype=torch.int64, device=dev) for h in held])
        all_ids = torch.cat(held)
        by_id = torch.argsort(all_ids, stable=True)
        recv_rows[:, t] = torch.bincount(block_owner(all_ids, n, world), minlength=world).cpu().numpy()
        incoming.append((tier_of.index_select(0, by_id), slot_of.index_select(0, by_id)))

    def rows_of(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = canonical.blocks[module.table_names[t]]
        return torch.cat([_as_rows(block[k]) for k in shapes[t]], dim=1).to(dev), outgoing[t]

    send = _send_buffer(send_rows, widths, rows_of, dev)
    recv, starts = _exchange(send, send_rows, recv_rows, widths)
    del send
    for t in range(len(module.table_names)):
        tier_of, slot_of = incoming[t]
        at = 0
        for p in range(world):
            k = int(recv_rows[p, t])
            rows = recv[int(starts[p, t]) : int(starts[p, t]) + k * int(widths[t])].view(k, int(widths[t]))
            parts = _unflat(rows, shapes[t])
            for i, kind in enumerate(TIERS):
                sel = flat_nonzero(tier_of[at : at + k] == i)
                if not sel.numel():
                    continue
                slots = slot_of[at : at + k].index_select(0, sel)
                for key, dst in _tensors_of(module, t, kind, names).items():
                    dst.index_copy_(0, slots, parts[key].index_select(0, sel))
            at += k
    module.zero_grad()


def empty_canonical(module: ShardedSequenceEmbedding, names: Names = None) -> Canonical:
    """Uninitialised canonical blocks of this rank (templates for a DCP load; ``names``: those tensors)."""
    blocks, lo = {}, []
    for t, (name, r) in enumerate(zip(module.table_names, module.routing, strict=True)):
        a, b = block_bounds(r.num_rows, module.world_size, module.rank)
        shapes = _row_shapes(module, t, names)
        blocks[name] = {k: torch.empty((b - a, *s), device=module.device) for k, s in shapes.items()}
        lo.append(a)
    return Canonical(list(module.table_names), [r.num_rows for r in module.routing], lo, blocks)


def _blocks_problem(module: ShardedSequenceEmbedding, canonical: Canonical, names: Names = None) -> str:
    """'' when ``canonical`` has every table of ``module`` with its tensors in this rank's block shape."""
    for t, (name, r) in enumerate(zip(module.table_names, module.routing, strict=True)):
        block = canonical.blocks.get(name)
        if block is None:
            return f"DCP state: no table {name!r} (it has {sorted(canonical.blocks)})"
        shapes = _row_shapes(module, t, names)
        if set(block) != set(shapes):
            return (
                f"DCP state: table {name!r} has tensors {sorted(block)}, this module's optimizer keeps "
                f"{sorted(shapes)}"
            )
        lo, hi = block_bounds(r.num_rows, module.world_size, module.rank)
        for key, shape in shapes.items():
            if tuple(block[key].shape) != (hi - lo, *shape):
                return (
                    f"DCP state: table {name!r} {key} block is {list(block[key].shape)}, this module needs "
                    f"{[hi - lo, *shape]} (rows {lo}..{hi - 1} of {r.num_rows})"
                )
    return ""


def canonical_of(module: ShardedSequenceEmbedding, blocks: dict[str, dict[str, torch.Tensor]]) -> Canonical:
    """``blocks`` (this rank's, per table and tensor name) as the module's :class:`Canonical`."""
    lo = [block_bounds(r.num_rows, module.world_size, module.rank)[0] for r in module.routing]
    rows = [r.num_rows for r in module.routing]
    return Canonical(list(module.table_names), rows, lo, blocks)


def _agree(error: str, device: torch.device) -> None:
    message = agreed_message(error, device)
    if message:
        raise agreed(CheckpointError(message))


def check_agreed(error: str, device: torch.device) -> None:
    """Raise one CheckpointError on every rank when any rank's ``error`` is not '' (collective)."""
    _agree(error, device)


__all__ = [
    "TIERS",
    "WEIGHT",
    "Canonical",
    "block_bounds",
    "block_owner",
    "canonical_of",
    "check_agreed",
    "empty_canonical",
    "from_canonical",
    "state_names",
    "to_canonical",
]
