"""The pipelined step in the tier program's linear form (``OptimizerConfig.overlap``).

:func:`solvers.time_model.step_time` with ``overlap`` prices the pipelined step: the next batch's input
distribution (the ``ids`` stage's latency, the ids bytes, dedup and routing) runs beside the
replica sync (the sync stages' latency, the sync bytes, the synced rows' work), so the step pays

    step = other + max(input, sync)

where ``other`` is everything else. Each of the three is a fixed part (:class:`FixedParts`, per set of
tiers and exchanges) plus a sum over rows of per-tier coefficients (:class:`TableCoefficients`'
``other_s``, ``input_s`` and ``sync_s``), so the step is convex in the tier shares: the tier program
minimises ``other + z`` subject to ``z >= input`` and ``z >= sync`` (an LP).

Lower bound: for every ``theta`` in [0, 1], ``max(input, sync) >= theta * input + (1 - theta) * sync``,
so the Lagrangian bound (:mod:`solvers.bounds`) of the linear objective ``other + theta * input +
(1 - theta) * sync`` bounds every plan's pipelined step. The bound is concave in ``theta`` (a partial
maximum of the dual function, jointly concave in ``theta`` and the memory price), so a golden-section
search finds its maximum, which equals the LP optimum up to the search's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.vocabulary import Tier
from solvers.bounds import LagrangeBound, lagrange_bound
from solvers.coefficients import TableCoefficients, link_times
from solvers.cost_model import Exchanges, split_bytes
from solvers.schedule import Phase, StepShape, shape_schedule
from solvers.time_model import INPUT_STAGES
from solvers.time_types import LatencyTable, LocalRates, stage_latency_s
from solvers.types import Workload
from solvers.volumes import routed_ids
from topology.views import ClusterView

THETA_STEPS = 12  # golden-section steps over theta (the bracket shrinks 0.618x per step: to 0.3%)
SEARCH_REL_TOL = 1e-6  # the memory price's bisection inside the search (any price gives a valid bound)


@dataclass(frozen=True)
class FixedParts:
    """A plan's cost that does not scale with rows (seconds per step), and the parts of it the
    pipelined step overlaps: the input distribution's and the replica sync's."""

    total_s: float
    input_s: float = 0.0
    sync_s: float = 0.0

    @property
    def other_s(self) -> float:
        return self.total_s - self.input_s - self.sync_s


def fixed_parts(
    workload: Workload,
    view: ClusterView,
    shape: StepShape,
    uses: Exchanges,
    total_s: float,
    dedup: bool,
    rates: LocalRates,
    latency: LatencyTable,
) -> FixedParts:
    """``total_s`` (the fixed cost of a plan of this shape) with its overlapped parts: the input stages'
    latency, the split sizes' bytes, every lookup's dedup and the routing of the
    ids (:func:`solvers.volumes.routed_ids`); the sync stages' latency."""
    stages = shape_schedule(shape, view)
    input_lat = sum(stage_latency_s(s, view, latency) for s in stages if s.name in INPUT_STAGES)
    sync_lat = sum(stage_latency_s(s, view, latency) for s in stages if s.phase is Phase.SYNC)
    splits = split_bytes(view, len(workload.tables), uses).max(axis=0)
    lookups = sum(workload.lookups_per_gpu(t) for t in workload.tables)
    routed = sum(routed_ids(workload, view, t, dedup) for t in workload.tables)
    local = (rates.dedup_s_per_lookup if dedup else 0.0) * lookups + rates.route_s_per_lookup * routed
    inputs = input_lat + float(splits @ link_times(view).inv_bw_s_per_byte) + local
    return FixedParts(total_s, float(inputs), float(sync_lat))


def tier_sum(c: TableCoefficients, rows: tuple[int, int], arr: str = "time_s") -> float:
    """Sum of the per-row coefficient ``arr`` over one table's plan (the ``h`` hottest rows hot, the next
    ``w`` warm, the rest cold), linear inside a histogram bucket."""
    h, w = rows
    values = getattr(c, arr)
    cum_rows = np.concatenate([[0.0], np.cumsum(c.rows)])

    def prefix(n: float, tier: int) -> float:
        return float(np.interp(n, cum_rows, np.concatenate([[0.0], np.cumsum(values[tier])])))

    return (
        prefix(h, Tier.HOT)
        + prefix(h + w, Tier.WARM)
        - prefix(h, Tier.WARM)
        + float(values[Tier.COLD].sum())
        - prefix(h + w, Tier.COLD)
    )


def pipelined_time(coeffs: list[TableCoefficients], rows: list[tuple[int, int]], fixed: FixedParts) -> float:
    """Seconds per step of a plan (per-table (hot, warm) rows) under the pipelined price (module doc)."""

    def total(arr: str) -> float:
        return sum(tier_sum(c, r, arr) for c, r in zip(coeffs, rows, strict=True))

    inputs = fixed.input_s + total("input_s")
    sync = fixed.sync_s + total("sync_s")
    return fixed.other_s + total("other_s") + max(inputs, sync)


def mixed(c: TableCoefficients, theta: float) -> TableCoefficients:
    """Coefficients whose ``time_s`` is ``other + theta * input + (1 - theta) * sync`` (both fetch modes)."""
    time_s = c.other_s + theta * c.input_s + (1.0 - theta) * c.sync_s
    group = None
    if c.cold_group_time_s is not None and c.cold_group_input_s is not None:
        # the cold tier has no sync part: other + theta * input of the group fetch's cold row
        group = c.cold_group_time_s - (1.0 - theta) * c.cold_group_input_s
    elif c.cold_group_time_s is not None:
        group = c.cold_group_time_s
    return replace(c, time_s=time_s, cold_group_time_s=group)


def overlap_bound(
    options: list[list[TableCoefficients]], budget_bytes: float, allowed: np.ndarray, fixed: FixedParts
) -> tuple[LagrangeBound, float]:
    """(the Lagrangian bound at the best theta, theta): a lower bound on every plan's pipelined step of
    these tiers, fixed parts included. ``options``: per fetch mode, every table's coefficients."""

    seen: dict[float, tuple[float, LagrangeBound]] = {}
    hint = [0.0]  # the last memory price: the next theta's starts near it

    def at(theta: float) -> float:
        mix = [[mixed(c, theta) for c in option] for option in options]
        bound = lagrange_bound(mix, budget_bytes, allowed, lam_hint=hint[0], rel_tol=SEARCH_REL_TOL)
        hint[0] = bound.lam_s_per_byte
        constant = fixed.other_s + theta * fixed.input_s + (1.0 - theta) * fixed.sync_s
        seen[theta] = (bound.bound_s + constant, bound)
        return seen[theta][0]

    lo, hi = 0.0, 1.0
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = at(a), at(b)
    for _ in range(THETA_STEPS):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = at(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = at(a)
    at(0.0), at(1.0)
    theta = max(seen, key=lambda t: seen[t][0])
    value, bound = seen[theta]
    return replace(bound, bound_s=value), theta
