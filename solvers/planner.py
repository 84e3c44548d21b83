"""One entry point for every strategy: make a plan, place it, price it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from solvers.baselines import BASELINES
from solvers.cost_model import SYNC_MODES, evaluate, row_wise_memory_bytes
from solvers.optimizer import OptimizerConfig, optimize_tiers
from solvers.placement import balance
from solvers.types import CostReport, Plan, PlannerError, Workload
from topology.views import ClusterView

STRATEGIES = ("flexshard", *BASELINES)


@dataclass
class PlannedStrategy:
    plan: Plan
    report: CostReport


def budget_bytes(workload: Workload, view: ClusterView, budget_x: float) -> float:
    """Per-GPU bytes of a budget given as a multiple of row-wise sharding's per-GPU bytes."""
    if not budget_x > 0:
        raise PlannerError(f"budget: must be a positive multiple of row-wise memory, got {budget_x!r}")
    return budget_x * row_wise_memory_bytes(workload, view)


def make_plan(
    strategy: str,
    workload: Workload,
    view: ClusterView,
    budget: float,
    dedup: bool = True,
    sync: str = "sparse",
    config: OptimizerConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> PlannedStrategy:
    """Plan ``workload`` on ``view`` with ``strategy`` under ``budget`` bytes per GPU, and price it."""
    if strategy not in STRATEGIES:
        raise PlannerError(f"strategy: unknown {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if sync not in SYNC_MODES:
        raise PlannerError(f"sync: must be one of {', '.join(SYNC_MODES)}, got {sync!r}")
    if strategy == "flexshard":
        cfg = config or OptimizerConfig()
        cfg.dedup, cfg.sync = dedup, sync
        plan = optimize_tiers(workload, view, budget, cfg, progress).plan
        plan = balance(workload, view, plan, budget)
    else:
        plan = BASELINES[strategy](workload, view, budget, dedup, sync)
    return PlannedStrategy(plan, evaluate(workload, view, plan))
