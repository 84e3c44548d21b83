"""The tier optimizer: which tiers, exchanges and fetch modes to use, and where the tier boundaries fall.

Using a tier or an exchange at all has a fixed cost (split sizes; latency when asked), so the tier
program (:mod:`solvers.tier_program`) is solved once per candidate: a set of tiers in use (hot, warm,
cold) and, where the cluster has several groups of equal size, whether cold rows may be fetched once
per group (:attr:`core.vocabulary.FetchMode.GROUP`). Candidates are taken cheapest lower bound first
(:mod:`solvers.bounds`), and skipped once their bound cannot beat the best plan found.

A group candidate also picks each table's fetch mode: first the one the Lagrangian bound prices
cheaper, then, on the solved boundaries, whichever mode is cheaper for the table's cold rows (memory
does not depend on the mode, so the plan stays feasible), solving again while a mode changes.
Finally whole tables move into the hot or warm tier where that saves time and fits.

The time minimised is the modeled step time of the slowest rank on the symmetric cluster
(``OptimizerConfig.step_time``, :mod:`solvers.time_model`): per-row bytes and local work
(:mod:`solvers.coefficients`) plus, per candidate, the latency of the collectives its exchanges issue
(:mod:`solvers.schedule`), the split sizes and the local work every plan does. With
``OptimizerConfig.overlap`` it is the pipelined step, ``other + max(input, sync)``, and the bounds are
restated for it (:mod:`solvers.overlap`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from core.errors import PlannerError
from core.vocabulary import FetchMode, Tier
from solvers.bounds import lagrange_bound
from solvers.coefficients import (
    TableCoefficients,
    exchange_shape,
    fixed_local_s,
    fixed_time_s,
    table_coefficients,
)
from solvers.cost_model import Exchanges, row_wise_memory_bytes, table_plan
from solvers.overlap import FixedParts, fixed_parts, overlap_bound, pipelined_time
from solvers.tier_program import OptimizerConfig, config_rates, linear_time, prefix_sum, refined_solve
from solvers.time_types import LatencyTable, LocalRates
from solvers.types import Plan, Workload
from topology.views import ClusterView

__all__ = ["OptimizerConfig", "OptimizerResult", "optimize_tiers"]
MODE_PASSES = 3  # solves per group candidate while table fetch modes change


@dataclass
class OptimizerResult:
    plan: Plan
    objective_s: float  # linear-model time of the returned plan (bandwidth part), seconds/iteration
    lower_bound_s: float  # Lagrangian bound on any plan's linear-model time
    gap: float  # (objective - bound) / bound
    rounds: int
    variables: int  # of the last program
    solve_time_s: float
    history: list[dict] = field(default_factory=list)


@dataclass
class _Candidate:
    """One set of tiers and exchanges to solve the program for, with its lower bound."""

    allowed: np.ndarray  # bool[3]: hot, warm, cold
    group: bool  # cold rows may be fetched once per group
    bound_s: float  # Lagrangian bound of the program's linear time (pipelined: of the whole step)
    fixed_s: float  # the least fixed cost of any plan of this candidate (pipelined: in bound_s)
    modes: list[FetchMode]  # per table, the fetch mode the bound priced cheaper
    fixed: FixedParts | None = None  # pipelined price: the fixed cost and its overlapped parts

    @property
    def total_bound_s(self) -> float:
        return self.bound_s if self.fixed is not None else self.bound_s + self.fixed_s


def optimize_tiers(
    workload: Workload,
    view: ClusterView,
    budget_bytes: float,
    config: OptimizerConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> OptimizerResult:
    """Choose every table's hot/warm/cold boundaries and cold fetch mode, minimising modeled time under
    ``budget_bytes`` per GPU (see the module docstring). Raises PlannerError when no plan fits (naming
    the smallest feasible budget)."""
    cfg = config or OptimizerConfig()
    t0 = time.perf_counter()
    rates = _rates(cfg, view)
    coeffs = table_coefficients(workload, view, cfg.dedup, cfg.sync, cfg.routing_metadata, cfg.wire, rates)
    floor_bytes = float(sum(c.memory_bytes[Tier.COLD].sum() for c in coeffs))
    if budget_bytes < floor_bytes * (1 - 1e-12):
        rw = row_wise_memory_bytes(workload, view)
        raise PlannerError(
            f"budget: {budget_bytes:,.0f} bytes ({budget_bytes / rw:.3g}x row-wise) per GPU is infeasible; "
            f"the smallest feasible budget is {floor_bytes:,.0f} bytes ({floor_bytes / rw:.3g}x row-wise) "
            f"per GPU (every row cold, split over {view.num_ranks} GPUs)"
        )
    candidates = sorted(_candidates(workload, view, coeffs, budget_bytes, cfg), key=lambda c: c.total_bound_s)
    best: dict | None = None
    history: list[dict] = []
    for cand in candidates:
        if best is not None and cand.total_bound_s >= best["total_s"]:
            continue
        solved = _solve_candidate(workload, view, coeffs, budget_bytes, cand, cfg, history, progress)
        if solved is not None and (best is None or solved["total_s"] < best["total_s"]):
            best = solved
    assert best is not None
    lower = min(c.total_bound_s for c in candidates)
    gap = max((best["total_s"] - lower) / lower, 0.0) if lower > 0 else 0.0  # >= 0 up to rounding
    tables = tuple(
        table_plan(t, view, h, w, mode)
        for t, (h, w), mode in zip(workload.tables, best["rows"], best["modes"], strict=True)
    )
    solve_time = time.perf_counter() - t0
    solver = {
        "objective_s": best["total_s"],
        "lower_bound_s": lower,
        "gap": gap,
        "rounds": best["rounds"],
        "variables": best["variables"],
        "solve_time_s": solve_time,
        "objective": "step" if cfg.step_time else "bytes",  # what objective_s measures
        "pipelined": bool(cfg.step_time and cfg.overlap),  # the step priced pipelined (solvers.overlap)
    }
    plan = Plan(
        "flexshard", tables, cfg.dedup, cfg.sync, budget_bytes=budget_bytes, solver=solver, wire=cfg.wire
    )
    return OptimizerResult(
        plan, best["total_s"], lower, gap, best["rounds"], best["variables"], solve_time, history
    )


def _candidates(
    workload: Workload,
    view: ClusterView,
    coeffs: list[TableCoefficients],
    budget: float,
    cfg: OptimizerConfig,
) -> list[_Candidate]:
    """Every set of tiers (and of cold fetch modes) a plan may use, with its lower bound."""
    warm_possible = cfg.allow_warm and view.num_groups > 1 and view.uniform_group_size not in (None, 1)
    group_possible = FetchMode.GROUP in cfg.fetch_modes and all(
        c.cold_group_time_s is not None for c in coeffs
    )
    out = []
    for hot in (False, True) if cfg.allow_hot else (False,):
        for warm in (False, True) if warm_possible else (False,):
            for cold in (True, False):
                allowed = np.array([hot, warm, cold])
                if not allowed.any() or (not cold and _min_memory(coeffs, allowed) > budget):
                    continue
                for group in (False, True) if cold and group_possible else (False,):
                    options = [coeffs, [c.for_fetch(FetchMode.GROUP) for c in coeffs]] if group else [coeffs]
                    bound = lagrange_bound(options, budget, allowed)
                    uses = Exchanges(warm=warm, cold_flat=cold and not group, cold_group=group)
                    fixed = _fixed_s(workload, view, hot, uses, cfg)
                    parts = _fixed_parts(workload, view, hot, uses, cfg)
                    if parts is not None:  # the pipelined step's bound: over theta (solvers.overlap)
                        bound, _ = overlap_bound(options, budget, allowed, parts)
                    modes = [FetchMode.GROUP if k else FetchMode.FLAT for k in bound.choice]
                    out.append(_Candidate(allowed, group, bound.bound_s, fixed, modes, parts))
    return out


def _solve_candidate(
    workload: Workload,
    view: ClusterView,
    coeffs: list[TableCoefficients],
    budget: float,
    cand: _Candidate,
    cfg: OptimizerConfig,
    history: list[dict],
    progress: Callable[[str], None] | None,
) -> dict | None:
    """The candidate's best plan (rows and modes per table, total seconds), or None when none fits."""
    modes = cand.modes

    def plan_time(priced: list[TableCoefficients], rows: list[tuple[int, int]]) -> float:
        """What the candidate compares: linear time, or the pipelined step at the candidate's shape."""
        return linear_time(priced, rows) if cand.fixed is None else pipelined_time(priced, rows, cand.fixed)

    for _ in range(MODE_PASSES):
        priced = [c.for_fetch(m) for c, m in zip(coeffs, modes, strict=True)]
        solved = refined_solve(
            priced, budget, cand.allowed, cand.bound_s, cfg, history, progress, fixed=cand.fixed
        )
        if solved is None:
            return None
        rows, _linear, nvars, rounds = solved
        rows = _whole_table_moves(priced, rows, budget, cand.allowed, plan_time)
        if not cand.group:
            break
        cheaper = _cheaper_modes(coeffs, rows, modes, plan_time)
        if cheaper == modes:
            break
        modes = cheaper
    priced = [c.for_fetch(m) for c, m in zip(coeffs, modes, strict=True)]
    linear_s = linear_time(priced, rows)
    hot, uses = _exchanges_used(rows, modes, workload)
    parts = _fixed_parts(workload, view, hot, uses, cfg)
    if parts is None:
        total = linear_s + _fixed_s(workload, view, hot, uses, cfg)
    else:
        total = pipelined_time(priced, rows, parts)
    return {
        "total_s": total,
        "rows": rows,
        "modes": modes,
        "linear_s": linear_s,
        "variables": nvars,
        "rounds": rounds,
    }


def _rates(cfg: OptimizerConfig, view: ClusterView) -> LocalRates | None:
    """The local rates the objective prices (None: bytes alone)."""
    if not cfg.step_time:
        return None
    return config_rates(cfg, view)


def _fixed_s(
    workload: Workload, view: ClusterView, hot: bool, uses: Exchanges, cfg: OptimizerConfig
) -> float:
    """A plan's cost that does not scale with rows: split sizes, and under the step-time objective the
    latency of its collectives and the local work every plan does (:func:`fixed_local_s`)."""
    ntab = len(workload.tables)
    if not cfg.step_time:
        return fixed_time_s(view, ntab, hot, uses, cfg.sync, cfg.include_latency, wire_dtype=cfg.wire)
    latency = LatencyTable.from_view(view) if cfg.latency is None else cfg.latency
    fixed = fixed_time_s(view, ntab, hot, uses, cfg.sync, True, latency, cfg.wire)
    shape = exchange_shape(view, hot, uses, cfg.sync, cfg.wire)
    return fixed + fixed_local_s(workload, view, shape, cfg.dedup, _rates(cfg, view))


def _fixed_parts(
    workload: Workload, view: ClusterView, hot: bool, uses: Exchanges, cfg: OptimizerConfig
) -> FixedParts | None:
    """Under the pipelined price (``overlap`` with the step objective), the fixed cost of a plan with
    these exchanges and its overlapped parts; else None."""
    if not (cfg.step_time and cfg.overlap):
        return None
    latency = LatencyTable.from_view(view) if cfg.latency is None else cfg.latency
    shape = exchange_shape(view, hot, uses, cfg.sync, cfg.wire)
    total = _fixed_s(workload, view, hot, uses, cfg)
    return fixed_parts(workload, view, shape, uses, total, cfg.dedup, _rates(cfg, view), latency)


def _plan_memory(c: TableCoefficients, h: int, w: int) -> float:
    """Per-GPU bytes of one table's (hot, warm) boundaries, without metadata if one tier holds it all."""
    total = float(c.rows.sum())
    mem = prefix_sum(c, h, Tier.HOT, "memory_bytes") + prefix_sum(c, h + w, Tier.WARM, "memory_bytes")
    mem += -prefix_sum(c, h, Tier.WARM, "memory_bytes") + c.memory_bytes[Tier.COLD].sum()
    mem -= prefix_sum(c, h + w, Tier.COLD, "memory_bytes")
    if h == total or w == total:
        mem -= c.whole_table_credit_bytes
    return float(mem)


def _whole_table_moves(
    coeffs: list[TableCoefficients],
    rows: list[tuple[int, int]],
    budget: float,
    allowed: np.ndarray,
    plan_time: Callable[[list[TableCoefficients], list[tuple[int, int]]], float] = linear_time,
) -> list[tuple[int, int]]:
    """Greedy: move whole tables into the hot or warm tier (no routing metadata) while that saves
    time (``plan_time`` of all tables' rows) and fits; the segment program sees only partial tiers with
    metadata."""
    rows = list(rows)
    mem = [_plan_memory(c, h, w) for c, (h, w) in zip(coeffs, rows, strict=True)]
    time_now = plan_time(coeffs, rows)
    while True:
        slack = budget - sum(mem)
        best = None
        for i, c in enumerate(coeffs):
            total = int(c.rows.sum())
            for tier, plan in ((Tier.HOT, (total, 0)), (Tier.WARM, (0, total))):
                if not allowed[tier] or rows[i] == plan:
                    continue
                t_new = plan_time(coeffs, rows[:i] + [plan] + rows[i + 1 :])
                m_new = _plan_memory(c, *plan)
                gain = time_now - t_new
                if gain > 1e-15 and m_new - mem[i] <= slack and (best is None or gain > best[0]):
                    best = (gain, i, plan, t_new, m_new)
        if best is None:
            return rows
        _, i, plan, time_now, m_new = best
        rows[i], mem[i] = plan, m_new


def _min_memory(coeffs: list[TableCoefficients], allowed: np.ndarray) -> float:
    """Least per-GPU bytes of any plan using only the allowed tiers (whole-table tiers without metadata)."""
    total = 0.0
    for c in coeffs:
        options = [c.memory_bytes[allowed].min(axis=0).sum()]
        options += [
            c.memory_bytes[t].sum() - c.whole_table_credit_bytes for t in (Tier.HOT, Tier.WARM) if allowed[t]
        ]
        total += min(options)
    return float(total)


def _cheaper_modes(
    coeffs: list[TableCoefficients],
    rows: list[tuple[int, int]],
    modes: list[FetchMode],
    plan_time: Callable[[list[TableCoefficients], list[tuple[int, int]]], float],
) -> list[FetchMode]:
    """Per table, the fetch mode under which the plan ``rows`` costs less (``plan_time``, the other
    tables at ``modes``). On a tie (no cold rows, so the mode does not matter here), the one whose cold
    rows are cheaper: it is the mode that lets the next solve keep rows cold where that pays."""
    out = []
    for i, c in enumerate(coeffs):
        priced = [c2.for_fetch(m) for c2, m in zip(coeffs, modes, strict=True)]
        times = {}
        for m in (FetchMode.FLAT, FetchMode.GROUP):
            priced[i] = c.for_fetch(m)
            times[m] = plan_time(priced, rows)
        least = min(times.values())
        tied = [m for m in times if times[m] <= least * (1 + 1e-12)]
        out.append(min(tied, key=lambda m: float(c.for_fetch(m).time_s[Tier.COLD].sum())))
    return out


def _exchanges_used(
    rows: list[tuple[int, int]], modes: list[FetchMode], workload: Workload
) -> tuple[bool, Exchanges]:
    """Whether a plan with these boundaries and modes has hot rows, and which exchanges it runs."""
    cold = [h + w < t.num_rows for (h, w), t in zip(rows, workload.tables, strict=True)]
    uses = Exchanges(
        warm=any(w > 0 for _, w in rows),
        cold_flat=any(c and m is FetchMode.FLAT for c, m in zip(cold, modes, strict=True)),
        cold_group=any(c and m is FetchMode.GROUP for c, m in zip(cold, modes, strict=True)),
    )
    return any(h > 0 for h, _ in rows), uses
