"""Read real interaction data into per-table access counts and per-sample lookups.

Formats (``fmt``):

* ``"seq"``: ``user item item ...`` lines (``amazon-yelp-sequences/*.txt``, ``gowalla-lightgcn``
  ``train_reconstructed.txt`` / ``test.txt``). One sample per user line. Tables ``item_id`` (one
  lookup per item of the line) and ``user_id`` (one lookup per sample). A
  ``<stem>_item2attributes.json`` beside the file (``{"item": [attr, ...]}``) adds a table
  ``item_attribute``: every item lookup also looks up each *distinct* attribute of its item.
* ``"csv"``: ``user,item,count`` lines (``repeat-consumption-uci``). Table ``item_id`` gets ``count``
  lookups per line; one sample per user with that user's total count as its sequence length;
  ``user_id`` one lookup per sample.
* ``"recbole"``: RecBole atomic files (``.inter`` plus optional ``.user`` / ``.item``), see
  ``recbole.py``.

Ids are taken as given (1-based Amazon ids leave row 0 untouched); a table has ``max id + 1`` rows
unless ``num_rows`` names its size. Several inputs are merged: counts add up, and samples of the
same user id (e.g. a train and a test split) merge into one sample. Every table's hotness order
(touched row ids by count descending, ties by id ascending) comes back beside the workload.

Errors are one-line ``PlannerError``s naming the file, line, field and value.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from solvers.types import PlannerError, RowHistogram, TableSpec, Workload

from ._text import Tokens, bad_value, grow, read_chunks, tokenize
from .synthetic import DEFAULT_BATCH_SIZE_PER_GPU

DEFAULT_DIM = 64
MAX_ID = 1 << 32  # larger raw ids need remapping (a dense table that size would not fit in memory)
FORMATS = ("auto", "seq", "csv", "recbole")
USER_TABLE = "user_id"
ITEM_TABLE = "item_id"
ATTRIBUTE_TABLE = "item_attribute"


@dataclass
class Parsed:
    """One input's tables before assembly.

    ``counts[t]`` are per-row lookups (int64, index = row id); ``sample_user[s]`` the user id of
    sample ``s`` and ``lengths[t][s]`` its lookups of table ``t``. ``per_sample_table`` (if set) is a
    table looked up once per *merged* sample (its counts are built after merging by user).
    """

    source: str
    counts: dict[str, np.ndarray]
    num_rows: dict[str, int]
    sample_user: np.ndarray
    lengths: dict[str, np.ndarray]
    per_sample_table: str | None = None
    mergeable: bool = True  # ids are raw integers shared across inputs


# --------------------------------------------------------------------------------------- helpers


def _check_ids(
    tok: Tokens, idx: np.ndarray, ids: np.ndarray, table: str, limit: int | None, path: Path, field_name: str
) -> None:
    """Raise on tokens that are not non-negative integers or reach past an explicit table size."""
    bad = (ids < 0) | (ids >= (MAX_ID if limit is None else limit))
    if bad.any():
        k = int(np.argmax(bad))
        i = int(idx[k])
        text = tok.text(i)
        if ids[k] >= 0 and limit is None:
            problem = f"ids of {MAX_ID:,} and above need remapping to dense ids (or an explicit num_rows)"
        elif ids[k] >= 0:
            problem = f"ids outside the table ({table!r} has num_rows {limit})"
        elif text.lstrip("-").isdigit():
            problem = "ids < 0 are not allowed"
        else:
            problem = "not a non-negative integer id"
        raise bad_value(path, int(tok.line[i]), field_name, text, problem)


def _limits(num_rows: Mapping[str, int] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, rows in (num_rows or {}).items():
        if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows <= 0:
            raise PlannerError(f"num_rows[{name!r}]: rows must be a positive integer, got {rows!r}")
        out[name] = int(rows)
    return out


def _size(name: str, counts: np.ndarray, limits: dict[str, int]) -> int:
    return limits.get(name, max(int(counts.size), 1))


# ------------------------------------------------------------------------------------- seq format


def _read_attributes(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(item, attribute)`` pairs, distinct per item, from an ``item2attributes.json``."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise PlannerError(f"{path}: cannot read ({exc.strerror})") from exc
    except ValueError as exc:
        raise PlannerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlannerError(
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


def read_seq(
    path: str | Path, num_rows: Mapping[str, int] | None = None, max_len: int | None = None
) -> Parsed:
    """Parse a ``user item item ...`` file (one sample per line; see module docstring)."""
    path = Path(path)
    limits = _limits(num_rows)
    attr_path = path.with_name(f"{path.stem}_item2attributes.json")
    attr_items = attr_ids = None
    nattr = np.zeros(0, dtype=np.int64)
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
        nattr = np.bincount(attr_items) if attr_items.size else nattr
    item_counts = np.zeros(0, dtype=np.int64)
    users, item_len, attr_len = [], [], []
    for buf, line0 in read_chunks(path):
        tok = tokenize(buf, line0)
        if tok.size == 0:
            continue
        first = tok.line_starts()
        first_idx = np.flatnonzero(first)
        user_ids = tok.values[first_idx]
        _check_ids(tok, first_idx, user_ids, USER_TABLE, limits.get(USER_TABLE), path, "user id")
        sample = np.cumsum(first) - 1  # chunk-local sample of each token
        item_mask = ~first
        if max_len is not None:
            last_idx = np.concatenate([first_idx[1:], [tok.size]]) - 1
            item_mask &= last_idx[sample] - np.arange(tok.size) < max_len  # keep the most recent items
        item_idx = np.flatnonzero(item_mask)
        items = tok.values[item_idx]
        _check_ids(tok, item_idx, items, ITEM_TABLE, limits.get(ITEM_TABLE), path, "item id")
        if items.size:
            item_counts = grow(item_counts, int(items.max()) + 1)
            item_counts[: int(items.max()) + 1] += np.bincount(items)
        users.append(user_ids)
        item_len.append(np.bincount(sample[item_idx], minlength=first_idx.size))
        if attr_items is not None:
            per_item = grow(nattr, int(items.max()) + 1 if items.size else 0)
            attr_len.append(np.bincount(sample[item_idx], weights=per_item[items], minlength=first_idx.size))
    if not users:
        raise PlannerError(f"{path}: empty file (no user lines)")
    sample_user = np.concatenate(users)
    counts = {ITEM_TABLE: item_counts}
    lengths = {ITEM_TABLE: np.concatenate(item_len)}
    if attr_items is not None and attr_ids is not None:
        weight = grow(item_counts, int(attr_items.max()) + 1 if attr_items.size else 0)[attr_items]
        size = int(attr_ids.max()) + 1 if attr_ids.size else 0
        counts[ATTRIBUTE_TABLE] = np.rint(np.bincount(attr_ids, weights=weight, minlength=size)).astype(
            np.int64
        )
        lengths[ATTRIBUTE_TABLE] = np.rint(np.concatenate(attr_len)).astype(np.int64)
    parsed = Parsed(
        source=str(path),
        counts=counts,
        num_rows={t: _size(t, c, limits) for t, c in counts.items()},
        sample_user=sample_user,
        lengths=lengths,
        per_sample_table=USER_TABLE,
    )
    if USER_TABLE in limits:
        parsed.num_rows[USER_TABLE] = limits[USER_TABLE]
    return parsed


# ------------------------------------------------------------------------------------- csv format


def _csv_counts(tok: Tokens, count_idx: np.ndarray, path: Path) -> np.ndarray:
    """The ``count`` column as int64; floats like ``3.0`` are accepted, anything else is an error."""
    counts = tok.values[count_idx]
    odd = counts < 0
    if not odd.any():
        return counts
    odd_idx = count_idx[odd]
    words = tok.as_strings(odd_idx)
    try:
        as_float = words.astype(np.float64)
    except ValueError:  # error path: find the first token that is not a number
        as_float = np.empty(words.size, dtype=np.float64)
        for k, w in enumerate(words.tolist()):
            try:
                as_float[k] = float(w)
            except ValueError:
                i = int(odd_idx[k])
                raise bad_value(path, int(tok.line[i]), "count", tok.text(i), "not a number") from None
    problems = (
        (np.isnan(as_float), "NaN count"),
        (np.isinf(as_float), "infinite count"),
        (as_float < 0, "negative count"),
        (as_float >= 2.0**62, "count too large"),
        (as_float != np.floor(as_float), "counts must be whole numbers"),
    )
    for mask, problem in problems:
        if mask.any():
            i = int(odd_idx[int(np.argmax(mask))])
            raise bad_value(path, int(tok.line[i]), "count", tok.text(i), problem)
    counts = counts.copy()
    counts[odd] = as_float.astype(np.int64)
    return counts


def read_csv(
    path: str | Path, num_rows: Mapping[str, int] | None = None, max_len: int | None = None
) -> Parsed:
    """Parse a ``user,item,count`` file (no header; see module docstring)."""
    path = Path(path)
    if max_len is not None:
        raise PlannerError(
            f"max_len: {path} is a csv count matrix without order; it cannot be truncated to recent ids"
        )
    limits = _limits(num_rows)
    item_counts = np.zeros(0, dtype=np.int64)
    users, totals = [], []
    for buf, line0 in read_chunks(path):
        tok = tokenize(buf, line0, separators=b",")
        if tok.size == 0:
            continue
        first_idx = np.flatnonzero(tok.line_starts())
        per_line = np.diff(np.concatenate([first_idx, [tok.size]]))
        if (per_line != 3).any():
            k = int(np.argmax(per_line != 3))
            i = int(first_idx[k])
            line_text = tok.buf[int(tok.starts[i]) : int(tok.ends[i + per_line[k] - 1])].decode(
                errors="replace"
            )
            raise bad_value(
                path, int(tok.line[i]), "user,item,count", line_text, f"expected 3 fields, got {per_line[k]}"
            )
        u_idx, i_idx, c_idx = first_idx, first_idx + 1, first_idx + 2
        user = tok.values[u_idx]
        item = tok.values[i_idx]
        _check_ids(tok, u_idx, user, USER_TABLE, limits.get(USER_TABLE), path, "user")
        _check_ids(tok, i_idx, item, ITEM_TABLE, limits.get(ITEM_TABLE), path, "item")
        count = _csv_counts(tok, c_idx, path)
        item_counts = grow(item_counts, int(item.max()) + 1)
        np.add.at(item_counts, item, count)  # exact int64 sums
        users.append(user)
        totals.append(count)
    if not users:
        raise PlannerError(f"{path}: empty file (no user,item,count lines)")
    counts = {ITEM_TABLE: item_counts}
    parsed = Parsed(
        source=str(path),
        counts=counts,
        num_rows={ITEM_TABLE: _size(ITEM_TABLE, item_counts, limits)},
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
            raise PlannerError(f"dim: no table named {unknown[0]!r}; tables are {', '.join(names)}")
        out = {n: dim.get(n, dim.get("*", DEFAULT_DIM)) for n in names}
    else:
        out = dict.fromkeys(names, dim)
    for n, d in out.items():
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d <= 0:
            raise PlannerError(f"dim: table {n!r} needs a positive integer embedding dimension, got {d!r}")
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
        raise PlannerError("inputs: nothing to read")
    if len(parts) > 1 and not all(p.mergeable for p in parts):
        raise PlannerError(
            "inputs: RecBole inputs remap tokens per file and cannot be merged; pass one at a time"
        )
    if not isinstance(batch_size_per_gpu, (int, np.integer)) or batch_size_per_gpu <= 0:
        raise PlannerError(f"batch_size_per_gpu: must be a positive integer, got {batch_size_per_gpu!r}")
    limits = _limits(num_rows)
    names: list[str] = []
    for p in parts:
        for t in list(p.counts) + ([p.per_sample_table] if p.per_sample_table else []):
            if t not in names:
                names.append(t)
    unknown = sorted(set(limits) - set(names))
    if unknown:
        raise PlannerError(f"num_rows: no table named {unknown[0]!r}; tables are {', '.join(names)}")
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
            raise PlannerError(
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
        raise PlannerError(f"{parts[0].source}: no lookups found")
    label = name or "+".join(Path(p.source).stem for p in parts)
    return Workload(name=label, tables=tuple(tables), batch_size_per_gpu=int(batch_size_per_gpu)), orders


# ----------------------------------------------------------------------------------- entry point


def detect_format(path: str | Path) -> str:
    """``"seq"``, ``"csv"`` or ``"recbole"`` from the extension, else from the first line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".inter", ".user", ".item"):
        return "recbole"
    if suffix == ".csv":
        return "csv"
    if suffix == ".json":
        raise PlannerError(
            f"{path}: an attribute file is read with the sequence file beside it; pass that instead"
        )
    if suffix == ".npz":
        raise PlannerError(f"{path}: a stats file; load it with load_stats / --workload, not as raw data")
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError as exc:
        raise PlannerError(f"{path}: cannot read ({exc.strerror})") from exc
    first = next((ln for ln in head.splitlines() if ln.strip()), b"")
    if not first:
        raise PlannerError(f"{path}: empty file")
    if b"\t" in first and b":" in first:
        return "recbole"
    if b"," in first:
        return "csv"
    if all(t.isdigit() for t in first.split()):
        return "seq"
    raise PlannerError(
        f"{path}: unknown format (first line {first[:40].decode(errors='replace')!r}); "
        "expected 'user item item ...', 'user,item,count' or a RecBole .inter"
    )


def _expand(path: Path, fmt: str) -> list[tuple[Path, str]]:
    """A file -> itself; a folder -> its one ``.inter`` or all its ``.csv`` files."""
    if not path.exists():
        raise PlannerError(f"{path}: no such file or folder")
    if path.is_file():
        return [(path, detect_format(path) if fmt == "auto" else fmt)]
    inters = sorted(path.glob("*.inter"))
    csvs = sorted(path.glob("*.csv"))
    if fmt in ("auto", "recbole") and inters:
        if len(inters) > 1:
            raise PlannerError(
                f"{path}: several .inter files ({', '.join(p.name for p in inters)}); pass one"
            )
        return [(inters[0], "recbole")]
    if fmt in ("auto", "csv") and csvs:
        return [(p, "csv") for p in csvs]
    listing = ", ".join(sorted(p.name for p in path.iterdir())[:10])
    raise PlannerError(f"{path}: cannot tell which files of this folder to read ({listing}); pass the files")


def read_workload(
    path: str | Path | Sequence[str | Path],
    fmt: str = "auto",
    dim: int | Mapping[str, int] = DEFAULT_DIM,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    max_len: int | None = None,
    num_rows: Mapping[str, int] | None = None,
    name: str | None = None,
) -> tuple[Workload, dict[str, np.ndarray]]:
    """Read one data file or folder (or several, merged) into a Workload and hotness orders.

    Args:
        path: a file, a folder (its ``.inter``, or all its ``.csv`` splits), or a list of them.
        fmt: ``"auto"`` (by extension, then content), ``"seq"``, ``"csv"`` or ``"recbole"``.
        dim: embedding dimension of every table, or ``{table: dim}`` (key ``"*"``: the rest).
        batch_size_per_gpu: samples per GPU per iteration.
        max_len: keep only each sample's most recent ``max_len`` items (seq, recbole).
        num_rows: explicit table sizes ``{table: rows}``; ids at or past them are errors.
        name: workload name (default: the input file stems).

    Returns:
        ``(workload, orders)``; ``orders[table]`` lists touched row ids hottest first.
    """
    from .recbole import read_recbole  # local: recbole imports this module's helpers

    if fmt not in FORMATS:
        raise PlannerError(f"fmt: unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if max_len is not None and (not isinstance(max_len, (int, np.integer)) or max_len <= 0):
        raise PlannerError(f"max_len: must be a positive integer, got {max_len!r}")
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise PlannerError("inputs: no data file given")
    files: list[tuple[Path, str]] = []
    for p in paths:
        files.extend(_expand(Path(p), fmt))
    readers = {"seq": read_seq, "csv": read_csv, "recbole": read_recbole}
    parts = [readers[f](p, num_rows=num_rows, max_len=max_len) for p, f in files]
    if name is None and len(paths) == 1 and Path(paths[0]).is_dir():
        name = Path(paths[0]).resolve().name
    return assemble(parts, dim=dim, batch_size_per_gpu=batch_size_per_gpu, name=name, num_rows=num_rows)
