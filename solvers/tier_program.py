"""The tier program: a PuLP linear program over CDF segments of each table, refined adaptively.

For every table the rows are in hotness order and the plan is two boundaries: the first ``h``
rows hot, the next ``w`` warm, the rest cold. Rows are grouped into segments at CDF breakpoints
(mass quantiles and a geometric grid of row counts), so the model has ``tables x segments``
variables, never one per row. Per segment two prefix variables, ``H`` (share of the segment that
is hot) and ``W`` (share that is hot or warm), with ``H_k >= H_k+1``, ``W_k >= W_k+1``, ``H <= W``:

    minimise   sum  c_cold + (c_warm - c_cold) W + (c_hot - c_warm) H       (seconds/iteration)
    subject to sum  m_cold + (m_warm - m_cold) W + (m_hot - m_warm) H <= budget   (bytes/GPU)

CBC (bundled with PuLP) solves it; the segments that hold a boundary are then split into finer
segments and the program solved again, until the boundaries sit inside single histogram buckets
(rows of equal probability, so a fractional share is exact) or the gap to the Lagrangian lower
bound (:mod:`solvers.bounds`) is below the target. :mod:`solvers.optimizer` decides which tiers,
exchanges and fetch modes the program is solved for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pulp

from core.errors import PlannerError
from core.vocabulary import FetchMode, SyncMode, Tier, WireDtype
from solvers.coefficients import TableCoefficients
from solvers.overlap import FixedParts, pipelined_time
from solvers.time_types import LatencyTable, LocalRates
from topology.views import ClusterView

INTEGER_ROWS_MAX = 64  # segments this small get whole-row variables in the final (integer) solve


@dataclass
class OptimizerConfig:
    """Knobs of :func:`optimize_tiers`; the defaults suit clusters of up to thousands of GPUs."""

    dedup: bool = True  # per-rank id dedup before the exchange
    sync: SyncMode = SyncMode.SPARSE  # replica gradient sync: touched rows, or every replicated row
    wire: WireDtype = WireDtype.FP32  # element type of embeddings and gradients on the wire
    allow_hot: bool = True
    allow_warm: bool = True
    initial_segments: int = 24  # mass-quantile breakpoints per table (plus a geometric row grid)
    split_factor: int = 8  # a refined segment is cut into this many
    max_rounds: int = 8
    target_gap: float = 1e-3  # stop refining below this relative gap to the lower bound
    solver_time_limit_s: float = 120.0
    routing_metadata: bool = True
    integer_rows: bool = True  # finish with whole-row counts in small segments (a MILP)
    integer_time_limit_s: float = 5.0  # CBC stops here with its best whole-row plan
    full_integer_max_vars: int = 400  # above this, only segments near the LP's boundaries are integer
    include_latency: bool = False  # bytes objective: also minimise the collectives' latency
    # the objective: modeled step time of the slowest rank (solvers.time_model: latency of the step's
    # collectives, bytes over bandwidth, local work), or with False bytes over bandwidth alone
    step_time: bool = True
    latency: LatencyTable | None = None  # collective latencies; None: the view's (LatencyTable.from_view)
    rates: LocalRates | None = None  # local work; None: LocalRates.for_view(view, gpu_host)
    gpu_host: str = "fused"  # on a GPU preset, the host work: "fused" (none) or "measured" (this runtime's)
    # price the pipelined step (train --pipeline on): the replica sync beside the next batch's input
    # distribution (solvers.time_model.step_time's overlap): the program minimises it (solvers.overlap)
    overlap: bool = False
    fetch_modes: tuple[FetchMode, ...] = (FetchMode.FLAT, FetchMode.GROUP)  # cold fetch modes to choose from


def config_rates(cfg: OptimizerConfig, view: ClusterView) -> LocalRates:
    """The local rates ``cfg`` prices ``view`` with: its own, else :meth:`LocalRates.for_view` with its
    ``gpu_host``."""
    return LocalRates.for_view(view, cfg.gpu_host) if cfg.rates is None else cfg.rates


def _initial_edges(coeffs: TableCoefficients, time_share: np.ndarray, segments: int) -> np.ndarray:
    """Bucket indices where segments start: CDF quantiles of access mass plus a geometric row grid."""
    k = coeffs.rows.size
    cum_rows = np.cumsum(coeffs.rows)
    cum_mass = np.cumsum(time_share)
    total = cum_mass[-1] if cum_mass[-1] > 0 else 1.0
    by_mass = np.searchsorted(cum_mass / total, np.linspace(0, 1, segments + 1)[1:-1], side="right")
    grid = 2.0 ** np.arange(0, np.log2(max(cum_rows[-1], 2)) + 1, 1.0)
    by_rows = np.searchsorted(cum_rows, grid, side="left")
    return np.unique(np.concatenate([[0, k], by_mass, by_rows]).clip(0, k))


def _refine(edges: np.ndarray, seg_index: set[int], factor: int) -> tuple[np.ndarray, bool]:
    """Split the listed segments (by index into ``edges``) into up to ``factor`` pieces each."""
    new = [edges]
    changed = False
    for s in seg_index:
        if s < 0 or s >= edges.size - 1:
            continue
        lo, hi = edges[s], edges[s + 1]
        if hi - lo > 1:
            new.append(np.unique(np.linspace(lo, hi, factor + 1).round().astype(np.int64)))
            changed = True
    return np.unique(np.concatenate(new)), changed


def _boundary_segments(h: np.ndarray, tol: float = 1e-7) -> set[int]:
    """Segments holding the boundary of a prefix share vector (fractional, or either side of a 1->0 step)."""
    frac = np.flatnonzero((h > tol) & (h < 1 - tol))
    if frac.size:
        return {int(s) for s in frac}
    full = np.flatnonzero(h >= 1 - tol)
    last = int(full[-1]) if full.size else -1
    return {last, last + 1}


def refined_solve(
    coeffs: list[TableCoefficients],
    budget_bytes: float,
    allowed: np.ndarray,
    bound_s: float,
    cfg: OptimizerConfig,
    history: list[dict],
    progress: Callable[[str], None] | None,
    fixed: FixedParts | None = None,
) -> tuple[list[tuple[int, int]], float, int, int] | None:
    """Solve the segment LP for one set of allowed tiers, refining segments around the boundaries
    (None when no plan with these tiers fits). With ``fixed``, the program minimises the pipelined step
    (:mod:`solvers.overlap`; the time returned and ``bound_s`` then include the fixed cost), else the
    linear time of the rows."""

    def time_of(rows: list[tuple[int, int]]) -> float:
        return linear_time(coeffs, rows) if fixed is None else pipelined_time(coeffs, rows, fixed)

    edges = [_initial_edges(c, c.time_s[Tier.COLD], cfg.initial_segments) for c in coeffs]
    best: tuple[float, list[tuple[int, int]]] | None = None
    solved: tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]] | None = None
    nvars = rounds = 0
    tiers = "+".join(tier.label for tier, a in zip(Tier, allowed, strict=True) if a)
    for rounds in range(1, cfg.max_rounds + 1):  # noqa: B007
        try:
            shares, nvars = _solve_lp(
                coeffs, edges, budget_bytes, allowed, cfg.solver_time_limit_s, fixed=fixed
            )
        except PlannerError:
            break  # fits only with whole-table tiers: left to the integer solve
        solved = ([e.copy() for e in edges], shares)
        rows = [_shares_to_rows(c, e, hs, ws) for c, e, (hs, ws) in zip(coeffs, edges, shares, strict=True)]
        linear = time_of(rows)
        if best is None or linear < best[0]:
            best = (linear, rows)
        gap = (best[0] - bound_s) / bound_s if bound_s > 0 else 0.0
        segments = int(sum(e.size - 1 for e in edges))
        history.append(
            {"tiers": tiers, "round": rounds, "segments": segments, "linear_s": linear, "gap": gap}
        )
        if progress:
            progress(f"{tiers}: round {rounds}, {nvars} variables, gap {gap:.1e}")
        if gap <= cfg.target_gap:
            break
        changed_any = False
        for i, (hs, ws) in enumerate(shares):
            edges[i], changed = _refine(
                edges[i], _boundary_segments(hs) | _boundary_segments(ws), cfg.split_factor
            )
            changed_any |= changed
        if not changed_any:
            break
    if cfg.integer_rows and (best is None or best[0] > bound_s * (1 + 1e-9)):
        if solved is not None:
            edges = solved[0]
        pinned = None
        if solved is not None and _integer_vars(coeffs, edges, allowed) > cfg.full_integer_max_vars:
            pinned = [_fix_far_segments(hs, ws) for hs, ws in solved[1]]
        try:
            limit = min(cfg.solver_time_limit_s, cfg.integer_time_limit_s)
            shares, nvars = _solve_lp(
                coeffs, edges, budget_bytes, allowed, limit, integer=True, pinned=pinned, fixed=fixed
            )
        except PlannerError:
            shares = None  # keep the rounded LP solution
        if shares is not None:
            rows = [_shares_to_rows(c, e, h, w) for c, e, (h, w) in zip(coeffs, edges, shares, strict=True)]
            linear = time_of(rows)
            history.append({"tiers": tiers, "round": "integer", "linear_s": linear})
            if best is None or linear < best[0]:
                best = (linear, rows)
    if best is None:
        return None
    return best[1], best[0], nvars, rounds


def _integer_vars(coeffs: list[TableCoefficients], edges: list[np.ndarray], allowed: np.ndarray) -> int:
    """Integer variables of the full integer finish: small segments times the prefix tiers in use."""
    tiers = int(allowed[Tier.HOT]) + int(allowed[Tier.WARM])
    small = sum(
        int((np.add.reduceat(c.rows, e[:-1]) <= INTEGER_ROWS_MAX).sum())
        for c, e in zip(coeffs, edges, strict=True)
    )
    return small * tiers


def _fix_far_segments(hs: np.ndarray, ws: np.ndarray) -> tuple[dict[int, float], dict[int, float]]:
    """Per share vector, the LP values of segments more than one segment away from its boundary:
    the integer finish keeps them, so it only decides whole rows where the LP was fractional."""
    out = []
    for share in (hs, ws):
        near = set()
        for s in _boundary_segments(share):
            near |= {s - 1, s, s + 1}
        out.append({j: float(v) for j, v in enumerate(share) if j not in near})
    return out[0], out[1]


def _segment_sums(
    c: TableCoefficients, edges: np.ndarray, arr: str = "time_s"
) -> tuple[np.ndarray, np.ndarray]:
    starts = edges[:-1]
    return np.add.reduceat(getattr(c, arr), starts, axis=1), np.add.reduceat(c.memory_bytes, starts, axis=1)


def _share(
    name: str, rows: float, low: int, integer: bool, fixed: float | None = None
) -> tuple[pulp.LpVariable, float]:
    """A segment's prefix share as (variable, scale), share = scale * variable: a whole row count
    for small segments in integer mode, else a fraction in [low, 1]; ``fixed`` pins the share."""
    if fixed is not None:
        value = min(max(fixed, float(low)), 1.0)
        return pulp.LpVariable(name, value, value), 1.0
    if integer and rows <= INTEGER_ROWS_MAX:
        return pulp.LpVariable(name, low * rows, rows, cat=pulp.LpInteger), 1.0 / float(rows)
    return pulp.LpVariable(name, low, 1), 1.0


def _solve_lp(
    coeffs: list[TableCoefficients],
    edges: list[np.ndarray],
    budget: float,
    allowed: np.ndarray,
    time_limit_s: float,
    integer: bool = False,
    pinned: list[tuple[dict[int, float], dict[int, float]]] | None = None,
    fixed: FixedParts | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """Solve the segment program; with ``integer`` the shares of small segments (at most
    ``INTEGER_ROWS_MAX`` rows) become whole row counts, so single hot rows are not split.
    ``pinned``: per table, (hot, warm) shares held at given values (segment index -> share).
    ``fixed``: minimise the pipelined step (:mod:`solvers.overlap`) with these fixed parts."""
    prob = pulp.LpProblem("flexshard_tiers", pulp.LpMinimize)
    objective: dict[pulp.LpVariable, float] = {}
    memory: dict[pulp.LpVariable, float] = {}
    # with overlap: the input distribution's and the sync's seconds, as constants plus per-variable terms
    parts: dict[str, dict[pulp.LpVariable, float]] = {"input_s": {}, "sync_s": {}}
    consts = {"input_s": 0.0, "sync_s": 0.0}
    const_mem = 0.0
    handles = []
    # scale to well-conditioned units: microseconds and MiB
    ts, ms = 1e6, 1.0 / 2**20
    for i, (c, e) in enumerate(zip(coeffs, edges, strict=True)):
        seg_t, seg_m = _segment_sums(c, e, "time_s" if fixed is None else "other_s")
        seg_parts = {}
        if fixed is not None:
            for name in parts:
                seg_parts[name] = _segment_sums(c, e, name)[0]
                consts[name] += float(seg_parts[name][Tier.COLD].sum())
        seg_rows = np.add.reduceat(c.rows, e[:-1])
        k = seg_t.shape[1]
        const_mem += seg_m[Tier.COLD].sum()

        cold_ok = bool(allowed[Tier.COLD])
        fix_h, fix_w = pinned[i] if pinned is not None else ({}, {})
        wv = (
            [_share(f"w_{i}_{j}", seg_rows[j], 0 if cold_ok else 1, integer, fix_w.get(j)) for j in range(k)]
            if allowed[Tier.WARM]
            else None
        )
        hv = None
        if allowed[Tier.HOT]:
            low = 0 if (cold_ok or wv is not None) else 1
            hv = [_share(f"h_{i}_{j}", seg_rows[j], low, integer, fix_h.get(j)) for j in range(k)]
        for j in range(k):
            if wv is not None:
                var, sc = wv[j]
                objective[var] = (seg_t[Tier.WARM, j] - seg_t[Tier.COLD, j]) * ts * sc
                memory[var] = (seg_m[Tier.WARM, j] - seg_m[Tier.COLD, j]) * ms * sc
                for name, seg in seg_parts.items():
                    parts[name][var] = (seg[Tier.WARM, j] - seg[Tier.COLD, j]) * ts * sc
                if j:
                    prob += sc * var <= wv[j - 1][1] * wv[j - 1][0]
            if hv is not None:
                var, sc = hv[j]
                lower = Tier.WARM if wv is not None else Tier.COLD
                objective[var] = (seg_t[Tier.HOT, j] - seg_t[lower, j]) * ts * sc
                memory[var] = (seg_m[Tier.HOT, j] - seg_m[lower, j]) * ms * sc
                for name, seg in seg_parts.items():
                    parts[name][var] = (seg[Tier.HOT, j] - seg[lower, j]) * ts * sc
                if j:
                    prob += sc * var <= hv[j - 1][1] * hv[j - 1][0]
                if wv is not None:
                    prob += sc * var <= wv[j][1] * wv[j][0]
        credit = c.whole_table_credit_bytes * ms
        if integer and credit > 0:  # whole-table tiers need no routing metadata (binary, exact)
            if hv is not None:
                whole_hot = pulp.LpVariable(f"whole_hot_{i}", cat=pulp.LpBinary)
                prob += whole_hot <= hv[-1][1] * hv[-1][0]
                memory[whole_hot] = -credit
            if wv is not None:
                whole_warm = pulp.LpVariable(f"whole_warm_{i}", cat=pulp.LpBinary)
                prob += whole_warm <= wv[-1][1] * wv[-1][0]
                if hv is not None:
                    prob += whole_warm <= 1 - hv[0][1] * hv[0][0]
                memory[whole_warm] = -credit
        handles.append((hv, wv, k))
    if fixed is not None:  # minimise other + max(input, sync): z above both
        z = pulp.LpVariable("overlapped_max", 0)
        for name, fixed_part in (("input_s", fixed.input_s), ("sync_s", fixed.sync_s)):
            prob += z >= pulp.LpAffineExpression(parts[name]) + (consts[name] + fixed_part) * ts, name
        objective[z] = 1.0
    prob += pulp.LpAffineExpression(objective)
    prob += pulp.LpAffineExpression(memory) <= (budget - const_mem) * ms, "memory_budget"
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-5 if integer else None)
    status = prob.solve(solver)
    if pulp.LpStatus[status] != "Optimal":
        raise PlannerError(f"optimizer: CBC ended with status {pulp.LpStatus[status]!r}; try a larger budget")

    def values(vs: list[tuple[pulp.LpVariable, float]] | None) -> np.ndarray | None:
        return None if vs is None else np.clip(np.array([(v.value() or 0.0) * sc for v, sc in vs]), 0.0, 1.0)

    shares = []
    for hv, wv, k in handles:
        hs = values(hv)
        hs = np.zeros(k) if hs is None else hs
        ws = values(wv)
        shares.append((hs, hs.copy() if ws is None else np.maximum(ws, hs)))
    return shares, len(objective)


def _shares_to_rows(
    c: TableCoefficients, edges: np.ndarray, hs: np.ndarray, ws: np.ndarray
) -> tuple[int, int]:
    """Integer (hot_rows, warm_rows) from prefix shares: a fractional segment keeps its hottest part."""
    seg_rows = np.add.reduceat(c.rows, edges[:-1])
    hot = int(np.floor(float(np.dot(hs, seg_rows)) + 1e-6))
    hot_or_warm = int(np.floor(float(np.dot(ws, seg_rows)) + 1e-6))
    return hot, max(hot_or_warm - hot, 0)


def linear_time(coeffs: list[TableCoefficients], rows: list[tuple[int, int]]) -> float:
    """Linear-model time of integer tier boundaries (rows inside a bucket are identical)."""
    total = 0.0
    for c, (h, w) in zip(coeffs, rows, strict=True):
        total += prefix_sum(c, h, Tier.HOT) + (prefix_sum(c, h + w, Tier.WARM) - prefix_sum(c, h, Tier.WARM))
        total += c.time_s[Tier.COLD].sum() - prefix_sum(c, h + w, Tier.COLD)
    return total


def prefix_sum(c: TableCoefficients, nrows: float, tier: int, arr: str = "time_s") -> float:
    """Sum of a tier's coefficient over the first ``nrows`` rows (linear inside a bucket)."""
    cum_rows = np.concatenate([[0.0], np.cumsum(c.rows)])
    cum = np.concatenate([[0.0], np.cumsum(getattr(c, arr)[tier])])
    return float(np.interp(nrows, cum_rows, cum))
