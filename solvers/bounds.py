"""A lower bound on any tier plan's modeled time, by Lagrangian relaxation of the memory budget.

Pricing memory at ``lam`` seconds per byte decouples the rows: each bucket of identical rows takes
the tier minimising ``time + lam * memory``. ``L(lam) = sum_k min_tier(...) - lam * budget`` is a
lower bound for every ``lam >= 0`` (weak duality) and its maximum equals the bucket-level linear
program's optimum. Prefix (hotness-ordered) plans are a subset, so the bound holds for them too.
Fully vectorised over all buckets of all tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.coefficients import TableCoefficients


@dataclass(frozen=True)
class LagrangeBound:
    bound_s: float  # max over lam of L(lam), seconds per iteration
    lam_s_per_byte: float
    iterations: int


def lagrange_bound(
    coeffs: list[TableCoefficients], budget_bytes: float, allowed: np.ndarray, iterations: int = 200
) -> LagrangeBound:
    """Maximise L(lam) by bisection on its supergradient (memory - budget).

    ``allowed``: bool[3], which tiers (hot, warm, cold) may be used.
    """
    time_s = np.concatenate([c.time_s for c in coeffs], axis=1)
    memory = np.concatenate([c.memory_bytes for c in coeffs], axis=1)
    starts = np.cumsum([0] + [c.rows.size for c in coeffs[:-1]])
    credit = np.array([c.whole_table_credit_bytes for c in coeffs])
    # a table may also sit whole in the hot or warm tier, without routing metadata
    whole_time = np.add.reduceat(time_s, starts, axis=1)[:2]  # [hot, warm] x tables
    whole_mem = np.add.reduceat(memory, starts, axis=1)[:2] - credit
    whole_ok = allowed[:2]
    time_s, memory = time_s[allowed], memory[allowed]
    cols = np.arange(time_s.shape[1])

    def evaluate(lam: float) -> tuple[float, float]:
        priced = time_s + lam * memory
        pick = np.argmin(priced, axis=0)
        per_table = np.add.reduceat(priced[pick, cols], starts)
        per_table_mem = np.add.reduceat(memory[pick, cols], starts)
        for tier in np.flatnonzero(whole_ok):
            whole = whole_time[tier] + lam * whole_mem[tier]
            better = whole < per_table
            per_table = np.where(better, whole, per_table)
            per_table_mem = np.where(better, whole_mem[tier], per_table_mem)
        return float(per_table.sum() - lam * budget_bytes), float(per_table_mem.sum())

    value0, mem0 = evaluate(0.0)
    if mem0 <= budget_bytes:
        return LagrangeBound(bound_s=value0, lam_s_per_byte=0.0, iterations=1)
    lo, hi = 0.0, 1e-18
    while evaluate(hi)[1] > budget_bytes and hi < 1e6:
        lo, hi = hi, hi * 4.0
    best = max(evaluate(lo)[0], evaluate(hi)[0])
    it = 0
    for it in range(iterations):  # noqa: B007
        mid = 0.5 * (lo + hi)
        value, mem = evaluate(mid)
        best = max(best, value)
        if mem > budget_bytes:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return LagrangeBound(bound_s=best, lam_s_per_byte=0.5 * (lo + hi), iterations=it + 1)
