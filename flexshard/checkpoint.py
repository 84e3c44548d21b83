"""Sharded checkpoints of a :class:`~flexshard.runtime.ShardedSequenceEmbedding` plus a dense model.

Layout of one checkpoint, ``<dir>/step-00000006/``:

* ``rank<r>.pt`` (one per rank): the rows rank ``r`` is responsible for, with their ids and optimizer
  state, as ``{"rows": {table: {tier: {"ids", "weights", "states": {name: tensor}}}}}`` (the state names
  and shapes of :mod:`flexshard.runtime.optimizers`), and what binds it to
  its checkpoint: the step, the rank, the layout fingerprint and a digest of the run's identity. Every
  row is saved exactly once: hot rows by rank 0 only, warm rows by the ranks of group 0 only (each its
  own warm shard), cold rows by their owner. Rank 0's file also holds the dense model's and the dense
  optimizer's state dicts (replicated, so saved once) and ``extra``.
* ``manifest.json``: schema, step, world size, groups, tables, optimizer and its iteration
  (``optimizer_step``: the module's ``step()`` count, Adam's ``t``), the layout fingerprint (a
  hash of every table's tier / owner / slot maps, i.e. plan and hotness orders), every rank file's name,
  size and sha256, and the run's identity (``run``, :mod:`flexshard.training.resume`; null when not
  given). Reading and validating both is :mod:`flexshard.checkpoint_manifest`: a rank file is unpickled
  only once its size and hash are the manifest's.

Atomicity: every rank writes its file into ``<dir>/.tmp-step-00000006/`` (a ``.part`` file renamed
when complete, hashed as it is written); after all ranks agree that their writes succeeded, rank 0
writes the manifest (also via a rename) and renames the temporary folder to ``step-00000006`` (one
atomic ``rename``). A checkpoint is a ``step-*`` folder *with* a manifest; an interrupted save leaves at
most a ``.tmp-*`` folder, which :func:`latest` ignores and the next save of that step replaces. All
ranks must see the same ``dir`` (a shared file system when ranks are on several hosts).

:func:`load` restores a module of the same world size, groups, tables, optimizer and layout (each is
checked, with a clear error; another world size or other groups: :mod:`flexshard.checkpoint_reshard`):
every rank reads its hot rows from rank 0's file, its warm rows from the
file of the group-0 rank at its position and its cold rows from its own file, and checks the saved
ids equal the ids it holds. :func:`load_full` assembles whole tables (every row exactly once, checked)
for references and tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.checkpoint_manifest import (
    MANIFEST,
    SCHEMA,
    HashingWriter,
    Manifest,
    RankFileRecord,
    TableEntry,
    latest,
    manifest_document,
    read_manifest,
    read_rank_file,
    run_digest,
    written_by_flexshard,
)
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message
from flexshard.runtime.optimizers import canonical, row_optimizer


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{int(step):08d}"


def layout_fingerprint(module: ShardedSequenceEmbedding) -> str:
    """sha256 over the world size, the groups and every table's name, size, dim and row routing."""
    h = hashlib.sha256()
    h.update(json.dumps([module.world_size, module.pg.groups]).encode())
    for r, dim in zip(module.routing, module.dims, strict=True):
        h.update(
            json.dumps([r.layout, r.name, r.num_rows, dim, r.hot_rows, r.warm_rows, r.cold_rows]).encode()
        )
        for arr in r.arrays():
            h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _saves(module: ShardedSequenceEmbedding, tier: Tier) -> bool:
    """Whether this rank saves its rows of ``tier`` (each row exactly once over the cluster)."""
    if tier is Tier.HOT:
        return module.rank == 0
    if tier is Tier.WARM:
        return module.pg.group == 0
    return True


def _atomic_torch_save(obj: Any, path: Path) -> RankFileRecord:
    """``torch.save`` to a ``.part`` file renamed onto ``path`` when complete; its name, size and sha256
    (hashed as it is written, not read back)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        writer = HashingWriter(f)
        try:
            torch.save(obj, writer)
        except Exception as e:  # a Ctrl-C inside the writer: torch's zip writer masks it with its own error
            if isinstance(e.__context__, KeyboardInterrupt):
                raise e.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    return writer.record(path.name)


def _atomic_text(text: str, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def save(
    module: ShardedSequenceEmbedding,
    dense_model: torch.nn.Module,
    dense_optimizer: Any | None,
    step: int,
    directory: str | os.PathLike,
    extra: dict[str, Any] | None = None,
    run: dict[str, str] | None = None,
) -> Path:
    """Save a checkpoint of ``step`` under ``directory`` (collective; see the module docstring);
    ``run``: the run's identity, recorded in the manifest (:mod:`flexshard.training.resume`). Returns the
    checkpoint folder. Raises :class:`CheckpointError` on every rank if any rank failed."""
    directory = Path(directory)
    final = step_dir(directory, step)
    tmp = directory / f".tmp-{final.name}"
    dev = module.device
    error = ""
    if module.rank == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # a save of this step that was interrupted
            tmp.mkdir()
        except OSError as e:
            error = f"cannot create {tmp}: {e.strerror or e}"
    _agree(error, dev, "checkpoint save: ")
    rows: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for (name, tier_name), (ids, w, states) in module.shard_rows().items():
        if _saves(module, Tier.parse(tier_name)):
            rows.setdefault(name, {})[tier_name] = {
                "ids": torch.as_tensor(ids, dtype=torch.int64),
                "weights": w.clone(),
                "states": {n: s.clone() for n, s in states.items()},
            }
    layout = layout_fingerprint(module)
    payload: dict[str, Any] = {
        "format": SCHEMA,
        "rank": module.rank,
        "step": int(step),
        "layout": layout,
        "run": run_digest(run),
        "rows": rows,
    }
    if module.rank == 0:
        payload["dense"] = {k: v.detach().cpu() for k, v in dense_model.state_dict().items()}
        payload["dense_optimizer"] = dense_optimizer.state_dict() if dense_optimizer is not None else None
        payload["extra"] = dict(extra or {})
    name = f"rank{module.rank}.pt"
    record = None
    try:
        record = _atomic_torch_save(payload, tmp / name)
    except OSError as e:
        error = f"rank {module.rank} cannot write {tmp / name}: {e.strerror or e}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (error, record))  # the errors agreed, the records to rank 0
    error = next((e for e, _ in everyone if e), "")
    if error:
        raise agreed(CheckpointError("checkpoint save: " + error))
    if module.rank == 0:
        manifest = manifest_document(
            step,
            module.world_size,
            module.pg.groups,
            [
                TableEntry(n, r.num_rows, d)
                for n, r, d in zip(module.table_names, module.routing, module.dims, strict=True)
            ],
            module.optimizer,
            layout,
            [rec for _, rec in everyone],
            run,
            module.optimizer_step,
        )
        try:
            _atomic_text(json.dumps(manifest, indent=1) + "\n", tmp / MANIFEST)
            if final.exists() and not written_by_flexshard(final):
                error = f"cannot publish {final}: it exists and is not a FlexShard checkpoint; move it away"
            elif final.exists():  # a checkpoint of this step from an earlier run: replace it
                old = directory / f".old-{final.name}"
                if old.exists():
                    shutil.rmtree(old)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
        except OSError as e:
            error = f"cannot publish {final}: {e.strerror or e}"
    _agree(error, dev, "checkpoint save: ")
    return final


def _agree(error: str, device: torch.device, prefix: str = "") -> None:
    """Collective: when any rank has an ``error``, raise the first rank's (in rank order) on every rank,
    as an agreed :class:`CheckpointError` (printed once under torchrun)."""
    message = agreed_message(error, device)
    if message:
        raise agreed(CheckpointError(prefix + message))


def model_mismatch(manifest: Manifest, module: ShardedSequenceEmbedding) -> str:
    """'' when the checkpoint has ``module``'s tables (names, rows, dims) and optimizer, else one line
    saying what differs (what must match at any world size and plan)."""
    where = manifest.where()
    tables = [[t.name, t.num_rows, t.dim] for t in manifest.tables]
    mine = [
        [n, r.num_rows, d] for n, r, d in zip(module.table_names, module.routing, module.dims, strict=True)
    ]
    if tables != mine:
        return f"{where} has tables {tables}, this model has {mine}"
    if canonical(manifest.optimizer) != canonical(module.optimizer):
        return f"{where} was saved with optimizer {manifest.optimizer!r}, this job uses {module.optimizer!r}"
    return ""


def check_compatible(manifest: Manifest, module: ShardedSequenceEmbedding) -> str:
    """'' when ``module`` is what the checkpoint was saved from (world, groups, tables, optimizer, plan),
    else one line saying what differs."""
    where = manifest.where()
    if manifest.world_size != module.world_size:
        return f"{where} was saved by {manifest.world_size} ranks, this job has {module.world_size}"
    if manifest.groups != module.pg.groups:
        return f"{where} was saved with groups {manifest.groups}, this job has {module.pg.groups}"
    problem = model_mismatch(manifest, module)
    if problem:
        return problem
    if manifest.layout != layout_fingerprint(module):
        return f"{where} was saved with a different plan (tiers, owners or hotness orders); use the same plan"
    return ""


def load(
    path: str | os.PathLike,
    module: ShardedSequenceEmbedding,
    dense_model: torch.nn.Module | None = None,
    dense_optimizer: Any | None = None,
) -> int:
    """Restore ``module`` (and the dense model / optimizer) from a checkpoint folder, or from the
    latest checkpoint under ``path``. Collective. Returns the checkpoint's step. Any problem (a malformed
    or foreign manifest or rank file, another world, plan or model) is one CheckpointError, the first
    rank's, raised on every rank."""
    error, manifest = "", None
    try:
        manifest = read_manifest(path)
        error = check_compatible(manifest, module)
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    assert manifest is not None
    files: dict[int, dict[str, Any]] = {}

    def shard(rank: int) -> dict[str, Any]:
        if rank not in files:
            files[rank] = read_rank_file(manifest, rank)
        return files[rank]

    groups = module.pg.groups
    try:
        for (name, tier_name), (ids, _w, _s) in module.shard_rows().items():
            tier = Tier.parse(tier_name)
            src = (
                0 if tier is Tier.HOT else groups[0][module.pg.position] if tier is Tier.WARM else module.rank
            )
            entry = shard(src)["rows"].get(name, {}).get(tier_name)
            saved = np.zeros(0, np.int64) if entry is None else entry["ids"].numpy()
            if not np.array_equal(saved, ids):
                raise CheckpointError(
                    f"{manifest.where()}: rank {src}'s {tier_name} rows of table {name!r} are not the "
                    f"rows rank {module.rank} holds"
                )
            if entry is None:
                continue
            t = module.table_names.index(name)
            held = module.shards[(t, tier)]
            held.weights.copy_(entry["weights"].to(module.device))
            for n, s in entry["states"].items():
                held.states[n].copy_(s.to(module.device))
        load_dense(manifest, shard, dense_model, dense_optimizer)
        module.optimizer_step = manifest.optimizer_step
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    module.zero_grad()
    return manifest.step


def load_dense(manifest: Manifest, shard, dense_model, dense_optimizer) -> None:
    """The dense model's and optimizer's state from rank 0's file (``shard(0)``, its checked payload);
    CheckpointError when it does not fit them (other keys, shapes or optimizer)."""
    try:
        if dense_model is not None:
            dense_model.load_state_dict(shard(0)["dense"])
        if dense_optimizer is not None and shard(0).get("dense_optimizer") is not None:
            dense_optimizer.load_state_dict(shard(0)["dense_optimizer"])
    except (RuntimeError, KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise CheckpointError(f"{manifest.where()}: rank0.pt: {e}") from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{manifest.where()}: rank0.pt: the dense state does not fit this model ({reason[:200]})"
        ) from None


@dataclass
class FullCheckpoint:
    step: int
    manifest: Manifest
    weights: dict[str, torch.Tensor]  # table -> float32[num_rows, dim]
    states: dict[str, dict[str, torch.Tensor]]  # table -> state name -> float32[num_rows, *per row]
    dense: dict[str, torch.Tensor]
    dense_optimizer: dict[str, Any] | None
    extra: dict[str, Any]


def load_full(path: str | os.PathLike) -> FullCheckpoint:
    """Whole tables from all rank files (no process group needed); checks every row is saved once."""
    manifest = read_manifest(path)
    weights, states, seen = {}, {}, {}
    optimizer = row_optimizer(manifest.optimizer)
    for t in manifest.tables:
        try:
            weights[t.name] = torch.zeros(t.num_rows, t.dim)
            shapes = optimizer.state_shapes(t.dim)
            states[t.name] = {n: torch.zeros(t.num_rows, *shape) for n, shape in shapes.items()}
            seen[t.name] = np.zeros(t.num_rows, dtype=np.int64)
        except (RuntimeError, MemoryError, ValueError) as e:
            raise CheckpointError(
                f"{manifest.where()}: table {t.name!r} of {t.num_rows:,} x {t.dim} does not fit in memory "
                f"here ({type(e).__name__})"
            ) from None
    first: dict[str, Any] = {}
    for r in range(manifest.world_size):
        payload = read_rank_file(manifest, r)
        if r == 0:
            first = payload
        for table, tiers in payload["rows"].items():
            for entry in tiers.values():
                ids = entry["ids"]
                weights[table][ids] = entry["weights"]
                for n, s in entry["states"].items():
                    states[table][n][ids] = s
                np.add.at(seen[table], ids.numpy(), 1)
    for table, count in seen.items():
        if (count != 1).any():
            bad = int(np.flatnonzero(count != 1)[0])
            raise CheckpointError(
                f"{manifest.where()}: table {table!r} row {bad} is saved {int(count[bad])} times "
                "(expected exactly once)"
            )
    return FullCheckpoint(
        manifest.step, manifest, weights, states, first["dense"], first["dense_optimizer"], first["extra"]
    )


__all__ = [
    "MANIFEST",
    "SCHEMA",
    "CheckpointError",
    "FullCheckpoint",
    "Manifest",
    "load_dense",
    "model_mismatch",
    "check_compatible",
    "latest",
    "layout_fingerprint",
    "load",
    "load_full",
    "read_manifest",
    "save",
    "step_dir",
]
