"""Per-row statistics computed elsewhere (a Spark, Dask or DuckDB job over a log too big for one machine),
read from Parquet into a workload and its hotness orders.

One record per (table, row) that was looked up, with these columns (any order, other columns ignored):

* ``table`` (string): the table's name; a file may hold several tables;
* ``row`` (integer): the row id, ``0 <= row < num_rows``;
* ``lookups`` (integer or float, ``>= 0``): the row's lookups over all the counted samples;
* ``samples_touched`` (integer, optional): how many of the counted samples look the row up at least once
  (``<= samples``, ``<= lookups``, and ``>= 1`` when ``lookups > 0``);
* ``samples`` (integer, ``> 0``): the number of samples counted for the table, the same on every record
  of the table.

Rows with no record have no lookups. A table has ``max row + 1`` rows unless ``num_rows`` names its size.
Tables are sorted by name (whatever order the job wrote its records in, the workload is the same).
A (table, row) pair given twice is an error (it is not summed: aggregate in the job). Several files
(e.g. the part files of a Spark job) are one data set: a table may span them, but all of a table's
records are in files with ``samples_touched`` or all in files without it.

Per table: the histogram and the hotness order come from ``lookups`` (ids by lookups descending, ties by
id, as :func:`~flexshard.workloads.readers.hotness_order`), ids per sample is ``sum(lookups) / samples``.
With ``samples_touched`` and a :class:`~flexshard.workloads.touch.Sampling` (how the job formed a sample,
recorded in plans and checked by ``train``), each row's per-sample touch probability is ``q =
samples_touched / samples`` and its lookups per sample ``m = lookups / samples``, kept as the same
compact :class:`~solvers.types.TouchProfile` as rates measured from histories (``touch_profile``, with
its stated bucket error). Without them the table keeps the independent-draw model.

Files are streamed record batch by record batch (numpy only, no Python code per record). While reading,
memory is one batch plus dense arrays per table (about 17 bytes per row); building the tables takes
more, as for any other input: a 10^7-row table took 0.7 GiB peak RSS with lookups only and 1.8 GiB with
its touch profile (whose per-row arrays, as for histories, dominate). Bad content raises a
one-line :class:`~core.errors.DataError` naming the file, the record, the table, the column and the
value; a bad argument raises :class:`~core.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.arrays import block_bounds
from core.errors import ConfigError, DataError
from solvers.types import RowHistogram, TableSpec, Workload

from .measured import measured_table
from .parquet import BATCH_ROWS, open_parquet, record_batches
from .parsed import MAX_ID, table_limits
from .readers import DEFAULT_DIM, PARQUET_SUFFIXES, hotness_order
from .synthetic import DEFAULT_BATCH_SIZE_PER_GPU
from .touch import Sampling

TABLE, ROW, LOOKUPS, TOUCHED, SAMPLES = "table", "row", "lookups", "samples_touched", "samples"
REQUIRED = (TABLE, ROW, LOOKUPS, SAMPLES)
SPEC = "table, row, lookups, samples and optionally samples_touched"
MAX_COUNT = 2**62  # integer lookups and samples at or above this are rejected (int64 sums)
DUPLICATE = "appears twice for this table; pairs are not summed (aggregate in the job: GROUP BY table, row)"


@dataclass
class _Table:
    """One table's records so far, as dense arrays indexed by row id (grown geometrically)."""

    lookups: np.ndarray  # int64 or float64
    touched: np.ndarray | None  # int64, or None: its files have no samples_touched column
    seen: np.ndarray  # bool: a record was read for the row
    samples: int
    first: str  # where ``samples`` was first read (for the error when a record disagrees)
    top: int = 0  # largest row id + 1


def _magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"PAR1"
    except OSError:
        return False


def _files(path: Path) -> list[Path]:
    """A Parquet file -> itself; a folder -> its ``.parquet`` / ``.pq`` files (a Spark job's output)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in PARQUET_SUFFIXES)
    return [path] if path.is_file() and (path.suffix.lower() in PARQUET_SUFFIXES or _magic(path)) else []


def is_row_stats(path: str | Path) -> bool:
    """Whether a Parquet file's columns include ``table``, ``row`` and ``lookups`` (its footer only)."""
    names = set(open_parquet(Path(path)).schema_arrow.names)
    return {TABLE, ROW, LOOKUPS} <= names


def row_stats_inputs(inputs: Sequence[str | Path], fmt: str = "auto") -> list[Path] | None:
    """The files to read when ``inputs`` are row-statistics files, else None (interaction data).

    ``fmt == "rows"``: they must be (Parquet files, or folders of them); ``"auto"``: they are when every
    input is Parquet and every file has the columns ``table``, ``row`` and ``lookups``; any other
    ``fmt``: never. Row statistics mixed with interaction logs are a ConfigError.
    """
    if fmt not in ("auto", "rows"):
        return None
    found: list[Path] = []
    for item in map(Path, inputs):
        files = _files(item)
        if not files:
            if fmt == "auto":
                return None
            what = "no Parquet files (.parquet, .pq) in it" if item.is_dir() else "not a Parquet file"
            raise DataError(f"{item}: {what if item.exists() else 'no such file or folder'}")
        found.extend(files)
    if fmt == "rows":
        return found
    kinds = [is_row_stats(f) for f in found]
    if not any(kinds):
        return None
    if not all(kinds):
        log = found[kinds.index(False)]
        raise ConfigError(
            f"inputs: {log} is an interaction log and {found[kinds.index(True)]} holds row statistics "
            f"({TABLE}, {ROW}, {LOOKUPS}); pass one kind at a time"
        )
    return found


def _schema(pf: pq.ParquetFile, path: Path) -> bool:
    """Check the columns' presence and types; whether the file has ``samples_touched``."""
    schema = pf.schema_arrow
    for name in REQUIRED:
        if schema.get_field_index(name) < 0:
            raise DataError(
                f"{path}: no column {name!r} (row statistics have columns {SPEC}); the file has columns "
                f"{', '.join(schema.names) or '(none)'}"
            )
    has_touched = schema.get_field_index(TOUCHED) >= 0
    for name in (*REQUIRED, TOUCHED) if has_touched else REQUIRED:
        kind = schema.field(name).type
        value = kind.value_type if pa.types.is_dictionary(kind) else kind
        if name == TABLE:
            ok, expected = pa.types.is_string(value) or pa.types.is_large_string(value), "strings"
        elif name == LOOKUPS:
            ok, expected = pa.types.is_integer(kind) or pa.types.is_floating(kind), "integers or floats"
        else:
            ok, expected = pa.types.is_integer(kind), "integers"
        if not ok:
            raise DataError(f"{path}: column {name!r} has type {kind}; expected {expected}")
    return has_touched


def _bad(path: Path, record: int, table: str | None, column: str, value: object, problem: str) -> DataError:
    where = f"{path}: record {record}: " + ("" if table is None else f"table {table!r}: ")
    return DataError(f"{where}column {column!r} value {value}: {problem}")


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def _numpy(
    col: pa.Array, path: Path, name: str, rec0: int, tables: list[str], codes: np.ndarray
) -> np.ndarray:
    """One column of a batch as numpy; a null is an error naming its record's table."""
    if col.null_count:
        k = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise _bad(path, rec0 + k, tables[codes[k]], name, "null", "missing values are not allowed")
    return col.to_numpy(zero_copy_only=False)


def _table_codes(col: pa.Array, path: Path, rec0: int) -> tuple[np.ndarray, list[str]]:
    """int64 code of each record's table and the names the codes index (the batch's distinct tables)."""
    if col.null_count:
        k = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise _bad(path, rec0 + k, None, TABLE, "null", "missing values are not allowed")
    enc = col if pa.types.is_dictionary(col.type) else pc.dictionary_encode(col)
    names = [str(n) for n in enc.dictionary.to_pylist()]
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    for code, name in enumerate(names):
        if not name and (codes == code).any():
            raise _bad(path, rec0 + int(np.argmax(codes == code)), None, TABLE, "''", "empty table name")
    return codes, names


@dataclass(frozen=True)
class _Records:
    """One table's records of one batch, as columns (``records``: their indices in the file)."""

    path: Path
    table: str
    records: np.ndarray
    rows: np.ndarray
    lookups: np.ndarray
    samples: np.ndarray
    touched: np.ndarray | None
    limit: int | None


def _check(r: _Records) -> None:
    """Every value of one table's records in one batch."""

    def fail(k: int | None, column: str, value: object, problem: str) -> None:
        if k is not None:
            raise _bad(r.path, int(r.records[k]), r.table, column, value, problem)

    k = _first(r.rows < 0)
    fail(k, ROW, r.rows[k] if k is not None else 0, "row ids must be >= 0")
    k = _first(r.rows >= (MAX_ID if r.limit is None else r.limit))
    if k is not None:
        problem = (
            f"row ids of {MAX_ID:,} and above need remapping to dense ids (or an explicit num_rows)"
            if r.limit is None
            else f"outside the table ({r.table!r} has num_rows {r.limit})"
        )
        fail(k, ROW, r.rows[k], problem)
    if r.lookups.dtype.kind == "f":
        k = _first(~np.isfinite(r.lookups))
        fail(k, LOOKUPS, r.lookups[k] if k is not None else 0, "must be a finite number")
    k = _first(r.lookups < 0)
    fail(k, LOOKUPS, r.lookups[k] if k is not None else 0, "must be >= 0")
    k = _first(r.lookups >= MAX_COUNT) if r.lookups.dtype.kind in "iu" else None
    fail(k, LOOKUPS, r.lookups[k] if k is not None else 0, "too large")
    k = _first((r.samples <= 0) | (r.samples >= MAX_COUNT))
    fail(k, SAMPLES, r.samples[k] if k is not None else 0, "must be a positive integer (below 2^62)")
    if r.touched is not None:
        k = _first(r.touched < 0)
        fail(k, TOUCHED, r.touched[k] if k is not None else 0, "must be >= 0")
        k = _first(r.touched > r.samples)
        fail(k, TOUCHED, r.touched[k] if k is not None else 0, f"more than the samples {r.samples[k or 0]}")
        k = _first(r.touched > r.lookups)
        fail(
            k,
            TOUCHED,
            r.touched[k] if k is not None else 0,
            f"more than the row's lookups {r.lookups[k or 0]} (a sample that touches a row looks it up)",
        )
        k = _first((r.touched == 0) & (r.lookups > 0))
        fail(k, TOUCHED, 0, f"the row has lookups {r.lookups[k or 0]}, so some sample touches it")
    ordered = np.argsort(r.rows, kind="stable")
    repeat = _first(r.rows[ordered][1:] == r.rows[ordered][:-1])
    if repeat is not None:
        fail(int(ordered[repeat + 1]), ROW, r.rows[ordered[repeat + 1]], DUPLICATE)


def _int64(a: np.ndarray) -> np.ndarray:
    """An integer column as int64 (unsigned values past int64 clipped to ``MAX_COUNT``, which every
    check rejects, instead of wrapping negative)."""
    return (np.minimum(a, MAX_COUNT) if a.dtype.kind == "u" else a).astype(np.int64)


def _grow(a: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=a.dtype)
    out[: a.size] = a
    return out


def _add(acc: _Table, r: _Records) -> None:
    """Check one table's records of one batch against what was read before, then store them."""
    k = _first(r.samples != acc.samples)
    if k is not None:
        raise _bad(
            r.path,
            int(r.records[k]),
            r.table,
            SAMPLES,
            r.samples[k],
            f"differs from the table's samples {acc.samples} ({acc.first}); every record of a table "
            "carries the same samples",
        )
    if (r.touched is None) != (acc.touched is None):
        raise DataError(
            f"{r.path}: table {r.table!r}: some of its records have a {TOUCHED!r} column and some do not "
            f"(the files differ); give it for all of a table's records or for none"
        )
    top = int(r.rows.max()) + 1
    if top > acc.seen.size:  # geometric growth: ids arriving in ascending order copy O(rows) in all
        size = r.limit if r.limit is not None else min(max(top, 2 * acc.seen.size), MAX_ID)
        acc.lookups, acc.seen = _grow(acc.lookups, size), _grow(acc.seen, size)
        if acc.touched is not None:
            acc.touched = _grow(acc.touched, size)
    k = _first(acc.seen[r.rows])
    if k is not None:
        raise _bad(r.path, int(r.records[k]), r.table, ROW, r.rows[k], DUPLICATE)
    acc.seen[r.rows] = True
    acc.lookups[r.rows] = r.lookups
    if acc.touched is not None and r.touched is not None:
        acc.touched[r.rows] = r.touched
    acc.top = max(acc.top, top)


def _read(path: Path, accs: dict[str, _Table], limits: Mapping[str, int], batch_rows: int) -> None:
    """Stream one file into ``accs``."""
    pf = open_parquet(path)
    has_touched = _schema(pf, path)
    float_lookups = pa.types.is_floating(pf.schema_arrow.field(LOOKUPS).type)
    columns = [TABLE, ROW, LOOKUPS, SAMPLES] + [TOUCHED] * has_touched
    done = 0  # records read
    for rec0, batch in record_batches(pf, path, columns, batch_rows, "records"):
        done = rec0 + batch.num_rows
        codes, names = _table_codes(batch.column(TABLE), path, rec0)
        got = {c: _numpy(batch.column(c), path, c, rec0, names, codes) for c in columns[1:]}
        order = np.argsort(codes, kind="stable")
        bounds = block_bounds(np.bincount(codes, minlength=len(names)))
        for code in np.flatnonzero(np.diff(bounds)):
            table = names[code]
            idx = order[bounds[code] : bounds[code + 1]]
            rows, samples = _int64(got[ROW][idx]), _int64(got[SAMPLES][idx])
            lookups = got[LOOKUPS][idx].astype(np.float64) if float_lookups else _int64(got[LOOKUPS][idx])
            touched = _int64(got[TOUCHED][idx]) if has_touched else None
            records = _Records(path, table, rec0 + idx, rows, lookups, samples, touched, limits.get(table))
            _check(records)
            if table not in accs:
                accs[table] = _Table(
                    lookups=np.zeros(0, dtype=lookups.dtype),
                    touched=np.zeros(0, dtype=np.int64) if has_touched else None,
                    seen=np.zeros(0, dtype=bool),
                    samples=int(samples[0]),
                    first=f"{path}: record {int(rec0 + idx[0])}",
                )
            acc = accs[table]
            if acc.lookups.dtype != lookups.dtype:  # integer in one file, float in another
                acc.lookups = acc.lookups.astype(np.float64)
                records = replace(records, lookups=lookups.astype(np.float64))
            _add(acc, records)
    if done != int(pf.metadata.num_rows):
        raise DataError(f"{path}: read {done} records, the file's metadata says {pf.metadata.num_rows}")


def row_stats_has_touched(paths: Sequence[str | Path]) -> bool:
    """Whether any of the files has a ``samples_touched`` column (their footers only)."""
    return any(open_parquet(Path(p)).schema_arrow.get_field_index(TOUCHED) >= 0 for p in paths)


def read_row_stats(
    paths: str | Path | Sequence[str | Path],
    sampling: Sampling | None = None,
    num_rows: Mapping[str, int] | None = None,
    dim: int = DEFAULT_DIM,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    name: str | None = None,
    batch_rows: int = BATCH_ROWS,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """Read row-statistics Parquet files (see the module docstring) into a workload and hotness orders.

    Args:
        paths: one file, or several files (or folders of them) holding one data set.
        sampling: how the job formed a sample: the tables with ``samples_touched`` get a touch profile
            recorded with ``sampling.describe()``. None: every table keeps the independent-draw model
            (``samples_touched`` is still checked).
        num_rows: explicit table sizes ``{table: rows}``; rows at or past them are errors.
        dim: embedding dimension of every table.
        batch_size_per_gpu: samples per GPU per iteration.
        name: workload name (default: the first input's stem).
        batch_rows: records per batch read.

    Returns:
        ``(workload, orders)``; ``orders[table]`` lists row ids with lookups, hottest first.
    """
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not items:
        raise ConfigError("inputs: no row-statistics file given")
    files = [f for item in items for f in (_files(Path(item)) or [Path(item)])]
    limits = table_limits(num_rows)
    if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim <= 0:
        raise ConfigError(f"dim: must be a positive integer, got {dim!r}")
    if not isinstance(batch_size_per_gpu, (int, np.integer)) or batch_size_per_gpu <= 0:
        raise ConfigError(f"batch_size_per_gpu: must be a positive integer, got {batch_size_per_gpu!r}")
    if sampling is not None and not row_stats_has_touched(files):
        raise ConfigError(
            f"sampling: {sampling.describe()} needs per-row {TOUCHED!r}, and {files[0]} has no such column"
        )
    accs: dict[str, _Table] = {}
    for path in files:
        if not path.exists():
            raise DataError(f"{path}: no such file or folder")
        _read(path, accs, limits, batch_rows)
    unknown = sorted(set(limits) - set(accs))
    if unknown:
        names = ", ".join(sorted(accs)) or "(none)"
        raise ConfigError(f"num_rows: no table named {unknown[0]!r}; tables are {names}")
    tables, orders = [], {}
    for table, acc in sorted(accs.items()):
        n = limits.get(table, max(acc.top, 1))
        counts = _grow(acc.lookups, n)[:n] if acc.lookups.size < n else acc.lookups[:n]
        total = counts.sum()
        if total <= 0:
            raise DataError(f"{files[0]}: table {table!r}: every row has lookups 0 (nothing is looked up)")
        order = hotness_order(counts)
        spec = TableSpec(
            name=table,
            num_rows=n,
            dim=int(dim),
            ids_per_sample=float(total) / acc.samples,
            hist=RowHistogram.from_counts(counts, n),
        )
        if sampling is not None and acc.touched is not None:
            touched = _grow(acc.touched, n)[:n] if acc.touched.size < n else acc.touched[:n]
            q = touched / acc.samples
            m = counts.astype(np.float64) / acc.samples
            spec = measured_table(spec, order, q, m, sampling)
        tables.append(spec)
        orders[table] = order
    if not tables:
        raise DataError(f"{files[0]}: no records")
    label = name or Path(items[0]).stem
    return Workload(name=label, tables=tuple(tables), batch_size_per_gpu=int(batch_size_per_gpu)), orders
