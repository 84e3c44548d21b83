"""Measured touch rates: what one training sample looks up, per row, and the compact profile kept of it.

A training batch is ``batch_size_per_gpu`` independent samples (:mod:`flexshard.workloads.samples`), so
everything the cost model needs about a real batch follows from two numbers per row: ``q``, the
probability that one sample touches the row at least once, and ``m``, its expected lookups per sample.
A batch of ``s`` samples then holds the row with probability ``1 - (1 - q)^s`` exactly, at any batch
size, group size or cluster size (:meth:`solvers.types.TouchProfile.distinct`): the rule that rescales a
profile to any shape has no error of its own. What it depends on is how a sample is formed
(:class:`Sampling`); a run that forms samples another way needs another profile.

``q`` and ``m`` are computed exactly from the histories (expectations over the sampler's random
choices, not a Monte Carlo replay), in O(interactions), one vectorised pass per chunk of users:

* ``next-item`` (training): a user with ``n >= 2`` items, a cut ``c`` uniform in ``1..n-1``, the history
  window ``[c - window, c)`` and the target ``c``, plus ``negatives`` items drawn uniformly (with
  replacement) from the table's touched rows. Position ``j`` is in the sample for the cuts
  ``j <= c <= j + window``; a row is touched for the union of those cut ranges over its positions.
* ``history``: a user with at least one item and its last ``window`` items (all without a window).

The user table (one id per sample) gets ``q = m = 1 / users`` for every user that can be sampled.

The profile (:func:`touch_profile`) is kept along the table's hotness order: the histogram's buckets
refined on a geometric grid of hotness rank (ratio ``1 + REFINE``), per bucket the lookups and the
distribution of ``q`` rounded to a geometric grid (ratio ``1 + QUANTIZATION``), and which entry of that
distribution each touched row is (for deals by id, which take a bucket's rows unevenly). Its stated error
(``bucket_error``) is measured against the per-row values: the largest difference, at any cut point
and for batches of ``ERROR_SAMPLES`` samples, between the masses the cost model interpolates and the
exact per-row sums, as a share of the table's total.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from core.arrays import block_bounds
from core.errors import ConfigError
from solvers.types import RowHistogram, TouchProfile, batch_touch_probability

from ._text import grow
from .sequences import Sequences

SAMPLING_MODES = ("next-item", "history")
DEFAULT_WINDOW = 20  # history positions a training sample keeps (train --max-len)
DEFAULT_NEGATIVES = 4  # random negatives per next-item sample (train --negatives)
QUANTIZATION = 0.01  # relative step of the grid q is rounded to (every rate within 0.5%)
REFINE = 0.05  # hotness buckets are split so that none spans more than 5% of the rank it starts at
ERROR_SAMPLES = (1.0, 16.0, 256.0, 4096.0)  # batch sizes (samples) at which bucket_error is measured


@dataclass(frozen=True)
class Sampling:
    """How a training sample is formed from a user's history (see the module docstring)."""

    mode: str = "next-item"
    window: int | None = DEFAULT_WINDOW  # positions kept (train --max-len); None: all (history mode)
    negatives: int = 0  # random touched items per sample (next-item only)

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_MODES:
            raise ConfigError(
                f"sampling: unknown mode {self.mode!r}; choose from {', '.join(SAMPLING_MODES)}"
            )
        if self.window is not None and (not isinstance(self.window, (int, np.integer)) or self.window <= 0):
            raise ConfigError(f"sampling.window: must be a positive integer, got {self.window!r}")
        if self.mode == "next-item" and self.window is None:
            raise ConfigError("sampling.window: next-item sampling needs a window (train --max-len)")
        if not isinstance(self.negatives, (int, np.integer)) or self.negatives < 0:
            raise ConfigError(f"sampling.negatives: must be a non-negative integer, got {self.negatives!r}")
        if self.mode == "history" and self.negatives:
            raise ConfigError("sampling.negatives: history samples have no candidates")

    def describe(self) -> str:
        """One line, e.g. ``next-item, window 20, negatives 4`` (what reports and contracts print)."""
        window = "whole history" if self.window is None else f"window {self.window}"
        extra = f", negatives {self.negatives}" if self.mode == "next-item" else ""
        return f"{self.mode}, {window}{extra}"


def eligible(lengths: np.ndarray, sampling: Sampling) -> np.ndarray:
    """bool[U]: the users a sample can be drawn from (``>= 2`` items for next-item, ``>= 1`` else)."""
    return lengths >= (2 if sampling.mode == "next-item" else 1)


@dataclass
class RateSums:
    """Per-row sums over users of the touch and lookup expectations, before dividing by the users."""

    touch: np.ndarray  # float64[R]
    lookups: np.ndarray  # float64[R]
    users: int = 0  # users that can be sampled


def add_histories(sums: RateSums, seq: Sequences, sampling: Sampling) -> RateSums:
    """``sums`` plus the users of ``seq`` (any chunk of users; each user in exactly one chunk)."""
    keep = eligible(seq.lengths, sampling)
    seq = seq.subset(keep) if not keep.all() else seq
    lengths = seq.lengths
    total = int(lengths.sum())
    sums.users += int(lengths.size)
    if total == 0:
        return sums
    user = np.repeat(np.arange(lengths.size), lengths)
    n = lengths[user]
    j = np.arange(total) - seq.offsets[:-1][user]  # position in the user's history
    items = seq.items
    if sampling.mode == "next-item":
        window = int(sampling.window)  # type: ignore[arg-type]
        lo, hi = np.maximum(j, 1), np.minimum(j + window, n - 1)  # cuts c with j in [c - window, c]
        weight = 1.0 / (n - 1)  # each cut has probability 1 / (n - 1)
    else:  # the kept positions are in every sample of the user: one unit range [1, 1], else empty
        kept = j >= (0 if sampling.window is None else np.maximum(n - sampling.window, 0))
        lo, hi = np.ones(total, dtype=np.int64), kept.astype(np.int64)
        weight = np.ones(total)
    count = np.maximum(hi - lo + 1, 0)
    size = int(items.max()) + 1
    sums.lookups = grow(sums.lookups, size)
    sums.touch = grow(sums.touch, size)
    sums.lookups[:size] += np.bincount(items, weights=count * weight, minlength=size)
    # union of each (user, item)'s cut ranges: sorted by position, each range adds what lies past the
    # previous range's end (ranges start and end in position order)
    order = np.lexsort((j, items, user))
    u, it, a, b, w = user[order], items[order], lo[order], hi[order], weight[order]
    same = np.zeros(total, dtype=bool)
    same[1:] = (u[1:] == u[:-1]) & (it[1:] == it[:-1])
    prev_end = np.where(same, np.concatenate([[0], b[:-1]]), -1)
    new = np.maximum(b - np.maximum(a, prev_end + 1) + 1, 0)
    sums.touch[:size] += np.bincount(it, weights=new * w, minlength=size)
    return sums


def item_rates(
    histories: Iterable[Sequences], sampling: Sampling, num_rows: int, pool: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(q, m, users)`` of the item table: per-sample touch probability and lookups of every row
    (float64[num_rows]) and the users a sample is drawn from.

    ``histories``: chunks of users (e.g. partitions of a log), each user in one chunk. ``pool``: the
    row ids negatives are drawn from (next-item with negatives; training uses the touched rows).
    """
    sums = RateSums(np.zeros(num_rows), np.zeros(num_rows))
    for seq in histories:
        add_histories(sums, seq, sampling)
    if sums.users == 0:
        raise ConfigError(f"histories: no user can be sampled ({sampling.describe()})")
    if sums.touch.size > num_rows:
        raise ConfigError(f"num_rows: {num_rows} rows, but the histories reach id {sums.touch.size - 1}")
    q = sums.touch / sums.users
    m = sums.lookups / sums.users
    if sampling.negatives:
        if pool is None or np.asarray(pool).size == 0:
            raise ConfigError("pool: negatives need the row ids they are drawn from")
        pool = np.asarray(pool, dtype=np.int64)
        per_row = np.bincount(pool, minlength=num_rows)[:num_rows] / pool.size  # one draw's pmf
        hit = -np.expm1(sampling.negatives * np.log1p(-np.minimum(per_row, 1.0)))
        q = 1.0 - (1.0 - q) * (1.0 - hit)  # negatives are drawn independently of the history
        m = m + sampling.negatives * per_row
    return np.minimum(q, 1.0), m, sums.users


def user_rates(users: np.ndarray, lengths: np.ndarray, sampling: Sampling, num_rows: int) -> tuple:
    """``(q, m)`` of the user table (one lookup per sample): ``1 / users`` for each user that can be
    sampled (``users`` raw ids, ``lengths`` their history lengths)."""
    ok = eligible(np.asarray(lengths), sampling)
    q = np.zeros(num_rows)
    q[np.asarray(users)[ok]] = 1.0 / max(int(ok.sum()), 1)
    return q, q.copy()


def refined_edges(hist: RowHistogram, ratio: float = REFINE) -> np.ndarray:
    """int64 bucket edges along hotness rank: the histogram's, plus a geometric grid (``ceil((1 +
    ratio)^i)``) so that no bucket ``[a, b)`` has ``b - a > max(1, ratio * a)`` rows."""
    total = hist.num_rows
    steps = int(np.ceil(np.log(max(total, 2)) / np.log1p(ratio))) + 1
    grid = np.unique(np.ceil((1.0 + ratio) ** np.arange(steps + 1)).astype(np.int64))
    edges = np.concatenate([block_bounds(hist.rows), grid[grid < total]])
    return np.unique(edges)


def touch_profile(
    hist: RowHistogram,
    order: np.ndarray,
    q: np.ndarray,
    m: np.ndarray,
    sampling: Sampling,
    quantization: float = QUANTIZATION,
    refine: float = REFINE,
) -> tuple[RowHistogram, TouchProfile]:
    """The table's histogram refined along hotness rank and its :class:`~solvers.types.TouchProfile`.

    ``hist``/``order``: the table's histogram and hotness order (touched row ids hottest first; the rows
    it does not list follow in id order); ``q``/``m``: per-row touch probability and lookups per sample
    (indexed by row id).
    """
    num_rows = hist.num_rows
    if q.shape != (num_rows,) or m.shape != (num_rows,):
        raise ConfigError(f"q, m: expected {num_rows} rows, got {q.shape} and {m.shape}")
    listed = np.zeros(num_rows, dtype=bool)
    listed[order] = True
    by_rank = np.concatenate([order, np.flatnonzero(~listed)])  # rank -> row id
    q_rank, m_rank = q[by_rank], m[by_rank]
    edges = refined_edges(hist, refine)
    old_edges = block_bounds(hist.rows)
    prob = hist.prob[np.searchsorted(old_edges, edges[:-1], side="right") - 1]
    refined = RowHistogram(rows=np.diff(edges), prob=prob)
    bucket = np.searchsorted(edges, np.arange(num_rows), side="right") - 1
    lookups = np.bincount(bucket, weights=m_rank, minlength=refined.num_buckets)
    touched = q_rank > 0
    step = np.log1p(quantization)
    level = np.round(np.log(q_rank[touched]) / step).astype(np.int64)
    key = bucket[touched] * (1 << 20) + (level + (1 << 19))  # level is in (-2^19, 0]
    keys, entry_of_touched, rows = np.unique(key, return_inverse=True, return_counts=True)
    touched_rank = np.flatnonzero(touched)
    rank_entry = np.full(touched_rank[-1] + 1 if touched_rank.size else 0, -1, dtype=np.int32)
    rank_entry[touched_rank] = entry_of_touched
    entry_bucket = keys >> 20
    entry_prob = np.minimum(np.exp(((keys & ((1 << 20) - 1)) - (1 << 19)) * step), 1.0)
    profile = TouchProfile(
        lookups=lookups,
        entry_bucket=entry_bucket,
        entry_prob=entry_prob,
        entry_rows=rows,
        quantization=quantization,
        bucket_error=0.0,
        sampling=sampling.describe(),
        rank_entry=rank_entry,
    )
    error = profile_error(profile, edges, q_rank, m_rank)
    return refined, dataclasses.replace(profile, bucket_error=error)


def profile_error(profile: TouchProfile, edges: np.ndarray, q_rank: np.ndarray, m_rank: np.ndarray) -> float:
    """Largest error of ``profile``'s interpolated cumulative masses against the per-row ones (``q_rank``,
    ``m_rank`` in hotness order) at any cut, for lookups and for the distinct rows of batches of
    ``ERROR_SAMPLES`` samples, each as a share of its table total."""
    cuts = np.arange(q_rank.size + 1, dtype=np.float64)
    edges_f = edges.astype(np.float64)
    worst = 0.0
    curves = [(profile.lookups, m_rank)] + [
        (profile.distinct(s), batch_touch_probability(q_rank, s)) for s in ERROR_SAMPLES
    ]
    for per_bucket, per_row in curves:
        exact = np.concatenate([[0.0], np.cumsum(per_row)])
        model = np.interp(cuts, edges_f, np.concatenate([[0.0], np.cumsum(per_bucket)]))
        total = max(float(exact[-1]), 1e-300)
        worst = max(worst, float(np.abs(model - exact).max()) / total)
    return worst
