"""Sharded checkpoints of a :class:`~flexshard.runtime.ShardedSequenceEmbedding` plus a dense model.

Layout of one checkpoint, ``<dir>/step-00000006/``:

* ``rank<r>.pt`` (one per rank): the rows rank ``r`` is responsible for, with their ids and row-wise
  optimizer state, as ``{"rows": {table: {tier: {"ids", "weights", "state"}}}}``. Every row is saved
  exactly once: hot rows by rank 0 only, warm rows by the ranks of group 0 only (each its own warm
  shard), cold rows by their owner. Rank 0's file also holds the dense model's and the dense
  optimizer's state dicts (replicated, so saved once) and ``extra``.
* ``manifest.json``: schema, step, world size, groups, tables, optimizer, the layout fingerprint (a
  hash of every table's tier / owner / slot maps, i.e. plan and hotness orders), the rank files and
  the run's identity (``run``, :mod:`flexshard.training.resume`; null when not given).

Atomicity: every rank writes its file into ``<dir>/.tmp-step-00000006/`` (a ``.part`` file renamed
when complete); after all ranks agree that their writes succeeded, rank 0 writes the manifest (also
via a rename) and renames the temporary folder to ``step-00000006`` (one atomic ``rename``). A
checkpoint is a ``step-*`` folder *with* a manifest; an interrupted save leaves at most a ``.tmp-*``
folder, which :func:`latest` ignores and the next save of that step replaces. All ranks must see the
same ``dir`` (a shared file system when ranks are on several hosts).

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
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.cli_common import first_line
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message

SCHEMA = "flexshard-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


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


def _atomic_torch_save(obj: Any, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


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
    for (name, tier_name), (ids, w, s) in module.shard_rows().items():
        if _saves(module, Tier.parse(tier_name)):
            rows.setdefault(name, {})[tier_name] = {
                "ids": torch.as_tensor(ids, dtype=torch.int64),
                "weights": w.clone(),
                "state": s.clone(),
            }
    payload: dict[str, Any] = {"rank": module.rank, "rows": rows}
    if module.rank == 0:
        payload["dense"] = {k: v.detach().cpu() for k, v in dense_model.state_dict().items()}
        payload["dense_optimizer"] = dense_optimizer.state_dict() if dense_optimizer is not None else None
        payload["extra"] = dict(extra or {})
    try:
        _atomic_torch_save(payload, tmp / f"rank{module.rank}.pt")
    except OSError as e:
        error = f"rank {module.rank} cannot write {tmp / f'rank{module.rank}.pt'}: {e.strerror or e}"
    _agree(error, dev, "checkpoint save: ")
    if module.rank == 0:
        manifest = {
            "schema": SCHEMA,
            "step": int(step),
            "world_size": module.world_size,
            "groups": module.pg.groups,
            "tables": [
                {"name": n, "num_rows": r.num_rows, "dim": d}
                for n, r, d in zip(module.table_names, module.routing, module.dims, strict=True)
            ],
            "optimizer": module.optimizer,
            "layout": layout_fingerprint(module),
            "files": [f"rank{r}.pt" for r in range(module.world_size)],
            "run": dict(run) if run is not None else None,
        }
        try:
            _atomic_text(json.dumps(manifest, indent=1) + "\n", tmp / MANIFEST)
            if final.exists():  # a checkpoint of this step from an earlier run: replace it
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


def latest(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint (``step-*`` folder with a manifest) of the highest step, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in directory.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MANIFEST).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return best[1] if best else None


def _resolve(path: str | os.PathLike) -> Path:
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"checkpoint {str(path)!r}: no complete checkpoint (step-* with {MANIFEST})")
    return found


def _agree(error: str, device: torch.device, prefix: str = "") -> None:
    """Collective: when any rank has an ``error``, raise the first rank's (in rank order) on every rank,
    as an agreed :class:`CheckpointError` (printed once under torchrun)."""
    message = agreed_message(error, device)
    if message:
        raise agreed(CheckpointError(prefix + message))


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    path = _resolve(path)
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable manifest ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CheckpointError(f"checkpoint {str(path)!r}: manifest schema must be {SCHEMA!r}")
    doc["path"] = str(path)
    return doc


def _check_compatible(doc: dict[str, Any], module: ShardedSequenceEmbedding) -> str:
    where = f"checkpoint {doc['path']!r}"
    if doc["world_size"] != module.world_size:
        return f"{where} was saved by {doc['world_size']} ranks, this job has {module.world_size}"
    if doc["groups"] != module.pg.groups:
        return f"{where} was saved with groups {doc['groups']}, this job has {module.pg.groups}"
    tables = [[t["name"], t["num_rows"], t["dim"]] for t in doc["tables"]]
    mine = [
        [n, r.num_rows, d] for n, r, d in zip(module.table_names, module.routing, module.dims, strict=True)
    ]
    if tables != mine:
        return f"{where} has tables {tables}, this model has {mine}"
    if doc["optimizer"] != module.optimizer:
        return f"{where} was saved with optimizer {doc['optimizer']!r}, this job uses {module.optimizer!r}"
    if doc["layout"] != layout_fingerprint(module):
        return f"{where} was saved with a different plan (tiers, owners or hotness orders); use the same plan"
    return ""


def _load_file(path: Path, name: str) -> dict[str, Any]:
    """One rank file, loaded without running pickled code (``weights_only``); CheckpointError when it is
    unreadable, not a checkpoint file, or holds anything but tensors and plain containers."""
    try:
        payload = torch.load(path / name, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
        reason = first_line(e) if not isinstance(e, pickle.UnpicklingError) else "not a FlexShard rank file"
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {name} ({reason})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {name} is not a FlexShard rank file")
    return payload


def load(
    path: str | os.PathLike,
    module: ShardedSequenceEmbedding,
    dense_model: torch.nn.Module | None = None,
    dense_optimizer: Any | None = None,
) -> int:
    """Restore ``module`` (and the dense model / optimizer) from a checkpoint folder, or from the
    latest checkpoint under ``path``. Collective. Returns the checkpoint's step."""
    error, step = "", -1
    try:
        doc = read_manifest(path)
        error = _check_compatible(doc, module)
        step = int(doc["step"])
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    ckpt = Path(doc["path"])
    files: dict[int, dict[str, Any]] = {}

    def shard(rank: int) -> dict[str, Any]:
        if rank not in files:
            files[rank] = _load_file(ckpt, doc["files"][rank])
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
                    f"checkpoint {str(ckpt)!r}: rank {src}'s {tier_name} rows of table {name!r} are not the "
                    f"rows rank {module.rank} holds"
                )
            if entry is None:
                continue
            t = module.table_names.index(name)
            held = module.shards[(t, tier)]
            held.weights.copy_(entry["weights"].to(module.device))
            held.state.copy_(entry["state"].to(module.device))
        if dense_model is not None:
            dense_model.load_state_dict(shard(0)["dense"])
        if dense_optimizer is not None and shard(0).get("dense_optimizer") is not None:
            dense_optimizer.load_state_dict(shard(0)["dense_optimizer"])
    except CheckpointError as e:
        error = str(e)
    _agree(error, module.device)
    module.zero_grad()
    return step


@dataclass
class FullCheckpoint:
    step: int
    manifest: dict[str, Any]
    weights: dict[str, torch.Tensor]  # table -> float32[num_rows, dim]
    state: dict[str, torch.Tensor]  # table -> float32[num_rows]
    dense: dict[str, torch.Tensor]
    dense_optimizer: dict[str, Any] | None
    extra: dict[str, Any]


def load_full(path: str | os.PathLike) -> FullCheckpoint:
    """Whole tables from all rank files (no process group needed); checks every row is saved once."""
    doc = read_manifest(path)
    ckpt = Path(doc["path"])
    weights, state, seen = {}, {}, {}
    for t in doc["tables"]:
        weights[t["name"]] = torch.zeros(t["num_rows"], t["dim"])
        state[t["name"]] = torch.zeros(t["num_rows"])
        seen[t["name"]] = np.zeros(t["num_rows"], dtype=np.int64)
    first: dict[str, Any] = {}
    for r, name in enumerate(doc["files"]):
        payload = _load_file(ckpt, name)
        if r == 0:
            first = payload
        for table, tiers in payload["rows"].items():
            for entry in tiers.values():
                ids = entry["ids"]
                weights[table][ids] = entry["weights"]
                state[table][ids] = entry["state"]
                np.add.at(seen[table], ids.numpy(), 1)
    for table, count in seen.items():
        if (count != 1).any():
            bad = int(np.flatnonzero(count != 1)[0])
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r}: table {table!r} row {bad} is saved {int(count[bad])} times "
                "(expected exactly once)"
            )
    return FullCheckpoint(
        int(doc["step"]),
        doc,
        weights,
        state,
        first.get("dense", {}),
        first.get("dense_optimizer"),
        first.get("extra", {}),
    )


__all__ = [
    "CheckpointError",
    "FullCheckpoint",
    "latest",
    "layout_fingerprint",
    "load",
    "load_full",
    "read_manifest",
    "save",
    "step_dir",
]
