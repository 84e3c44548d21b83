"""Modeled step time in the reports: each strategy's step split into collective latency, bytes over
bandwidth and local work, its collectives per step, and what the hot and warm tiers save over
``row_wise_group_dedup`` (:mod:`solvers.time_model`).

Records are :func:`flexshard.cli.simulate_records`'s, with ``step_s``, ``latency_s``, ``bandwidth_s``,
``local_s``, ``overlapped_s`` (priced as ``train --pipeline on`` runs: the next batch's id exchange
beside the replica sync hides the shorter of the two; ``step = latency + bandwidth + local -
overlapped``), ``collectives`` and the plan's ``hot_rows`` / ``warm_rows``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flexshard.report import format_table
from solvers.time_types import StepTime
from solvers.types import Plan

GROUP_DEDUP = "row_wise_group_dedup"
STEP_KEYS = ("step_s", "latency_s", "bandwidth_s", "local_s", "overlapped_s", "collectives")


def step_record(step: StepTime | None, prefix: str = "") -> dict[str, Any]:
    """The step-time fields of a simulate record (None where the plan was not priced), each key after
    ``prefix``."""
    if step is None:
        return dict.fromkeys(prefix + key for key in STEP_KEYS)
    values = (
        step.total_s,
        step.latency_s,
        step.bandwidth_s,
        step.local_s,
        step.overlapped_s,
        step.collectives,
    )
    return {prefix + key: value for key, value in zip(STEP_KEYS, values, strict=True)}


TORCHREC_PREFIX = "torchrec_"
TORCHREC_ROW = "torchrec_default"  # the step table's row of TorchRec's default in its own collectives


def torchrec_record(step: StepTime | None) -> dict[str, Any]:
    """The fields of TorchRec's default's simulate record that price its plan in TorchRec's own
    collectives (:func:`solvers.planner.torchrec_step`), ``torchrec_step_s`` and its parts; None where
    the plan was not priced."""
    return step_record(step, TORCHREC_PREFIX)


def step_table(records: Sequence[dict[str, Any]], extra: Sequence[dict[str, Any]] = ()) -> str:
    """Strategies x budgets: modeled step ms and its parts, and collectives per step; after the row-wise
    record without dedup, where it has them, a row :data:`TORCHREC_ROW` of its plan in TorchRec's own
    collectives (TorchRec's default). ``extra``: records priced for the headline only (e.g. TorchRec's
    default under ``--dedup on``), whose TorchRec rows close their budget's rows."""
    theirs = {r["budget_x"]: r for r in extra if r["feasible"] and r.get("torchrec_step_s") is not None}
    rows = []
    priced = [r for r in records if r["feasible"] and r.get("step_s") is not None]
    for i, r in enumerate(priced):
        name = f"*{r['strategy']}" if r["strategy"] == "flexshard" else r["strategy"]
        rows.append(_step_row(r, name, ""))
        if r.get("torchrec_step_s") is not None:
            rows.append(_step_row(r, TORCHREC_ROW, TORCHREC_PREFIX))
            theirs.pop(r["budget_x"], None)
        last_of_budget = i + 1 == len(priced) or priced[i + 1]["budget_x"] != r["budget_x"]
        if last_of_budget and r["budget_x"] in theirs:
            rows.append(_step_row(theirs.pop(r["budget_x"]), TORCHREC_ROW, TORCHREC_PREFIX))
    header = ["budget", "strategy", "dedup", "step ms", "latency", "bandwidth", "local", "overlapped"]
    header.append("collectives")
    return format_table(header, rows)


def _step_row(r: dict[str, Any], name: str, prefix: str) -> list[str]:
    """A step table row of record ``r``'s figures (``prefix``: :data:`TORCHREC_PREFIX` for its TorchRec
    pricing)."""
    overlapped = r.get(prefix + "overlapped_s") or 0.0
    return [
        f"{r['budget_x']:g}x",
        name,
        "on" if r["dedup"] else "off",
        *(f"{r[prefix + key] * 1e3:.3f}" for key in ("step_s", "latency_s", "bandwidth_s", "local_s")),
        f"{-overlapped * 1e3:.3f}" if overlapped else "0.000",
        str(r[prefix + "collectives"]),
    ]


def tier_savings(records: Sequence[dict[str, Any]], extra: Sequence[dict[str, Any]] = ()) -> list[str]:
    """What FlexShard's hot and warm tiers save in modeled step time over ``row_wise_group_dedup`` at
    the same budget and dedup (``extra``: records priced for this only): a line per dedup setting and
    saving, naming the budgets it holds at (budgets whose plans save the same are one line)."""
    index = {(r["budget_x"], r["dedup"], r["strategy"]): r for r in [*extra, *records]}
    budgets: dict[tuple[bool, str], list[float]] = {}  # (dedup, saving) -> budgets, in the records' order
    for ours in records:
        if ours["strategy"] != "flexshard" or not ours["feasible"] or ours.get("step_s") is None:
            continue
        base = index.get((ours["budget_x"], ours["dedup"], GROUP_DEDUP))
        if base is None or not base["feasible"] or base.get("step_s") is None:
            continue
        budgets.setdefault((ours["dedup"], savings_text(ours, base)), []).append(ours["budget_x"])
    return [
        f"Tiers of FlexShard at {_budgets_text(at)}, dedup {'on' if dedup else 'off'}: {text}"
        for (dedup, text), at in budgets.items()
    ]


def _budgets_text(budgets: Sequence[float]) -> str:
    """``2x``, ``2x and 4x``, ``1x, 2x and 4x``."""
    names = [f"{b:g}x" for b in budgets]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def savings_text(ours: dict[str, Any], base: dict[str, Any]) -> str:
    """What the tiers of ``ours`` save over ``base`` (records, or :func:`step_record` plus tier rows)."""
    figures = f"{ours['step_s'] * 1e3:.3f} vs {base['step_s'] * 1e3:.3f} ms"
    if not ours.get("hot_rows") and not ours.get("warm_rows"):
        return (
            f"the plan uses no replicas (no hot or warm rows), so the tiers save nothing over {GROUP_DEDUP} "
            f"in modeled step time ({figures}; any difference is the cold rows' fetch modes)"
        )
    saved = base["step_s"] - ours["step_s"]
    share = saved / base["step_s"] if base["step_s"] > 0 else 0.0
    rows = f"{ours.get('hot_rows', 0):,} hot and {ours.get('warm_rows', 0):,} warm rows"
    verb = "save" if saved >= 0 else "cost"
    return (
        f"the tiers ({rows}) {verb} {abs(saved) * 1e3:.3f} ms ({abs(share):.1%}) of modeled step time over "
        f"{GROUP_DEDUP} ({figures}; {ours['collectives']} vs {base['collectives']} collectives)"
    )


def plan_step_lines(plan: Plan, step: StepTime | None, baseline: StepTime | None = None) -> list[str]:
    """The modeled step of a plan, split, and what its tiers save over ``baseline`` (row_wise_group_dedup
    priced the same way), for ``flexshard plan``."""
    if step is None:
        return []
    lines = [
        f"Modeled step time: {step.total_s * 1e3:.3f} ms at rank {step.slowest_rank} = collective latency "
        f"{step.latency_s * 1e3:.3f} ms ({step.collectives} collectives: "
        + ", ".join(s.name for s in step.stages)
        + f") + bandwidth {step.bandwidth_s * 1e3:.3f} ms + local work {step.local_s * 1e3:.3f} ms"
        + (f" - overlapped {step.overlapped_s * 1e3:.3f} ms (pipelined)" if step.overlap else ""),
        f"  latencies: {step.latency_source or '-'}; local work: {step.rates_source or '-'}",
    ]
    if baseline is not None and plan.strategy == "flexshard":
        ours = {
            **step_record(step),
            "hot_rows": sum(tp.hot_rows for tp in plan.tables),
            "warm_rows": sum(tp.warm_rows for tp in plan.tables),
        }
        lines.append("Tiers: " + savings_text(ours, step_record(baseline)))
    return lines
