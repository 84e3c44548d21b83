"""``torch.distributed.checkpoint`` (DCP) checkpoints of a sharded embedding, and the conversion between
them and ``flexshard train``'s own checkpoints (:mod:`flexshard.checkpoint`).

In a job, :func:`save_dcp` / :func:`load_dcp` save and load the module's DCP state
(:mod:`flexshard.runtime.dcp_state`: every row once, as TorchRec keys it) plus any other state dicts
(``others``, e.g. ``{"dense": model.state_dict()}``), at any world size and plan. :func:`load_dcp` first
compares the checkpoint's metadata with the module (every table's weights and optimizer state present,
of the same shape, no other optimizer state): a difference is one line, on every rank.

Conversion (offline, one process, whole tables in memory: ``num_rows * (dim + state) * 4`` bytes per
table), ``flexshard convert-checkpoint SRC DST`` (the direction is what SRC is):

* **flexshard -> DCP** (:func:`flexshard_to_dcp`): the tables and their optimizer states as
  ``model.embeddings.<t>.weight`` and ``optim.state.embeddings.<t>.weight.<t>.<state>`` (TorchRec's keys,
  :func:`~flexshard.runtime.dcp_state.state_key`: ``momentum1``, Adam's ``exp_avg_sq``; none for SGD; Adam's
  iteration as ``<t>.step``, the manifest's ``optimizer_step``), and under ``flexshard`` one bytes entry
  with what only ``flexshard train`` uses: the manifest (step, world, groups, optimizer, run identity),
  the dense model, the dense optimizer and ``extra``. A job loads it with :func:`load_dcp` (or TorchRec's
  DCP load) at any world size and plan.
* **DCP -> flexshard** (:func:`dcp_to_flexshard`): a checkpoint folder ``DST/step-NNNNNNNN`` whose rank
  files hold the rows in contiguous blocks (as cold rows; every row once) and whose manifest records the
  layout :data:`~flexshard.checkpoint_manifest.BLOCKS_LAYOUT`, so that ``flexshard train --resume`` re-deals
  it to its plan (:mod:`flexshard.checkpoint_reshard`) at any world size, the saved one included. World,
  groups, step, run identity and dense state are the ``flexshard`` entry's when there is one (a checkpoint
  that came from flexshard), else 1 rank, step 0, no identity and no dense state. The optimizer is the
  ``flexshard`` entry's, else the one of the registry (:mod:`flexshard.runtime.optimizers`) whose state
  names and shapes are the saved ones (none: SGD; ``momentum1 [rows]``: row-wise Adagrad; ``momentum1
  [rows, dim]``: element-wise Adagrad; with ``exp_avg_sq [rows, dim]``: Adam); its ``optimizer_step`` the
  entry's, else ``<t>.step``, else 0. States no optimizer keeps are one line.

A round trip either way gives back the same rows, states, dense state, step and identity (the flexshard
side's rank files are then in blocks rather than by the first plan).

``prefix`` (every function, ``--prefix``): text before every weight key, the ``EmbeddingCollection``'s key
in a TorchRec model and a dot (``"ec."``), so that a checkpoint is shared with TorchRec's own
``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}``.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from core.errors import CheckpointError, agreed
from core.vocabulary import Tier
from flexshard.checkpoint import _atomic_text, _atomic_torch_save, load_full, step_dir
from flexshard.checkpoint_manifest import (
    BLOCKS_LAYOUT,
    MANIFEST,
    SCHEMA,
    TableEntry,
    manifest_document,
    read_manifest,
    run_digest,
)
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.agreement import agreed_message
from flexshard.runtime.dcp_state import STEP, block_bounds, state_key, step_of, weight_key
from flexshard.runtime.optimizers import REGISTRY, row_optimizer

META = ".metadata"  # the file DCP's FileSystemWriter writes last


def _table_of(key: str, prefix: str = "") -> str:
    """The table of a weight key ``<prefix>embeddings.<table>.weight``."""
    return key[len(prefix) + len("embeddings.") : -len(".weight")]


def _expected(module: ShardedSequenceEmbedding, prefix: str = "") -> dict[str, tuple[str, list[int]]]:
    """Flattened DCP key -> (table, shape) of every tensor of ``module``'s DCP state."""
    from flexshard.runtime import dcp_state

    out = {}
    for t, (name, r) in enumerate(zip(module.table_names, module.routing, strict=True)):
        key = weight_key(name, prefix)
        out[f"model.{key}"] = (name, [r.num_rows, module.dims[t]])
        hot = module.shards[(t, Tier.HOT)]
        for s, v in dcp_state._row_states(hot).items():
            out[f"optim.state.{key}.{state_key(name, s)}"] = (name, [r.num_rows, *v.shape[1:]])
        if dcp_state.uses_step(module):
            out[f"optim.state.{key}.{state_key(name, STEP)}"] = (name, [])
    return out


def dcp_mismatch(path: str | os.PathLike, module: ShardedSequenceEmbedding, prefix: str = "") -> str:
    """'' when the DCP checkpoint at ``path`` holds ``module``'s tables and optimizer state (names and shapes;
    any world size and plan; weight keys after ``prefix``), else one line saying what differs."""
    where = f"DCP checkpoint {str(path)!r}"
    try:
        saved = FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a missing or foreign file: one line naming it
        return f"{where}: not a DCP checkpoint (no readable {META}: {type(e).__name__})"
    expected = _expected(module, prefix)
    head = f"model.{prefix}embeddings."
    tables = sorted(_table_of(k[len("model.") :], prefix) for k in saved if k.startswith(head))
    for key, (table, shape) in expected.items():
        meta = saved.get(key)
        if meta is None and not tables:
            roots = sorted({k.split(".")[0] for k in saved})
            return f"{where}: no {key} (table {table!r}); its keys start with {roots}"
        if meta is None:
            return f"{where}: no {key} (table {table!r}; it has tables {tables})"
        if not isinstance(meta, TensorStorageMetadata) or list(meta.size) != shape:
            got = list(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            return f"{where}: {key} is {got}, this module's is {shape}"
    for name in module.table_names:
        under = f"optim.state.{weight_key(name, prefix)}."
        have = sorted(k[len(under) :] for k in saved if k.startswith(under))
        want = sorted(k[len(under) :] for k in expected if k.startswith(under))
        if have != want:
            return f"{where}: table {name!r} has optimizer state {have}, this module keeps {want}"
    return ""


def save_dcp(
    module: ShardedSequenceEmbedding, path: str | os.PathLike, others: dict | None = None, prefix: str = ""
) -> None:
    """Save ``module``'s DCP state (and ``others``: more state dicts, keys other than ``model`` and
    ``optim``; ``prefix`` before every weight key) as a DCP checkpoint at ``path``. Collective."""
    state = {**(others or {}), **module.dcp_state_dict(prefix=prefix)}
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_dcp(
    module: ShardedSequenceEmbedding, path: str | os.PathLike, others: dict | None = None, prefix: str = ""
) -> None:
    """Load a DCP checkpoint saved by :func:`save_dcp`, :func:`flexshard_to_dcp` or a TorchRec model whose
    ``EmbeddingCollection`` sits at ``prefix`` (``{"model": model.state_dict(), "optim":
    optimizer.state_dict()}``), at any world size and plan, into ``module`` and, in place, into ``others``
    (state dicts of tensors, as DCP loads them). Checked first (:func:`dcp_mismatch`): one agreed
    CheckpointError. Collective."""
    problem = agreed_message(dcp_mismatch(path, module, prefix), module.device)
    if problem:
        raise agreed(CheckpointError(problem))
    state = {**(others or {}), **module.dcp_state_dict(empty=True, prefix=prefix)}
    dcp.load(state, checkpoint_id=os.fspath(path))
    module.load_dcp_state_dict(state, prefix)


# --- offline conversion ---------------------------------------------------------------------------------


def is_dcp(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file()


def _fresh(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{str(dst)!r}: exists and is not an empty folder; give a new one")


def flexshard_to_dcp(src: str | os.PathLike, dst: str | os.PathLike, prefix: str = "") -> Path:
    """Write the flexshard checkpoint ``src`` (a ``step-*`` folder, or the latest under it) as a DCP
    checkpoint in the new folder ``dst`` (module docstring; ``prefix`` before every weight key). Returns
    ``dst``."""
    dst = Path(dst)
    read_manifest(src)  # a flexshard checkpoint there, before anything is written
    _fresh(dst)
    full = load_full(src)
    manifest = full.manifest
    model = {weight_key(t.name, prefix): full.weights[t.name] for t in manifest.tables}
    step = row_optimizer(manifest.optimizer).uses_step
    states = {}
    for t in manifest.tables:
        states[weight_key(t.name, prefix)] = {state_key(t.name, n): v for n, v in full.states[t.name].items()}
        if step:
            states[weight_key(t.name, prefix)][state_key(t.name, STEP)] = torch.tensor(
                manifest.optimizer_step
            )
    meta = {
        "manifest": manifest.document(),
        "dense": full.dense,
        "dense_optimizer": full.dense_optimizer,
        "extra": full.extra,
    }
    blob = io.BytesIO()
    torch.save(meta, blob)
    blob.seek(0)
    state = {"model": model, "optim": {"state": states}, "flexshard": blob}
    with warnings.catch_warnings():  # DCP warns that it saves in one process: what this does on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(os.fspath(dst)), no_dist=True)
    return dst


def read_dcp(path: str | os.PathLike) -> dict[str, Any]:
    """Everything in a DCP checkpoint, whole (one process; bytes entries as ``io.BytesIO``)."""
    if not is_dcp(path):
        raise CheckpointError(f"DCP checkpoint {str(path)!r}: not a DCP checkpoint (no {META})")
    state: dict[str, Any] = {}
    # as torch's own format_utils.dcp_to_torch_save: dcp.load fills only the keys it is given
    _load_state_dict(state, storage_reader=FileSystemReader(os.fspath(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # fmt: skip
    return state


def dcp_to_flexshard(
    src: str | os.PathLike, dst: str | os.PathLike, step: int | None = None, prefix: str = ""
) -> Path:
    """Write the DCP checkpoint ``src`` as a flexshard checkpoint under ``dst`` (``dst/step-NNNNNNNN``; the
    step is the saved one, else ``step``, else 0), rows in contiguous blocks (module docstring); its weight
    keys are ``<prefix>embeddings.<table>.weight`` (a TorchRec model's: ``prefix`` its collection's key and
    a dot). Returns the checkpoint folder."""
    where = f"DCP checkpoint {str(src)!r}"
    state = read_dcp(src)
    model, optim = state.get("model"), state.get("optim", {}).get("state", {})
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"{where}: no model.embeddings.<table>.weight tensors")
    meta = {}
    if "flexshard" in state:
        state["flexshard"].seek(0)
        meta = torch.load(state["flexshard"], weights_only=False)
    doc = meta.get("manifest", {})
    head = weight_key("", prefix)[: -len(".weight")]  # <prefix>embeddings.
    found = [_table_of(k, prefix) for k in model if k.startswith(head) and k.endswith(".weight")]
    names = [t["name"] for t in doc["tables"]] if doc else found
    if not names:
        raise CheckpointError(
            f"{where}: no model.{head}<table>.weight tensors (its model keys: {sorted(model)})"
        )
    tables, weights, rows_states, optimizers, steps = [], {}, {}, set(), set()
    for name in names:
        w = model.get(weight_key(name, prefix))
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.float32:
            raise CheckpointError(
                f"{where}: model.{weight_key(name, prefix)} is not a float32 [rows, dim] tensor"
            )
        saved = dict(optim.get(weight_key(name, prefix), {}))
        if state_key(name, STEP) in saved:
            steps.add(
                step_of(name, saved.pop(state_key(name, STEP)), f"optim.state.{weight_key(name, prefix)}")
            )
        kind = doc.get("optimizer") or _optimizer_of(name, saved, w.shape, where)
        states = row_optimizer(kind).state_shapes(int(w.shape[1]))
        rows_states[name] = {}
        for n, shape in states.items():
            s = saved.pop(state_key(name, n), None)
            if not isinstance(s, torch.Tensor) or tuple(s.shape) != (w.shape[0], *shape):
                got = list(s.shape) if isinstance(s, torch.Tensor) else None
                raise CheckpointError(
                    f"{where}: table {name!r} optimizer state {state_key(name, n)} is {got}, "
                    f"{kind} keeps {[int(w.shape[0]), *shape]}"
                )
            rows_states[name][n] = s
        if saved:
            raise CheckpointError(
                f"{where}: table {name!r} has optimizer state {sorted(saved)} {kind} does not keep"
            )
        optimizers.add(kind)
        tables.append(TableEntry(name, int(w.shape[0]), int(w.shape[1])))
        weights[name] = w
    if len(optimizers) > 1:
        raise CheckpointError(
            f"{where}: the tables' optimizer states are of {sorted(optimizers)}; one optimizer per checkpoint"
        )
    if len(steps) > 1:
        raise CheckpointError(f"{where}: the tables' <t>.step differ ({sorted(steps)})")
    optimizer = optimizers.pop() if optimizers else "sgd"
    optimizer_step = int(doc.get("optimizer_step", steps.pop() if steps else 0))
    world, groups = int(doc.get("world_size", 1)), doc.get("groups", [[0]])
    run = doc.get("run")
    step = int(doc["step"]) if doc else int(step or 0)
    final = step_dir(dst, step)
    _fresh(final)
    final.mkdir(parents=True, exist_ok=True)
    files = []
    for rank in range(world):
        rows = {}
        for t in tables:
            lo, hi = block_bounds(t.num_rows, world, rank)
            if hi > lo:
                rows[t.name] = {"cold": {
                    "ids": torch.arange(lo, hi, dtype=torch.int64),
                    "weights": weights[t.name][lo:hi].clone(),
                    "states": {n: v[lo:hi].clone() for n, v in rows_states[t.name].items()},
                }}  # fmt: skip
        payload = {"format": SCHEMA, "rank": rank, "step": step, "layout": BLOCKS_LAYOUT,
                   "run": run_digest(run), "rows": rows}  # fmt: skip
        if rank == 0:
            payload |= {"dense": meta.get("dense", {}), "dense_optimizer": meta.get("dense_optimizer"),
                        "extra": meta.get("extra", {})}  # fmt: skip
        files.append(_atomic_torch_save(payload, final / f"rank{rank}.pt"))
    document = manifest_document(
        step, world, groups, tables, optimizer, BLOCKS_LAYOUT, files, run, optimizer_step
    )
    _atomic_text(json.dumps(document, indent=1) + "\n", final / MANIFEST)
    return final


def _optimizer_of(name: str, saved: dict[str, Any], shape: torch.Size, where: str) -> str:
    """The optimizer of the registry whose states (TorchRec keys, shapes) are exactly ``saved``'s, for a
    table ``name`` of ``shape`` ``[rows, dim]``; CheckpointError in one line when none is."""
    got = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in saved.items()}
    for kind, opt in REGISTRY.items():
        want = {state_key(name, n): (int(shape[0]), *s) for n, s in opt.state_shapes(int(shape[1])).items()}
        if want == got:
            return kind
    shown = {k: list(v) if v is not None else "not a tensor" for k, v in sorted(got.items())}
    raise CheckpointError(
        f"{where}: table {name!r} has optimizer state {shown}, the state of none of {sorted(REGISTRY)}"
    )


def convert(src: str | os.PathLike, dst: str | os.PathLike, prefix: str = "") -> Path:
    """:func:`dcp_to_flexshard` when ``src`` is a DCP checkpoint, else :func:`flexshard_to_dcp`. Any
    problem (a missing, foreign or damaged checkpoint, an unwritable ``dst``) is one CheckpointError."""
    try:
        if is_dcp(src):
            return dcp_to_flexshard(src, dst, prefix=prefix)
        return flexshard_to_dcp(src, dst, prefix)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP's and pickle's errors, named in one line
        text = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
        raise CheckpointError(f"cannot convert {str(src)!r} to {str(dst)!r} ({reason})") from None


def cmd_convert(args: Any) -> int:
    """``flexshard convert-checkpoint SRC DST``."""
    to = "flexshard checkpoint" if is_dcp(args.src) else "DCP checkpoint"
    print(f"wrote {convert(args.src, args.dst, args.prefix)} ({to})")
    return 0


def add_parser(sub: Any) -> Any:
    """The ``convert-checkpoint`` subcommand's parser."""
    p = sub.add_parser(
        "convert-checkpoint",
        help="flexshard train checkpoint <-> torch.distributed.checkpoint (DCP) checkpoint",
        description="Convert a flexshard train checkpoint into a DCP checkpoint, or a DCP checkpoint into "
        "a flexshard train checkpoint (the direction is what SRC is). See flexshard/checkpoint_dcp.py.",
    )
    p.add_argument("src", help="a flexshard checkpoint (step-* folder, or a --checkpoint-dir: its latest) "
                   "or a DCP checkpoint folder")  # fmt: skip
    p.add_argument("dst", help="from flexshard: a new DCP folder; from DCP: the --checkpoint-dir to write "
                   "step-NNNNNNNN into")  # fmt: skip
    p.add_argument("--prefix", default="", help="before every weight key: the EmbeddingCollection's key in a "
                   "TorchRec model and a dot, e.g. ec. (default: none)")  # fmt: skip
    return p


__all__ = [
    "add_parser",
    "cmd_convert",
    "convert",
    "dcp_mismatch",
    "dcp_to_flexshard",
    "flexshard_to_dcp",
    "is_dcp",
    "load_dcp",
    "read_dcp",
    "save_dcp",
]
