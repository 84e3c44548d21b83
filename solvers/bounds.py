"""A lower bound on any tier plan's modeled time, by Lagrangian relaxation of the memory budget.

Pricing memory at ``lam`` seconds per byte decouples the tables: each table takes the prefix plan
(the ``h`` hottest rows hot, the next ``w`` warm, the rest cold) minimising
``time + lam * memory``, or sits whole in one tier without routing metadata. Inside a histogram
bucket the rows are identical, so the best boundaries lie on bucket edges, and for each warm/cold
boundary ``b`` the best hot boundary is a running minimum: O(buckets) per table. Then

    L(lam) = sum_tables min_plan (time + lam * memory) - lam * budget

is a lower bound on every plan's linear-model time for every ``lam >= 0`` (weak duality), and its
maximum equals the optimum of the bucket-level program with fractional rows (the per-table
constraint system, monotone prefix shares, has integral vertices). Vectorised over tables padded to
a common number of buckets.

When a table may fetch its cold rows in several ways (:class:`core.vocabulary.FetchMode`), each way is
one set of coefficients, and the table takes the cheapest priced plan over all of them: the bound then
covers every per-table choice of fetch mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.vocabulary import Tier
from solvers.coefficients import TableCoefficients


@dataclass(frozen=True)
class LagrangeBound:
    bound_s: float  # max over lam of L(lam), seconds per iteration
    lam_s_per_byte: float
    iterations: int
    choice: np.ndarray | None = None  # int[T]: per table, the option (fetch mode) cheapest at lam


class _PrefixPricer:
    """Cheapest prefix plan of every table at a memory price, on padded [tables, buckets] arrays."""

    def __init__(self, coeffs: list[TableCoefficients], allowed: np.ndarray) -> None:
        kmax = max(c.rows.size for c in coeffs)
        nt = len(coeffs)
        self.time = np.zeros((3, nt, kmax))
        self.mem = np.zeros((3, nt, kmax))
        self.valid = np.zeros((nt, kmax + 1), dtype=bool)  # bucket edges 0..K_t
        for i, c in enumerate(coeffs):
            k = c.rows.size
            self.time[:, i, :k] = c.time_s
            self.mem[:, i, :k] = c.memory_bytes
            self.valid[i, : k + 1] = True
        self.last = np.array([c.rows.size for c in coeffs])
        self.credit = np.array([c.whole_table_credit_bytes for c in coeffs])
        self.allowed = allowed

    @staticmethod
    def _cum(x: np.ndarray) -> np.ndarray:
        return np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)

    def price(self, lam: float) -> tuple[np.ndarray, np.ndarray]:
        """Per table (the cheapest priced plan, its memory in bytes)."""
        priced = self.time + lam * self.mem
        cum = self._cum(priced)  # [3, T, K+1]
        cum_mem = self._cum(self.mem)
        rows = np.arange(self.valid.shape[0])
        total_cold = cum[Tier.COLD, rows, self.last][:, None]
        total_cold_mem = cum_mem[Tier.COLD, rows, self.last][:, None]
        inf = np.inf
        # hot boundary h <= warm/cold boundary b; f(h) = CH[h] - CW[h], running minimum over h <= b
        if self.allowed[Tier.HOT]:
            f = cum[Tier.HOT] - cum[Tier.WARM] if self.allowed[Tier.WARM] else cum[Tier.HOT] - cum[Tier.COLD]
            f = np.where(self.valid, f, inf)
            best_h = np.minimum.accumulate(f, axis=1)
            arg_h = _running_argmin(f)
        else:
            best_h = np.zeros_like(cum[Tier.HOT])
            arg_h = np.zeros(best_h.shape, dtype=np.int64)
        if self.allowed[Tier.WARM]:
            cost_b = best_h + cum[Tier.WARM] + total_cold - cum[Tier.COLD]
        else:  # no warm tier: b = h
            cost_b = best_h + cum[Tier.COLD] + total_cold - cum[Tier.COLD]
        if not self.allowed[Tier.COLD]:
            cost_b = np.where(np.arange(cost_b.shape[1])[None, :] == self.last[:, None], cost_b, inf)
        cost_b = np.where(self.valid, cost_b, inf)
        b = np.argmin(cost_b, axis=1)
        h = arg_h[rows, b]
        cost = cost_b[rows, b]
        upper = Tier.WARM if self.allowed[Tier.WARM] else Tier.COLD
        mem = (
            cum_mem[Tier.HOT, rows, h]
            + (cum_mem[upper, rows, b] - cum_mem[upper, rows, h])
            + (total_cold_mem[:, 0] - cum_mem[Tier.COLD, rows, b])
        )
        # whole-table tiers need no routing metadata
        for tier in (Tier.HOT, Tier.WARM):
            if self.allowed[tier]:
                whole_mem = cum_mem[tier, rows, self.last] - self.credit
                whole = cum[tier, rows, self.last] - lam * self.credit
                better = whole < cost
                cost = np.where(better, whole, cost)
                mem = np.where(better, whole_mem, mem)
        return cost, mem


def _running_argmin(f: np.ndarray) -> np.ndarray:
    """Index of the running minimum along axis 1 (first occurrence)."""
    idx = np.broadcast_to(np.arange(f.shape[1]), f.shape)
    running = np.minimum.accumulate(f, axis=1)
    is_new = f <= running  # positions where the running minimum is attained
    return np.maximum.accumulate(np.where(is_new, idx, 0), axis=1)


def lagrange_bound(
    coeffs: list[TableCoefficients] | list[list[TableCoefficients]],
    budget_bytes: float,
    allowed: np.ndarray,
    iterations: int = 100,
    lam_hint: float = 0.0,
    rel_tol: float = 1e-12,
) -> LagrangeBound:
    """Maximise L(lam) over lam >= 0 by bisection on its supergradient (memory - budget), to ``rel_tol``
    of lam.

    ``coeffs``: per table its coefficients, or one list per option (e.g. per fetch mode), each with
    every table; a table takes its cheapest option at each price. ``allowed``: bool[3], which tiers
    (hot, warm, cold) may be used. ``lam_hint``: a price near the optimum (e.g. a neighbouring
    problem's) to start the bracket from.
    """
    options = [coeffs] if isinstance(coeffs[0], TableCoefficients) else coeffs
    pricers = [_PrefixPricer(c, np.asarray(allowed, dtype=bool)) for c in options]

    def priced(lam: float) -> tuple[float, float, np.ndarray]:
        prices = [p.price(lam) for p in pricers]
        costs = np.stack([c for c, _ in prices])  # [options, tables]
        mems = np.stack([m for _, m in prices])
        choice = np.argmin(costs, axis=0)
        tables = np.arange(costs.shape[1])
        return float(costs[choice, tables].sum()), float(mems[choice, tables].sum()), choice

    def evaluate(lam: float) -> tuple[float, float]:
        cost, mem, _ = priced(lam)
        return cost - lam * budget_bytes, mem

    value0, mem0 = evaluate(0.0)
    if mem0 <= budget_bytes:
        return LagrangeBound(bound_s=value0, lam_s_per_byte=0.0, iterations=1, choice=priced(0.0)[2])
    lo, hi = 0.0, 1e-18
    if lam_hint > 0.0:
        hi = lam_hint * 2.0
        if evaluate(lam_hint / 2.0)[1] > budget_bytes:
            lo = lam_hint / 2.0
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
        if hi - lo <= rel_tol * hi:
            break
    lam = 0.5 * (lo + hi)
    return LagrangeBound(bound_s=best, lam_s_per_byte=lam, iterations=it + 1, choice=priced(lam)[2])
