"""Safe resume: a checkpoint folder belongs to one run, and ``--resume`` continues only that run.

A run's identity (:func:`run_identity`) is what its checkpoints' contents depend on: the plan (tiers,
owners, hotness orders, world and groups: :func:`flexshard.checkpoint.layout_fingerprint`), the data,
the seed, the optimizer and its settings, the model's shape, the batch, the wire precision and the
sample placement. Every checkpoint's manifest records it. ``--resume`` refuses a checkpoint of another
identity with one line naming the first setting that differs (:func:`identity_mismatch`), except the
world, its groups and the plan (:data:`REDEALT`): a job restarted at another world size, with other groups
or with another plan (re-planned, or laid out by another FlexShard version) has its rows re-dealt by id
(:mod:`flexshard.checkpoint_reshard`); everything else must still match; a fresh run
refuses a folder that already holds checkpoints, unless ``--overwrite`` (which removes them first, and
only them: otherwise the new run's steps would mix with the old run's later ones). ``--keep N`` keeps
the newest ``N`` checkpoints (:func:`prune`). A run holds its folder with a lock naming its host and
process (:func:`claim_directory`, :mod:`core.folder_lock`): a second job on the folder is refused, so two
jobs never both write (or both report success) there. When the newest checkpoint is refused,
:func:`fallback_hint` names the newest older one that verifies.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import CheckpointError, OutputError
from core.folder_lock import FolderLock
from flexshard import checkpoint
from flexshard.checkpoint_manifest import STEP_DIR, Manifest, loadable_older, step_of, written_by_flexshard
from flexshard.plan_file import PlanFile
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.training.config import TrainConfig


def run_identity(
    config: TrainConfig, source: Any, plan_file: PlanFile, module: ShardedSequenceEmbedding
) -> dict[str, str]:
    """The settings a run's checkpoints depend on, as strings (stored in every manifest)."""
    return {
        "world": f"{module.world_size} ranks in groups {module.pg.groups}",
        "plan": checkpoint.layout_fingerprint(module),
        "data": f"{source.name} (statistics {plan_file.fingerprints.get('workload', 'unknown')})"
        + (f", vocabulary {source.vocabulary.fingerprint()[:16]}" if source.vocabulary else ""),
        "seed": str(config.seed),
        "optimizer": f"{config.optimizer}, lr {config.lr:g}, eps {module.eps:g}",
        "model": f"dim {config.dim}, max-len {config.max_len}, negatives {config.negatives}, "
        f"objective {config.objective}",
        "batch": f"{plan_file.batch_size_per_gpu} per rank",
        "exchange": f"dedup {'on' if module.dedup else 'off'}, {module.sync} sync, wire {module.wire_dtype}, "
        f"sample placement {config.sample_placement}",
    }


REDEALT = ("world", "plan")  # may differ: the checkpoint's rows are then re-dealt by id


def identity_mismatch(path: Path, saved: dict[str, str] | None, current: dict[str, str]) -> str:
    """'' when ``saved`` (a manifest's ``run``) is ``current`` but for :data:`REDEALT`, else one line
    naming what differs."""
    if saved is None:
        return ""  # saved before checkpoints recorded their run: nothing to compare
    for key, value in current.items():
        if _named(saved.get(key)) != _named(value) and key not in REDEALT:
            what = f"{key}: {saved.get(key)!r} there, {value!r} here"
            return (
                f"--resume: {path} was saved by another run ({what}); resume with that run's settings, or "
                "start this run in another --checkpoint-dir (or over this one with --overwrite)"
            )
    return ""


def _named(value: str | None) -> str | None:
    """An identity value with row-wise Adagrad's older name ('adagrad, lr ...', the same optimizer) as
    its canonical one, so runs saved before the rename resume."""
    return "rowwise_" + value if isinstance(value, str) and value.startswith("adagrad, ") else value


_LEFTOVER = re.compile(r"^\.(tmp|old)-step-\d{8,}$")


def existing_checkpoints(directory: str | Path) -> list[Path]:
    """The folders under ``directory`` that this tool's checkpoints wrote: complete checkpoints
    (``step-NNNNNNNN`` with a ``flexshard-checkpoint/*`` manifest) and the leftovers of interrupted saves
    (``.tmp-step-NNNNNNNN``, ``.old-step-NNNNNNNN``), by name. Nothing else (a user's ``step-notes/``)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(
        p
        for p in d.iterdir()
        if written_by_flexshard(p) or (_LEFTOVER.match(p.name) and p.is_dir() and not p.is_symlink())
    )


def claim_directory(config: TrainConfig) -> FolderLock | None:
    """Take ``--checkpoint-dir`` for this run (call on rank 0, before any work): created if missing, held
    by a lock naming this host and process (another job's live lock is refused), checked, and for a fresh
    run cleared of another run's checkpoints with ``--overwrite`` (only folders this tool wrote). The lock,
    to release at the end (None without ``--checkpoint-dir``). CheckpointError (one line) when the run may
    not write there; the lock is then released."""
    if not config.checkpoint_dir:
        return None
    d = Path(config.checkpoint_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir: cannot create {d}: {e.strerror or e}") from None
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        raise CheckpointError(f"--checkpoint-dir: {d}: not a writable folder")
    try:
        lock = FolderLock.acquire(d, "--checkpoint-dir")
    except OutputError as e:
        raise CheckpointError(str(e)) from None
    try:
        problem = _inputs_inside(config, d) or ("" if config.resume else _fresh_run_problem(config, d))
    except BaseException:
        lock.release()
        raise
    if problem:
        lock.release()
        raise CheckpointError(problem)
    return lock


def _inputs_inside(config: TrainConfig, d: Path) -> str:
    """'' unless an input or ``--metrics-out`` lies in a folder that checkpoints replace or remove."""
    root = d.resolve()
    for flag, given in [*config.inputs(), ("--metrics-out", config.metrics_out)]:
        if given is None:
            continue
        try:
            inside = Path(given).resolve().relative_to(root).parts
        except ValueError:
            continue
        if len(inside) > 1 and (checkpoint_folder_name(inside[0]) or _LEFTOVER.match(inside[0])):
            return (
                f"--checkpoint-dir: {flag} {given!r} lies in {d / inside[0]}, a folder that checkpoints "
                "replace or remove; move it out"
            )
    return ""


def checkpoint_folder_name(name: str) -> bool:
    return STEP_DIR.match(name) is not None


def _fresh_run_problem(config: TrainConfig, d: Path) -> str:
    """'' when a fresh run may start in ``d``: no other run's checkpoints (``--overwrite`` removes them
    here) and no ``step-NNNNNNNN`` folder this tool did not write (its saves would replace it)."""
    foreign = sorted(
        p.name for p in d.iterdir() if checkpoint_folder_name(p.name) and not written_by_flexshard(p)
    )
    if foreign:  # checked before --overwrite removes anything: a refused run changes nothing
        return (
            f"--checkpoint-dir: {d / foreign[0]} is not a checkpoint this tool wrote (no FlexShard "
            "manifest), and this run's saves would replace it; move it out of the folder"
        )
    old = existing_checkpoints(d)
    if old and not config.overwrite:
        return (
            f"--checkpoint-dir: {config.checkpoint_dir} holds {len(old)} checkpoint(s) of another run "
            f"(latest {old[-1].name}); --resume to continue it, --overwrite to replace it, or another folder"
        )
    for p in old:
        try:
            shutil.rmtree(p)
        except OSError as e:
            return f"--overwrite: cannot remove {p}: {e.strerror or e}"
    return ""


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (0: keep all); returns those removed."""
    if keep <= 0:
        return []
    done = sorted((p for p in existing_checkpoints(directory) if p.name.startswith("step-")), key=step_of)
    removed = done[:-keep] if len(done) > keep else []  # by step: step-100000000 is newer than step-99999999
    for p in removed:
        try:
            shutil.rmtree(p)
        except OSError as e:
            raise CheckpointError(f"--keep: cannot remove {p}: {e.strerror or e}") from None
    return removed


def fallback_hint(newest: Path, accept: Callable[[Manifest], str], only_found: bool = False) -> str:
    """What to do when the newest checkpoint ``newest`` is refused: the newest older checkpoint beside it
    that verifies (manifest, every rank file's size and hash) and that ``accept`` takes, and how to resume
    from it; or that none does ('' then with ``only_found``: where the refusal was this run's settings).
    Reads whole rank files: call on one rank, only after a refusal."""
    step = step_of(newest)
    older = loadable_older(newest.parent, step, accept) if step is not None else None
    if older is None:
        return "" if only_found else f"no older checkpoint in {newest.parent} would load either"
    aside = newest.parent / f"refused-{newest.name}"
    return (
        f"{older.name} would load (its manifest and rank file hashes verify): to resume from it, move the "
        f"refused one aside (mv {newest} {aside}) and --resume again"
    )
