"""Interaction logs in Parquet: one row per interaction, streamed row group by row group.

A log has a user id column, an item id column and optionally a time column (an integer, or a
Parquet timestamp / date, compared as its int64 value) and a count column (a row with count ``c``
is ``c`` interactions with its item; count 0 adds none). :class:`ParquetColumns` names them.

* :func:`read_parquet` gives the per-table counts ``readers.read_workload`` assembles, like
  ``readers.read_csv``: one lookup of ``item_id`` per interaction, one sample per user.
* :func:`parquet_histories` gives every user's history (items in time order, ties by file order) for
  logs far larger than memory and in any order: an external group-by that hashes users into
  partition files on disk in a first pass, then sorts one partition at a time in memory.

Only numpy and pyarrow run over the data (no Python code per row or per id). Bad content raises
one-line :class:`~core.errors.DataError` naming the file, the row, the column and the value; a bad
argument raises :class:`~core.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.arrays import block_bounds
from core.errors import ConfigError, DataError

from .parsed import (
    ITEM_TABLE,
    MAX_ID,
    USER_TABLE,
    Parsed,
    check_max_len,
    history_counts,
    interaction_counts,
    table_limits,
    table_size,
)
from .sequences import Sequences, sequences_from_lines

BATCH_ROWS = 1 << 20  # rows per record batch read (at most one row group; ~40 MB of int64 columns)
MEMORY_BYTES = 512 * 2**20  # default memory for one partition of parquet_histories
SORT_BYTES_PER_ROW = 80  # pass 2's working memory per row besides the stored record (order, copies)
MAX_PARTITIONS = 4096
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing of user ids to partitions


@dataclass(frozen=True)
class ParquetColumns:
    """The column names of a Parquet interaction log; ``time`` and ``count`` are optional."""

    user: str = "user"
    item: str = "item"
    time: str | None = None
    count: str | None = None


@dataclass(frozen=True)
class LogChunk:
    """Consecutive rows of a log, checked and converted to int64 arrays of one length ``L``."""

    users: np.ndarray  # int64[L] user ids
    items: np.ndarray  # int64[L] item ids
    counts: np.ndarray  # int64[L] interactions per row (>= 0; all 1 without a count column)
    times: np.ndarray | None  # int64[L] the time column's value (timestamps in their unit), or None
    rows: np.ndarray  # int64[L] the row index of each line in the file (0-based)


def open_parquet(path: Path) -> pq.ParquetFile:
    """``pyarrow.parquet.ParquetFile`` of ``path``; DataError when it cannot be read or is not Parquet."""
    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        if isinstance(exc, pa.ArrowException):  # pyarrow's IOError: the bytes are not a Parquet file
            raise DataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except pa.ArrowException as exc:
        raise DataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None


def _bad(path: Path, row: int, column: str, value: object, problem: str) -> DataError:
    return DataError(f"{path}: row {row}: column {column!r} value {value}: {problem}")


def _check_schema(pf: pq.ParquetFile, path: Path, columns: ParquetColumns) -> list[tuple[str, str]]:
    """``(role, column)`` of the columns to read, after checking that each exists with a usable type."""
    schema = pf.schema_arrow
    wanted = [(r, getattr(columns, r)) for r in ("user", "item", "time", "count")]
    wanted = [(r, c) for r, c in wanted if c is not None]
    for role, name in wanted:
        if schema.get_field_index(name) < 0:
            raise DataError(
                f"{path}: no column {name!r} (the {role} column); the file has columns "
                f"{', '.join(schema.names) or '(none)'}"
            )
        kind = schema.field(name).type
        ok = pa.types.is_integer(kind) or (
            role == "time" and (pa.types.is_timestamp(kind) or pa.types.is_date(kind))
        )
        if not ok:
            expected = "integers, a timestamp or a date" if role == "time" else "integers"
            raise DataError(f"{path}: column {name!r} ({role}) has type {kind}; expected {expected}")
    return wanted


def _as_numpy(col: pa.Array, path: Path, name: str, row0: int) -> np.ndarray:
    """One column of a record batch as numpy (its integer dtype; temporal types as int64), no nulls."""
    if col.null_count:
        k = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise _bad(path, row0 + k, name, "null", "missing values are not allowed")
    if pa.types.is_date32(col.type):
        col = col.cast(pa.int32())
    elif pa.types.is_timestamp(col.type) or pa.types.is_date64(col.type):
        col = col.cast(pa.int64())
    return col.to_numpy(zero_copy_only=False)


def _check_ids(ids: np.ndarray, path: Path, name: str, table: str, limit: int | None, row0: int) -> None:
    bad = (ids < 0) | (ids >= (MAX_ID if limit is None else limit))
    if bad.any():
        k = int(np.argmax(bad))
        value = int(ids[k])
        if value < 0:
            problem = "ids < 0 are not allowed"
        elif limit is None:
            problem = f"ids of {MAX_ID:,} and above need remapping to dense ids (or an explicit num_rows)"
        else:
            problem = f"ids outside the table ({table!r} has num_rows {limit})"
        raise _bad(path, row0 + k, name, value, problem)


def parquet_chunks(
    path: str | Path,
    columns: ParquetColumns = ParquetColumns(),
    limits: Mapping[str, int] | None = None,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[LogChunk]:
    """Stream a Parquet log row group by row group, in record batches of at most ``batch_rows`` rows,
    reading only the named columns, each checked: ids non-negative and below ``limits[table]`` (tables
    ``user_id`` and ``item_id``; ``MAX_ID`` without a limit), counts non-negative, no nulls.
    Memory: one row group as pyarrow reads it plus one batch as int64 arrays (~50 bytes per row)."""
    path = Path(path)
    limits = limits or {}
    pf = open_parquet(path)
    wanted = _check_schema(pf, path, columns)
    total = int(pf.metadata.num_rows)
    if total == 0:
        raise DataError(f"{path}: empty file (no rows)")
    names = list(dict.fromkeys(c for _, c in wanted))
    row0 = 0
    for row0, batch in record_batches(pf, path, names, batch_rows, "rows"):
        n = batch.num_rows
        got = {role: _as_numpy(batch.column(name), path, name, row0) for role, name in wanted}
        _check_ids(got["user"], path, columns.user, USER_TABLE, limits.get(USER_TABLE), row0)
        _check_ids(got["item"], path, columns.item, ITEM_TABLE, limits.get(ITEM_TABLE), row0)
        if "count" in got:
            counts = got["count"]
            bad = (counts < 0) | (counts >= 2**62)
            if bad.any():
                k = int(np.argmax(bad))
                problem = "counts must be >= 0" if counts[k] < 0 else "count too large"
                raise _bad(path, row0 + k, str(columns.count), int(counts[k]), problem)
            counts = counts.astype(np.int64, copy=False)
        else:
            counts = np.ones(n, dtype=np.int64)
        yield LogChunk(
            users=got["user"].astype(np.int64, copy=False),
            items=got["item"].astype(np.int64, copy=False),
            counts=counts,
            times=got["time"].astype(np.int64, copy=False) if "time" in got else None,
            rows=np.arange(row0, row0 + n, dtype=np.int64),
        )
        row0 += n
    if row0 != total:
        raise DataError(f"{path}: read {row0} rows, the file's metadata says {total}")


def record_batches(
    pf: pq.ParquetFile, path: Path, columns: list[str], batch_rows: int, what: str
) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(index of its first record, batch) of ``columns``, one row group at a time (a batch never spans
    two), empty batches skipped; a read error is a DataError naming where (``what``: "rows", "records")."""
    batches = (
        batch
        for group in range(pf.num_row_groups)
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=columns)
    )
    start = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{path}: cannot read {what} from {start} on ({str(exc).splitlines()[0]})"
            ) from None
        if batch is None:
            return
        if batch.num_rows:
            yield start, batch
            start += batch.num_rows


# ------------------------------------------------------------------------------------------ counts


def read_parquet(
    path: str | Path,
    num_rows: Mapping[str, int] | None = None,
    max_len: int | None = None,
    columns: ParquetColumns = ParquetColumns(),
) -> Parsed:
    """Per-table counts of a Parquet log, like ``readers.read_csv``: ``item_id`` one lookup per
    interaction, one sample per user (``user_id`` looked up once per sample) whose length is the
    user's interactions. ``max_len`` keeps each user's most recent ``max_len`` items (by the time
    column, else file order), through :func:`parquet_histories` (bounded memory). Memory otherwise:
    one record batch plus int64 counts per item id and per user id (8 bytes x the largest id)."""
    path = Path(path)
    limits = table_limits(num_rows)
    if max_len is not None:
        max_len = check_max_len(max_len)
        histories = parquet_histories(path, columns, max_len=max_len, limits=limits)
        item_counts, sample_user, totals = history_counts(histories)
    else:
        _check_schema(open_parquet(path), path, columns)  # the time column too, though it is not read
        rows = parquet_chunks(path, dataclasses.replace(columns, time=None), limits)
        item_counts, sample_user, totals = interaction_counts(rows, unit_counts=columns.count is None)
    parsed = Parsed(
        source=str(path),
        counts={ITEM_TABLE: item_counts},
        num_rows={ITEM_TABLE: table_size(ITEM_TABLE, item_counts, limits)},
        sample_user=sample_user,  # one sample per user (merged with other inputs' at assembly)
        lengths={ITEM_TABLE: totals},
        per_sample_table=USER_TABLE,
    )
    if USER_TABLE in limits:
        parsed.num_rows[USER_TABLE] = limits[USER_TABLE]
    return parsed


# --------------------------------------------------------------------------------------- histories


def _record_dtype(columns: ParquetColumns, limits: Mapping[str, int]) -> np.dtype:
    """One stored row: ids as uint32 when every id fits (the default limit), else int64."""
    small = all(limits.get(t, MAX_ID) <= 2**32 for t in (USER_TABLE, ITEM_TABLE))
    ids = np.uint32 if small else np.int64
    fields = [("user", ids), ("item", ids)]
    if columns.count is not None:
        fields.append(("count", np.int64))
    if columns.time is not None:
        fields.append(("time", np.int64))
    return np.dtype(fields)


def _records(chunk: LogChunk, dtype: np.dtype) -> np.ndarray:
    rec = np.empty(chunk.users.size, dtype=dtype)
    rec["user"], rec["item"] = chunk.users, chunk.items
    if "count" in dtype.names:
        rec["count"] = chunk.counts
    if "time" in dtype.names:
        rec["time"] = chunk.times
    return rec


def _partition_of(users: np.ndarray, parts: int) -> np.ndarray:
    """uint16[L]: the partition (0 .. parts-1) of each user id, by a multiplicative hash."""
    h = (users.astype(np.uint64) * _HASH) >> np.uint64(32)
    return (h % np.uint64(parts)).astype(np.uint16)


def _histories(rec: np.ndarray, max_len: int | None) -> Sequences:
    """The histories of the rows ``rec`` (in file order): sorted by (user, time, file order), each row's
    item ``count`` times, only each user's last ``max_len`` items when given."""
    if "time" in rec.dtype.names:
        order = np.lexsort((rec["time"], rec["user"]))  # stable: ties keep file order
    else:
        order = np.argsort(rec["user"], kind="stable")
    users = rec["user"][order].astype(np.int64)
    items = rec["item"][order].astype(np.int64)
    counts = rec["count"][order] if "count" in rec.dtype.names else None
    del order
    if max_len is not None and users.size:
        lengths = np.ones(users.size, dtype=np.int64) if counts is None else counts
        total = np.cumsum(lengths)  # users are sorted: each user's rows are one run
        last = np.append(np.flatnonzero(users[1:] != users[:-1]), users.size - 1)
        run = np.cumsum(np.append(0, users[1:] != users[:-1]))
        after = total[last][run] - total  # the user's interactions on later rows
        counts = np.clip(max_len - after, 0, lengths)
    if counts is None:
        return sequences_from_lines(users, np.ones(users.size, dtype=np.int64), items)
    return sequences_from_lines(users, counts, np.repeat(items, counts))


def parquet_histories(
    path: str | Path,
    columns: ParquetColumns = ParquetColumns(),
    max_len: int | None = None,
    limits: Mapping[str, int] | None = None,
    memory_bytes: int = MEMORY_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[Sequences]:
    """Every user's history in a Parquet log of any size and row order, in bounded memory.

    Items are in time order (the time column, else file order; ties by file order); a row with count
    ``c`` gives ``c`` copies of its item (count 0: none; a user with only such rows has an empty
    history); ``max_len`` keeps each user's last ``max_len`` items. Yields one :class:`Sequences` per
    partition of users (ascending within it); every user appears in exactly one.

    Args:
        path: the Parquet file.
        columns: its column names.
        max_len: keep only each user's most recent ``max_len`` items.
        limits: table sizes ``{"user_id": rows, "item_id": rows}``; ids at or past them are errors.
        memory_bytes: bytes one partition may take while it is sorted (~ rows x (record + 80 B));
            a file that fits is sorted in memory, else users are hashed into P partitions spilled to
            binary files in a temporary folder (``$TMPDIR``; rows x 16-32 bytes), removed at the end
            (P is at most ``MAX_PARTITIONS``: past ~2 x 10^10 rows a partition outgrows the bound).
        progress: called with ``(rows read, rows in the file)`` after each row group of pass 1 (each
            record batch, when a row group is larger than one batch).
    """
    path = Path(path)
    limits = table_limits(limits)
    if max_len is not None:
        max_len = check_max_len(max_len)
    if not isinstance(memory_bytes, (int, np.integer)) or memory_bytes <= 0:
        raise ConfigError(f"memory_bytes: must be a positive integer, got {memory_bytes!r}")
    pf = open_parquet(path)
    _check_schema(pf, path, columns)
    total = int(pf.metadata.num_rows)
    dtype = _record_dtype(columns, limits)
    row_bytes = dtype.itemsize + SORT_BYTES_PER_ROW
    parts = min(max(math.ceil(total * row_bytes / memory_bytes), 1), MAX_PARTITIONS, max(total, 1))
    batch_rows = int(min(max(memory_bytes // (4 * row_bytes), 1024), BATCH_ROWS))
    chunks = parquet_chunks(path, columns, limits, batch_rows)
    if parts == 1:
        rec = np.empty(total, dtype=dtype)
        done = 0
        for chunk in chunks:
            rec[done : done + chunk.users.size] = _records(chunk, dtype)
            done += chunk.users.size
            if progress is not None:
                progress(done, total)
        yield _histories(rec, max_len)
        return
    with tempfile.TemporaryDirectory(prefix="flexshard-parquet-") as tmp:
        files = [Path(tmp) / f"part-{p:04d}.bin" for p in range(parts)]
        done = 0
        for chunk in chunks:
            part = _partition_of(chunk.users, parts)
            order = np.argsort(part, kind="stable")  # file order kept inside each partition
            rec = _records(chunk, dtype)[order]
            bounds = block_bounds(np.bincount(part, minlength=parts))
            for p in np.flatnonzero(np.diff(bounds)):
                with open(files[p], "ab") as fh:
                    rec[bounds[p] : bounds[p + 1]].tofile(fh)
            done += chunk.users.size
            if progress is not None:
                progress(done, total)
        del chunk, part, order, rec
        for file in files:
            if not file.exists():
                continue
            rec = np.fromfile(file, dtype=dtype)
            os.unlink(file)
            yield _histories(rec, max_len)
            del rec


# ------------------------------------------------------------------------------------------ writing


class ParquetLogWriter:
    """Append interaction rows to a Parquet log, one row group per :meth:`write` call (int64 columns
    ``user``, ``item``, and ``time`` / ``count`` when given). ``with ParquetLogWriter(path) as w: ...``"""

    def __init__(self, path: str | Path, time: bool = False, count: bool = False) -> None:
        names = ["user", "item"] + ["time"] * time + ["count"] * count
        self.schema = pa.schema([(n, pa.int64()) for n in names])
        self._writer = pq.ParquetWriter(str(path), self.schema)

    def write(
        self,
        users: np.ndarray,
        items: np.ndarray,
        times: np.ndarray | None = None,
        counts: np.ndarray | None = None,
    ) -> None:
        """Append rows (equal-length integer arrays) as one row group."""
        given = {"user": users, "item": items, "time": times, "count": counts}
        arrays = []
        for name in self.schema.names:
            if given[name] is None:
                raise ConfigError(f"{name}: this log has a {name!r} column; pass its values")
            arrays.append(pa.array(np.asarray(given[name], dtype=np.int64)))
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> ParquetLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_parquet_log(
    path: str | Path,
    users: np.ndarray,
    items: np.ndarray,
    times: np.ndarray | None = None,
    counts: np.ndarray | None = None,
    row_group_rows: int = 1_000_000,
) -> None:
    """Write an interaction log (int64 columns ``user``, ``item``, optional ``time`` and ``count``) in
    row groups of ``row_group_rows`` rows."""
    n = int(np.asarray(users).size)
    for name, arr in (("items", items), ("times", times), ("counts", counts)):
        if arr is not None and np.asarray(arr).size != n:
            raise ConfigError(f"{name}: {np.asarray(arr).size} values for {n} users")
    with ParquetLogWriter(path, time=times is not None, count=counts is not None) as w:
        for s in range(0, max(n, 1), row_group_rows):
            part = slice(s, s + row_group_rows)
            w.write(
                np.asarray(users)[part],
                np.asarray(items)[part],
                None if times is None else np.asarray(times)[part],
                None if counts is None else np.asarray(counts)[part],
            )
