"""One entry point for every strategy: make a plan, place it, price it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from core.errors import ConfigError, PlannerError
from core.vocabulary import Deal, SyncMode, WireDtype
from solvers.baselines import BASELINES
from solvers.cost_model import row_wise_memory_bytes
from solvers.optimizer import OptimizerConfig, optimize_tiers
from solvers.placement import balance, priced_spread
from solvers.types import CostReport, Plan, Workload
from topology.views import ClusterView

STRATEGIES = ("flexshard", *BASELINES)


@dataclass
class PlannedStrategy:
    plan: Plan
    report: CostReport


def budget_bytes(workload: Workload, view: ClusterView, budget_x: float) -> float:
    """Per-GPU bytes of a budget given as a multiple of row-wise sharding's per-GPU bytes."""
    if not 0 < budget_x < float("inf"):
        raise ConfigError(f"budget: must be a positive multiple of row-wise memory, got {budget_x!r}")
    return budget_x * row_wise_memory_bytes(workload, view)


def make_plan(
    strategy: str,
    workload: Workload,
    view: ClusterView,
    budget: float,
    dedup: bool = True,
    sync: SyncMode | str = SyncMode.SPARSE,
    config: OptimizerConfig | None = None,
    progress: Callable[[str], None] | None = None,
    wire: WireDtype | str = WireDtype.FP32,
) -> PlannedStrategy:
    """Plan ``workload`` on ``view`` with ``strategy`` under ``budget`` bytes per GPU, and price it.

    ``dedup``, ``sync`` and ``wire`` (the element type of vectors on the wire) apply to every strategy
    and take precedence over ``config``'s (the optimizer's other knobs); no argument is modified.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy: unknown {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    sync, wire = SyncMode.parse(sync), WireDtype.parse(wire)
    if strategy != "flexshard":
        baseline = replace(BASELINES[strategy](workload, view, budget, dedup, sync), wire=wire)
        return PlannedStrategy(*priced_spread(workload, view, baseline))
    cfg = replace(config or OptimizerConfig(), dedup=dedup, sync=sync, wire=wire)
    plan = balance(workload, view, optimize_tiers(workload, view, budget, cfg, progress).plan, budget)
    plan, report = priced_spread(workload, view, plan)
    best = PlannedStrategy(plan, report)
    if best.report.memory_per_gpu_bytes > budget * (1 + 1e-9):  # a bug, not bad input
        raise AssertionError(
            f"optimizer returned {best.report.memory_per_gpu_bytes:.0f} B per GPU over {budget:.0f}"
        )
    # Every baseline's tiers and owner shares are a point of FlexShard's plan space; the tier
    # optimizer assumes even shares and cannot see table-wise's, so they are priced as candidates
    # (dealt FlexShard's way) and the cheapest plan is kept.
    for name, baseline in BASELINES.items():
        try:
            candidate = baseline(workload, view, budget, dedup, sync)
        except PlannerError:
            continue
        tables = tuple(replace(tp, deal=Deal.INTERLEAVE) for tp in candidate.tables)  # FlexShard's deal
        chosen = {**plan.solver, "chosen": f"{name} tiers"}
        candidate = replace(candidate, strategy="flexshard", tables=tables, solver=chosen, wire=wire)
        candidate, report = priced_spread(workload, view, candidate)
        if report.memory_per_gpu_bytes <= budget * (1 + 1e-9) and _better(report, best.report):
            best = PlannedStrategy(candidate, report)
    return best


def _better(a: CostReport, b: CostReport) -> bool:
    """Lower modeled time wins; near-ties (1e-9 relative) go to fewer inter-group bytes."""
    if a.modeled_time_s < b.modeled_time_s * (1 - 1e-9):
        return True
    return a.modeled_time_s <= b.modeled_time_s * (1 + 1e-9) and a.inter_group_bytes < b.inter_group_bytes
