"""The plan a training run executes: a plan file checked against the run, or one made on the fly.

With ``--plan``, the plan's settings (dedup, sync, wire precision, batch per GPU) apply. A flag that asks
for another value is refused (:func:`flexshard.contract.settings_mismatch`), unless ``--override-plan``
says the difference is on purpose; each override is logged. The data, world and tables are checked when the
sharded module is built (:mod:`flexshard.contract`); with ``--resume`` the world is checked here, so a job
resumed at another world size with the old world's plan stops with a line that says what to give instead.

Without ``--plan``, rank 0 plans the source's workload with ``--strategy`` on ``--groups`` emulated
NVLink groups of consecutive ranks, priced as H100-class hosts (the ``h100:<groups>x<ranks per group>``
topology preset: NVSwitch and one 400 Gb/s NIC per GPU) at ``--budget`` times row-wise memory, and
broadcasts the plan document. Either way the plan must price the state of ``--optimizer``
(:func:`priced_for`: 0 bytes per row for sgd, 4 for rowwise_adagrad, 4 x dim for elementwise_adagrad,
8 x dim for adam); a ``--plan`` that priced less is refused unless ``--override-plan``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from core.errors import InputError, PlanMismatchError, PlannerError, agreed
from core.ranks import RankLayout
from flexshard.contract import sampling_mismatch, settings_mismatch, show_setting, world_mismatch
from flexshard.plan_file import PlanFile, read_plan, to_dict, write_plan
from flexshard.runtime.optimizers import state_bytes_per_row
from flexshard.training.config import DEFAULT_DIM, TrainConfig
from flexshard.training.summary import left_out_note
from flexshard.workloads import DEFAULT_BATCH_SIZE_PER_GPU, Vocabulary, fingerprint
from solvers.optimizer import OptimizerConfig
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.presets import h100_cluster
from topology.views import cluster_view


def batch_size(config: TrainConfig, plan_file: PlanFile | None) -> int:
    """Samples per rank and step: ``--batch-size``, else the plan's, else the default."""
    if config.batch_size is not None:
        return config.batch_size
    return plan_file.batch_size_per_gpu if plan_file is not None else DEFAULT_BATCH_SIZE_PER_GPU


def model_dim(config: TrainConfig, plan_file: PlanFile | None) -> int:
    """The embedding dim of the run: ``--dim``, else the plan's when every table of the plan has the same
    one (a plan made from ``flexshard stats --dim D``), else :data:`DEFAULT_DIM`."""
    if config.dim is not None:
        return config.dim
    dims = {t.dim for t in plan_file.tables} if plan_file is not None else set()
    return dims.pop() if len(dims) == 1 else DEFAULT_DIM


def check_plan(
    config: TrainConfig,
    plan_file: PlanFile,
    table_names: list[str],
    world: int,
    sampling: dict[str, str] | None = None,
) -> tuple[PlanFile, list[str]]:
    """The ``--plan`` file restricted to the model's tables, its settings checked against the flags (see
    the module docstring) and its measured tables against ``sampling`` (``{table: how this run forms
    samples}``); with the log lines of any override."""
    plan_file = plan_file.restricted_to(table_names)
    notes = [f"--plan: {left_out_note(plan_file)}"] if plan_file.left_out else []
    message = sampling_mismatch(plan_file, sampling or {})
    if message and not config.override_plan:
        raise PlanMismatchError(message)
    if message:
        notes.append(f"override: {message.split(';')[0]}")
    message = world_mismatch(plan_file, world)
    if message and config.resume:  # a resized resume: the plan must be for the new world, or none
        raise PlanMismatchError(
            f"--plan: {message}; --resume re-deals the checkpoint to a plan for {world} ranks, or to the "
            "plan made on the fly without --plan"
        )
    message = state_mismatch(plan_file, config.optimizer)
    if message and not config.override_plan:
        raise PlanMismatchError(message)
    if message:
        notes.append(f"override: {message.split(';')[0]}")
    if config.groups is not None:
        message = world_mismatch(plan_file, world, RankLayout.consecutive(world, config.groups, "--groups"))
        if message:
            raise PlanMismatchError(f"--groups {config.groups}: {message}")
    requested = {
        "dedup": config.dedup,
        "sync": config.sync,
        "wire": config.wire_dtype,
        "batch_size_per_gpu": config.batch_size,
    }
    message = settings_mismatch(plan_file, requested)
    if not message:
        return plan_file, notes
    if not config.override_plan:
        raise PlanMismatchError(message)
    overridden = plan_file.with_overrides(config.dedup, config.sync, config.batch_size, config.wire_dtype)
    notes += [
        f"override: {key} {show_setting(run)} (the plan was made with {show_setting(made)}; "
        "its predicted bytes do not apply)"
        for key, (made, run) in overridden.overrides.items()
    ]
    return overridden, notes


def check_vocabulary(plan_file: PlanFile, vocabulary: Vocabulary | None) -> None:
    """PlanMismatchError when the plan was made from statistics whose string ids map to rows by another
    vocabulary than this run's (``--vocab``, or the one built from ``--data``); not overridable: the
    rows would be other ids. A plan made from integer ids records none and is checked by its orders."""
    made = plan_file.fingerprints.get("vocabulary", "")
    run = vocabulary.fingerprint() if vocabulary else ""
    if made and made != run:
        raise PlanMismatchError(
            f"--plan was made from data whose string ids map to rows by vocabulary {made[:12]}, this run's "
            f"by {run[:12] or 'none (integer ids)'}; pass --vocab with the stats file the plan was made from"
        )


def priced_for(workload: Workload, optimizer: str) -> Workload:
    """``workload`` with every table's optimizer state priced for ``optimizer`` (bytes per row)."""
    tables = tuple(
        replace(t, optimizer_bytes_per_row=state_bytes_per_row(optimizer, t.dim)) for t in workload.tables
    )
    return replace(workload, tables=tables)


def state_mismatch(plan_file: PlanFile, optimizer: str) -> str:
    """'' when the plan priced at least ``optimizer``'s state for every table, else one line saying which
    table it underpriced (its memory budget would not hold the state)."""
    for t in plan_file.tables:
        need = state_bytes_per_row(optimizer, t.dim)
        if t.optimizer_bytes_per_row < need:
            return (
                f"--plan priced table {t.name!r} with {t.optimizer_bytes_per_row} optimizer bytes per row, "
                f"--optimizer {optimizer} keeps {need}; make the plan with flexshard plan --optimizer "
                f"{optimizer} (or run it anyway with --override-plan)"
            )
    return ""


def plan_on_the_fly(config: TrainConfig, source, world: int, rank: int) -> PlanFile:
    """Plan on rank 0 and broadcast the plan document; every rank reads it back (collective)."""
    layout = RankLayout.consecutive(world, config.groups or 1, "--groups")

    def document() -> dict:
        workload = priced_for(source.workload(), config.optimizer)
        view = cluster_view(h100_cluster(layout.num_groups, world // layout.num_groups))
        planned = make_plan(
            config.strategy or "flexshard",
            workload,
            view,
            budget_bytes(workload, view, config.budget),
            True if config.dedup is None else config.dedup,
            config.sync or "sparse",
            # the bytes objective, as before the time model: the runtime's tests rely on these plans
            # having every tier; the step objective is `flexshard plan`'s (issue 23 decides when
            # train follows)
            OptimizerConfig(step_time=False),
            wire=config.wire_dtype or "fp32",
        )
        doc = to_dict(planned.plan, workload, view, planned.report, fingerprint(workload), source.orders)
        if source.vocabulary:  # the rows of string ids, as a plan file from `flexshard plan` records
            doc["fingerprints"]["vocabulary"] = source.vocabulary.fingerprint()
        return doc

    return broadcast_plan(document, rank)


def broadcast_plan(document: Callable[[], dict], rank: int) -> PlanFile:
    """The plan document ``document()`` makes on rank 0, broadcast and read back as a :class:`PlanFile`
    on every rank (collective over the default group). An :class:`InputError` on rank 0 is raised on
    every rank as one :class:`PlannerError`."""
    doc: list = [None]
    if rank == 0:
        try:
            doc[0] = document()
        except InputError as e:
            doc[0] = {"error": str(e)}
    dist.broadcast_object_list(doc, src=0)
    if "error" in doc[0]:
        raise agreed(PlannerError(f"plan: {doc[0]['error']}"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        write_plan(path, doc[0])
        return read_plan(path)
