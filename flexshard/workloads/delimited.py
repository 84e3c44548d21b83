"""Delimited interaction files (comma, tab or semicolon separated) read by their header with ``pyarrow.csv``.

One row is one interaction (or ``count`` of them). The first line decides the layout (:func:`sniff`):

* a **header** when none of its fields is a number: it names the columns. Recognised names (any case;
  spaces, ``_`` and ``-`` ignored) are in ``RECOGNISED``: ``user`` / ``user_id`` / ``customer_id`` ...,
  ``item`` / ``item_id`` / ``product_id`` / ``asin`` ..., ``timestamp`` / ``time`` / ``ts`` / ``date``
  ..., ``count`` / ``quantity`` / ``plays`` .... A ``rating`` or ``score`` column is not a count and is
  not read (each rated item is one interaction). ``--user-col/--item-col/--time-col/--count-col``
  (:class:`~flexshard.workloads.parquet.ParquetColumns`) name columns explicitly and win over the names.
  Other columns are ignored. Quoted fields follow CSV rules.
* **no header** (a field is a number): columns by position, ``user,item`` or ``user,item,count``, with
  integer ids (string ids need a header). A
  headerless comma file of three columns is parsed by the numpy parser of ``sequences.csv_chunks``
  (``repeat-consumption-uci``; errors name the line); every other layout by ``pyarrow.csv``.

Ids: a column of integers is taken as row ids (non-negative, below ``MAX_ID`` or the declared table
size); a column of strings (product codes, hashes) is mapped to dense rows through a
:class:`~flexshard.workloads.vocabulary.Vocabulary` (first-seen order). Histories
(:mod:`~flexshard.workloads.delimited_reads`): with a time column, each user's rows in time order (ties
in file order); without one, in file order, and :meth:`Layout.note` says so. Files are streamed in
blocks of ``BLOCK_BYTES``; no Python code runs per row or per id.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from core.errors import ConfigError, DataError

from .parquet import LogChunk, ParquetColumns
from .parsed import (
    ITEM_TABLE,
    MAX_ID,
    USER_TABLE,
)
from .paths import check_file
from .vocabulary import Vocabulary

BLOCK_BYTES = 1 << 24  # 16 MiB of text per block (~1M rows; the first block fixes the column types)
MAX_COUNT = 2**62  # a count at or past it is refused (int64 sums of counts must not overflow)
DELIMITERS = {"\t": "tab", ",": "comma", ";": "semicolon"}
ROLES = ("user", "item", "time", "count")
TABLE_OF = {"user": USER_TABLE, "item": ITEM_TABLE}
RECOGNISED = {
    "user": ("user", "userid", "uid", "useridx", "customer", "customerid", "visitorid", "reviewerid",
             "memberid", "accountid", "sessionid", "session"),
    "item": ("item", "itemid", "iid", "itemidx", "product", "productid", "asin", "sku", "movieid",
             "trackid", "songid", "artistid", "businessid", "articleid", "videoid", "poiid", "locationid"),
    "time": ("timestamp", "time", "ts", "datetime", "date", "eventtime", "unixtime", "unixreviewtime",
             "createdat", "timestamputc"),
    "count": ("count", "counts", "cnt", "quantity", "qty", "plays", "playcount", "frequency", "freq",
              "clicks", "numplays"),
}  # fmt: skip
NOT_COUNTS = ("rating", "ratings", "score", "stars", "label", "weight")


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


@dataclass(frozen=True)
class Layout:
    """How one delimited file is read: delimiter, header, and the column of each role."""

    path: Path
    delimiter: str
    header: bool
    names: tuple[str, ...]  # the header's column names, or user,item[,count] by position
    roles: tuple[tuple[str, str], ...]  # (role, column name) of the columns read, in ROLES order
    legacy: bool  # headerless comma user,item,count: the numpy parser (sequences.csv_chunks)
    header_lines: int = 0  # lines up to and including the header (blank lines before it too)

    def column(self, role: str) -> str | None:
        return dict(self.roles).get(role)

    def note(self) -> str | None:
        """The line a reader shows when the file has no time order (None when it has a time column)."""
        if self.column("time") is not None:
            return None
        return (
            f"{self.path} has no time column: each user's history is in file order (rows sorted by user "
            "or item id are not sequences; name a timestamp column to order them)"
        )


def _first_line(path: Path) -> tuple[str, int]:
    """The first non-blank line (BOM and quotes kept) and its line number; DataError for an empty file."""
    with open(check_file(path), "rb") as fh:
        head = fh.read(1 << 16)
    if head[:4] == b"PAR1":
        raise DataError(f"{path}: a Parquet file, not delimited text")
    text = head.lstrip(b"\xef\xbb\xbf").decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            return line.strip("\r\n"), number
    raise DataError(f"{path}: empty file")


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def sniff(path: str | Path, columns: ParquetColumns | None = None) -> Layout:
    """The layout of a delimited file from its first line and the column flags (see the module)."""
    path = Path(path)
    columns = columns or ParquetColumns()
    line, number = _first_line(path)
    delimiter = next((d for d in DELIMITERS if d in line), None)
    if delimiter is None:
        raise DataError(
            f"{path}:{number}: no comma, tab or semicolon in the first line {line[:40]!r}; a space-separated "
            "file is read as 'user item item ...' lines (--format seq)"
        )
    fields = [f.strip().strip('"').strip() for f in line.split(delimiter)]
    explicit = {
        role: name
        for role, name in (("user", columns.user), ("item", columns.item), ("time", columns.time),
                           ("count", columns.count))
        if name is not None and name != getattr(ParquetColumns(), role)
    }  # fmt: skip
    if any(_is_number(f) for f in fields):  # no header: columns by position
        if explicit:
            flag = next(iter(explicit))
            raise ConfigError(f"--{flag}-col: {path} has no header line naming its columns")
        if len(fields) not in (2, 3):
            raise DataError(
                f"{path}:{number}: {len(fields)} {DELIMITERS[delimiter]}-separated fields and no header: "
                "name the columns in a first line (user, item, and optionally timestamp and count)"
            )
        names = ("user", "item", "count")[: len(fields)]
        legacy = delimiter == "," and len(fields) == 3
        return Layout(path, delimiter, False, names, tuple((n, n) for n in names), legacy)
    if len(set(fields)) != len(fields):
        dup = next(f for f in fields if fields.count(f) > 1)
        raise DataError(f"{path}:{number}: the header names column {dup!r} twice")
    roles = []
    for role in ROLES:
        if role in explicit:
            if explicit[role] not in fields:
                raise DataError(
                    f"{path}: no column {explicit[role]!r} (--{role}-col); the header has {', '.join(fields)}"
                )
            roles.append((role, explicit[role]))
            continue
        found = [f for f in fields if _key(f) in RECOGNISED[role]]
        if len(found) > 1:
            raise DataError(
                f"{path}:{number}: columns {' and '.join(map(repr, found))} both name the {role}; "
                f"choose one with --{role}-col"
            )
        if found:
            roles.append((role, found[0]))
        elif role in ("user", "item"):
            raise DataError(
                f"{path}:{number}: no {role} column in the header {', '.join(fields)!r} (recognised names: "
                f"{', '.join(RECOGNISED[role][:6])} ...; or --{role}-col NAME; a file of string ids needs "
                "a header line)"
            )
    return Layout(path, delimiter, True, tuple(fields), tuple(roles), False, number)


# --------------------------------------------------------------------------------------- reading


def _bad(path: Path, row: int, column: str, value: object, problem: str) -> DataError:
    return DataError(f"{path}: row {row}: column {column!r} value {value}: {problem}")


def _first_bad(mask: np.ndarray | pa.Array) -> int:
    mask = mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array) else mask
    return int(np.argmax(mask))


def _ids(
    col: pa.Array, role: str, layout: Layout, vocab: Vocabulary, limits: Mapping[str, int], row0: int
) -> np.ndarray:
    """A user or item column as int64 row ids: integers as given, strings through the vocabulary."""
    path, name, table = layout.path, str(layout.column(role)), TABLE_OF[role]
    if col.null_count:
        raise _bad(path, row0 + _first_bad(col.is_null()) + 1, name, "''", "missing id")
    limit = limits.get(table)
    if not layout.header and not pa.types.is_integer(col.type):
        k = _first_bad(pc.invert(pc.match_substring_regex(col.cast(pa.string()), r"^[0-9]+$")))
        raise _bad(
            path, row0 + k + 1, name, repr(col[k].as_py()), "not an integer id (string ids need a header)"
        )
    if pa.types.is_integer(col.type) and table not in vocab:
        ids = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        bad = (ids < 0) | (ids >= (MAX_ID if limit is None else limit))
        if bad.any():
            k = _first_bad(bad)
            problem = (
                "ids < 0 are not allowed"
                if ids[k] < 0
                else f"ids outside the table ({table!r} has num_rows {limit})"
                if limit is not None
                else f"ids of {MAX_ID:,} and above need remapping to dense ids (or an explicit num_rows)"
            )
            raise _bad(path, row0 + k + 1, name, int(ids[k]), problem)
        vocab.integer.add(table)
        return ids
    if not (
        pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_integer(col.type)
    ):
        raise DataError(
            f"{path}: column {name!r} ({role} ids) holds {col.type} values; ids are integers or strings"
        )
    if table in vocab.integer:
        raise DataError(
            f"{path}: column {name!r} holds string ids, an earlier input integer {role} ids; read them apart"
        )
    ids = vocab.encode(table, col, f"{path}: column {name!r}")
    if limit is not None and ids.size and int(ids.max()) >= limit:
        raise DataError(
            f"{path}: column {name!r}: more distinct {role} ids than num_rows {limit} of {table!r}"
        )
    return ids


def _counts(col: pa.Array, layout: Layout, row0: int) -> np.ndarray:
    """The count column as int64 (whole numbers >= 0, below ``MAX_COUNT``)."""
    path, name = layout.path, str(layout.column("count"))
    if col.null_count:
        raise _bad(path, row0 + _first_bad(col.is_null()) + 1, name, "''", "missing count")
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        k = _first_bad(pc.invert(pc.match_substring_regex(col.cast(pa.string()), r"^\s*[-+0-9.eE]+\s*$")))
        raise _bad(path, row0 + k + 1, name, repr(col[k].as_py()), "not a number")
    values = col.to_numpy(zero_copy_only=False)
    as_float = values.astype(np.float64)
    problems = (
        (np.isnan(as_float), "NaN count"),
        (np.isinf(as_float), "infinite count"),
        (as_float < 0, "negative count"),
        (as_float >= MAX_COUNT, f"count past the largest, {MAX_COUNT:,}"),
        (as_float != np.floor(as_float), "counts must be whole numbers"),
    )
    for mask, problem in problems:
        if mask.any():
            k = _first_bad(mask)
            raise _bad(path, row0 + k + 1, name, values[k], problem)
    return values.astype(np.int64)


def _times(col: pa.Array, layout: Layout, row0: int) -> np.ndarray:
    """The time column as int64 (integers; timestamps and dates as their value) or float64 (decimals)."""
    path, name = layout.path, str(layout.column("time"))
    if col.null_count:
        raise _bad(path, row0 + _first_bad(col.is_null()) + 1, name, "''", "missing time")
    kind = col.type
    if pa.types.is_date32(kind):
        col = col.cast(pa.int32())
    elif pa.types.is_timestamp(kind) or pa.types.is_date64(kind):
        col = col.cast(pa.int64())
    elif not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise _bad(path, row0 + 1, name, repr(col[0].as_py()), "not a number, a date or a timestamp")
    values = col.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        k = _first_bad(~np.isfinite(values))
        raise _bad(path, row0 + k + 1, name, values[k], "not a number, a date or a timestamp")
    return values.astype(np.float64 if values.dtype.kind == "f" else np.int64, copy=False)


def chunks(
    layout: Layout,
    vocab: Vocabulary,
    limits: Mapping[str, int] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> Iterator[LogChunk]:
    """Stream a (non-legacy) delimited file block by block: user and item row ids, counts (1 without a
    count column), times (None without a time column) and each row's index (0-based, after the header)."""
    path, limits = layout.path, limits or {}
    # the header's names as sniff stripped them (spaces, quotes, a BOM): its line is skipped
    read = pacsv.ReadOptions(
        block_size=block_bytes, column_names=list(layout.names), skip_rows=layout.header_lines
    )
    parse = pacsv.ParseOptions(delimiter=layout.delimiter)
    convert = pacsv.ConvertOptions(
        include_columns=[name for _, name in layout.roles],
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=True,
    )
    row0, total = 0, 0
    try:
        reader = pacsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
        for batch in reader:
            n = batch.num_rows
            if not n:
                continue
            col = {role: batch.column(name) for role, name in layout.roles}
            yield LogChunk(
                users=_ids(col["user"], "user", layout, vocab, limits, row0),
                items=_ids(col["item"], "item", layout, vocab, limits, row0),
                counts=_counts(col["count"], layout, row0) if "count" in col else np.ones(n, np.int64),
                times=_times(col["time"], layout, row0) if "time" in col else None,
                rows=np.arange(row0, row0 + n, dtype=np.int64),
            )
            row0 += n
            total += n
    except pa.ArrowException as exc:
        message = str(exc).splitlines()[0]
        raise DataError(f"{path}: cannot parse the rows after row {row0} ({message})") from None
    if total == 0:
        raise DataError(f"{path}: no rows after the header")
