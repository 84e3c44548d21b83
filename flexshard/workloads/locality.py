"""Per-batch locality of a row histogram, and Meta's DLRM locality statistics files.

``batch_locality`` answers, in closed form, "if one batch draws ``lookups`` ids independently from
this table's row distribution, how many distinct rows does it touch, how many of them exactly once,
and how concentrated are the lookups on the hottest touched rows". These are the figures Meta
publishes for its production-calibrated DLRM traces (``locality_stats.txt`` in
``facebookresearch/dlrm_datasets``), which ``parse_locality_stats`` reads, so synthetic skews can be
calibrated against them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.errors import ConfigError, DataError
from solvers.types import RowHistogram

TOP_FRACTIONS = (0.001, 0.01, 0.1)


@dataclass(frozen=True)
class BatchLocality:
    """Expected locality of one batch (expectations under independent draws).

    ``top_share[f]`` is the share of the batch's lookups that go to the hottest fraction ``f`` of
    the rows the batch touches.
    """

    lookups: float  # draws in the batch
    unique_rows: float  # expected number of distinct rows touched
    touched_once_share: float  # E[rows touched exactly once] / E[rows touched]
    top_share: dict[float, float] = field(default_factory=dict)
    mean_reuse: float = 0.0  # lookups / unique_rows


def batch_locality(
    hist: RowHistogram,
    lookups: float,
    fractions: tuple[float, ...] = TOP_FRACTIONS,
    method: str = "realized",
) -> BatchLocality:
    """Expected locality of one batch of ``lookups`` independent draws from ``hist``.

    A row of probability ``p`` is touched with probability ``1 - (1-p)**L`` and exactly once with
    probability ``L p (1-p)**(L-1)``; ``unique_rows`` and ``touched_once_share`` sum these over the
    histogram's buckets exactly (binomial draws; the share is a ratio of expectations).

    ``top_share[f]`` (share of lookups landing on the hottest fraction ``f`` of the touched rows) is
    approximated from expected counts in one of two ways:

    * ``"realized"`` (default; how Meta's statistics rank rows): rows are ranked by their count in
      the batch. A bucket's count is Poisson(``L p``), so the expected number of rows used at least
      ``c`` times is ``N(c) = sum rows * P(X >= c)`` and they carry ``sum rows * L p * P(X >= c-1)``
      lookups. The threshold count ``c*`` with ``N(c*+1) < f N(1) <= N(c*)`` is found by bisection and
      rows used exactly ``c*`` times fill the remainder. Poisson tails are summed exactly below 32
      and use the Wilson–Hilferty approximation above (error ~1e-3 on the straddling buckets only).
      Matches a Monte-Carlo simulation to about 0.1 percentage point.
    * ``"expected"``: rows are taken in probability order (= expected-count order ``L p``) until
      their expected number of touched rows reaches ``f * unique_rows``; their lookups ``sum L p``
      over ``L`` is the share (the boundary bucket split pro rata). This ignores that realised counts
      re-order rows of equal probability by luck, so it underestimates shares that reach into the
      touched-once tail (by ~1 point at 10% on a Meta-calibrated table).

    Args:
        hist: the table's row histogram.
        lookups: ids drawn per batch (> 0; need not be an integer).
        fractions: fractions of touched rows for ``top_share``.
        method: ``"realized"`` or ``"expected"``.
    """
    L = float(lookups)
    if not np.isfinite(L) or L <= 0:
        raise ConfigError(f"lookups: must be a positive number of draws per batch, got {lookups!r}")
    if method not in ("realized", "expected"):
        raise ConfigError(f"method: must be 'realized' or 'expected', got {method!r}")
    p = hist.prob
    n = hist.rows.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_miss = np.log1p(-np.minimum(p, 1.0))  # log(1 - p); -inf where p == 1
        p_touch = np.where(p >= 1.0, 1.0, -np.expm1(L * log_miss))
        # exactly once: L p (1-p)**(L-1); for L == 1 that is p (and 0 * -inf must not appear)
        p_once = p.copy() if L == 1.0 else np.where(p >= 1.0, 0.0, L * p * np.exp((L - 1.0) * log_miss))
    touched = n * p_touch
    unique = float(touched.sum())
    once = float((n * p_once).sum())
    if method == "realized":
        shares = {float(f): _realized_top_share(n, L * p, float(f), L) for f in fractions}
    else:
        shares = {float(f): _expected_top_share(n, p, touched, float(f), unique) for f in fractions}
    return BatchLocality(
        lookups=L,
        unique_rows=unique,
        touched_once_share=once / unique if unique > 0 else 0.0,
        top_share=shares,
        mean_reuse=L / unique if unique > 0 else 0.0,
    )


def _expected_top_share(n: np.ndarray, p: np.ndarray, touched: np.ndarray, f: float, unique: float) -> float:
    """Top-``f`` share with rows ranked by probability (see ``batch_locality``, method "expected")."""
    target = f * unique
    cum_touched = np.cumsum(touched)
    k = min(int(np.searchsorted(cum_touched, target, side="left")), p.size - 1)
    before_t = cum_touched[k - 1] if k > 0 else 0.0
    before_l = float(np.dot(n[:k], p[:k]))
    part = (target - before_t) / touched[k] if touched[k] > 0 else 0.0
    return float(min(1.0, before_l + min(max(part, 0.0), 1.0) * n[k] * p[k]))


_EXACT_TAIL_BELOW = 32  # Poisson tails P(X >= c) are summed exactly for c below this
_SERIES_TERMS = 96


def _erfc(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erfc, otypes=[np.float64])(x)


def poisson_sf(c: int, lam: np.ndarray) -> np.ndarray:
    """``P(X >= c)`` for ``X ~ Poisson(lam)``, elementwise over ``lam`` (float64), integer ``c``.

    Exact (term sums in log space, no cancellation for small tails) for ``c < 32``; the
    Wilson–Hilferty cube-root normal approximation of ``P(chi2_{2c} <= 2 lam)`` above (absolute
    error below ~1e-3).
    """
    lam = np.asarray(lam, dtype=np.float64)
    if c <= 0:
        return np.ones_like(lam)
    out = np.empty_like(lam)
    if c < _EXACT_TAIL_BELOW:
        with np.errstate(divide="ignore", invalid="ignore", under="ignore"):
            log_lam = np.log(lam)
            small = lam < c
            # lam < c: sum the tail directly from term c (terms shrink by lam / (c+m) < 1)
            ls = lam[small]
            term = np.exp(c * log_lam[small] - ls - math.lgamma(c + 1.0))
            term = np.where(ls > 0, term, 0.0)
            tail = term.copy()
            for m in range(1, _SERIES_TERMS):
                term = term * ls / (c + m)
                tail += term
            out[small] = tail
            # lam >= c: one minus the first c terms
            lb = lam[~small]
            lb_log = log_lam[~small]
            head = np.zeros_like(lb)
            for j in range(c):
                head += np.exp(j * lb_log - lb - math.lgamma(j + 1.0))
            out[~small] = np.clip(1.0 - head, 0.0, 1.0)
        return out
    k = 2.0 * c
    v = 2.0 / (9.0 * k)
    z = (np.cbrt(2.0 * lam / k) - (1.0 - v)) / math.sqrt(v)
    return np.clip(0.5 * _erfc(-z / math.sqrt(2.0)), 0.0, 1.0)


def _realized_top_share(n: np.ndarray, lam: np.ndarray, f: float, L: float) -> float:
    """Top-``f`` share with rows ranked by Poisson counts (see ``batch_locality``, "realized")."""

    def rows_at_least(c: int) -> float:
        return float(np.dot(n, poisson_sf(c, lam)))

    touched = rows_at_least(1)
    if touched <= 0:
        return 0.0
    target = f * touched
    lo = 1  # rows_at_least(lo) >= target
    top = float(lam.max())
    hi = int(math.ceil(top + 12.0 * math.sqrt(top) + 16.0))  # rows_at_least(hi) ~ 0 < target
    while rows_at_least(hi) >= target:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rows_at_least(mid) >= target:
            lo = mid
        else:
            hi = mid
    above = rows_at_least(lo + 1)  # rows used more than lo times: all in the top set
    lookups_above = float(np.dot(n * lam, poisson_sf(lo, lam)))  # E[X; X >= lo+1] = lam P(X >= lo)
    return float(min(1.0, (lookups_above + max(target - above, 0.0) * lo) / L))


def top_share(hist: RowHistogram, fraction: float, touched_only: bool = False) -> float:
    """Share of all accesses that go to the hottest ``fraction`` of the table's rows.

    With ``touched_only`` the fraction is of rows with a non-zero probability (as the data READMEs
    report it). Buckets are split pro rata.
    """
    n = hist.rows.astype(np.float64)
    if touched_only:
        n = np.where(hist.prob > 0, n, 0.0)
    target = float(fraction) * float(n.sum())
    cum_rows = np.cumsum(n)
    k = min(int(np.searchsorted(cum_rows, target, side="left")), n.size - 1)
    before_r = cum_rows[k - 1] if k > 0 else 0.0
    mass = n * hist.prob
    before_m = float(mass[:k].sum())
    take = min(max(target - before_r, 0.0), n[k])
    return float(min(1.0, before_m + take * hist.prob[k]))


def zipf_slope(hist: RowHistogram, bins: int = 40) -> float:
    """Zipf-like exponent: minus the OLS slope of log(probability) vs log(rank) over touched rows.

    Ranks are sampled at ``bins`` log-spaced points (as the data READMEs do), so a long tail does not
    outweigh the head. Returns 0 for a table with fewer than 2 touched rows.
    """
    touched = int(hist.rows[hist.prob > 0].sum())
    if touched < 2:
        return 0.0
    ranks = np.unique(np.round(np.geomspace(1, touched, bins)).astype(np.int64))
    bucket = np.searchsorted(np.cumsum(hist.rows), ranks, side="left")  # rank r lies in this bucket
    y = np.log(hist.prob[bucket])
    x = np.log(ranks.astype(np.float64))
    if x.size < 2:
        return 0.0
    slope = np.polyfit(x, y, 1)[0]
    return float(-slope)


@dataclass(frozen=True)
class LocalitySection:
    """One trace's block of a Meta ``locality_stats.txt``: per-batch reuse ("col size") histogram.

    Bin ``j`` holds rows used ``(edges[j], edges[j+1]]`` times in the batch (the last bin is open);
    ``row_share[j]`` is its share of the touched rows, ``lookup_share[j]`` its share of the lookups.
    Shares are printed with 3 decimals in the file.
    """

    trace: str
    batch_size: int
    lookups: int  # "Avg # of indices"
    unique_rows: int  # "Avg # of unique cols"
    mean_reuse: float  # "Avg col size"
    edges: np.ndarray  # int64[B], lower edges 0, 1, 2, 4, ...
    row_share: np.ndarray  # float64[B]
    lookup_share: np.ndarray  # float64[B]

    @property
    def touched_once_share(self) -> float:
        """Share of touched rows used exactly once in the batch (the ``(0, 1]`` bin)."""
        return float(self.row_share[0])

    def top_share(self, fraction: float) -> float:
        """Share of lookups on the hottest ``fraction`` of touched rows, interpolated in the bins.

        Rows are taken from the highest bin down; within a bin lookups are taken pro rata to rows
        (rows of one bin are treated as equally hot). Approximate: the shares have 3 decimals.
        """
        rows = self.row_share[::-1] / max(self.row_share.sum(), 1e-300)
        looks = self.lookup_share[::-1] / max(self.lookup_share.sum(), 1e-300)
        cum_r = np.concatenate([[0.0], np.cumsum(rows)])
        cum_l = np.concatenate([[0.0], np.cumsum(looks)])
        return float(np.interp(fraction, cum_r, cum_l))


_NUM = r"([0-9.eE+-]+)"
_BIN = re.compile(r"^\((\d+), (\d+)\]: " + _NUM + r"$|^\((\d+)\+: " + _NUM + r"$")


def parse_locality_stats(path: str | Path) -> list[LocalitySection]:
    """Read a ``locality_stats.txt`` of ``facebookresearch/dlrm_datasets`` into its sections.

    Each section starts with the trace's file name, then ``Locality stats after processing N batches
    of size B``, the averages, and two binned histograms (of rows, then of lookups). Raises
    DataError naming the line on anything else.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the locality stats file ({exc.strerror})") from exc
    sections: list[LocalitySection] = []
    cur: dict | None = None
    mode = ""

    def close() -> None:
        if cur is None:
            return
        need = ("batch_size", "lookups", "unique_rows", "mean_reuse")
        missing = [k for k in need if k not in cur]
        if missing or not cur["rows"] or len(cur["rows"]) != len(cur["looks"]):
            raise DataError(f"{path}: section {cur['trace']!r} is incomplete (missing {missing or 'bins'})")
        edges = np.array([e for e, _ in cur["rows"]], dtype=np.int64)
        sections.append(
            LocalitySection(
                trace=cur["trace"],
                batch_size=cur["batch_size"],
                lookups=cur["lookups"],
                unique_rows=cur["unique_rows"],
                mean_reuse=cur["mean_reuse"],
                edges=edges,
                row_share=np.array([v for _, v in cur["rows"]], dtype=np.float64),
                lookup_share=np.array([v for _, v in cur["looks"]], dtype=np.float64),
            )
        )

    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        try:
            if not line or line.startswith("[") or line.startswith("['"):
                continue
            if line.endswith(".pt") or (
                cur is None and not line.startswith(("(", "Avg", "Locality", "Histogram"))
            ):
                close()
                cur = {"trace": line, "rows": [], "looks": []}
                mode = ""
                continue
            if cur is None:
                raise ValueError("data before the first trace name")
            if line.startswith("Locality stats after processing"):
                cur["batch_size"] = int(line.rsplit(" ", 1)[1])
            elif line.startswith("Avg # of indices:"):
                cur["lookups"] = int(float(line.split(":")[1]))
            elif line.startswith("Avg # of unique cols:"):
                cur["unique_rows"] = int(float(line.split(":")[1]))
            elif line.startswith("Avg col size:"):
                cur["mean_reuse"] = float(line.split(":")[1])
            elif line.startswith("Histogram of col sizes"):
                mode = "rows"
            elif line.startswith("Ratio of index distribution"):
                mode = "looks"
            elif line.startswith("("):
                m = _BIN.match(line)
                if m is None or not mode:
                    raise ValueError("not a histogram bin")
                lo = int(m.group(1) if m.group(1) is not None else m.group(4))
                val = float(m.group(3) if m.group(3) is not None else m.group(5))
                cur[mode].append((lo, val))
            else:
                raise ValueError("unrecognised line")
        except (ValueError, IndexError) as exc:
            raise DataError(f"{path}:{lineno}: cannot parse {line[:60]!r} ({exc})") from None
    close()
    if not sections:
        raise DataError(f"{path}: no locality sections found (empty file?)")
    return sections
