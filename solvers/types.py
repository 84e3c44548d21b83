"""The planner's nouns: workloads, row statistics, plans and cost reports.

Everything here is plain data (dataclasses over numpy arrays); no torch. Quantities carry their
unit in the name (``_bytes``, ``_s``, ``_Bps`` = bytes per second) or in the docstring.

Row statistics are kept as a *hotness histogram*: rows sorted by access probability (hottest
first) and run-length encoded into buckets of rows that share one probability. Real traces encode
exactly (rows with equal counts share a bucket; the number of distinct counts is small), synthetic
distributions are bucketed on a fine geometric grid of ranks. Memory is O(buckets), never O(rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from core.errors import PlannerError
from core.traffic import Traffic
from core.vocabulary import Component, Deal, FetchMode, LinkClass, SyncMode, WireDtype
from solvers.wire import vector_bytes

ROUTING_BYTES_PER_REPLICATED_ROW = 12  # int64 sorted id + int32 slot, per hot/warm row, on every rank
MEMORY_PARTS = ("hot", "warm", "cold", "routing")  # columns of CostReport.memory_by_part_bytes


@dataclass(frozen=True)
class RowHistogram:
    """Per-row access probabilities of one table, hottest first, run-length encoded.

    ``rows[k]`` rows each have access probability ``prob[k]`` (per lookup); ``prob`` is
    non-increasing and ``sum(rows * prob) == 1``. Rows never accessed form a final bucket with
    probability 0.
    """

    rows: np.ndarray  # int64[K]
    prob: np.ndarray  # float64[K]

    def __post_init__(self) -> None:
        rows = np.ascontiguousarray(self.rows, dtype=np.int64)
        prob = np.ascontiguousarray(self.prob, dtype=np.float64)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "prob", prob)
        if rows.ndim != 1 or rows.shape != prob.shape or rows.size == 0:
            raise PlannerError(
                f"histogram: rows and prob must be equal-length 1-D arrays, got {rows.shape}, {prob.shape}"
            )
        if (rows <= 0).any():
            raise PlannerError(f"histogram.rows: every bucket needs at least one row, got min {rows.min()}")
        bad = ~(np.isfinite(prob) & (prob >= 0))
        if bad.any():
            k = int(np.argmax(bad))
            raise PlannerError(
                f"histogram.prob: probabilities must be finite and >= 0, got {float(prob[k])} (bucket {k})"
            )
        if (np.diff(prob) > 1e-12 * max(prob[0], 1e-300)).any():
            raise PlannerError("histogram.prob: buckets must be sorted hottest first")
        total = float(np.dot(rows.astype(np.float64), prob))
        if not abs(total - 1.0) < 1e-6:
            raise PlannerError(f"histogram: probabilities must sum to 1 over rows, got {total:.9g}")

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())

    @property
    def num_buckets(self) -> int:
        return int(self.rows.size)

    @classmethod
    def from_counts(cls, counts: np.ndarray, num_rows: int | None = None) -> RowHistogram:
        """Exact histogram from per-row access counts (any order; ``num_rows`` defaults to ``len(counts)``).

        Integer counts are grouped with ``np.bincount`` (O(rows), no sort); other counts with
        ``np.unique``.
        """
        counts = np.asarray(counts)
        if counts.ndim != 1:
            raise PlannerError(f"counts: expected a 1-D array, got shape {counts.shape}")
        if counts.dtype.kind == "f" and not np.isfinite(counts).all():
            k = int(np.argmax(~np.isfinite(counts)))
            raise PlannerError(f"counts: access counts must be finite, got {float(counts[k])} (row {k})")
        if counts.size and counts.min() < 0:
            k = int(np.argmin(counts))
            raise PlannerError(f"counts: negative access count {counts[k]} (row {k})")
        n = counts.size if num_rows is None else int(num_rows)
        if n < counts.size:
            raise PlannerError(f"num_rows: {n} is smaller than the {counts.size} counted rows")
        if counts.dtype.kind in "iu" and counts.size and int(counts.max()) <= 4 * counts.size + 1024:
            per_value = np.bincount(counts)  # O(rows), no sort
            values = np.flatnonzero(per_value)
            multiplicity = per_value[values]
        else:
            values, multiplicity = np.unique(counts, return_counts=True)
        multiplicity = multiplicity.astype(np.int64)
        if n > counts.size:  # rows never counted have count 0
            if values.size and values[0] == 0:
                multiplicity[0] += n - counts.size
            else:
                values = np.concatenate([[0], values])
                multiplicity = np.concatenate([[n - counts.size], multiplicity])
        total = float(np.dot(values.astype(np.float64), multiplicity))
        if total <= 0:
            raise PlannerError("counts: the table has no accesses at all")
        order = np.argsort(-values.astype(np.float64), kind="stable")
        return cls(rows=multiplicity[order], prob=values[order].astype(np.float64) / total)


def batch_touch_probability(p: np.ndarray, draws: float) -> np.ndarray:
    """Probability that ``draws`` independent draws, each hitting with probability ``p``, hit at least
    once: ``1 - (1 - p)^draws``, computed stably (``p`` clipped below 1 so the log stays finite)."""
    return -np.expm1(draws * np.log1p(-np.minimum(p, 1.0 - 1e-16)))


@dataclass(frozen=True)
class TouchProfile:
    """Measured per-sample access statistics of one table, aligned with its histogram's buckets.

    Training forms a batch from independent samples (a user and a window of its history), so a row
    that one sample touches with probability ``q`` is in a batch of ``s`` samples with probability
    ``1 - (1 - q)^s`` exactly, whatever the ids inside a sample have in common (repeats, sessions).
    This profile keeps, per hotness bucket ``k`` of the table's :class:`RowHistogram`:

    * ``lookups[k]``: expected lookups of the bucket's rows per sample (all its rows together);
    * the distribution of ``q`` over the bucket's rows as sparse entries: ``entry_rows[e]`` rows of
      bucket ``entry_bucket[e]`` have per-sample touch probability ``entry_prob[e]`` (``q`` rounded to
      a geometric grid of ratio ``1 + quantization``, so every row's touch rate at any batch size is
      off by at most ``quantization / 2`` relative; rows of no entry have ``q = 0``).

    ``bucket_error``: the largest error, over every cut point along the hotness order, of the masses
    interpolated inside a bucket against the per-row masses, as a share of the table's total (stated
    by whoever measured the profile). ``sampling``: how a sample was formed (e.g.
    ``"next-item, window 20, negatives 4"``), for reports and contracts.

    ``rank_entry`` (optional): which entry each row belongs to, along the hotness order (int32[L] for
    ranks ``0 .. L - 1``, ``-1`` for a row of ``q = 0``; ranks past ``L`` have ``q = 0``). It tells
    *which* rows of a bucket are the widely shared ones, which only a deal by id needs (TorchRec's
    contiguous id ranges, :func:`solvers.dealing.range_masses`): 4 bytes per touched row, beside the
    hotness order's 8.
    """

    lookups: np.ndarray  # float64[K] lookups per sample
    entry_bucket: np.ndarray  # int64[E], non-decreasing
    entry_prob: np.ndarray  # float64[E] in (0, 1]
    entry_rows: np.ndarray  # int64[E] > 0
    quantization: float
    bucket_error: float
    sampling: str
    rank_entry: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, dtype in (
            ("lookups", np.float64),
            ("entry_bucket", np.int64),
            ("entry_prob", np.float64),
            ("entry_rows", np.int64),
        ):
            object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        if self.rank_entry is not None:
            self._check_rank_entry()
        e = self.entry_bucket.size
        if self.lookups.ndim != 1 or any(a.shape != (e,) for a in (self.entry_prob, self.entry_rows)):
            raise PlannerError("touch profile: lookups and entry arrays must be 1-D, entries of equal length")
        if not np.isfinite(self.lookups).all() or (self.lookups < 0).any():
            raise PlannerError("touch profile.lookups: must be finite and >= 0")
        if e and (
            (np.diff(self.entry_bucket) < 0).any()
            or self.entry_bucket[0] < 0
            or self.entry_bucket[-1] >= self.lookups.size
        ):
            raise PlannerError("touch profile.entry_bucket: must be sorted bucket indices")
        if not (
            np.isfinite(self.entry_prob).all()
            and (self.entry_prob > 0).all()
            and (self.entry_prob <= 1).all()
        ):
            raise PlannerError("touch profile.entry_prob: per-sample touch probabilities must be in (0, 1]")
        if (self.entry_rows <= 0).any():
            raise PlannerError("touch profile.entry_rows: every entry needs at least one row")
        for name in ("quantization", "bucket_error"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise PlannerError(f"touch profile.{name}: must be finite and >= 0, got {v!r}")

    def _check_rank_entry(self) -> None:
        """``rank_entry`` as int32 holding exactly ``entry_rows[e]`` ranks of every entry ``e``."""
        ranks = np.asarray(self.rank_entry)
        if ranks.ndim != 1 or ranks.dtype.kind not in "iu":
            raise PlannerError(
                f"touch profile.rank_entry: expected 1-D integers, got {ranks.dtype} {ranks.shape}"
            )
        e = self.entry_bucket.size
        if ranks.size and (ranks.min() < -1 or ranks.max() >= e):
            bad = int(ranks.min()) if ranks.min() < -1 else int(ranks.max())
            raise PlannerError(f"touch profile.rank_entry: entry {bad} is outside -1..{e - 1}")
        ranks = np.ascontiguousarray(ranks, dtype=np.int32)
        counts = np.bincount(ranks[ranks >= 0], minlength=e)
        if not np.array_equal(counts, self.entry_rows):
            first = int(np.flatnonzero(counts != self.entry_rows)[0])
            raise PlannerError(
                f"touch profile.rank_entry: lists {int(counts[first])} rows of entry {first}, "
                f"which has {int(self.entry_rows[first])}"
            )
        object.__setattr__(self, "rank_entry", ranks)

    def check_ranks(self, bucket_edges: np.ndarray) -> None:
        """Raise PlannerError unless every rank of ``rank_entry`` lies in its entry's bucket
        (``bucket_edges``: int64[K + 1], the first rank of each histogram bucket and the table's rows)."""
        if self.rank_entry is None:
            return
        if self.rank_entry.size > bucket_edges[-1]:
            size, rows = self.rank_entry.size, int(bucket_edges[-1])
            raise PlannerError(f"touch profile.rank_entry: {size} ranks for a table of {rows} rows")
        rank = np.flatnonzero(self.rank_entry >= 0)
        bucket = self.entry_bucket[self.rank_entry[rank]]
        wrong = (rank < bucket_edges[bucket]) | (rank >= bucket_edges[bucket + 1])
        if wrong.any():
            r = int(rank[np.argmax(wrong)])
            raise PlannerError(
                f"touch profile.rank_entry: rank {r} is outside bucket {int(bucket[np.argmax(wrong)])}"
            )

    def entry_touched(self, samples: float) -> np.ndarray:
        """float64[E]: one row's probability of being in a batch of ``samples`` samples, per entry."""
        return batch_touch_probability(self.entry_prob, samples)

    @property
    def num_buckets(self) -> int:
        return int(self.lookups.size)

    @property
    def lookups_per_sample(self) -> float:
        return float(self.lookups.sum())

    def rows_per_bucket(self) -> np.ndarray:
        """int64[K]: rows with a non-zero touch probability in each bucket."""
        return np.bincount(self.entry_bucket, weights=self.entry_rows, minlength=self.num_buckets).astype(
            np.int64
        )

    def distinct(self, samples: float) -> np.ndarray:
        """float64[K]: expected distinct rows of each bucket in a batch of ``samples`` independent samples
        (``sum over rows of 1 - (1 - q)^samples``)."""
        return self.bucket_sums(self.entry_touched(samples))

    def bucket_sums(self, per_row: np.ndarray) -> np.ndarray:
        """float64[K]: the sum over each bucket's rows of a per-row value given per entry (float64[E])."""
        return np.bincount(self.entry_bucket, weights=per_row * self.entry_rows, minlength=self.num_buckets)


@dataclass(frozen=True)
class TableSpec:
    """One sequence embedding table and how it is accessed.

    ``ids_per_sample`` is the mean sequence length (lookups per sample); ``length_values`` /
    ``length_probs`` optionally give its distribution (a sparse pmf). ``touch``: measured per-sample
    statistics (:class:`TouchProfile`); without it the cost model takes a batch's ids as independent
    draws from ``hist``. ``order``: the row ids hottest first (a stats file's order; ``None``: ids are
    hotness ranks, as in synthetic workloads); only TorchRec's contiguous id ranges are priced by it.
    """

    name: str
    num_rows: int
    dim: int
    ids_per_sample: float
    hist: RowHistogram
    element_bytes: int = 4  # fp32 weights and gradients
    optimizer_bytes_per_row: int = 4  # row-wise Adagrad: one fp32 accumulator per row
    length_values: np.ndarray | None = None
    length_probs: np.ndarray | None = None
    touch: TouchProfile | None = None
    order: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise PlannerError("table.name: must be a non-empty string")
        for fld in ("num_rows", "dim", "element_bytes"):
            v = getattr(self, fld)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise PlannerError(f"table {self.name!r}: {fld} must be a positive integer, got {v!r}")
        if self.optimizer_bytes_per_row < 0:
            raise PlannerError(
                f"table {self.name!r}: optimizer_bytes_per_row must be >= 0, "
                f"got {self.optimizer_bytes_per_row!r}"
            )
        if not np.isfinite(self.ids_per_sample) or self.ids_per_sample <= 0:
            raise PlannerError(
                f"table {self.name!r}: ids_per_sample must be positive, got {self.ids_per_sample!r}"
            )
        if self.hist.num_rows != self.num_rows:
            raise PlannerError(
                f"table {self.name!r}: histogram covers {self.hist.num_rows} rows "
                f"but num_rows is {self.num_rows}"
            )
        if self.touch is not None:
            tp = self.touch
            if tp.num_buckets != self.hist.num_buckets or (tp.rows_per_bucket() > self.hist.rows).any():
                raise PlannerError(
                    f"table {self.name!r}: the touch profile does not match the histogram's "
                    f"{self.hist.num_buckets} buckets"
                )
            if abs(tp.lookups_per_sample - self.ids_per_sample) > 1e-6 * max(self.ids_per_sample, 1.0):
                raise PlannerError(
                    f"table {self.name!r}: ids_per_sample {self.ids_per_sample:g} differs from the touch "
                    f"profile's {tp.lookups_per_sample:g} lookups per sample"
                )

    @property
    def row_bytes(self) -> int:
        """Bytes one stored row costs: weights plus optimizer state."""
        return self.dim * self.element_bytes + self.optimizer_bytes_per_row

    @property
    def vector_bytes(self) -> int:
        """Bytes of one embedding (or gradient) vector as stored (on the wire at full precision)."""
        return self.dim * self.element_bytes

    def wire_bytes(self, wire: WireDtype) -> int:
        """Bytes of one embedding (or gradient) vector sent as ``wire`` (``solvers.wire.vector_bytes``)."""
        return vector_bytes(self.dim, self.element_bytes, wire)


@dataclass(frozen=True)
class Workload:
    """Tables plus the per-GPU batch that drives their lookups."""

    name: str
    tables: tuple[TableSpec, ...]
    batch_size_per_gpu: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        if not self.tables:
            raise PlannerError(f"workload {self.name!r}: has no tables")
        if not isinstance(self.batch_size_per_gpu, (int, np.integer)) or self.batch_size_per_gpu <= 0:
            raise PlannerError(
                f"workload.batch_size_per_gpu: must be a positive integer, got {self.batch_size_per_gpu!r}"
            )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise PlannerError(f"workload {self.name!r}: duplicate table name {dup!r}")

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self.tables)

    def with_orders(self, orders: dict[str, np.ndarray] | None) -> Workload:
        """This workload with each table's hotness ``order`` (ids hottest first) from ``orders``; tables
        it does not name keep theirs."""
        orders = orders or {}
        tables = tuple(replace(t, order=orders[t.name]) if t.name in orders else t for t in self.tables)
        return replace(self, tables=tables)

    def lookups_per_gpu(self, table: TableSpec) -> float:
        """Expected lookups of ``table`` per GPU per iteration."""
        return self.batch_size_per_gpu * table.ids_per_sample


@dataclass(frozen=True)
class TablePlan:
    """Tiers and owners of one table.

    Rows are taken in hotness order: the first ``hot_rows`` are hot, the next ``warm_rows`` warm,
    the rest cold. ``warm_share[r]`` is the share of the warm rows rank ``r`` holds within its
    group (sums to 1 over each group); ``cold_share[r]`` the share of cold rows it holds (sums to
    1 over the cluster). Rows are dealt to owners by a weighted interleave over hotness rank
    (:mod:`solvers.dealing`), the tier's hottest row at position ``warm_start`` / ``cold_start`` of
    the owner pattern, or (``deal`` ``ranges``, all rows cold) by TorchRec's contiguous id ranges.
    ``fetch``: how the cold rows' lookups reach their owners (:class:`core.vocabulary.FetchMode`).
    """

    name: str
    hot_rows: int
    warm_rows: int
    cold_rows: int
    warm_share: np.ndarray  # float64[N]
    cold_share: np.ndarray  # float64[N]
    fetch: FetchMode = FetchMode.FLAT
    deal: Deal = Deal.INTERLEAVE
    warm_start: int = 0  # owner pattern position of the hottest warm row
    cold_start: int = 0  # owner pattern position of the hottest cold row

    def __post_init__(self) -> None:
        object.__setattr__(self, "fetch", FetchMode.parse(self.fetch))
        object.__setattr__(self, "deal", Deal.parse(self.deal))


@dataclass(frozen=True)
class Plan:
    """A sharding plan for a workload on a cluster (one strategy, one budget).

    ``dedup``: ids deduplicated per rank before the exchange; ``sync``: how replica gradients are
    summed; ``wire``: the element type of embeddings and gradients on the wire. Each table's cold
    fetch mode is in its :class:`TablePlan`. Plans are immutable: derive
    variants with ``dataclasses.replace``.
    """

    strategy: str
    tables: tuple[TablePlan, ...]
    dedup: bool
    sync: SyncMode = SyncMode.SPARSE
    budget_bytes: float | None = None  # per-GPU memory budget the plan was made for
    solver: dict = field(default_factory=dict)  # solver metadata (bounds, gap, iterations, seconds)
    wire: WireDtype = WireDtype.FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "sync", SyncMode.parse(self.sync))
        object.__setattr__(self, "wire", WireDtype.parse(self.wire))

    def cold_fetch(self, mode: FetchMode) -> bool:
        """Whether some table has cold rows fetched in ``mode``."""
        return any(tp.cold_rows > 0 and tp.fetch is mode for tp in self.tables)


@dataclass
class CostReport:
    """Modeled per-iteration cost of a plan, per rank.

    ``traffic`` is bytes per iteration with a rank axis (:class:`core.traffic.Traffic`:
    ``[rank, link class, component, direction]``).
    """

    traffic: Traffic  # bytes per iteration, per rank
    time_s: np.ndarray  # float64[N], bytes / bandwidth per link class, summed, per iteration per rank
    memory_by_part_bytes: np.ndarray  # float64[N, 4]: rows (+ optimizer state) per tier, routing ids
    latency_s: float  # collective latency per iteration (hops x link latency), not in time_s
    # TorchRec's ranges over random id orders (solvers.torchrec_default): ranks are then slowest first,
    # and this holds the draws and the slowest rank's relative standard error; None otherwise
    random_order: dict | None = None

    @property
    def memory_bytes(self) -> np.ndarray:
        """float64[N]: embedding + optimizer + routing bytes per rank."""
        return self.memory_by_part_bytes.sum(axis=1)

    def link_bytes(self, link: LinkClass, components: tuple[Component, ...] = tuple(Component)) -> np.ndarray:
        """float64[N]: bytes per rank on one link class, max(send, recv), summed over ``components``."""
        return self.traffic.link_bytes(link, components)

    @property
    def inter_group_bytes(self) -> float:
        """Bottleneck rank's inter-group bytes per iteration (sync included)."""
        return float(self.link_bytes(LinkClass.INTER_GROUP).max())

    @property
    def intra_group_bytes(self) -> float:
        """Bottleneck rank's intra-group bytes per iteration (sync included)."""
        return float(self.link_bytes(LinkClass.INTRA_GROUP).max())

    @property
    def sync_bytes(self) -> float:
        """Bottleneck rank's replica-synchronisation bytes per iteration, both link classes."""
        per_rank = self.traffic.bytes[:, :, Component.SYNC, :].sum(axis=1).max(axis=1)
        return float(per_rank.max())

    @property
    def modeled_time_s(self) -> float:
        return float(self.time_s.max())

    @property
    def time_with_latency_s(self) -> float:
        """Slowest rank's modeled time plus the collective latency."""
        return self.modeled_time_s + self.latency_s

    @property
    def memory_per_gpu_bytes(self) -> float:
        return float(self.memory_bytes.max())
