"""One entry point for every strategy: make a plan, place it, price it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from core.errors import ConfigError, PlannerError
from core.vocabulary import Deal, FetchMode, SyncMode, WireDtype
from solvers.baselines import BASELINES
from solvers.cost_model import row_wise_memory_bytes
from solvers.optimizer import OptimizerConfig, optimize_tiers
from solvers.placement import balance, priced_spread
from solvers.schedule import torchrec_schedule
from solvers.tier_program import config_rates
from solvers.time_model import step_time
from solvers.time_types import StepTime
from solvers.types import ROUTING_BYTES_PER_REPLICATED_ROW, CostReport, Plan, Workload
from topology.views import ClusterView

STRATEGIES = ("flexshard", *BASELINES)


@dataclass
class PlannedStrategy:
    plan: Plan
    report: CostReport
    step: StepTime | None = None  # modeled step time (solvers.time_model)


def budget_bytes(workload: Workload, view: ClusterView, budget_x: float) -> float:
    """Per-GPU bytes of a budget given as a multiple of row-wise sharding's per-GPU bytes, capped at
    :func:`everything_fits_bytes` (a larger budget allows no other plan: everything fits), so that a
    budget such as 1e308x never reaches the solver as an infinite or huge bound."""
    if not 0 < budget_x < float("inf"):
        raise ConfigError(f"budget: must be a positive multiple of row-wise memory, got {budget_x!r}")
    return min(budget_x * row_wise_memory_bytes(workload, view), everything_fits_bytes(workload))


def everything_fits_bytes(workload: Workload) -> float:
    """Per-GPU bytes no plan can exceed: every row of every table on the GPU (vector and optimizer
    state) plus the routing entry of every row (``ROUTING_BYTES_PER_REPLICATED_ROW``, B)."""
    return float(sum(t.num_rows * (t.row_bytes + ROUTING_BYTES_PER_REPLICATED_ROW) for t in workload.tables))


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
    cfg = replace(config or OptimizerConfig(), dedup=dedup, sync=sync, wire=wire)

    def priced(plan: Plan) -> PlannedStrategy:
        plan, report = priced_spread(workload, view, plan)
        step = step_time(workload, view, plan, cfg.latency, config_rates(cfg, view), overlap=cfg.overlap)
        return PlannedStrategy(plan, report, step)

    if strategy != "flexshard":
        return priced(replace(BASELINES[strategy](workload, view, budget, dedup, sync), wire=wire))
    even = optimize_tiers(workload, view, budget, cfg, progress).plan
    first = priced(balance(workload, view, even, budget))
    if cfg.step_time and first.plan.solver.get("placement") == "balanced":
        # placement balances bytes per link; it is kept only where it also shortens the modeled step
        unbalanced = priced(even)
        if _better(unbalanced, first, True):
            first = unbalanced
    plan, report = first.plan, first.report
    if report.memory_per_gpu_bytes > budget * (1 + 1e-9):  # a bug, not bad input
        raise AssertionError(
            f"optimizer returned {report.memory_per_gpu_bytes:.0f} B per GPU over {budget:.0f} B"
        )
    solver = {**plan.solver, "optimizer_plan_s": report.modeled_time_s}  # the optimizer's plan, evaluated
    solver["optimizer_plan_step_s"] = first.step.total_s
    best = PlannedStrategy(replace(plan, solver=solver), report, first.step)
    # Every baseline is a point of FlexShard's plan space (tiers, owner shares, a deal). The tier
    # optimizer assumes even shares and cannot see table-wise's, so each baseline is priced as a
    # candidate: its tiers dealt FlexShard's way, and its own plan as the baseline prices it (row-wise's
    # id ranges may leave a slow rank rows that few lookups reach). The cheapest plan is kept (modeled
    # step time; modeled time under the bytes objective), so FlexShard is never above a feasible baseline.
    solver = {k: v for k, v in solver.items() if k != "placement"}  # candidates keep their shares
    for name, baseline in BASELINES.items():
        try:
            own = replace(baseline(workload, view, budget, dedup, sync), strategy="flexshard", wire=wire)
        except PlannerError:
            continue
        dealt = tuple(replace(tp, deal=Deal.INTERLEAVE) for tp in own.tables)  # FlexShard's deal
        candidates = [(replace(own, tables=dealt), f"{name} tiers")]
        by_id = [tp.deal is Deal.RANGES for tp in own.tables]
        real_ids = all(t.order is not None for t, r in zip(workload.tables, by_id, strict=True) if r)
        if any(by_id) and real_ids:  # ranges of random id orders are an expectation, not a plan to run
            candidates.append((own, f"{name} plan"))
        if view.num_groups > 1 and any(tp.cold_rows > 0 and tp.fetch is not FetchMode.GROUP for tp in dealt):
            # its tiers with the group fetch for the cold rows (a baseline's replicas beside the fetch
            # that saves most inter-group bytes)
            grouped = tuple(replace(tp, fetch=FetchMode.GROUP) if tp.cold_rows > 0 else tp for tp in dealt)
            candidates.append((replace(own, tables=grouped), f"{name} tiers, group fetch"))
        for candidate, chosen in candidates:
            got = priced(replace(candidate, solver={**solver, "chosen": chosen}))
            if got.report.memory_per_gpu_bytes <= budget * (1 + 1e-9) and _better(got, best, cfg.step_time):
                best = got
    solver = {**best.plan.solver, "step_s": best.step.total_s}
    return PlannedStrategy(replace(best.plan, solver=solver), best.report, best.step)


def torchrec_step(
    workload: Workload, view: ClusterView, plan: Plan, config: OptimizerConfig | None = None
) -> StepTime:
    """The modeled step of ``plan`` run by TorchRec's own sequence sharding, in its collectives
    (:func:`~solvers.schedule.torchrec_schedule`: five world all-to-alls) rather than FlexShard's runtime's,
    with ``config``'s latencies and local rates: TorchRec's default is the row-wise plan without dedup
    priced so. Its plain step: a row-wise plan has no replica sync to overlap."""
    cfg = config or OptimizerConfig()
    rates = config_rates(cfg, view)
    return step_time(workload, view, plan, cfg.latency, rates, stages=torchrec_schedule(view))


def _better(a: PlannedStrategy, b: PlannedStrategy, by_step: bool) -> bool:
    """Lower modeled step time wins (modeled bandwidth time under the bytes objective); near-ties (1e-9
    relative) go to fewer inter-group bytes."""
    if by_step and a.step is not None and b.step is not None:
        ta, tb = a.step.total_s, b.step.total_s
    else:
        ta, tb = a.report.modeled_time_s, b.report.modeled_time_s
    if ta < tb * (1 - 1e-9):
        return True
    return ta <= tb * (1 + 1e-9) and a.report.inter_group_bytes < b.report.inter_group_bytes
