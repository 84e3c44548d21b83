"""Readable reports: a plan's per-table tiers, traffic by link class and memory; strategy comparisons."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from core.vocabulary import Component, FetchMode
from solvers.cost_model import row_wise_memory_bytes
from solvers.placement import is_homogeneous
from solvers.types import MEMORY_PARTS, CostReport, Plan, Workload
from solvers.volumes import table_mass
from topology.views import ClusterView


def human_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{0.0 if abs(x) < 0.5 else x:.0f} B"  # never "-0 B": a residue under half a byte is none


def human_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def touch_rates_line(workload: Workload) -> str:
    """Which row statistics priced each table: measured per-sample touch rates (with their sampling and
    stated bucketing error) or independent draws from the histogram."""
    measured = [t for t in workload.tables if t.touch is not None]
    if not measured:
        return (
            "Touch rates: independent draws from each table's histogram (no measured rates in the workload)"
        )
    parts = [
        f"{t.name} measured ({t.touch.sampling}; bucketing error {t.touch.bucket_error:.2%})"
        for t in measured
    ]
    rest = [t.name for t in workload.tables if t.touch is None]
    if rest:
        parts.append(f"{', '.join(rest)} independent draws")
    return "Touch rates: " + "; ".join(parts)


def _budget_text(workload: Workload, view: ClusterView, plan: Plan, budget_x: float) -> str:
    """``budget 2.00x row-wise = 9.95 GB per GPU``, or the cap when the multiple asked for more than
    every table on every GPU (:func:`solvers.planner.everything_fits_bytes`)."""
    if plan.budget_bytes is not None and plan.budget_bytes < budget_x * row_wise_memory_bytes(workload, view):
        capped = human_bytes(plan.budget_bytes)
        return f"budget {budget_x:g}x row-wise, capped at {capped} per GPU (everything fits)"
    return f"budget {budget_x:.2f}x row-wise = {human_bytes(plan.budget_bytes)} per GPU"


def plan_report(
    workload: Workload, view: ClusterView, plan: Plan, report: CostReport, budget_x: float
) -> str:
    n = view.num_ranks
    sizes = sorted({len(g) for g in view.groups})
    head = (
        f"{plan.strategy} plan: workload {workload.name!r} ({len(workload.tables)} tables, "
        f"{human_count(workload.num_rows)} rows) on {n} GPUs in {view.num_groups} groups of "
        f"{'/'.join(map(str, sizes))}; {_budget_text(workload, view, plan, budget_x)}; "
        f"dedup {'on' if plan.dedup else 'off'}, {plan.sync} sync"
    )
    rows = []
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        mass = table_mass(t, workload.lookups_per_gpu(t), n)
        cum = mass.at(np.array([0.0, tp.hot_rows, tp.hot_rows + tp.warm_rows, t.num_rows]))["lookups"]
        share = np.diff(cum) / max(cum[-1], 1e-300)
        rows.append(
            [
                t.name,
                human_count(t.num_rows),
                t.dim,
                f"{t.ids_per_sample:g}",
                human_count(tp.hot_rows),
                human_count(tp.warm_rows),
                human_count(tp.cold_rows),
                tp.fetch.value if tp.cold_rows else "-",
                f"{share[0]:.1%}",
                f"{share[1]:.1%}",
                f"{share[2]:.1%}",
            ]
        )
    tiers = format_table(
        [
            "table",
            "rows",
            "dim",
            "ids/sample",
            "hot",
            "warm",
            "cold",
            "cold fetch",
            "lookups hot",
            "warm",
            "cold",
        ],
        rows,
    )
    traffic_rows = []
    for link in view.link_classes:  # one group: no inter-group link class
        worst = int(np.argmax(report.link_bytes(link)))
        traffic_rows.append(
            [
                link.label,
                *(human_bytes(report.traffic.component_bytes(link, c)[worst]) for c in Component),
                human_bytes(report.link_bytes(link).max()),
            ]
        )
    traffic = format_table(["link (bottleneck rank)", *Component.labels(), "total"], traffic_rows)
    mem = report.memory_bytes
    lines = [
        head,
        "",
        tiers,
        touch_rates_line(workload),
        "",
        "Bytes per iteration (max of send and receive)"
        + (":" if view.has_inter_group else "; one group, so no inter-group links:"),
        traffic,
        "",
        f"Modeled communication time: {report.modeled_time_s * 1e3:.3f} ms per iteration "
        f"(bytes / bandwidth; collective latency adds {report.latency_s * 1e3:.3f} ms), "
        f"slowest rank {int(np.argmax(report.time_s))}",
        f"Memory per GPU: min {human_bytes(mem.min())}, median {human_bytes(float(np.median(mem)))}, "
        f"max {human_bytes(mem.max())} of {human_bytes(plan.budget_bytes)} budget; on the fullest GPU: "
        + ", ".join(
            f"{part} {human_bytes(v)}"
            for part, v in zip(MEMORY_PARTS, report.memory_by_part_bytes[int(np.argmax(mem))], strict=True)
        ),
    ]
    device = float(view.memory_bytes.min())
    if device > 0 and mem.max() > device:
        lines.append(
            f"Warning: {human_bytes(mem.max())} per GPU exceeds the smallest device memory in the topology "
            f"({human_bytes(device)}); use more GPUs or smaller tables"
        )
    if "lower_bound_s" in plan.solver:
        lines += solver_lines(view, plan, report)
    return "\n".join(lines)


def solver_lines(view: ClusterView, plan: Plan, report: CostReport) -> list[str]:
    """What the tier optimizer found (``plan.solver``, as :func:`solvers.planner.make_plan` records it) and,
    where they differ, why its objective is not the modeled time: on links of unequal speed the optimizer
    prices even owner shares with every rank at the slowest link per class, while the modeled time is
    the evaluated model's (each rank's own shares and links); and a baseline's plan may have been cheaper
    in the evaluated model than the optimizer's."""
    s = plan.solver
    lines = []
    if s.get("placement") == "balanced":
        lines.append("Placement: owner shares balanced by link speed (see per-rank memory above)")
    what = "modeled step" if s.get("objective") == "step" else "objective"
    if s.get("pipelined"):
        what = "modeled pipelined step"
    lines.append(
        f"Tier optimizer (even shares, slowest link per class): "
        f"{what} {s['objective_s'] * 1e3:.3f} ms, "
        f"lower bound {s['lower_bound_s'] * 1e3:.3f} ms, "
        f"gap {s['gap']:.2%}, {s['rounds']} rounds, {s['variables']} variables, {s['solve_time_s']:.2f} s"
    )
    by_step = s.get("objective") == "step" and "step_s" in s  # the step-time objective (solvers.time_model)
    optimizer_plan_s = s.get(
        "optimizer_plan_step_s" if by_step else "optimizer_plan_s", report.modeled_time_s
    )
    chosen_s = s["step_s"] if by_step else report.modeled_time_s
    if not is_homogeneous(view):
        links = [("intra-group", view.intra_bw_Bps)]
        if view.num_groups > 1:
            links.append(("inter-group", view.inter_bw_Bps))
        slowest = ", ".join(f"{name} {bw.min() / 1e9:.3g} GB/s" for name, bw in links)
        spread = ", ".join(f"{name} {bw.min() / 1e9:.3g}-{bw.max() / 1e9:.3g} GB/s" for name, bw in links)
        lines.append(
            f"Objective vs modeled time: the objective, {s['objective_s'] * 1e3:.3f} ms, prices the "
            f"optimizer's plan with even owner shares and every rank at the slowest link per class "
            f"({slowest}); the evaluated model, which gives the modeled time, prices it at "
            f"{optimizer_plan_s * 1e3:.3f} ms with its own owner shares on each rank's own links ({spread})"
        )
    if "chosen" in s:
        name, _, kind = s["chosen"].rpartition(" ")
        what = (
            f"{name}'s own plan, as {name} prices it"
            if kind == "plan"
            else f"{name}'s tiers, dealt FlexShard's way"
        )
        lines.append(
            f"Chosen instead of the optimizer's plan: {what}, {chosen_s * 1e3:.3f} ms in the evaluated "
            f"model against the optimizer's plan's {optimizer_plan_s * 1e3:.3f} ms"
        )
    return lines


def plan_shape(plan: Plan) -> dict[str, Any]:
    """What a simulate record keeps of a plan: rows per tier over the tables, and how many tables have cold
    rows and how many of them fetch those once per group (the headline's reasons read them)."""
    cold = [tp for tp in plan.tables if tp.cold_rows]
    return {
        "hot_rows": sum(tp.hot_rows for tp in plan.tables),
        "warm_rows": sum(tp.warm_rows for tp in plan.tables),
        "cold_rows": sum(tp.cold_rows for tp in plan.tables),
        "cold_tables": len(cold),
        "group_fetch_tables": sum(tp.fetch is FetchMode.GROUP for tp in cold),
    }


def comparison_table(records: list[dict[str, Any]]) -> str:
    """Strategies x budgets, with inter-group bytes relative to row-wise at the same budget and dedup;
    FlexShard's rows marked ``*`` (:data:`flexshard.simulate_headline.LEGEND`)."""
    rowwise = {
        (r["budget_x"], r["dedup"]): r for r in records if r["strategy"] == "row_wise" and r["feasible"]
    }
    rows = []
    for r in records:
        base = rowwise.get((r["budget_x"], r["dedup"]))
        if r["feasible"] and base and base["inter_group_bytes"]:
            rel = f"{r['inter_group_bytes'] / base['inter_group_bytes'] - 1:+.1%}"
        else:
            rel = "-"
        rows.append(
            [
                f"{r['budget_x']:g}x",
                f"*{r['strategy']}" if r["strategy"] == "flexshard" else r["strategy"],
                "on" if r["dedup"] else "off",
                human_bytes(r["inter_group_bytes"]),
                human_bytes(r["intra_group_bytes"]),
                human_bytes(r["sync_bytes"]),
                f"{r['modeled_time_s'] * 1e3:.3f}" if r["feasible"] else "infeasible",
                human_bytes(r["memory_per_gpu_bytes"]),
                rel,
            ]
        )
    return format_table(
        [
            "budget",
            "strategy",
            "dedup",
            "inter-group",
            "intra-group",
            "sync",
            "time ms",
            "mem/GPU",
            "inter vs row-wise",
        ],
        rows,
    )


def tradeoffs(records: list[dict[str, Any]], point: Sequence[str] = ("budget_x", "dedup")) -> list[str]:
    """One line per point and baseline where FlexShard moves more bytes across groups than the baseline:
    what it gets for them. ``records`` as :func:`flexshard.cli.simulate_records` makes them (strategy,
    feasible, inter/intra-group bytes, modeled time), a point being the records with equal ``point``
    keys. FlexShard minimises modeled time, so it may take a few more NIC bytes to spend fewer NVLink
    bytes (a group fetch routes cold lookups through NVLink; a whole-table warm tier does not)."""
    lines = []
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in records:
        by_point.setdefault(tuple(r[k] for k in point), {})[r["strategy"]] = r
    for key, recs in by_point.items():
        ours = recs.get("flexshard")
        if not ours or not ours["feasible"]:
            continue
        where = ", ".join(f"{k} {_point_value(v)}" for k, v in zip(point, key, strict=True))
        for name, r in recs.items():
            if name == "flexshard" or not r["feasible"]:
                continue
            if ours["inter_group_bytes"] <= r["inter_group_bytes"] * (1 + 1e-9) + 1.0:  # 1 B: rounding
                continue
            more = ours["inter_group_bytes"] - r["inter_group_bytes"]
            less = r["intra_group_bytes"] - ours["intra_group_bytes"]
            key, what = (
                ("step_s", "modeled step time") if _stepped(ours, r) else ("modeled_time_s", "modeled time")
            )
            times = f"({ours[key] * 1e3:.4g} vs {r[key] * 1e3:.4g} ms)"
            faster = ours[key] <= r[key] * (1 + 1e-9)
            if faster and less > 0:
                why = (
                    f"it trades {human_bytes(more)} more across groups for {human_bytes(less)} less within "
                    f"groups, and its {what} is lower {times}"
                )
            elif faster and key == "step_s":
                why = (
                    f"its {what} is lower all the same {times}: fewer collectives or less local work pay "
                    "for the bytes"
                )
            elif faster:
                why = (
                    f"its modeled time is lower all the same {times}: the bytes are each link class's "
                    "busiest rank, not its slowest one (on links of unequal speed a plan loads the fast "
                    "ranks more)"
                )
            else:
                why = f"and is not faster in {what}: the planner missed a better plan"
            lines.append(
                f"{where}: {name} moves {human_bytes(r['inter_group_bytes'])} across groups, FlexShard "
                f"{human_bytes(ours['inter_group_bytes'])}; {why}"
            )
    return lines


def _stepped(*records: dict[str, Any]) -> bool:
    """Whether every record carries a modeled step time (the planner's objective then)."""
    return all(r.get("step_s") is not None for r in records)


def _point_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}x" if isinstance(value, float) else str(value)
