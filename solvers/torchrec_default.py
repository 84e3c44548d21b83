"""TorchRec's default layout, defined once: contiguous ranges of a table's ids, in their given order.

TorchRec's row-wise sharding (its default for sequence tables, dedup off) gives rank ``r`` the ids
``[r B, (r + 1) B)``, ``B = ceil(R / N)`` (:func:`solvers.dealing.range_rows`). Which rows those are
depends on the id order:

* **real ids** (a stats file's hotness order, ``TableSpec.order``): the ranges of the ids as given,
  priced row by row (:func:`solvers.dealing.range_masses`);
* **no id order** (synthetic tables: their rows are numbered hottest first only for convenience): the
  *expected* busiest rank over uniformly random id orders, by a seeded Monte Carlo
  (:func:`expected_order_statistics`).

Under a uniformly random id order each rank's range is a uniform random subset of the rows of its
size, the ranges disjoint. One draw deals every table's rows that way (tables independently), prices
every rank's traffic (linear in the masses it serves) and its modeled time; the report is the average,
over draws, of the ranks taken slowest first (row ``k`` = the ``k``-th slowest rank's expected record),
so its slowest rank is the expected slowest rank, not the slowest rank of the expected load (which
would be the even share, ``evaluate(..., dealt=False)``).

A draw of one table (:func:`random_range_draws`): its heaviest rows, each of a value (volume per
iteration served) of at least :data:`EXPLICIT_ROW_SIGMA` of a rank's standard deviation (every row of a
table of at most :data:`SMALL_TABLE_ROWS` rows; at most :data:`MAX_EXPLICIT_ROWS`), are placed
exactly (distinct uniform positions among the ``R`` ids); the other rows fill each rank's remaining
range, and their sum is drawn from the normal law with the exact mean and variance of a uniform
subset of that size (sampling without replacement; a sum of many small values). Cost
O(draws x (explicit rows + N + buckets)), independent of the number of rows.

Draws come in chunks (:func:`chunk_draws`), each seeded by (:data:`SEED`, table name, chunk), until
the standard error of the slowest rank's time is below :data:`TARGET_REL_STDERR` of it (at most
:data:`MAX_CHUNKS` chunks), so figures reproduce exactly.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from core.errors import PlannerError
from core.traffic import Traffic
from core.vocabulary import FetchMode, LinkClass
from solvers import dealing, wire
from solvers.types import CostReport, Plan, TableSpec
from topology.views import ClusterView

SEED = 20260522  # the Monte Carlo's seed (figures reproduce exactly)
CHUNK_VALUES = 64_000  # draws x ranks per chunk (1000 draws on 64 ranks; at least 100 draws)
MAX_CHUNKS = 16  # at most 16 chunks (16,000 draws on 64 ranks)
TARGET_REL_STDERR = 1e-3  # stop when the slowest rank's time has a standard error below 0.1% of it
EXPLICIT_ROW_SIGMA = 0.1  # rows worth >= 10% of a rank's standard deviation are placed one by one
MAX_EXPLICIT_ROWS = 50_000
SMALL_TABLE_ROWS = 4096  # tables of at most this many rows have every row placed one by one
MEMO_ENTRIES = 64  # order statistics kept for repeated pricings (simulate prices one layout per budget)


@dataclass(frozen=True)
class RandomRangeTable:
    """One table dealt by TorchRec's ranges over a random id order: its flat lookups' volume per GPU
    (``cumulative`` at row ``edges``, from :class:`solvers.volumes.TableMass`) and vector bytes."""

    name: str
    edges: np.ndarray  # float64[B + 1]: rows before each bucket edge
    cumulative: np.ndarray  # float64[B + 1]: volume (lookups, or distinct rows with dedup) per GPU
    num_rows: int
    vector_bytes: int


@dataclass(frozen=True)
class OrderStatistics:
    """Expected per-rank records over random id orders, ranks slowest first."""

    traffic: np.ndarray  # float64[N, 2, 4, 2]: the k-th slowest rank's expected bytes (Traffic axes)
    time_s: np.ndarray  # float64[N]: the k-th slowest rank's expected modeled seconds
    draws: int
    rel_stderr: float  # standard error of time_s[0] over draws, relative to it


def chunk_draws(num_ranks: int) -> int:
    """Draws per chunk on ``num_ranks`` ranks: :data:`CHUNK_VALUES` / N, at least 100."""
    return max(100, CHUNK_VALUES // int(num_ranks))


def random_range_draws(table: RandomRangeTable, num_ranks: int, chunk: int) -> np.ndarray:
    """float64[chunk_draws(N), N]: the volume each rank serves in each draw of a uniformly random
    id order of ``table`` (seeded by :data:`SEED`, the table's name and ``chunk``; cached)."""
    return _draws(
        table.name,
        table.edges.tobytes(),
        table.cumulative.tobytes(),
        int(table.num_rows),
        int(num_ranks),
        int(chunk),
    )


@lru_cache(maxsize=512)
def _draws(name: str, edges: bytes, cumulative: bytes, num_rows: int, n: int, chunk: int) -> np.ndarray:
    rows, value = dealing.bucket_values(
        np.frombuffer(edges, dtype=np.float64), np.frombuffer(cumulative, dtype=np.float64)[:, None]
    )
    value = value[:, 0]
    rng = np.random.default_rng(np.random.SeedSequence([SEED, zlib.crc32(name.encode()), chunk]))
    caps = dealing.range_rows(num_rows, n)
    out = _random_subsets(rows, value, num_rows, caps, chunk_draws(n), rng)
    out.flags.writeable = False
    return out


def _random_subsets(
    rows: np.ndarray, value: np.ndarray, num_rows: int, caps: np.ndarray, draws: int, rng: np.random.Generator
) -> np.ndarray:
    """float64[draws, N]: each rank's sum of ``value`` over a uniform random subset of ``caps[r]`` rows,
    the subsets disjoint (``rows[k]`` rows of per-row value ``value[k]``, hottest first)."""
    n = caps.size
    rows = rows.astype(np.int64)
    sigma = np.sqrt((rows * value**2).sum() / n)  # a rank's standard deviation, at most
    if num_rows <= SMALL_TABLE_ROWS:  # every row placed one by one: exact in distribution
        heavy_buckets = np.arange(rows.size)
    else:
        heavy_buckets = (
            np.flatnonzero(value >= EXPLICIT_ROW_SIGMA * sigma) if sigma > 0 else np.array([], int)
        )
    per_bucket = np.zeros_like(rows)
    per_bucket[heavy_buckets] = rows[heavy_buckets]
    by_value = np.argsort(-value, kind="stable")  # the heaviest first, within the cap
    wanted = per_bucket[by_value]
    before = np.cumsum(wanted) - wanted
    per_bucket[by_value] = np.clip(MAX_EXPLICIT_ROWS - before, 0, wanted)
    explicit = np.repeat(value, per_bucket)  # the rows placed one by one
    rest_rows = rows - per_bucket
    out = np.zeros((draws, n))
    owner = _positions(num_rows, explicit.size, draws, rng) // dealing.range_size(num_rows, n)
    if explicit.size:
        flat = owner + n * np.arange(draws)[:, None]
        out += np.bincount(flat.ravel(), np.tile(explicit, draws), minlength=draws * n).reshape(draws, n)
    m = int(rest_rows.sum())
    if m > 0:
        mean = float((rest_rows * value).sum()) / m
        var = float((rest_rows * (value - mean) ** 2).sum()) / m
        taken = caps[None, :] - np.bincount(
            (owner + n * np.arange(draws)[:, None]).ravel(), minlength=draws * n
        ).reshape(draws, n)
        spread = np.sqrt(np.maximum(taken * var * (m - taken) / max(m - 1, 1), 0.0))
        z = rng.standard_normal((draws, n))
        if n > 1:  # the ranks' rest sums add up to the rest's total: centre the noise, keep its variance
            z = (z - z.mean(axis=1, keepdims=True)) * np.sqrt(n / (n - 1))
        out += taken * mean + spread * z
    return out


def _positions(num_rows: int, count: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """int64[draws, count]: ``count`` distinct uniform positions in ``[0, num_rows)`` per draw, in order."""
    if count == 0:
        return np.zeros((draws, 0), dtype=np.int64)
    if count * count < 0.02 * num_rows:  # collisions rare: draw with replacement, redraw a draw that has one
        out = rng.integers(num_rows, size=(draws, count))
        while True:
            s = np.sort(out, axis=1)
            bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
            if not bad.size:
                return out
            out[bad] = rng.integers(num_rows, size=(bad.size, count))
    return np.stack([rng.choice(num_rows, count, replace=False) for _ in range(draws)])


def served_traffic(view: ClusterView, masses: np.ndarray, vector_bytes: int) -> np.ndarray:
    """float64[..., N, 2, 4, 2]: bytes of one table's flat lookups when rank ``r`` serves ``masses[..., r]``
    of its volume (each rank looks up the sum), as :func:`solvers.cost_model.lookup_traffic` prices it."""
    volume = masses.sum(axis=-1, keepdims=True)
    share = np.divide(masses, volume, out=np.zeros_like(masses), where=volume > 0)
    gsize = view.group_size_of_rank().astype(np.float64)
    asked, served = wire.lookups_by_link(share, view.group_share(share), gsize, view.num_ranks, volume, False)
    out = np.zeros((*masses.shape, 2, 4, 2))
    for link in LinkClass:
        for (component, direction), b in wire.lookup_messages(
            asked[link], served[link], vector_bytes
        ).items():
            out[..., link, component, direction] += b
    return out


def expected_order_statistics(
    view: ClusterView, base_traffic: np.ndarray, tables: list[RandomRangeTable]
) -> OrderStatistics:
    """The ranks' expected records, slowest first, over uniformly random id orders of ``tables``
    (dealt by ranges, fetched flat) on top of ``base_traffic`` (float64[N, 2, 4, 2]: every other byte
    of the plan, which does not depend on the id order). The draws are seeded, so the same inputs give
    the same statistics: they are kept (:data:`MEMO_ENTRIES`) for the repeated pricings of one layout."""
    key = _memo_key(view, base_traffic, tables)
    if key not in _MEMO:
        _MEMO[key] = _order_statistics(view, base_traffic, tables)
        if len(_MEMO) > MEMO_ENTRIES:
            _MEMO.popitem(last=False)
    kept = _MEMO[key]
    return replace(kept, traffic=kept.traffic.copy(), time_s=kept.time_s.copy())  # callers may add to them


_MEMO: OrderedDict[bytes, OrderStatistics] = OrderedDict()


def _memo_key(view: ClusterView, base_traffic: np.ndarray, tables: list[RandomRangeTable]) -> bytes:
    """A digest of every input :func:`_order_statistics` reads."""
    h = hashlib.sha256()
    for array in (view.intra_bw_Bps, view.inter_bw_Bps, view.group_of_rank, base_traffic):
        h.update(np.ascontiguousarray(array, dtype=np.float64).tobytes())
    for t in tables:
        h.update(f"{t.name}\0{t.num_rows}\0{t.vector_bytes}\0".encode())
        h.update(t.edges.tobytes() + b"\0" + t.cumulative.tobytes())
    return h.digest()


def _order_statistics(
    view: ClusterView, base_traffic: np.ndarray, tables: list[RandomRangeTable]
) -> OrderStatistics:
    n = view.num_ranks
    bw = np.stack([view.intra_bw_Bps, view.inter_bw_Bps], axis=1)
    sums, times = np.zeros((n, 2, 4, 2)), []
    for chunk in range(MAX_CHUNKS):
        traffic = np.broadcast_to(base_traffic, (chunk_draws(n), *base_traffic.shape)).copy()
        for t in tables:
            traffic += served_traffic(view, random_range_draws(t, n, chunk), t.vector_bytes)
        per_link = traffic.sum(axis=-2).max(axis=-1)  # [D, N, 2]
        time = np.divide(per_link, bw, out=np.zeros_like(per_link), where=per_link > 0).sum(axis=-1)
        order = np.argsort(-time, axis=1, kind="stable")
        times.append(np.take_along_axis(time, order, axis=1))
        sums += np.take_along_axis(traffic, order[:, :, None, None, None], axis=1).sum(axis=0)
        slowest = np.concatenate(times)[:, 0]
        rel = (
            float(slowest.std(ddof=1) / np.sqrt(slowest.size) / slowest.mean()) if slowest.mean() > 0 else 0.0
        )
        if rel < TARGET_REL_STDERR:
            break
    all_times = np.concatenate(times)
    return OrderStatistics(sums / all_times.shape[0], all_times.mean(axis=0), all_times.shape[0], rel)


def random_table(table: TableSpec, plan: Plan, mass, column: int) -> RandomRangeTable:
    """``table`` (a :class:`~solvers.types.TableSpec` of ``plan``) as dealt over random id orders, its volume
    the ``column`` of ``mass`` (:class:`solvers.volumes.TableMass`)."""
    table_plan = next(tp for tp in plan.tables if tp.name == table.name)
    if table_plan.fetch is not FetchMode.FLAT:
        raise PlannerError(f"plan table {table.name!r}: ranges without an id order need the flat fetch")
    cumulative = np.ascontiguousarray(mass.stacked()[:, column])
    return RandomRangeTable(table.name, mass.rows, cumulative, table.num_rows, table.wire_bytes(plan.wire))


def expected_report(view: ClusterView, base: CostReport, tables: list[RandomRangeTable]) -> CostReport:
    """``base`` (a :class:`~solvers.types.CostReport` without the lookups of ``tables``) with them added
    over random id orders: ranks slowest first (:func:`expected_order_statistics`), memory as in ``base``."""
    stats = expected_order_statistics(view, base.traffic.bytes, tables)
    meta = {"draws": stats.draws, "rel_stderr": stats.rel_stderr}
    return replace(base, traffic=Traffic(stats.traffic), time_s=stats.time_s, random_order=meta)


def expected_range_masses(num_rows: int, num_ranks: int, totals: np.ndarray) -> np.ndarray:
    """float64[N, Q]: each rank's expected share of ``totals`` (float64[Q]) under ranges of a random id
    order: its range's rows over the table's."""
    rows = dealing.range_rows(num_rows, num_ranks).astype(np.float64)
    return rows[:, None] / num_rows * np.asarray(totals, dtype=np.float64)[None, :]
