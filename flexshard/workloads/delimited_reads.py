"""Counts and per-user histories of delimited files (the parser is :mod:`flexshard.workloads.delimited`).

* :func:`read_delimited`: per-table counts, streamed (one block, plus int64 counts per item and user row).
* :func:`history_chunks` / :func:`csv_histories`: every user's history, items in time order (a time
  column; ties in file order) or file order, each ``count`` times. A file up to ``SPILL_BYTES`` is
  grouped in memory (~40 bytes per row); a larger one is written block by block, as integer row ids, to
  a temporary Parquet log and grouped by :func:`~flexshard.workloads.parquet.parquet_histories`' external
  group-by (bounded memory, ``$TMPDIR`` holding ~32 bytes per row while it runs).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from core.errors import ConfigError, DataError

from ._text import grow
from .delimited import Layout, chunks, sniff
from .parquet import MEMORY_BYTES, ParquetColumns, ParquetLogWriter, parquet_histories
from .parsed import (
    ITEM_TABLE,
    USER_TABLE,
    Parsed,
    check_expansion,
    check_max_len,
    history_counts,
    interaction_counts,
    table_limits,
    table_size,
)
from .sequences import Sequences, read_count_sequences, sequences_from_counts, sequences_from_lines
from .vocabulary import Vocabulary

SPILL_BYTES = 256 * 2**20  # larger delimited files are grouped by user on disk
_SIGN = np.int64(0x7FFFFFFFFFFFFFFF)


def ordered_int64(times: np.ndarray) -> np.ndarray:
    """int64 keys in the order of ``times`` (integers as they are; float64 by their bits, negative ones
    flipped), so a Parquet log of int64 columns keeps decimal timestamps' order exactly."""
    if times.dtype.kind != "f":
        return times.astype(np.int64, copy=False)
    bits = (np.asarray(times, dtype=np.float64) + 0.0).view(np.int64)  # + 0.0: -0.0 becomes 0.0
    return np.where(bits < 0, bits ^ _SIGN, bits)


def _where(layout: Layout) -> str:
    return f"{layout.path}: column {layout.column('count')!r}"


def _in_memory(
    layout: Layout, vocab: Vocabulary, limits: Mapping[str, int], max_len: int | None
) -> Sequences:
    parts = list(chunks(layout, vocab, limits))
    users = np.concatenate([p.users for p in parts])
    items = np.concatenate([p.items for p in parts])
    counts = np.concatenate([p.counts for p in parts])
    check_expansion(float(counts.sum(dtype=np.float64)), int(counts.max()), _where(layout))
    if parts[0].times is None:  # file order
        seq = sequences_from_counts(users, items, counts)
    else:  # time order, ties in file order (lexsort is stable)
        order = np.lexsort((np.concatenate([p.times for p in parts]), users))
        counts = counts[order]
        seq = sequences_from_lines(users[order], counts, np.repeat(items[order], counts))
    return seq if max_len is None else seq.truncated(max_len)


def _spilled(
    layout: Layout, vocab: Vocabulary, limits: Mapping[str, int], max_len: int | None, memory_bytes: int
) -> Iterator[Sequences]:
    timed = layout.column("time") is not None
    with tempfile.TemporaryDirectory(prefix="flexshard-csv-") as tmp:
        log = Path(tmp) / "log.parquet"
        total, largest = 0.0, 0
        with ParquetLogWriter(log, time=timed, count=True) as writer:
            for c in chunks(layout, vocab, limits):
                total += float(c.counts.sum(dtype=np.float64))
                largest = max(largest, int(c.counts.max()))
                writer.write(c.users, c.items, ordered_int64(c.times) if timed else None, c.counts)
        check_expansion(total, largest, _where(layout))
        columns = ParquetColumns("user", "item", "time" if timed else None, "count")
        yield from parquet_histories(log, columns, max_len, limits, memory_bytes)


def _check_max_len(layout: Layout, max_len: int | None) -> int | None:
    if max_len is None:
        return None
    if layout.column("count") is not None and layout.column("time") is None:
        raise ConfigError(
            f"max_len: {layout.path} is a count matrix without a time column; it cannot be truncated to "
            "recent ids"
        )
    return check_max_len(max_len)


def history_chunks(
    path: str | Path,
    columns: ParquetColumns | None = None,
    vocabulary: Vocabulary | None = None,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    spill_bytes: int = SPILL_BYTES,
    memory_bytes: int = MEMORY_BYTES,
) -> Iterator[Sequences]:
    """Every user's history in a delimited file, as chunks of users (one chunk unless the file is larger
    than ``spill_bytes``; then partitions of about ``memory_bytes`` each); every user is in one chunk."""
    layout = sniff(path, columns)
    max_len = _check_max_len(layout, max_len)
    if layout.legacy:
        yield read_count_sequences(path, num_rows)
        return
    vocab = vocabulary if vocabulary is not None else Vocabulary()
    limits = table_limits(num_rows)
    if Path(path).stat().st_size <= spill_bytes:
        yield _in_memory(layout, vocab, limits, max_len)
    else:
        yield from _spilled(layout, vocab, limits, max_len, memory_bytes)


def csv_histories(
    path: str | Path,
    columns: ParquetColumns | None = None,
    vocabulary: Vocabulary | None = None,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    spill_bytes: int = SPILL_BYTES,
) -> Sequences:
    """:func:`history_chunks` as one :class:`Sequences` (users ascending)."""
    parts = list(history_chunks(path, columns, vocabulary, max_len, num_rows, spill_bytes))
    if len(parts) == 1:
        return parts[0]
    return sequences_from_lines(
        np.concatenate([p.users for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.items for p in parts]),
    )


def read_delimited(
    layout: Layout,
    num_rows: Mapping[str, int] | None = None,
    max_len: int | None = None,
    vocabulary: Vocabulary | None = None,
) -> Parsed:
    """Per-table counts of a (non-legacy) delimited file, as ``readers.read_csv``: ``item_id`` one lookup
    per interaction, one sample per user whose length is its interactions (its last ``max_len`` with
    ``max_len``, from :func:`history_chunks`). Memory: one block plus int64 counts per item and user row."""
    limits = table_limits(num_rows)
    vocab = vocabulary if vocabulary is not None else Vocabulary()
    max_len = _check_max_len(layout, max_len)
    if max_len is not None:
        histories = history_chunks(layout.path, _columns(layout), vocab, max_len, num_rows)
        item_counts, sample_user, totals = history_counts(histories)
    else:
        item_counts, sample_user, totals = interaction_counts(chunks(layout, vocab, limits))
    if ITEM_TABLE in vocab:  # every string is a row, also one whose rows were cut by max_len
        item_counts = grow(item_counts, vocab.size(ITEM_TABLE))
    parsed = Parsed(
        source=str(layout.path),
        counts={ITEM_TABLE: item_counts},
        num_rows={ITEM_TABLE: table_size(ITEM_TABLE, item_counts, limits)},
        sample_user=sample_user,
        lengths={ITEM_TABLE: totals},
        per_sample_table=USER_TABLE,
    )
    if USER_TABLE in limits:
        parsed.num_rows[USER_TABLE] = limits[USER_TABLE]
    return parsed


def _columns(layout: Layout) -> ParquetColumns:
    """The column flags that make :func:`~flexshard.workloads.delimited.sniff` give ``layout`` again."""
    if not layout.header:
        return ParquetColumns()
    return ParquetColumns(
        str(layout.column("user")), str(layout.column("item")), layout.column("time"), layout.column("count")
    )


def order_note(path: str | Path, columns: ParquetColumns | None = None) -> str | None:
    """:meth:`Layout.note` of a delimited file; None for other files (or when its layout is bad: the
    reader reports that)."""
    path = Path(path)
    if path.suffix.lower() in (".inter", ".user", ".item", ".parquet", ".pq", ".npz", ".json"):
        return None
    try:
        return sniff(path, columns).note()
    except (DataError, ConfigError, OSError):
        return None
