"""Dealing: which owner each row of a tier goes to, and how many accesses each owner gets from it.

Two deals (:class:`core.vocabulary.Deal`), shared by the cost model and the runtime's routing:

* ``interleave`` (FlexShard's): the rows of a tier, hottest first, go to owners by a weighted
  round-robin pattern of ``period`` positions (:func:`interleave_pattern`), rotated so that the tier's
  hottest row lands at pattern position ``start`` (:func:`owner_pattern`). Over any prefix an owner's
  row count stays within about one of its share, but its share of the *accesses* is larger where a few
  rows carry much of a tier's mass: the owner dealt the first row of every round gets the heaviest.
  :func:`interleave_masses` prices exactly that, bucket by bucket of the hotness histogram.
* ``ranges`` (TorchRec's row-wise sharding): a table's ids split into ``N`` contiguous ranges of
  ``ceil(R / N)`` ids, rank ``r`` owning ``[r B, (r + 1) B)``. Where ids follow hotness (synthetic
  workloads, whose ids *are* hotness ranks), the first range holds the whole head.
  :func:`range_masses` prices it from the table's hotness order. The cost model prices a table without
  one (synthetic) over uniformly random id orders instead (:mod:`solvers.torchrec_default`).

Rows inside one histogram bucket are identical to the cost model (its masses are linear inside a
bucket), so both functions are exact for the model's masses: per bucket, the rows each owner gets times
the bucket's per-row value. Arrays of buckets or pattern positions, never one entry per row (except
the hotness order that :func:`range_masses` reads). A deal by id can take a bucket's rows unevenly
(ids numbered by first visit follow how many users touch a row), so where a measured profile says
which row is which (``TouchProfile.rank_entry``) :func:`range_masses` prices every row as itself.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from core.errors import PlannerError

OWNER_PATTERN_PERIOD = 4096  # rows per repetition of the weighted owner interleave


def interleave_pattern(shares: np.ndarray, period: int) -> np.ndarray:
    """Owner of each position in a repeating pattern of ``period`` rows (smooth weighted round-robin).

    Over every prefix of the pattern each owner's count stays within one of ``share * prefix``.
    """
    shares = np.asarray(shares, dtype=np.float64)
    if shares.sum() <= 0:
        raise PlannerError("placement: shares must have a positive sum")
    w = shares / shares.sum()
    credit = np.zeros_like(w)
    out = np.empty(period, dtype=np.int64)
    for j in range(period):  # O(period x owners), independent of the number of rows
        credit += w
        k = int(np.argmax(credit))
        out[j] = k
        credit[k] -= 1.0
    return out


def owner_pattern(shares: np.ndarray, period: int, start: int = 0) -> np.ndarray:
    """The interleave pattern of ``shares`` rotated so that item 0 takes position ``start``:
    ``out[j] = interleave_pattern(shares, period)[(j + start) % period]`` (int64[period], read-only;
    cached, as the cost model asks for the same few patterns many times)."""
    return _owner_pattern(
        tuple(float(x) for x in np.asarray(shares, dtype=np.float64)), int(period), int(start)
    )


@lru_cache(maxsize=1024)
def _owner_pattern(shares: tuple[float, ...], period: int, start: int) -> np.ndarray:
    pattern = np.roll(_base_pattern(shares, period), -(start % period))
    pattern.flags.writeable = False
    return pattern


@lru_cache(maxsize=64)
def _base_pattern(shares: tuple[float, ...], period: int) -> np.ndarray:
    return interleave_pattern(np.array(shares), period)  # every start of these shares rolls this one


def first_position(pattern: np.ndarray, owner: int) -> int:
    """The first position of ``owner`` in ``pattern`` (the ``start`` that deals it a tier's hottest row)."""
    where = np.flatnonzero(pattern == owner)
    if not where.size:
        raise PlannerError(f"placement: owner {owner} has no position in the pattern (zero share)")
    return int(where[0])


def owner_rows(pattern: np.ndarray, count: int, num_owners: int) -> np.ndarray:
    """int64[K]: how many of the items ``0 .. count - 1`` each of ``K`` owners gets when item ``j`` goes to
    ``pattern[j % P]``. O(P)."""
    full, rest = divmod(int(count), pattern.size)
    per_period = np.bincount(pattern, minlength=num_owners)
    return (full * per_period + np.bincount(pattern[:rest], minlength=num_owners)).astype(np.int64)


def bucket_values(edges: np.ndarray, cumulative: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows per bucket int64[K], per-row value float64[K, Q]) of cumulative quantities ``cumulative``
    (float64[K + 1, Q]) at row ``edges`` (float64[K + 1]); empty buckets get value 0."""
    rows = np.diff(np.rint(edges).astype(np.int64))
    total = np.diff(cumulative, axis=0)
    per_row = np.divide(total, rows[:, None], out=np.zeros_like(total), where=rows[:, None] > 0)
    return rows, per_row


def interp_columns(x: np.ndarray, edges: np.ndarray, cumulative: np.ndarray) -> np.ndarray:
    """float64[len(x), Q]: each column of ``cumulative`` (float64[K + 1, Q] at row ``edges``) at rows ``x``,
    linear inside a bucket."""
    return np.stack([np.interp(x, edges, column) for column in cumulative.T], axis=1)


def interleave_masses(
    edges: np.ndarray, cumulative: np.ndarray, first: int, last: int, pattern: np.ndarray, num_owners: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64[K], masses float64[K, Q]) each of ``num_owners`` owners gets when the rows
    ``first .. last - 1`` (hotness ranks) are dealt by ``pattern`` (item 0 = row ``first``).

    ``edges`` (float64[B + 1], from 0 to the table's rows) and ``cumulative`` (float64[B + 1, Q]) are the
    table's cumulative quantities at its bucket edges (rows inside a bucket identical).

    With ``C_k(x)`` owner k's items among the first ``x`` and ``v_e`` bucket e's per-row values, owner k's
    mass ``sum_e (C_k(x_{e+1}) - C_k(x_e)) v_e`` is summed by parts, ``sum_i C_k(x_i) (v_{i-1} - v_i)``, and
    ``C_k(x) = (x // P) n_k + [pattern[:x % P] == k]``: a whole-period part and, per pattern position
    ``j``, the weight of the edges past it. O(P Q + B log B), never buckets x owners."""
    cut = np.unique(np.clip(np.rint(edges).astype(np.int64), first, last))
    if cut.size < 2:
        return np.zeros(num_owners, np.int64), np.zeros((num_owners, cumulative.shape[1]))
    _, per_row = bucket_values(cut.astype(np.float64), interp_columns(cut, edges, cumulative))
    zero = np.zeros((1, per_row.shape[1]))
    weight = -np.diff(np.vstack([zero, per_row, zero]), axis=0)  # [E + 1, Q]: v_{i-1} - v_i
    full, rest = np.divmod(cut - first, pattern.size)
    per_period = np.bincount(pattern, minlength=num_owners).astype(np.float64)
    masses = per_period[:, None] * (full.astype(np.float64) @ weight)[None, :]
    by_rest = np.argsort(rest, kind="stable")
    past = np.vstack([np.cumsum(weight[by_rest][::-1], axis=0)[::-1], zero])  # past[m]: sorted edges >= m
    beyond = past[np.searchsorted(rest[by_rest], np.arange(pattern.size), side="right")]  # [P, Q]
    for q in range(weight.shape[1]):
        masses[:, q] += np.bincount(pattern, weights=beyond[:, q], minlength=num_owners)
    return owner_rows(pattern, int(cut[-1] - first), num_owners), masses


def hotness_ids(order: np.ndarray | None, count: int, num_rows: int) -> np.ndarray:
    """int64[count]: the ids of the ``count`` hottest rows. ``order`` lists ids hottest first (a stats
    file's order; ids it omits follow in ascending id order); ``None``: ids are hotness ranks."""
    if order is None:
        return np.arange(count, dtype=np.int64)
    order = np.asarray(order, dtype=np.int64)
    if order.size >= count:
        return order[:count]
    listed = np.zeros(num_rows, dtype=bool)
    listed[order] = True
    return np.concatenate([order, np.flatnonzero(~listed)[: count - order.size]])


def range_size(num_rows: int, num_ranks: int) -> int:
    """Ids per contiguous range of the ``ranges`` deal: ``ceil(num_rows / num_ranks)``."""
    return -(-int(num_rows) // int(num_ranks))


def range_rows(num_rows: int, num_ranks: int) -> np.ndarray:
    """int64[N]: ids each rank owns under the ``ranges`` deal (the last ranges may be short or empty)."""
    size = range_size(num_rows, num_ranks)
    return np.minimum(size, np.maximum(int(num_rows) - size * np.arange(num_ranks), 0)).astype(np.int64)


def range_masses(
    edges: np.ndarray,
    cumulative: np.ndarray,
    order: np.ndarray | None,
    num_rows: int,
    num_ranks: int,
    entries: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64[N], masses float64[N, Q]) each rank owns under the ``ranges`` deal of a whole table
    (``edges``/``cumulative`` as in :func:`interleave_masses`; ``order`` as in :func:`hotness_ids`).

    Without an order, O(N); with one, only rows of a positive quantity are looked up by id (O(those
    rows)); the rest add rows, not mass. ``entries`` = (``rank_entry`` int[L], ``per_entry``
    float64[E, Q]): which entry each of the hottest ``L`` rows is and one row's quantities per entry
    (``TouchProfile.rank_entry``); then every row is priced as itself, not as its bucket's average
    (O(L))."""
    size = range_size(num_rows, num_ranks)
    rows = range_rows(num_rows, num_ranks)
    if entries is not None:
        rank_entry, per_entry = entries
        ranks = np.flatnonzero(rank_entry >= 0)
        owner = hotness_ids(order, rank_entry.size, num_rows)[ranks] // size
        value = per_entry[rank_entry[ranks]]  # [rows, Q]
        masses = [np.bincount(owner, weights=column, minlength=num_ranks) for column in value.T]
        return rows, np.stack(masses, axis=1)
    if order is None:  # ids are hotness ranks: each range is a stretch of the hotness order, O(N)
        bounds = np.minimum(size * np.arange(num_ranks + 1), num_rows).astype(np.float64)
        return rows, np.diff(interp_columns(bounds, edges, cumulative), axis=0)
    bucket_rows, per_row = bucket_values(edges, cumulative)
    live = np.flatnonzero((per_row > 0).any(axis=1))
    if not live.size:
        return rows, np.zeros((num_ranks, cumulative.shape[1]))
    count = int(np.rint(edges[live[-1] + 1]))  # rows up to the last bucket with mass
    ids = hotness_ids(order, count, num_rows)
    bucket = np.repeat(np.arange(bucket_rows.size), bucket_rows)[:count]
    owner = ids // size
    k = bucket_rows.size
    composition = np.bincount(owner * k + bucket, minlength=num_ranks * k).reshape(num_ranks, k)
    return rows, composition.astype(np.float64) @ per_row
