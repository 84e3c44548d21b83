"""Planning without torch: the cost model, the tier optimizer, placement and baselines.

* ``types``: the nouns (RowHistogram, TableSpec, Workload, TablePlan, Plan, CostReport);
* ``wire``: what each exchange puts on the wire (the traffic formulas every layer prices with);
* ``cost_model``: bytes per link class per iteration, modeled time and memory of a plan, per rank;
* ``coefficients``: the same model as per-row tier coefficients (the optimizer's linear form);
* ``optimizer``: the PuLP tier program; ``bounds``: its Lagrangian lower bound;
* ``placement``: owner shares balanced by link speed; ``baselines``: the strategies we compare with;
* ``planner``: one entry point, ``make_plan(strategy, workload, view, budget)``.
"""

from core.errors import PlannerError
from solvers.cost_model import evaluate, row_wise_memory_bytes
from solvers.optimizer import OptimizerConfig, optimize_tiers
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from solvers.types import CostReport, Plan, RowHistogram, TablePlan, TableSpec, Workload

__all__ = [
    "STRATEGIES",
    "CostReport",
    "OptimizerConfig",
    "Plan",
    "PlannerError",
    "RowHistogram",
    "TablePlan",
    "TableSpec",
    "Workload",
    "budget_bytes",
    "evaluate",
    "make_plan",
    "optimize_tiers",
    "row_wise_memory_bytes",
]
