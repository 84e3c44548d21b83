"""The batches a training run draws: the embedded synthetic workload, or real histories from a file.

Both sources give, per rank and step, a deterministic :class:`~flexshard.model.Batch` (a function of
``(seed, step, rank)``), the tables the model looks up (``(name, rows, dim)``), their hotness orders and
the :class:`~solvers.types.Workload` a plan for them is made from.

* :class:`SyntheticSource`: tables ``item`` (50,000 rows) and ``creator`` (5,000 rows, 10 items each)
  with a Zipf head (alpha 0.9 over the hottest 10% of items) plus a 5% uniform tail; history lengths
  uniform in ``1..max_len``. Rows are numbered hottest first, so there are no hotness orders.
* :class:`SequenceFileSource`: a file of user histories read by the one workloads parser (``user item
  ...`` lines, ``user,item,count`` rows or a Parquet log; :mod:`flexshard.workloads.measured`), tables
  ``item_id`` (history and candidates) and ``user_id`` (one per sample); the workload, its hotness
  orders and its measured touch rates are what ``flexshard stats --window <max_len> --negatives <K>``
  computes from the same file. Samples come from :class:`flexshard.workloads.HistorySampler`
  (``next-item``): a user with at least two items, a cut point (the target), the ``max_len`` items
  before it and ``negatives`` random touched items.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import DataError
from flexshard.model import Batch
from flexshard.training.config import TrainConfig
from flexshard.workloads import (
    ITEM_TABLE,
    USER_TABLE,
    HistorySampler,
    ParquetColumns,
    Sampling,
    Sequences,
    Vocabulary,
    detect_format,
    id_sorted_note,
    load_stats_with_vocabulary,
    load_workload_with_orders,
    measured,
    order_note,
    sequences_from_lines,
)
from flexshard.workloads.measured import HISTORY_FORMATS
from flexshard.workloads.paths import check_file
from flexshard.workloads.row_stats import is_row_stats
from solvers.types import RowHistogram, TableSpec, Workload

SYN_ITEMS, SYN_ITEMS_PER_CREATOR, SYN_ALPHA, SYN_HEAD, SYN_TAIL = 50_000, 10, 0.9, 5_000, 0.05
SYN_TABLES = ("item", "creator")  # the synthetic source's sequence tables


class SyntheticSource:
    """The embedded synthetic workload (module docstring)."""

    name = "synthetic"

    def __init__(self, dim: int, max_len: int, negatives: int, batch_size: int, seed: int) -> None:
        self.dim, self.max_len, self.negatives, self.batch_size, self.seed = (
            dim,
            max_len,
            negatives,
            batch_size,
            seed,
        )
        p = np.full(SYN_ITEMS, SYN_TAIL / SYN_ITEMS)
        head = np.arange(1, SYN_HEAD + 1, dtype=np.float64) ** -SYN_ALPHA
        p[:SYN_HEAD] += (1 - SYN_TAIL) * head / head.sum()
        self.pmf = p / p.sum()
        self.cdf = np.cumsum(self.pmf)
        self.seq_tables = list(SYN_TABLES)
        self.user_table: str | None = None
        self.vocabulary: Vocabulary | None = None  # integer ids
        self.orders: dict[str, np.ndarray] = {}  # rows are numbered hottest first
        self.touch_sampling: dict[str, str] = {}  # the workload's rates are exact draws, not measured
        self.tables = [("item", SYN_ITEMS, dim), ("creator", SYN_ITEMS // SYN_ITEMS_PER_CREATOR, dim)]

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n), side="right"), SYN_ITEMS - 1)

    def batch(self, step: int, rank: int) -> Batch:
        rng = np.random.default_rng([self.seed, step, rank, 1])
        b = self.batch_size
        lengths = rng.integers(1, self.max_len + 1, b).astype(np.int64)
        items = self._draw(rng, int(lengths.sum()))
        cand = np.concatenate(
            [self._draw(rng, b)[:, None], rng.integers(0, SYN_ITEMS, (b, self.negatives))], axis=1
        ).astype(np.int64)
        per = SYN_ITEMS_PER_CREATOR
        return Batch(
            lengths, {"item": items, "creator": items // per}, {"item": cand, "creator": cand // per}
        )

    def workload(self) -> Workload:
        mean_hist = (self.max_len + 1) / 2
        ids = mean_hist + 1 + self.negatives
        mix = ((mean_hist + 1) * self.pmf + self.negatives / SYN_ITEMS) / ids  # history + target + negatives
        per_creator = mix.reshape(-1, SYN_ITEMS_PER_CREATOR).sum(1)
        specs = [
            TableSpec(name, rows, dim, ids, RowHistogram.from_counts(p))
            for (name, rows, dim), p in zip(self.tables, (mix, per_creator), strict=True)
        ]
        return Workload("train-synthetic", tuple(specs), self.batch_size)

    def describe(self) -> str:
        return "synthetic (" + ", ".join(f"{n} {r:,} x {d}" for n, r, d in self.tables) + ")"


def _joined_histories(parts: list[Sequences]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(users, lengths, items) of chunks of users (e.g. a Parquet log's partitions), laid end to end."""
    return (
        np.concatenate([p.users for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.items for p in parts]),
    )


class SequenceFileSource:
    """A file of user histories: tables ``item_id`` (history, candidates) and ``user_id`` (see the module)."""

    def __init__(
        self,
        path: str,
        dim: int,
        max_len: int,
        negatives: int,
        batch_size: int,
        seed: int,
        options: DataOptions | None = None,
    ) -> None:
        self.path, self.max_len, self.negatives = Path(path), max_len, negatives
        self.batch_size, self.seed, self.name = batch_size, seed, Path(path).name
        options = options or DataOptions()
        check_file(self.path, "--data", "a folder; train reads one file of user histories")
        fmt = detect_format(self.path)
        if fmt not in HISTORY_FORMATS:
            raise DataError(
                f"--data: {path}: train reads histories ({', '.join(HISTORY_FORMATS)} files), got {fmt!r}"
            )
        if fmt == "parquet" and is_row_stats(self.path):
            raise DataError(
                f"--data: {path}: per-row statistics (table, row, lookups columns), not an interaction log; "
                "train samples user histories: pass the log they were computed from"
            )
        self.vocabulary, num_rows = options.vocabulary()
        columns = options.columns
        self.note = order_note(self.path, columns) if fmt == "csv" else None
        workload, orders = load_workload_with_orders(
            self.path, dim=dim, batch_size_per_gpu=batch_size, num_rows=num_rows, vocabulary=self.vocabulary,
            columns=columns,
        )  # fmt: skip
        specs = {t.name: t for t in workload.tables}
        self.seq_tables, self.user_table = [ITEM_TABLE], USER_TABLE
        keep = [specs[ITEM_TABLE], specs[USER_TABLE]]
        self._counted = Workload(f"train-{self.path.stem}", tuple(keep), batch_size)
        self._measured: Workload | None = None
        self.orders = {t.name: orders[t.name] for t in keep if t.name in orders}
        self.tables = [(t.name, t.num_rows, t.dim) for t in keep]
        touched = self.orders.get(ITEM_TABLE)
        self.sampling = Sampling("next-item", max_len, negatives)
        self.touch_sampling = dict.fromkeys((ITEM_TABLE, USER_TABLE), self.sampling.describe())
        # one read: the sampler and the rates share it; string ids through the counts' vocabulary
        named = {} if columns is None else {"columns": columns}
        parts = list(measured.histories(self.path, fmt, None, self.vocabulary, **named)())
        self._histories = lambda: parts
        whole = parts[0] if len(parts) == 1 else sequences_from_lines(*_joined_histories(parts))
        sorted_note = id_sorted_note(*whole.ascending_pairs(), self.path)
        self.note = "; ".join(filter(None, (self.note, sorted_note))) or None
        try:
            self.sampler = HistorySampler(
                whole,
                self.sampling,
                batch_size,
                seed,
                touched if touched is not None and touched.size else None,
            )
        except DataError:
            raise DataError(f"--data: {path}: no user with at least two items") from None

    def batch(self, step: int, rank: int) -> Batch:
        s = self.sampler.batch(step, rank)
        item = self.seq_tables[0]
        return Batch(s.lengths, {item: s.history}, {item: s.candidates}, s.users)

    def workload(self) -> Workload:
        """The tables with touch rates measured on this source's own sampling (what a plan made on the
        fly is priced on)."""
        if self._measured is None:
            self._measured = measured.with_touch_rates(
                self._counted, self.orders, self._histories, self.sampling
            )
        return self._measured

    def describe(self) -> str:
        tables = f"{self.path} (" + ", ".join(f"{n} {r:,} x {d}" for n, r, d in self.tables) + ")"
        return tables + (f"; note: {self.note}" if self.note else "")


@dataclass(frozen=True)
class DataOptions:
    """How ``--data`` is read: its columns (``--user-col`` ...; Parquet and delimited files) and the
    stats file whose vocabulary maps its string ids (``--vocab``)."""

    columns: ParquetColumns | None = None
    vocab: str | None = None

    def vocabulary(self) -> tuple[Vocabulary, dict[str, int] | None]:
        """The vocabulary to map string ids with (``--vocab``'s, frozen; else an empty one that reading
        fills) and the table sizes it fixes (its tables' strings; None without ``--vocab``)."""
        if self.vocab is None:
            return Vocabulary(), None
        check_file(self.vocab, "--vocab", "a folder; expected the stats file (.npz) of flexshard stats")
        _workload, _orders, vocab = load_stats_with_vocabulary(self.vocab)
        if vocab is None:
            raise DataError(
                f"--vocab: {self.vocab}: holds no vocabulary (the ids of its data were integers, rows as "
                "they are: leave --vocab out)"
            )
        return vocab, {t: vocab.size(t) for t in vocab.tables}


def data_options(config: TrainConfig) -> DataOptions:
    """The :class:`DataOptions` of the flags."""
    named = (config.user_col, config.item_col, config.time_col, config.count_col)
    columns = None
    if any(named):
        default = ParquetColumns()
        columns = ParquetColumns(config.user_col or default.user, config.item_col or default.item, *named[2:])
    return DataOptions(columns, config.vocab)


def table_shape(data: str | None) -> tuple[int, bool]:
    """(sequence tables, whether a user table is looked up) of the source ``make_source(data, ...)``
    builds, known before it is built (for :mod:`flexshard.training.limits`)."""
    return (1, True) if data else (len(SYN_TABLES), False)


def make_source(
    data: str | None,
    dim: int,
    max_len: int,
    negatives: int,
    batch_size: int,
    seed: int,
    options: DataOptions | None = None,
) -> SyntheticSource | SequenceFileSource:
    """The source of ``--data`` (a file of histories), or the synthetic one without it."""
    args = (dim, max_len, negatives, batch_size, seed)
    return SequenceFileSource(data, *args, options) if data else SyntheticSource(*args)
