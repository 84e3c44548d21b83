"""Loading a checkpoint at another world size or other groups: every rank's rows re-dealt from the old
rank files.

A checkpoint holds every row exactly once, with its global id, wherever it was (:mod:`flexshard.checkpoint`:
hot rows in rank 0's file, warm rows in group 0's files, cold rows in their owner's). A module built for
another world runs another plan (remade for the new world, or given), so each rank now holds other rows
in each tier. :func:`load_resharded` fills them, with their optimizer state:

* each rank opens every old rank file once, memory-mapped (only the pages it reads are loaded);
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
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.checkpoint import read_manifest
from flexshard.cli_common import first_line
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message

CHUNK_IDS = 1 << 22  # saved ids looked up at once: 4 Mi ids, ~150 MiB of scratch
TIERS = (Tier.HOT, Tier.WARM, Tier.COLD)


def is_resize(manifest: dict[str, Any], module: ShardedSequenceEmbedding) -> bool:
    """Whether the checkpoint of ``manifest`` was saved by another world size or other groups than
    ``module``'s (then :func:`load_resharded` loads it; :func:`flexshard.checkpoint.load` refuses it)."""
    return manifest["world_size"] != module.world_size or manifest["groups"] != module.pg.groups


def describe_resize(manifest: dict[str, Any], module: ShardedSequenceEmbedding, batch_per_rank: int) -> str:
    """One log phrase: the old and the new world, and what happens to the global batch."""
    old, new = manifest["world_size"], module.world_size
    return (
        f"rows re-dealt from {old} ranks in groups {manifest['groups']} to {new} ranks in groups "
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
        offsets = np.concatenate([[0], np.cumsum([a.size for a in ids])]).astype(np.int64)
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


def _open_rank_file(path: Path, name: str) -> dict[str, Any]:
    """One old rank file, memory-mapped and loaded without running pickled code; CheckpointError when it
    is unreadable or not a rank file."""
    try:
        payload = torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
        reason = first_line(e) if not isinstance(e, pickle.UnpicklingError) else "not a FlexShard rank file"
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {name} ({reason})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {name} is not a FlexShard rank file")
    return payload


def _compatibility(doc: dict[str, Any], module: ShardedSequenceEmbedding) -> str:
    """'' when the checkpoint has the module's tables (names, rows, dims) and optimizer, else why not."""
    where = f"checkpoint {doc['path']!r}"
    tables = [[t["name"], t["num_rows"], t["dim"]] for t in doc["tables"]]
    mine = [
        [n, r.num_rows, d] for n, r, d in zip(module.table_names, module.routing, module.dims, strict=True)
    ]
    if tables != mine:
        return f"{where} has tables {tables}, this model has {mine}"
    if doc["optimizer"] != module.optimizer:
        return f"{where} was saved with optimizer {doc['optimizer']!r}, this job uses {module.optimizer!r}"
    if len(doc["files"]) != doc["world_size"]:
        return f"{where} lists {len(doc['files'])} rank files for {doc['world_size']} ranks"
    return ""


def _entry(where: str, table: str, tier: str, entry: Any, num_rows: int, dim: int):
    """A saved ``(table, tier)`` entry's ids (numpy), weights and state, checked."""
    ok = isinstance(entry, dict) and all(
        isinstance(entry.get(k), torch.Tensor) for k in ("ids", "weights", "state")
    )
    if ok:
        ids, w, s = entry["ids"], entry["weights"], entry["state"]
        n = ids.shape[0] if ids.dim() == 1 else -1
        ok = (
            ids.dtype == torch.int64
            and n >= 0
            and tuple(w.shape) == (n, dim)
            and w.dtype == torch.float32
            and tuple(s.shape) == (n,)
            and s.dtype == torch.float32
        )
    if not ok:
        raise CheckpointError(
            f"{where}: table {table!r} {tier} rows are not ids, [rows, {dim}] weights, state"
        )
    ids_np = ids.numpy()
    if ids_np.size and (int(ids_np.min()) < 0 or int(ids_np.max()) >= num_rows):
        raise CheckpointError(f"{where}: table {table!r} {tier} rows have ids outside 0..{num_rows - 1}")
    return ids_np, w, s


def _copy_from(payload: dict[str, Any], where: str, module: ShardedSequenceEmbedding, held: list[HeldRows]):
    """Copy the rows of one old rank file that this rank holds into ``module``'s shards."""
    dev = module.device
    for table, tiers in payload["rows"].items():
        if table not in module.table_names or not isinstance(tiers, dict):
            raise CheckpointError(f"{where}: table {table!r} is not one of {module.table_names}")
        t = module.table_names.index(table)
        num_rows, dim = module.routing[t].num_rows, module.dims[t]
        for tier_name, entry in tiers.items():
            ids, w, s = _entry(where, table, str(tier_name), entry, num_rows, dim)
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
                    shard.state.index_copy_(0, slots, s.index_select(0, rows).to(dev))


def _load_dense(payload: dict[str, Any], where: str, dense_model, dense_optimizer) -> None:
    """The dense model's and optimizer's state from rank 0's file (replicated: saved once)."""
    try:
        if dense_model is not None:
            dense_model.load_state_dict(payload["dense"])
    except (KeyError, RuntimeError) as e:  # no dense state, or another model's
        raise CheckpointError(f"{where}: the dense model's state does not fit ({first_line(e)})") from None
    if dense_optimizer is not None and payload.get("dense_optimizer") is not None:
        dense_optimizer.load_state_dict(payload["dense_optimizer"])


def load_resharded(
    path: str | os.PathLike,
    module: ShardedSequenceEmbedding,
    dense_model: torch.nn.Module | None = None,
    dense_optimizer: Any | None = None,
) -> int:
    """Restore ``module`` (any world size, groups and plan) and the dense model / optimizer from the
    checkpoint folder ``path``, or the latest under it (see the module docstring). The tables (names,
    rows, dims) and the optimizer must be the checkpoint's. Collective; returns the checkpoint's step."""
    error, step, doc = "", -1, None
    try:
        doc = read_manifest(path)
        error = _compatibility(doc, module)
        step = int(doc["step"])
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    ckpt = Path(doc["path"])
    held = [
        HeldRows.of([module.shards[(t, kind)].ids for kind in TIERS]) for t in range(len(module.table_names))
    ]
    try:
        for name in doc["files"]:
            payload = _open_rank_file(ckpt, name)
            _copy_from(payload, f"checkpoint {str(ckpt)!r}: {name}", module, held)
            if name == doc["files"][0]:
                _load_dense(payload, f"checkpoint {str(ckpt)!r}: {name}", dense_model, dense_optimizer)
            del payload
        for table, rows in zip(module.table_names, held, strict=True):
            lost = rows.missing()
            if lost >= 0:
                raise CheckpointError(
                    f"checkpoint {str(ckpt)!r}: table {table!r} row {lost} (held by rank {module.rank}) is "
                    "in no rank file"
                )
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    module.zero_grad()
    return step


def _agree(error: str, device: torch.device) -> None:
    """Raise the first rank's ``error`` (rank order) on every rank as an agreed CheckpointError."""
    message = agreed_message(error, device)
    if message:
        raise agreed(CheckpointError(message))


__all__ = ["CHUNK_IDS", "HeldRows", "describe_resize", "is_resize", "load_resharded"]
