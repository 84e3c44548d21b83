"""The plan as a contract: fingerprints of what a plan was made for, and the checks that refuse a run it
does not fit.

A plan's tiers index each table's *hotness order* (row ids, hottest first); its owner map is dealt over
a *world* of ranks in groups; its predicted bytes assume its *settings* (dedup, sync, batch per GPU). A
run that differs in any of these still executes, and its numbers mean nothing. So:

* other data (a different hotness order), another world size or other groups, other tables (names,
  rows, dim): refused with a one-line :class:`~core.errors.PlanMismatchError` that says what differs
  and what to do;
* other settings: refused the same way, unless the run changes them on purpose
  (:meth:`flexshard.plan_file.PlanFile.with_overrides`; ``flexshard train --override-plan``), which is
  recorded and logged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from core.errors import PlanMismatchError
from core.ranks import RankLayout
from flexshard.fingerprints import order_fingerprint
from flexshard.plan_file import PlanFile

REPLAN = "make a plan for this run (flexshard stats, then flexshard plan)"


def world_mismatch(plan_file: PlanFile, world_size: int, layout: RankLayout | None = None) -> str:
    """'' when the plan was made for ``world_size`` ranks (in ``layout``'s groups, when given), else a
    one-line message saying what differs and what to do."""
    if plan_file.world_size != world_size:
        return (
            f"the plan is for {plan_file.world_size} ranks, this job has {world_size}: launch "
            f"{plan_file.world_size} ranks, or {REPLAN} with a topology of {world_size} GPUs"
        )
    if layout is not None and layout != plan_file.layout:
        return (
            f"the plan's groups are {plan_file.groups}, this job's are {layout.to_lists()}: "
            f"run with the plan's groups, or {REPLAN} for these groups"
        )
    return ""


def tables_mismatch(
    plan_file: PlanFile,
    tables: Sequence[tuple[str, int, int]],
    orders: Mapping[str, np.ndarray] | None = None,
) -> str:
    """'' when the model's ``tables`` (``(name, rows, dim)``, in the plan's order) and their hotness
    ``orders`` are the ones the plan was made for, else a one-line message naming the first difference."""
    names = [str(t[0]) for t in tables]
    planned = [t.name for t in plan_file.tables]
    if names != planned:
        return f"the plan's tables are {planned}, the model's are {names}: {REPLAN} with the model's tables"
    orders = orders or {}
    unknown = [n for n in orders if n not in names]
    if unknown:
        return f"orders: no table named {unknown[0]!r} in the plan (tables {names})"
    for meta, (name, rows, dim) in zip(plan_file.tables, tables, strict=True):
        where = f"table {name!r}: the plan"
        if int(rows) != meta.num_rows:
            return f"{where} covers {meta.num_rows} rows, the model has {int(rows)}: {REPLAN}"
        if int(dim) != meta.dim:
            return (
                f"{where} was made for dim {meta.dim}, the model has dim {int(dim)}: train with --dim "
                f"{meta.dim}, or make the plan with flexshard stats --dim {int(dim)}, then flexshard plan"
            )
        got = order_fingerprint(orders.get(name), meta.num_rows)
        if got != meta.order_fingerprint:
            return (
                f"{where} was made from other data (hotness order {meta.order_fingerprint[:12]}, "
                f"this run's {got[:12]}); {REPLAN} from this run's data"
            )
    return ""


SETTINGS = ("dedup", "sync", "wire", "batch_size_per_gpu")


def settings_mismatch(plan_file: PlanFile, requested: Mapping[str, object]) -> str:
    """'' when every requested setting (``None``: not requested) equals the plan's, else a one-line
    message naming the first one that differs and the ways forward."""
    made = {
        "dedup": plan_file.plan.dedup,
        "sync": plan_file.plan.sync.value,
        "wire": plan_file.plan.wire.value,
        "batch_size_per_gpu": plan_file.batch_size_per_gpu,
    }
    for key in SETTINGS:
        value = requested.get(key)
        if value is None:
            continue
        value = getattr(value, "value", value)
        if value != made[key]:
            was, asked = show_setting(made[key]), show_setting(value)
            return (
                f"{key}: the plan was made with {key} {was}, this run asks for {asked}; follow the plan "
                f"(drop the setting), make a plan with {key} {asked}, or override the plan on purpose "
                "(--override-plan; its predicted bytes then do not apply)"
            )
    return ""


def sampling_mismatch(plan_file: PlanFile, sampling: Mapping[str, str]) -> str:
    """'' when every table the plan priced on measured touch rates was measured on samples formed as
    this run forms them (``sampling[table]``, e.g. ``"next-item, window 20, negatives 4"``), else a
    one-line message naming the table, both samplings and the ways forward."""
    for meta in plan_file.tables:
        run = sampling.get(meta.name)
        if meta.touch_rates is None or run is None or run == meta.touch_rates:
            continue
        return (
            f"table {meta.name!r}: the plan was priced on samples formed as '{meta.touch_rates}', this "
            f"run forms '{run}'; run `flexshard stats` with this run's window and negatives and plan "
            "again, or override the plan on purpose (--override-plan; its predicted bytes then do not apply)"
        )
    return ""


def show_setting(value: object) -> str:
    """A setting's value as flags and logs spell it (``on`` / ``off`` for booleans)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def require(message: str) -> None:
    """Raise :class:`PlanMismatchError` with ``message`` when it is not empty."""
    if message:
        raise PlanMismatchError(message)
