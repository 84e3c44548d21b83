"""Safe resume: a checkpoint folder belongs to one run, and ``--resume`` continues only that run.

A run's identity (:func:`run_identity`) is what its checkpoints' contents depend on: the plan (tiers,
owners, hotness orders, world and groups: :func:`flexshard.checkpoint.layout_fingerprint`), the data,
the seed, the optimizer and its settings, the model's shape, the batch, the wire precision and the
sample placement. Every checkpoint's manifest records it. ``--resume`` refuses a checkpoint of another
identity with one line naming the first setting that differs (:func:`identity_mismatch`); a fresh run
refuses a folder that already holds checkpoints, unless ``--overwrite`` (which removes them first:
otherwise the new run's steps would mix with the old run's later ones). ``--keep N`` keeps the newest
``N`` checkpoints (:func:`prune`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from core.errors import CheckpointError
from flexshard import checkpoint
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


def identity_mismatch(path: Path, saved: dict[str, str] | None, current: dict[str, str]) -> str:
    """'' when ``saved`` (a manifest's ``run``) is ``current``, else one line naming what differs."""
    if saved is None:
        return ""  # saved before checkpoints recorded their run: nothing to compare
    for key, value in current.items():
        if saved.get(key) != value:
            what = (
                "another plan: its tiers, owners or hotness orders differ"
                if key == "plan"
                else f"{key}: {saved.get(key)!r} there, {value!r} here"
            )
            return (
                f"--resume: {path} was saved by another run ({what}); resume with that run's settings, or "
                "start this run in another --checkpoint-dir (or over this one with --overwrite)"
            )
    return ""


def existing_checkpoints(directory: str | Path) -> list[Path]:
    """The complete and partial checkpoint folders under ``directory`` (``step-*``, ``.tmp-step-*``)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith(("step-", ".tmp-step-")))


def directory_problem(config: TrainConfig) -> str:
    """'' when the run may write into ``--checkpoint-dir`` (created if missing, writable; for a fresh run,
    no other run's checkpoints, which ``--overwrite`` removes here). Call on one rank, before the work."""
    if not config.checkpoint_dir:
        return ""
    d = Path(config.checkpoint_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--checkpoint-dir: cannot create {d}: {e.strerror or e}"
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        return f"--checkpoint-dir: {d}: not a writable folder"
    if config.resume:
        return ""
    old = existing_checkpoints(d)
    if not old:
        return ""
    if not config.overwrite:
        return (
            f"--checkpoint-dir: {config.checkpoint_dir} holds {len(old)} checkpoint(s) of another run "
            f"(latest {old[-1].name}); --resume to continue it, --overwrite to replace it, or another folder"
        )
    try:
        for p in old:
            shutil.rmtree(p)
    except OSError as e:
        return f"--overwrite: cannot remove {p}: {e.strerror or e}"
    return ""


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints (0: keep all); returns those removed."""
    if keep <= 0:
        return []
    done = [p for p in existing_checkpoints(directory) if p.name.startswith("step-")]
    done = [p for p in done if (p / checkpoint.MANIFEST).is_file()]
    removed = sorted(done, key=lambda p: p.name)[:-keep] if len(done) > keep else []
    for p in removed:
        try:
            shutil.rmtree(p)
        except OSError as e:
            raise CheckpointError(f"--keep: cannot remove {p}: {e.strerror or e}") from None
    return removed
