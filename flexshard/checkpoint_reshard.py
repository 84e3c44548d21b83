"""Loading a checkpoint at another world size, other groups or another plan: every rank's rows re-dealt
from the old rank files.

A checkpoint holds every row exactly once, with its global id, wherever it was (:mod:`flexshard.checkpoint`:
hot rows in rank 0's file, warm rows in group 0's files, cold rows in their owner's). A module built for
another world runs another plan (remade for the new world, or given), so each rank now holds other rows
in each tier. :func:`load_resharded` fills them, with their optimizer state:

* each rank reads every old rank file once: its size and sha256 checked against the manifest, then
  memory-mapped and checked (:func:`~flexshard.checkpoint_manifest.read_rank_file`);
* :class:`HeldRows` lists the ids the rank holds in any tier of a table, sorted; each saved
  ``(table, tier)`` entry's ids are looked up in it by binary search (``np.searchsorted``, keys sorted
  first), in chunks of :data:`CHUNK_IDS` ids, so an old cold row may land in a new hot, warm or cold shard;
* only the matched rows' weights and state are read and copied (``index_select`` / ``index_copy_``);
* every held row must be found exactly once over the old files, else a :class:`CheckpointError`.

Memory per rank: its own rows (already allocated by the module), 17 bytes per row it holds (sorted ids,
their order, a found mark) and one chunk. From each old file it reads the ids (8 bytes per saved row) and
the rows it holds; the mapped file pages are the page cache's, not the process's own memory (a 420 MB
rank file, its ids and 2% of its rows read: 24 MB more anonymous memory). The dense model and the dense
optimizer are replicated: they load from rank 0's file, as in :func:`flexshard.checkpoint.load`.
Collective, with one agreed error on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.arrays import block_bounds
from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.checkpoint import layout_fingerprint, load_dense, model_mismatch
from flexshard.checkpoint_manifest import BLOCKS_LAYOUT, Manifest, read_manifest, read_rank_file
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message

CHUNK_IDS = 1 << 22  # saved ids looked up at once: 4 Mi ids, ~150 MiB of scratch
TIERS = (Tier.HOT, Tier.WARM, Tier.COLD)


def is_resize(manifest: Manifest, module: ShardedSequenceEmbedding) -> bool:
    """Whether the checkpoint of ``manifest`` was saved by another world size or other groups than
    ``module``'s, or holds its rows in blocks (converted from DCP, :mod:`flexshard.checkpoint_dcp`): then
    :func:`load_resharded` loads it (:func:`flexshard.checkpoint.load` refuses it)."""
    return (
        manifest.world_size != module.world_size
        or manifest.groups != module.pg.groups
        or manifest.layout == BLOCKS_LAYOUT
    )


def needs_redeal(manifest: Manifest, module: ShardedSequenceEmbedding) -> bool:
    """Whether :func:`load_resharded` loads the checkpoint of ``manifest``: :func:`is_resize`, or the same
    world laid out by another plan (re-planned, e.g. from fresh statistics, or the same plan laid out by
    another FlexShard version): each row is then found by its id."""
    return is_resize(manifest, module) or manifest.layout != layout_fingerprint(module)


def describe_resize(manifest: Manifest, module: ShardedSequenceEmbedding, batch_per_rank: int) -> str:
    """One log phrase: the old and the new world, and what happens to the global batch (the same world:
    the rows re-dealt to this run's plan)."""
    old, new = manifest.world_size, module.world_size
    if not is_resize(manifest, module):
        return (
            f"rows re-dealt by id to this run's plan for {new} ranks in groups {module.pg.groups} (the "
            "checkpoint's plan put rows in other tiers, owners or slots)"
        )
    return (
        f"rows re-dealt from {old} ranks in groups {manifest.groups} to {new} ranks in groups "
        f"{module.pg.groups}; global batch {new} x {batch_per_rank} samples (was {old} x {batch_per_rank})"
    )


@dataclass
class HeldRows:
    """The rows one rank holds of one table, over its tiers, as one sorted id list (:meth:`of` each tier's
    ids in slot order, tiers in :data:`TIERS` order); :meth:`place` says where saved ids go."""

    sorted_ids: np.ndarray  # int64[n]: every held id, ascending
    order: np.ndarray  # int64[n]: sorted_ids[i] is the concatenated tiers' row order[i]
    offsets: np.ndarray  # int64[len(TIERS) + 1]: where each tier starts in the concatenation
    found: np.ndarray  # bool[n]: sorted_ids[i] was found in a saved entry

    @classmethod
    def of(cls, ids: list[np.ndarray]) -> HeldRows:
        """From each tier's ids in slot order (a rank holds a row in one tier at most)."""
        offsets = block_bounds([a.size for a in ids])
        joined = np.concatenate([np.asarray(a, dtype=np.int64) for a in ids])
        order = np.argsort(joined, kind="stable").astype(np.int64)
        sorted_ids = joined[order]
        if sorted_ids.size > 1 and (np.diff(sorted_ids) == 0).any():
            raise ValueError("HeldRows: an id is held twice")
        return cls(sorted_ids, order, offsets, np.zeros(sorted_ids.size, dtype=bool))

    def place(self, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """For ``saved`` ids (int64): the indices into ``saved`` of the ids held here, their tier index
        and slot, and -1 or the first id seen twice (held and already found, or twice in ``saved``).
        Marks the held ones found."""
        n = self.sorted_ids.size
        if n == 0 or saved.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, -1
        by_id = np.argsort(saved)  # sorted keys: the binary searches share their cache lines
        pos = np.minimum(np.searchsorted(self.sorted_ids, saved[by_id]), n - 1)
        hit = np.flatnonzero(self.sorted_ids[pos] == saved[by_id])
        repeated = np.flatnonzero(np.diff(pos[hit]) == 0)  # hits in id order: a repeat is adjacent
        if repeated.size:
            return hit, hit, hit, int(self.sorted_ids[pos[hit[repeated[0]]]])
        src = by_id[hit]
        keep = np.argsort(src)  # back to file order: the rows are read in ascending order
        src, at = src[keep], pos[hit[keep]]
        again = self.found[at]
        if again.any():
            return src, at, at, int(saved[src[np.argmax(again)]])
        self.found[at] = True
        row = self.order[at]
        tier = np.searchsorted(self.offsets, row, side="right") - 1
        return src, tier, row - self.offsets[tier], -1

    def missing(self) -> int:
        """-1, or the first held id not found yet."""
        lost = np.flatnonzero(~self.found)
        return int(self.sorted_ids[lost[0]]) if lost.size else -1


def compatibility(manifest: Manifest, module: ShardedSequenceEmbedding) -> str:
    """'' when ``module`` can load the checkpoint of ``manifest`` re-dealt (its tables and optimizer are the
    checkpoint's; world, groups and plan may differ), else one line saying what differs."""
    return model_mismatch(manifest, module)


def _copy_from(payload: dict[str, Any], where: str, module: ShardedSequenceEmbedding, held: list[HeldRows]):
    """Copy the rows of one old rank file (its payload checked by
    :func:`~flexshard.checkpoint_manifest.read_rank_file`) that this rank holds into ``module``'s shards."""
    dev = module.device
    for table, tiers in payload["rows"].items():
        if table not in module.table_names:
            raise CheckpointError(f"{where}: table {table!r} is not one of {module.table_names}")
        t = module.table_names.index(table)
        for entry in tiers.values():
            ids, w, states = entry["ids"].numpy(), entry["weights"], entry["states"]
            for start in range(0, ids.size, CHUNK_IDS):  # one pass per chunk of ids
                src, tier, slot, twice = held[t].place(ids[start : start + CHUNK_IDS])
                if twice >= 0:
                    raise CheckpointError(f"{where}: table {table!r} row {twice} is saved more than once")
                for k, kind in enumerate(TIERS):
                    sel = tier == k
                    if not sel.any():
                        continue
                    rows = torch.from_numpy(src[sel] + start)
                    slots = torch.from_numpy(slot[sel]).to(dev)
                    shard = module.shards[(t, kind)]
                    shard.weights.index_copy_(0, slots, w.index_select(0, rows).to(dev))
                    for n, s in states.items():
                        shard.states[n].index_copy_(0, slots, s.index_select(0, rows).to(dev))


def load_resharded(
    path: str | os.PathLike,
    module: ShardedSequenceEmbedding,
    dense_model: torch.nn.Module | None = None,
    dense_optimizer: Any | None = None,
) -> int:
    """Restore ``module`` (any world size, groups and plan) and the dense model / optimizer from the
    checkpoint folder ``path``, or the latest under it (see the module docstring). The tables (names,
    rows, dims) and the optimizer must be the checkpoint's. Collective; returns the checkpoint's step."""
    error, manifest = "", None
    try:
        manifest = read_manifest(path)
        error = compatibility(manifest, module)
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    held = [
        HeldRows.of([module.shards[(t, kind)].ids for kind in TIERS]) for t in range(len(module.table_names))
    ]
    try:
        for rank, record in enumerate(manifest.files):
            payload = read_rank_file(manifest, rank, mmap=True)  # size and hash checked before unpickling
            _copy_from(payload, f"{manifest.where()}: {record.name}", module, held)
            if rank == 0:
                load_dense(manifest, lambda _r, p=payload: p, dense_model, dense_optimizer)
            del payload
        for table, rows in zip(module.table_names, held, strict=True):
            lost = rows.missing()
            if lost >= 0:
                raise CheckpointError(
                    f"{manifest.where()}: table {table!r} row {lost} (held by rank {module.rank}) is in no "
                    "rank file"
                )
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    module.zero_grad()
    module.optimizer_step = manifest.optimizer_step
    return manifest.step


def _agree(error: str, device: torch.device) -> None:
    """Raise the first rank's ``error`` (rank order) on every rank as an agreed CheckpointError."""
    message = agreed_message(error, device)
    if message:
        raise agreed(CheckpointError(message))


__all__ = [
    "CHUNK_IDS",
    "HeldRows",
    "compatibility",
    "describe_resize",
    "is_resize",
    "load_resharded",
    "needs_redeal",
]
