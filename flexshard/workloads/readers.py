"""Read real interaction data into per-table access counts and per-sample lookups.

Formats (``fmt``):

* ``"seq"``: ``user item item ...`` lines (``amazon-yelp-sequences/*.txt``, ``gowalla-lightgcn``
  ``train_reconstructed.txt`` / ``test.txt``), parsed by ``sequences.seq_chunks``: one line per user,
  one line per interaction (``user item``, SASRec's format) or a mix; the lines of a user make one
  sample. Tables ``item_id`` (one lookup per item) and ``user_id`` (one lookup per sample). A
  ``<stem>_item2attributes.json`` beside the file (``{"item": [attr, ...]}``) adds a table
  ``item_attribute``: every item lookup also looks up each *distinct* attribute of its item.
* ``"csv"``: delimited tables (comma, tab or semicolon), read by their header (``delimited.py``: user,
  item and optional time and count columns; string ids through a vocabulary); a headerless
  ``user,item,count`` file (``repeat-consumption-uci``) by the numpy parser. Table ``item_id`` gets
  ``count`` lookups per row (1 without a count column); one sample per user with that user's total
  count as its sequence length; ``user_id`` one lookup per sample.
* ``"recbole"``: RecBole atomic files (``.inter`` plus optional ``.user`` / ``.item``), see
  ``recbole.py``.
* ``"parquet"``: an interaction log in Parquet (user, item, optional time and count columns named by
  ``ParquetColumns``), counted like ``csv``; see ``parquet.py``.

Ids are taken as given (1-based Amazon ids leave row 0 untouched); a table has ``max id + 1`` rows
unless ``num_rows`` names its size. Several inputs are merged: counts add up, and samples of the
same user id (e.g. a train and a test split) merge into one sample. Every table's hotness order
(touched row ids by count descending, ties by id ascending) comes back beside the workload.

Errors: a malformed or missing input raises a one-line ``core.errors.DataError`` naming the file, line,
field and value; a bad argument (``fmt``, ``dim``, ``batch_size_per_gpu``, ``max_len``, ``num_rows``)
raises ``core.errors.ConfigError``. Both are ``InputError``s.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from core.errors import ConfigError, DataError
from solvers.types import RowHistogram, TableSpec, Workload

from ._text import bad_value, grow
from .delimited import sniff
from .delimited_reads import read_delimited
from .parquet import ParquetColumns, read_parquet
from .parsed import (
    ATTRIBUTE_TABLE,
    ITEM_TABLE,
    MAX_ID,
    USER_TABLE,
    Parsed,
    check_max_len,
    table_limits,
    table_size,
)
from .paths import check_file
from .recbole import read_recbole
from .sequences import csv_chunks, items_after, keep_last, seq_chunks
from .synthetic import DEFAULT_BATCH_SIZE_PER_GPU
from .vocabulary import Vocabulary

DEFAULT_DIM = 64
PARQUET_SUFFIXES = (".parquet", ".pq")
FORMATS = ("auto", "seq", "csv", "recbole", "parquet")


# ------------------------------------------------------------------------------------- seq format


def _read_attributes(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(item, attribute)`` pairs, distinct per item, from an ``item2attributes.json``."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise DataError(
            f"{path}: expected a JSON object {{item id: [attribute ids]}}, got {type(data).__name__}"
        )
    if not data:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = list(data.keys())
    values = list(data.values())
    try:
        items = np.array(keys).astype(np.int64)
        lens = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        attrs = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=int(lens.sum()))
    except (TypeError, ValueError, OverflowError):
        bad = next(
            (
                k
                for k, v in data.items()
                if not (k.isdigit() and isinstance(v, list) and all(isinstance(x, int) for x in v))
            ),
            keys[0],
        )
        raise bad_value(
            path, None, "item2attributes", f"{bad}: {data[bad]!r}", "expected item id -> list of int ids"
        ) from None
    for arr, what in ((items, "item id"), (attrs, "attribute id")):
        out = (arr < 0) | (arr >= MAX_ID)
        if out.any():
            value = int(arr[int(np.argmax(out))])
            problem = (
                "ids < 0 are not allowed" if value < 0 else f"ids of {MAX_ID:,} and above need remapping"
            )
            raise bad_value(path, None, what, value, problem)
    owner = np.repeat(items, lens)
    order = np.lexsort((attrs, owner))  # distinct (item, attribute) pairs
    owner, attrs = owner[order], attrs[order]
    keep = np.ones(owner.size, dtype=bool)
    keep[1:] = (owner[1:] != owner[:-1]) | (attrs[1:] != attrs[:-1])
    return owner[keep], attrs[keep]


def _seq_counts(
    path: Path, limits: dict[str, int], nattr: np.ndarray | None, keep: int | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """One streaming pass over a seq file: ``(item counts, user of each line, item lookups of each
    line, attribute lookups of each line (float, when ``nattr`` gives the attributes per item) or
    None, items on each line)``. ``keep``: None (every item), an int (each line's last ``keep``
    items) or int64[lines] (line ``l``'s last ``keep[l]`` items)."""
    item_counts = np.zeros(0, dtype=np.int64)
    users, item_len, attr_len, line_len = [], [], [], []
    done = 0  # lines seen so far (the index into an array ``keep``)
    for chunk in seq_chunks(path, limits):
        n_lines = chunk.users.size
        sample = np.repeat(np.arange(n_lines), chunk.lengths)  # chunk-local line of each item
        items = chunk.items
        if keep is not None:
            recent = np.minimum(chunk.lengths, keep) if isinstance(keep, int) else keep[done : done + n_lines]
            if recent.size != n_lines:
                raise DataError(f"{path}: the file changed while it was read")
            mask = keep_last(chunk.lengths, recent)
            items, sample = items[mask], sample[mask]
        done += n_lines
        if items.size:
            item_counts = grow(item_counts, int(items.max()) + 1)
            item_counts[: int(items.max()) + 1] += np.bincount(items)
        users.append(chunk.users)
        item_len.append(np.bincount(sample, minlength=n_lines))
        line_len.append(chunk.lengths)
        if nattr is not None:
            per_item = grow(nattr, int(items.max()) + 1 if items.size else 0)
            attr_len.append(np.bincount(sample, weights=per_item[items], minlength=n_lines))
    if not users:
        raise DataError(f"{path}: empty file (no user lines)")
    attr = np.concatenate(attr_len) if nattr is not None else None
    return item_counts, np.concatenate(users), np.concatenate(item_len), attr, np.concatenate(line_len)


def read_seq(
    path: str | Path, num_rows: Mapping[str, int] | None = None, max_len: int | None = None
) -> Parsed:
    """Parse a ``user item item ...`` file (one sample per line; see module docstring).

    Streams the file: memory holds per-line and per-row arrays, never all items. ``max_len`` keeps
    each user's most recent items over all its lines of the file (a second pass when a user has
    several lines).
    """
    path = Path(path)
    limits = table_limits(num_rows)
    attr_path = path.with_name(f"{path.stem}_item2attributes.json")
    attr_items = attr_ids = nattr = None
    if attr_path.is_file():
        attr_items, attr_ids = _read_attributes(attr_path)
        if attr_ids.size and ATTRIBUTE_TABLE in limits and attr_ids.max() >= limits[ATTRIBUTE_TABLE]:
            raise bad_value(
                attr_path,
                None,
                ATTRIBUTE_TABLE,
                int(attr_ids.max()),
                f"ids outside the table ({ATTRIBUTE_TABLE!r} has num_rows {limits[ATTRIBUTE_TABLE]})",
            )
        nattr = np.bincount(attr_items) if attr_items.size else np.zeros(0, dtype=np.int64)
    keep = None if max_len is None else check_max_len(max_len)
    item_counts, sample_user, item_len, attr_len, line_len = _seq_counts(path, limits, nattr, keep)
    if keep is not None and np.unique(sample_user).size < sample_user.size:
        # a user on several lines: its most recent items over all of them, not per line
        recent = np.clip(keep - items_after(sample_user, line_len), 0, line_len)
        item_counts, sample_user, item_len, attr_len, _ = _seq_counts(path, limits, nattr, recent)
    counts = {ITEM_TABLE: item_counts}
    lengths = {ITEM_TABLE: item_len}
    if attr_items is not None and attr_ids is not None and attr_len is not None:
        weight = grow(item_counts, int(attr_items.max()) + 1 if attr_items.size else 0)[attr_items]
        size = int(attr_ids.max()) + 1 if attr_ids.size else 0
        counts[ATTRIBUTE_TABLE] = np.rint(np.bincount(attr_ids, weights=weight, minlength=size)).astype(
            np.int64
        )
        lengths[ATTRIBUTE_TABLE] = np.rint(attr_len).astype(np.int64)
    parsed = Parsed(
        source=str(path),
        counts=counts,
        num_rows={t: table_size(t, c, limits) for t, c in counts.items()},
        sample_user=sample_user,
        lengths=lengths,
        per_sample_table=USER_TABLE,
    )
    if USER_TABLE in limits:
        parsed.num_rows[USER_TABLE] = limits[USER_TABLE]
    return parsed


# ------------------------------------------------------------------------------------- csv format


def read_csv(
    path: str | Path,
    num_rows: Mapping[str, int] | None = None,
    max_len: int | None = None,
    columns: ParquetColumns | None = None,
    vocabulary: Vocabulary | None = None,
) -> Parsed:
    """Parse a delimited file by its header (``delimited.py``); a headerless ``user,item,count`` file
    with the numpy parser of ``sequences.csv_chunks`` (see the module)."""
    path = Path(path)
    layout = sniff(path, columns)
    if not layout.legacy:
        return read_delimited(layout, num_rows, max_len, vocabulary)
    if max_len is not None:
        raise ConfigError(
            f"max_len: {path} is a csv count matrix without order; it cannot be truncated to recent ids"
        )
    limits = table_limits(num_rows)
    item_counts = np.zeros(0, dtype=np.int64)
    users, totals = [], []
    for chunk in csv_chunks(path, limits):
        item_counts = grow(item_counts, int(chunk.items.max()) + 1)
        np.add.at(item_counts, chunk.items, chunk.counts)  # exact int64 sums
        users.append(chunk.users)
        totals.append(chunk.counts)
    if not users:
        raise DataError(f"{path}: empty file (no user,item,count lines)")
    counts = {ITEM_TABLE: item_counts}
    parsed = Parsed(
        source=str(path),
        counts=counts,
        num_rows={ITEM_TABLE: table_size(ITEM_TABLE, item_counts, limits)},
        sample_user=np.concatenate(users),  # one "sample" per line; merged by user at assembly
        lengths={ITEM_TABLE: np.concatenate(totals)},
        per_sample_table=USER_TABLE,
    )
    if USER_TABLE in limits:
        parsed.num_rows[USER_TABLE] = limits[USER_TABLE]
    return parsed


# -------------------------------------------------------------------------------------- assembly


def hotness_order(counts: np.ndarray) -> np.ndarray:
    """Touched row ids sorted by count descending, ties by id ascending (int64)."""
    touched = np.flatnonzero(counts > 0)
    return touched[np.argsort(-counts[touched], kind="stable")].astype(np.int64)


def _dims(dim: int | Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    if isinstance(dim, Mapping):
        unknown = sorted(set(dim) - set(names) - {"*"})
        if unknown:
            raise ConfigError(f"dim: no table named {unknown[0]!r}; tables are {', '.join(names)}")
        out = {n: dim.get(n, dim.get("*", DEFAULT_DIM)) for n in names}
    else:
        out = dict.fromkeys(names, dim)
    for n, d in out.items():
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d <= 0:
            raise ConfigError(f"dim: table {n!r} needs a positive integer embedding dimension, got {d!r}")
    return {n: int(d) for n, d in out.items()}


def assemble(
    parts: Sequence[Parsed],
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    name: str | None = None,
    num_rows: Mapping[str, int] | None = None,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """Merge parsed inputs (by table name and user id) into a Workload and hotness orders."""
    if not parts:
        raise ConfigError("inputs: nothing to read")
    if len(parts) > 1 and not all(p.mergeable for p in parts):
        raise ConfigError(
            "inputs: RecBole inputs remap tokens per file and cannot be merged; pass one at a time"
        )
    if not isinstance(batch_size_per_gpu, (int, np.integer)) or batch_size_per_gpu <= 0:
        raise ConfigError(f"batch_size_per_gpu: must be a positive integer, got {batch_size_per_gpu!r}")
    limits = table_limits(num_rows)
    names: list[str] = []
    for p in parts:
        for t in list(p.counts) + ([p.per_sample_table] if p.per_sample_table else []):
            if t not in names:
                names.append(t)
    unknown = sorted(set(limits) - set(names))
    if unknown:
        raise ConfigError(f"num_rows: no table named {unknown[0]!r}; tables are {', '.join(names)}")
    users = np.concatenate([p.sample_user for p in parts])
    merge_users = parts[0].mergeable
    if merge_users:
        uniq, sample_of = np.unique(users, return_inverse=True)
    else:
        uniq, sample_of = users, np.arange(users.size)
    n_samples = int(uniq.size)
    counts: dict[str, np.ndarray] = {}
    lengths: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    offset = 0
    for p in parts:
        s = slice(offset, offset + p.sample_user.size)
        offset += p.sample_user.size
        for t, c in p.counts.items():
            counts[t] = grow(counts.get(t, np.zeros(0, np.int64)), c.size)
            counts[t][: c.size] += c
            lengths.setdefault(t, np.zeros(n_samples, dtype=np.int64))
            np.add.at(lengths[t], sample_of[s], p.lengths[t])  # samples of one user add up
            rows[t] = max(rows.get(t, 0), p.num_rows.get(t, c.size))
    for t in names:
        if t in counts:
            continue
        # a table looked up once per (merged) sample: the user id of every sample
        counts[t] = np.bincount(uniq) if uniq.size else np.zeros(0, np.int64)
        lengths[t] = np.ones(n_samples, dtype=np.int64)
        rows[t] = max([p.num_rows.get(t, 0) for p in parts] + [counts[t].size])
    for t, limit in limits.items():
        if counts[t].size > limit and counts[t][limit:].any():
            raise ConfigError(
                f"num_rows[{t!r}]: {limit} is too small; ids outside the table reach {counts[t].size - 1}"
            )
        rows[t] = limit
    dims = _dims(dim, names)
    tables = []
    orders: dict[str, np.ndarray] = {}
    for t in names:
        c = counts[t]
        total = int(c.sum())
        if total == 0:
            continue  # a table nobody looks up (e.g. a feature with no values)
        n_rows = max(rows[t], int(c.size), 1)
        values, freq = np.unique(lengths[t], return_counts=True)
        tables.append(
            TableSpec(
                name=t,
                num_rows=n_rows,
                dim=dims[t],
                ids_per_sample=total / n_samples,
                hist=RowHistogram.from_counts(c, n_rows),
                length_values=values.astype(np.int64),
                length_probs=freq / n_samples,
            )
        )
        orders[t] = hotness_order(c)
    if not tables:
        raise DataError(f"{parts[0].source}: no lookups found")
    label = name or "+".join(Path(p.source).stem for p in parts)
    return Workload(name=label, tables=tuple(tables), batch_size_per_gpu=int(batch_size_per_gpu)), orders


# ----------------------------------------------------------------------------------- entry point


def detect_format(path: str | Path) -> str:
    """``"seq"``, ``"csv"``, ``"recbole"`` or ``"parquet"`` from the extension, else from the content
    (Parquet's ``PAR1`` magic bytes, then the first line)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".inter", ".user", ".item"):
        return "recbole"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix == ".csv":
        return "csv"
    if suffix == ".json":
        raise ConfigError(
            f"{path}: an attribute file is read with the sequence file beside it; pass that instead"
        )
    if suffix == ".npz":
        raise ConfigError(f"{path}: a stats file; load it with load_stats / --workload, not as raw data")
    try:
        with open(check_file(path), "rb") as fh:
            head = fh.read(1 << 16)
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    if head[:4] == b"PAR1":
        return "parquet"
    first = next((ln for ln in head.splitlines() if ln.strip()), b"")
    if not first:
        raise DataError(f"{path}: empty file")
    if b"\t" in first and b":" in first:
        return "recbole"
    if b"," in first or b"\t" in first or b";" in first:
        return "csv"  # a delimited table, read by its header (delimited.py)
    if all(t.isdigit() for t in first.decode(errors="replace").split()):  # any script's digits: the
        return "seq"  # sequence parser then names a non-ASCII one ('٣') as not an id
    raise DataError(
        f"{path}: unknown format (first line {first[:40].decode(errors='replace')!r}); "
        "expected 'user item item ...', 'user,item,count', a RecBole .inter or Parquet"
    )


def _expand(path: Path, fmt: str) -> list[tuple[Path, str]]:
    """A file -> itself; a folder -> its one ``.inter``, or all its ``.csv`` or its Parquet files."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if not path.is_dir():
        check_file(path)  # a fifo, a socket, a device: named in one line
    if path.is_file():
        return [(path, detect_format(path) if fmt == "auto" else fmt)]
    inters = sorted(path.glob("*.inter"))
    csvs = sorted(path.glob("*.csv"))
    if fmt in ("auto", "recbole") and inters:
        if len(inters) > 1:
            raise DataError(f"{path}: several .inter files ({', '.join(p.name for p in inters)}); pass one")
        return [(inters[0], "recbole")]
    if fmt in ("auto", "csv") and csvs:
        return [(p, "csv") for p in csvs]
    parquets = sorted(p for p in path.iterdir() if p.suffix.lower() in PARQUET_SUFFIXES)
    if fmt in ("auto", "parquet") and parquets:
        return [(p, "parquet") for p in parquets]
    listing = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "it is empty"
    raise DataError(f"{path}: cannot tell which files of this folder to read ({listing}); pass the files")


def read_workload(
    path: str | Path | Sequence[str | Path],
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    name: str | None = None,
    columns: ParquetColumns | None = None,
    vocabulary: Vocabulary | None = None,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """Read one data file or folder (or several, merged) into a Workload and hotness orders.

    Args:
        path: a file, a folder (its ``.inter``, or all its ``.csv`` or Parquet splits), or a list of them.
        fmt: ``"auto"`` (by extension, then content), ``"seq"``, ``"csv"``, ``"recbole"`` or ``"parquet"``.
        dim: embedding dimension of every table, or ``{table: dim}`` (key ``"*"``: the rest).
        batch_size_per_gpu: samples per GPU per iteration.
        max_len: keep only each sample's most recent ``max_len`` items (seq, recbole, parquet).
        num_rows: explicit table sizes ``{table: rows}``; ids at or past them are errors.
        name: workload name (default: the input file stems).
        columns: the column names of Parquet and delimited inputs (default ``ParquetColumns()``; delimited
            files otherwise by their header's names); others ignore it.
        vocabulary: maps string ids of delimited inputs to rows (filled in first-seen order, or frozen:
            read from a stats file); default a fresh one per call.

    Returns:
        ``(workload, orders)``; ``orders[table]`` lists touched row ids hottest first.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"fmt: unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if max_len is not None:
        check_max_len(max_len)
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise ConfigError("inputs: no data file given")
    files: list[tuple[Path, str]] = []
    for p in paths:
        files.extend(_expand(Path(p), fmt))
    cols = columns or ParquetColumns()
    vocab = vocabulary if vocabulary is not None else Vocabulary()
    readers = {"seq": read_seq, "recbole": read_recbole}
    parts = [
        read_parquet(p, num_rows, max_len, cols)
        if f == "parquet"
        else read_csv(p, num_rows, max_len, cols, vocab)
        if f == "csv"
        else readers[f](p, num_rows, max_len)
        for p, f in files
    ]
    if name is None and len(paths) == 1 and Path(paths[0]).is_dir():
        name = Path(paths[0]).resolve().name
    return assemble(parts, dim=dim, batch_size_per_gpu=batch_size_per_gpu, name=name, num_rows=num_rows)
