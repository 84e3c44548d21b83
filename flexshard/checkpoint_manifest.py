"""A checkpoint's manifest and rank files, validated before anything in them is used.

The manifest (``manifest.json``, schema ``flexshard-checkpoint/3``) binds the checkpoint together: its
step (equal to the folder's ``step-NNNNNNNN``), the world, the tables, the optimizer and its iteration
(``optimizer_step``, Adam's ``t``), the layout fingerprint, the run's identity, and per rank the file's
name (exactly ``rank<r>.pt``, inside the folder), its size in bytes and its sha256. A rank file is read
only after its size and hash match (:func:`verify_rank_file`), so a file copied from another step or
another run, a truncated file or random bytes are refused before unpickling; it is then unpickled without
running code
(``torch.load(weights_only=True)``) and its structure checked (:func:`read_rank_file`): the step, rank,
layout and run it records, every table and tier, tensor dtypes and shapes, ids within the table. Every
problem is one :class:`~core.errors.CheckpointError` line naming the folder and the field or file.

Schema 3 keeps each row's optimizer state as named tensors (``states``: the optimizer's, see
:mod:`flexshard.runtime.optimizers`). Schema 2 (before these optimizers: ``sgd`` or ``adagrad``, one
row-wise accumulator ``state`` per row, no ``optimizer_step``) still reads: its ``state`` becomes
``states = {"momentum1": state}`` for ``adagrad`` (now ``rowwise_adagrad``) and nothing for ``sgd``, and
``optimizer_step`` is 0 (neither optimizer uses it).

These are the readers any code that loads checkpoints uses (:mod:`flexshard.checkpoint`'s ``load`` and
``load_full``, resume at another world size): :func:`read_manifest` -> :class:`Manifest`,
:func:`read_rank_file` -> the payload dict. :func:`loadable_older` finds the newest older checkpoint
that verifies, for the error that refuses the newest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import CheckpointError
from core.vocabulary import Tier
from flexshard.runtime.optimizers import OPTIMIZER_CHOICES, row_optimizer

SCHEMA = "flexshard-checkpoint/3"
SCHEMA_2 = "flexshard-checkpoint/2"  # one row-wise accumulator per row: still read (see above)
SCHEMA_FAMILY = "flexshard-checkpoint/"  # every version of it: folders this tool wrote
MANIFEST = "manifest.json"
BLOCKS_LAYOUT = "blocks"  # layout of a checkpoint converted from DCP: rows in blocks, re-dealt on load
STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 1 << 22  # bytes read at a time while hashing


@dataclass(frozen=True)
class TableEntry:
    """One table as the manifest records it: name, rows, embedding dim."""

    name: str
    num_rows: int
    dim: int


@dataclass(frozen=True)
class RankFileRecord:
    """One rank's file: its name in the checkpoint folder, size in bytes, sha256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A checked manifest. ``path``: the checkpoint folder; ``run``: the run's identity (None when the
    saver gave none)."""

    path: Path
    step: int
    world_size: int
    groups: list[list[int]]
    tables: tuple[TableEntry, ...]
    optimizer: str
    layout: str
    files: tuple[RankFileRecord, ...]
    run: dict[str, str] | None
    optimizer_step: int = 0  # the module's step() count when saved (Adam's t)
    schema: str = SCHEMA  # the schema the checkpoint was written in (2 or 3)

    def where(self) -> str:
        return f"checkpoint {str(self.path)!r}"

    def table(self, name: str) -> TableEntry | None:
        return next((t for t in self.tables if t.name == name), None)

    def document(self) -> dict[str, Any]:
        """The manifest as written to ``manifest.json``."""
        return manifest_document(
            self.step, self.world_size, self.groups, self.tables, self.optimizer, self.layout, self.files,
            self.run, self.optimizer_step,
        )  # fmt: skip


def manifest_document(
    step: int,
    world_size: int,
    groups: list[list[int]],
    tables: tuple[TableEntry, ...] | list[TableEntry],
    optimizer: str,
    layout: str,
    files: tuple[RankFileRecord, ...] | list[RankFileRecord],
    run: dict[str, str] | None,
    optimizer_step: int = 0,
) -> dict[str, Any]:
    """The JSON document of a manifest (schema :data:`SCHEMA`)."""
    return {
        "schema": SCHEMA,
        "step": int(step),
        "world_size": int(world_size),
        "groups": [list(map(int, g)) for g in groups],
        "tables": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim} for t in tables],
        "optimizer": optimizer,
        "optimizer_step": int(optimizer_step),
        "layout": layout,
        "files": [{"name": f.name, "bytes": f.size, "sha256": f.sha256} for f in files],
        "run": dict(run) if run is not None else None,
    }


def run_digest(run: dict[str, str] | None) -> str | None:
    """sha256 of a run identity (canonical JSON), as each rank file records it; None for None."""
    if run is None:
        return None
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()


class HashingWriter:
    """A binary file wrapper that counts and hashes what is written through it (for ``torch.save``)."""

    def __init__(self, file: Any) -> None:
        self.file, self.size, self._hash = file, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def record(self, name: str) -> RankFileRecord:
        return RankFileRecord(name, self.size, self._hash.hexdigest())


# -- the folder ------------------------------------------------------------------------------------------


def step_of(folder: Path) -> int | None:
    """The step a ``step-NNNNNNNN`` folder name says, else None."""
    m = STEP_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def checkpoint_folders(directory: str | os.PathLike) -> list[Path]:
    """The ``step-NNNNNNNN`` folders under ``directory`` that hold a manifest file, newest step first (not
    validated: a damaged newest one is refused when read, with the older ones named)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(step_of(p), p) for p in d.iterdir()]
    return [
        p for s, p in sorted((x for x in found if x[0] is not None), reverse=True) if (p / MANIFEST).is_file()
    ]


def latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint (``step-*`` folder with a manifest) of the highest step under ``directory``, or None."""
    found = checkpoint_folders(directory)
    return found[0] if found else None


def written_by_flexshard(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint this tool wrote: a ``step-NNNNNNNN`` folder whose manifest is a
    JSON object of a ``flexshard-checkpoint/*`` schema (any version)."""
    if step_of(folder) is None or folder.is_symlink() or not folder.is_dir():
        return False
    try:
        doc = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(doc, dict)
        and isinstance(doc.get("schema"), str)
        and (doc["schema"].startswith(SCHEMA_FAMILY))
    )


# -- the manifest ----------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The checked manifest of a checkpoint folder, or of the latest checkpoint under ``path``.
    CheckpointError (one line naming the folder and the field) when there is none or it is malformed."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        found = latest(path)
        if found is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: no complete checkpoint (step-* with {MANIFEST})"
            )
        path = found
    try:
        doc = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable {MANIFEST} ({reason})") from None
    return parse_manifest(doc, path)


def parse_manifest(doc: Any, folder: Path) -> Manifest:
    """``doc`` (a parsed ``manifest.json``) checked field by field against the folder it is in."""
    where = f"checkpoint {str(folder)!r}: {MANIFEST}"

    def bad(field: str, value: Any, expected: str) -> CheckpointError:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        return CheckpointError(f"{where}: field {field!r} = {text}; expected {expected}")

    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    schema = doc.get("schema")
    if schema not in (SCHEMA, SCHEMA_2):
        if isinstance(schema, str) and schema.startswith(SCHEMA_FAMILY):
            raise CheckpointError(
                f"{where}: schema {schema!r} is from another FlexShard version (this one reads {SCHEMA!r} "
                f"and {SCHEMA_2!r}, whose manifests record every rank file's hash); start a fresh run "
                "(here: --overwrite)"
            )
        raise bad("schema", schema, repr(SCHEMA))
    keys = ("step", "world_size", "groups", "tables", "optimizer", "layout", "files", "run")
    for key in keys + (("optimizer_step",) if schema == SCHEMA else ()):
        if key not in doc:
            raise CheckpointError(f"{where}: field {key!r} missing")

    def count(field: str, minimum: int) -> int:
        value = doc[field]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise bad(field, value, f"an integer >= {minimum}")
        return value

    step, world = count("step", 0), count("world_size", 1)
    optimizer_step = count("optimizer_step", 0) if schema == SCHEMA else 0
    named = step_of(folder)
    if named is not None and named != step:
        raise CheckpointError(
            f"{where}: step {step} differs from its folder's {folder.name} (a manifest from another "
            "checkpoint)"
        )
    groups = doc["groups"]
    flat = [r for g in groups for r in g] if isinstance(groups, list) and all(
        isinstance(g, list) and g and all(isinstance(r, int) and not isinstance(r, bool) for r in g)
        for g in groups
    ) else None  # fmt: skip
    if flat is None or len(flat) != world or sorted(flat) != list(range(world)):
        raise bad("groups", groups, f"lists of ranks covering 0..{world - 1} once")
    tables = doc["tables"]
    if not isinstance(tables, list) or not tables:
        raise bad("tables", tables, "a non-empty list of {name, num_rows, dim}")
    entries = []
    for k, t in enumerate(tables):
        ok = (
            isinstance(t, dict)
            and set(t) == {"name", "num_rows", "dim"}
            and isinstance(t["name"], str)
            and all(
                isinstance(t[f], int) and not isinstance(t[f], bool) and 0 < t[f] < limit
                for f, limit in (("num_rows", 2**63), ("dim", 2**31))
            )
        )
        if not ok:
            raise bad(f"tables[{k}]", t, "{name: text, num_rows: 1..2^63-1, dim: 1..2^31-1}")
        entries.append(TableEntry(t["name"], t["num_rows"], t["dim"]))
    if len({t.name for t in entries}) != len(entries):
        raise bad("tables", [t.name for t in entries], "distinct table names")
    for key in ("optimizer", "layout"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise bad(key, doc[key], "a non-empty string")
    known = OPTIMIZER_CHOICES if schema == SCHEMA else ("sgd", "adagrad")
    if doc["optimizer"] not in known:
        raise bad("optimizer", doc["optimizer"], f"one of {', '.join(known)}")
    files = doc["files"]
    if not isinstance(files, list) or len(files) != world:
        raise bad("files", files, f"a list of {world} rank files (one per rank)")
    records = []
    for r, f in enumerate(files):
        name = f"rank{r}.pt"
        ok = (
            isinstance(f, dict)
            and set(f) == {"name", "bytes", "sha256"}
            and isinstance(f["bytes"], int)
            and not isinstance(f["bytes"], bool)
            and f["bytes"] >= 0
            and isinstance(f["sha256"], str)
            and _SHA256.match(f["sha256"]) is not None
        )
        if not ok:
            raise bad(f"files[{r}]", f, "{name, bytes, sha256}")
        if f["name"] != name:
            raise bad(f"files[{r}].name", f["name"], f"{name!r} (a file inside the checkpoint folder)")
        records.append(RankFileRecord(name, f["bytes"], f["sha256"]))
    run = doc["run"]
    if run is not None and not (isinstance(run, dict) and all(isinstance(v, str) for v in run.values())):
        raise bad("run", run, "null or an object of strings")
    return Manifest(
        folder, step, world, [list(g) for g in groups], tuple(entries), doc["optimizer"], doc["layout"],
        tuple(records), run, optimizer_step, schema,
    )  # fmt: skip


# -- the rank files --------------------------------------------------------------------------------------


def verify_rank_file(manifest: Manifest, rank: int) -> Path:
    """The path of ``rank``'s file once it is a regular file in the folder whose size and sha256 are the
    manifest's; else CheckpointError (a missing, replaced, truncated or foreign file)."""
    record = manifest.files[rank]
    path = manifest.path / record.name
    where = f"{manifest.where()}: {record.name}"
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{where}: not a regular file (a rank file is never a link or a folder)")
    if st.st_size != record.size:
        raise CheckpointError(
            f"{where}: {st.st_size} bytes, the manifest records {record.size} (truncated, damaged, or a file "
            "of another checkpoint)"
        )
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot read ({e.strerror or e})") from None
    if h.hexdigest() != record.sha256:
        raise CheckpointError(
            f"{where}: its sha256 is not the one the manifest records (damaged, or a file of another "
            "checkpoint)"
        )
    return path


def read_rank_file(manifest: Manifest, rank: int, mmap: bool = False) -> dict[str, Any]:
    """``rank``'s payload, verified (:func:`verify_rank_file`), unpickled without running code and checked
    (:func:`check_payload`). CheckpointError on any problem. ``mmap``: tensors stay mapped from the file
    (read as they are used), for a reader that needs a few rows of each."""
    path = verify_rank_file(manifest, rank)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001  any failure to unpickle is a malformed file, not a bug here
        raise CheckpointError(
            f"{manifest.where()}: cannot read {path.name} (not a FlexShard rank file: {type(e).__name__})"
        ) from None
    return check_payload(payload, manifest, rank)


def _show(value: Any) -> str:
    """``repr(value)`` on one line, at most 80 characters (a value from a file can be anything)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _is_tensor(x: Any, dtype: torch.dtype, ndim: int) -> bool:
    return isinstance(x, torch.Tensor) and x.layout == torch.strided and x.dtype == dtype and x.dim() == ndim


def check_payload(payload: Any, manifest: Manifest, rank: int) -> dict[str, Any]:
    """``payload`` when it is ``rank``'s file of this checkpoint: the step, rank, layout and run it records
    are the manifest's, and every table, tier and tensor is well formed (ids int64 within the table,
    weights float32 ``[n, dim]``, each optimizer state float32 ``[n, *shape per row]``; hot rows only in
    rank 0's file, warm rows only in group 0's); rank 0's also holds the dense state. Else
    CheckpointError."""
    where = f"{manifest.where()}: {manifest.files[rank].name}"
    form = payload.get("format") if isinstance(payload, dict) else None
    if not isinstance(form, str) or form != manifest.schema:
        raise CheckpointError(f"{where}: not a FlexShard rank file of schema {manifest.schema!r}")
    for key, want in (
        ("rank", rank),
        ("step", manifest.step),
        ("layout", manifest.layout),
        ("run", run_digest(manifest.run)),
    ):
        got = payload.get(key)
        if type(got) is not type(want) or got != want:  # a value from a file: compared by type first
            raise CheckpointError(f"{where}: records {key} {_show(got)}, the manifest {want!r}")
    rows = payload.get("rows")
    if not isinstance(rows, dict):
        raise CheckpointError(f"{where}: 'rows' is not a table -> tier mapping")
    for name, tiers in rows.items():
        table = manifest.table(name) if isinstance(name, str) else None
        if table is None or not isinstance(tiers, dict):
            raise CheckpointError(f"{where}: rows of {_show(name)}, which is not a table of the manifest")
        for tier_name, entry in tiers.items():
            _check_entry(where, table, tier_name, entry, rank, manifest)
            if manifest.schema == SCHEMA_2:  # the row-wise accumulator, named as schema 3 names it
                state = entry.pop("state")
                entry["states"] = {"momentum1": state} if manifest.optimizer == "adagrad" else {}
    if rank == 0:
        dense, opt, extra = payload.get("dense"), payload.get("dense_optimizer"), payload.get("extra")
        if not isinstance(dense, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in dense.items()
        ):
            raise CheckpointError(f"{where}: 'dense' is not a state dict of tensors")
        if opt is not None and not isinstance(opt, dict):
            raise CheckpointError(f"{where}: 'dense_optimizer' is not a state dict")
        if not isinstance(extra, dict):
            raise CheckpointError(f"{where}: 'extra' is not a mapping")
    return payload


def _check_entry(
    where: str, table: TableEntry, tier_name: Any, entry: Any, rank: int, manifest: Manifest
) -> None:
    what, group0 = f"{where}: table {table.name!r} tier {_show(tier_name)}", manifest.groups[0]
    if not isinstance(tier_name, str) or tier_name not in [t.label for t in Tier]:
        raise CheckpointError(f"{what}: not a tier (hot, warm, cold)")
    if (tier_name == Tier.HOT.label and rank != 0) or (tier_name == Tier.WARM.label and rank not in group0):
        raise CheckpointError(f"{what}: rank {rank}'s file never holds these rows")
    state_key = "states" if manifest.schema == SCHEMA else "state"
    if not isinstance(entry, dict) or set(entry) != {"ids", "weights", state_key}:
        raise CheckpointError(f"{what}: expected ids, weights and {state_key}")
    ids, weights = entry["ids"], entry["weights"]
    if not _is_tensor(ids, torch.int64, 1):
        raise CheckpointError(f"{what}: ids are not a 1-D int64 tensor")
    n = int(ids.shape[0])
    if not _is_tensor(weights, torch.float32, 2) or tuple(weights.shape) != (n, table.dim):
        raise CheckpointError(f"{what}: weights are not float32 [{n}, {table.dim}]")
    if manifest.schema == SCHEMA_2:
        shapes, states = {"state": ()}, {"state": entry["state"]}
    else:
        shapes, states = row_optimizer(manifest.optimizer).state_shapes(table.dim), entry["states"]
    if not isinstance(states, dict) or set(states) != set(shapes):
        raise CheckpointError(f"{what}: optimizer states are not {sorted(shapes)} ({manifest.optimizer})")
    for name, shape in shapes.items():
        s = states[name]
        if not _is_tensor(s, torch.float32, 1 + len(shape)) or tuple(s.shape) != (n, *shape):
            raise CheckpointError(f"{what}: optimizer state {name!r} is not float32 {[n, *shape]}")
    if n and (int(ids.min()) < 0 or int(ids.max()) >= table.num_rows):
        raise CheckpointError(
            f"{what}: ids {int(ids.min())}..{int(ids.max())} outside the table's 0..{table.num_rows - 1}"
        )


# -- the newest that would load --------------------------------------------------------------------------


def loadable_older(
    directory: str | os.PathLike, below_step: int, accept: Callable[[Manifest], str]
) -> Path | None:
    """The newest checkpoint under ``directory`` of a step below ``below_step`` whose manifest reads, whose
    rank files all match their sizes and hashes, and that ``accept`` (a problem, or '') takes; or None."""
    for folder in checkpoint_folders(directory):
        step = step_of(folder)
        if step is None or step >= below_step:
            continue
        try:
            manifest = read_manifest(folder)
            for r in range(manifest.world_size):
                verify_rank_file(manifest, r)
        except CheckpointError:
            continue
        if not accept(manifest):
            return folder
    return None
