"""Save and load a workload plus its hotness orders as one ``.npz``, and fingerprint workloads.

Layout: ``meta`` is a UTF-8 JSON document stored as a uint8 array (no pickles); table ``i`` has
arrays ``t{i}.rows`` (int64), ``t{i}.prob`` (float64), optionally ``t{i}.order`` (int64 row ids,
hottest first), ``t{i}.len_values`` / ``t{i}.len_probs`` (its sequence-length pmf) and, when its
touch rates were measured (version 2), ``t{i}.touch_lookups`` / ``touch_bucket`` / ``touch_prob`` /
``touch_rows`` (a :class:`~solvers.types.TouchProfile`; its quantization, bucket error and sampling
in the table's metadata) and, from version 3, ``t{i}.touch_rank_entry`` (int32: the profile entry of
each touched row along the hotness order). Versions 1 (no touch rates) and 2 are read too. Data with
string ids adds ``vocab.<table>.offsets`` / ``.data`` (the strings of each row, UTF-8) and meta
``vocabulary`` (its tables and fingerprint, checked on load; :mod:`~flexshard.workloads.vocabulary`).
Files are written to a temporary file beside the target and moved into place with ``os.replace``, so a
reader never sees a partial file. Loading validates everything and raises ``core.errors.DataError``
(a path that cannot be written raises ``OutputError``; bad orders passed to ``save_stats``, ``ConfigError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from core.arrays import block_bounds
from core.errors import ConfigError, DataError
from core.osutil import atomic_open
from solvers.types import PlannerError, RowHistogram, TableSpec, TouchProfile, Workload

from .paths import not_a_file
from .vocabulary import Vocabulary

FORMAT = "flexshard-stats"
VERSION = 3
READS = (1, 2, 3)
TOUCH_ARRAYS = (("lookups", "f"), ("bucket", "i"), ("prob", "f"), ("rows", "i"))


def _touch_arrays(tp: TouchProfile) -> dict[str, np.ndarray]:
    """The profile's arrays by their ``TOUCH_ARRAYS`` key, little-endian float64 / int64 (file order)."""
    arrays = (tp.lookups, tp.entry_bucket, tp.entry_prob, tp.entry_rows)
    return {
        key: np.ascontiguousarray(a, dtype="<f8" if kind == "f" else "<i8")
        for (key, kind), a in zip(TOUCH_ARRAYS, arrays, strict=True)
    }


def fingerprint(workload: Workload) -> str:
    """sha256 (hex) of what a plan depends on, stable across runs and machines.

    Covers, per table in order: name, num_rows, dim, ids_per_sample, element and optimizer bytes,
    the histogram arrays (little-endian int64 rows, float64 prob) and the length pmf. Not the
    workload's name nor ``batch_size_per_gpu`` (a run setting the CLI may override).
    """
    h = hashlib.sha256(b"flexshard-workload-v1")

    def blob(data: bytes) -> None:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)

    for t in workload.tables:
        blob(t.name.encode("utf-8"))
        blob(
            struct.pack(
                "<qqdqq",
                t.num_rows,
                t.dim,
                float(t.ids_per_sample),
                t.element_bytes,
                t.optimizer_bytes_per_row,
            )
        )
        blob(np.ascontiguousarray(t.hist.rows, dtype="<i8").tobytes())
        blob(np.ascontiguousarray(t.hist.prob, dtype="<f8").tobytes())
        if t.length_values is not None and t.length_probs is not None:
            blob(np.ascontiguousarray(t.length_values, dtype="<i8").tobytes())
            blob(np.ascontiguousarray(t.length_probs, dtype="<f8").tobytes())
        else:
            blob(b"")
        if t.touch is not None:  # absent from the hash otherwise: version 1 fingerprints stay valid
            tp = t.touch
            blob(b"touch")
            for a in _touch_arrays(tp).values():
                blob(a.tobytes())
            blob(struct.pack("<dd", tp.quantization, tp.bucket_error))
            blob(tp.sampling.encode("utf-8"))
            if tp.rank_entry is not None:  # absent from the hash otherwise: version 2 fingerprints stay valid
                blob(b"rank_entry")
                blob(np.ascontiguousarray(tp.rank_entry, dtype="<i4").tobytes())
    return h.hexdigest()


def _check_order(table: TableSpec, order: np.ndarray, where: str | None = None) -> np.ndarray:
    """``order`` as int64 row ids of ``table``: ConfigError for an argument, or DataError naming
    ``where`` for an order read from a file."""
    order = np.asarray(order)
    problem = None
    if order.ndim != 1 or order.dtype.kind not in "iu":
        problem = f"expected a 1-D integer array, got {order.dtype} {order.shape}"
    elif order.size > table.num_rows:
        problem = f"{order.size} ids for a table of {table.num_rows} rows"
    elif order.size and (order.min() < 0 or order.max() >= table.num_rows):
        bad = int(order.min()) if order.min() < 0 else int(order.max())
        problem = f"id {bad} is outside the table (0..{table.num_rows - 1})"
    if problem is None:
        return order.astype(np.int64)
    if where is None:
        raise ConfigError(f"orders[{table.name!r}]: {problem}")
    raise DataError(f"{where}: orders[{table.name!r}]: {problem}")


def save_stats(
    path: str | Path,
    workload: Workload,
    orders: dict[str, np.ndarray] | None = None,
    vocabulary: Vocabulary | None = None,
) -> Path:
    """Write ``workload`` and ``orders`` (``{table: row ids hottest first}``, any subset) to ``path``, with
    the ``vocabulary`` of string ids when given (meta ``vocabulary``: its tables and fingerprint)."""
    path = Path(path)
    orders = orders or {}
    names = [t.name for t in workload.tables]
    unknown = sorted(set(orders) - set(names))
    if unknown:
        raise ConfigError(f"orders: no table named {unknown[0]!r} in workload {workload.name!r}")
    arrays: dict[str, np.ndarray] = {}
    tables_meta = []
    for i, t in enumerate(workload.tables):
        arrays[f"t{i}.rows"] = np.ascontiguousarray(t.hist.rows, dtype=np.int64)
        arrays[f"t{i}.prob"] = np.ascontiguousarray(t.hist.prob, dtype=np.float64)
        if t.name in orders:
            arrays[f"t{i}.order"] = _check_order(t, orders[t.name])
        has_lengths = t.length_values is not None and t.length_probs is not None
        if has_lengths:
            arrays[f"t{i}.len_values"] = np.asarray(t.length_values, dtype=np.int64)
            arrays[f"t{i}.len_probs"] = np.asarray(t.length_probs, dtype=np.float64)
        touch = None
        if t.touch is not None:
            tp = t.touch
            for key, a in _touch_arrays(tp).items():
                arrays[f"t{i}.touch_{key}"] = a
            if tp.rank_entry is not None:
                arrays[f"t{i}.touch_rank_entry"] = np.ascontiguousarray(tp.rank_entry, dtype="<i4")
            touch = {
                "quantization": tp.quantization,
                "bucket_error": tp.bucket_error,
                "sampling": tp.sampling,
                "has_rank_entry": tp.rank_entry is not None,
            }
        tables_meta.append(
            {
                "name": t.name,
                "num_rows": int(t.num_rows),
                "dim": int(t.dim),
                "ids_per_sample": float(t.ids_per_sample),
                "element_bytes": int(t.element_bytes),
                "optimizer_bytes_per_row": int(t.optimizer_bytes_per_row),
                "has_order": t.name in orders,
                "has_lengths": has_lengths,
                "touch": touch,
            }
        )
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "workload": workload.name,
        "batch_size_per_gpu": int(workload.batch_size_per_gpu),
        "fingerprint": fingerprint(workload),
        "tables": tables_meta,
    }
    if vocabulary:
        for table in vocabulary.tables:
            spec = next((t for t in workload.tables if t.name == table), None)
            if spec is not None and vocabulary.size(table) > spec.num_rows:
                raise ConfigError(
                    f"vocabulary: {vocabulary.size(table)} {table} ids for a table of {spec.num_rows} rows"
                )
        arrays.update(vocabulary.arrays())
        meta["vocabulary"] = {"tables": vocabulary.tables, "fingerprint": vocabulary.fingerprint()}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    with atomic_open(path, "wb", what="stats file") as fh:  # OutputError when it cannot be written
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def _field(meta: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = meta.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise DataError(f"{where}: field {key!r} is missing or has the wrong type ({value!r})")
    return value


@contextlib.contextmanager
def _from_file(where: str) -> Iterator[None]:
    """Re-raise a PlannerError of the workload types (built from a file's content) as DataError."""
    try:
        yield
    except PlannerError as exc:
        raise DataError(f"{where}: {exc}") from None


def _read(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and the checked metadata (format, version) of a stats file; DataError when malformed."""
    path = Path(path)
    why = not_a_file(path, "a folder, not a stats file")
    if why is not None:
        raise DataError(f"{path}: {'no such stats file' if why == 'no such file' else 'is ' + why}")
    try:
        with open(path, "rb") as fh:  # our handle, closed even when numpy gives up half-way
            loaded = np.load(fh, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError("a single .npy array, not an .npz archive")
            with loaded as z:
                arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, RuntimeError) as exc:
        raise DataError(
            f"{path}: not a readable FlexShard stats file ({type(exc).__name__}: {exc})"
        ) from None
    where = f"{path}"
    if "meta" not in arrays or arrays["meta"].dtype != np.uint8 or arrays["meta"].ndim != 1:
        raise DataError(f"{where}: not a FlexShard stats file (no metadata)")
    try:
        meta = json.loads(arrays["meta"].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"{where}: corrupt metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{where}: not a FlexShard stats file (format {found!r})")
    if meta.get("version") not in READS:
        raise DataError(
            f"{where}: stats file version {meta.get('version')!r}; this FlexShard reads versions "
            f"{', '.join(map(str, READS))}"
        )
    return arrays, meta


def load_stats(path: str | Path) -> tuple[Workload, dict[str, np.ndarray]]:
    """Read a file written by ``save_stats``; raises DataError on anything malformed."""
    workload, orders, _vocab = load_stats_with_vocabulary(path)
    return workload, orders


def load_stats_with_vocabulary(
    path: str | Path,
) -> tuple[Workload, dict[str, np.ndarray], Vocabulary | None]:
    """:func:`load_stats` and the file's frozen vocabulary of string ids (None if its ids were integers),
    checked against its fingerprint and its tables' sizes."""
    arrays, meta = _read(path)
    where = f"{path}"
    name = _field(meta, "workload", str, where)
    batch = _field(meta, "batch_size_per_gpu", int, where)
    stored_fp = _field(meta, "fingerprint", str, where)
    tables_meta = _field(meta, "tables", list, where)
    tables = []
    orders: dict[str, np.ndarray] = {}

    def array(key: str, kind: str, itemsize: int = 8) -> np.ndarray:
        a = arrays.get(key)
        if a is None or a.ndim != 1 or a.dtype.kind != kind or a.dtype.itemsize != itemsize:
            got = "missing" if a is None else f"{a.dtype} {a.shape}"
            expected = f"{'int' if kind == 'i' else 'float'}{8 * itemsize}"
            raise DataError(f"{where}: array {key!r} is {got}, expected 1-D {expected}")
        return a

    with _from_file(where):  # what TableSpec / Workload reject in a stored table is bad data
        for i, tm in enumerate(tables_meta):
            if not isinstance(tm, dict):
                raise DataError(f"{where}: table {i} metadata is not an object")
            tw = f"{where}: table {i}"
            tname = _field(tm, "name", str, tw)
            rows_meta = _field(tm, "num_rows", int, tw)
            ids = _field(tm, "ids_per_sample", (int, float), tw)
            hist = RowHistogram(rows=array(f"t{i}.rows", "i"), prob=array(f"t{i}.prob", "f"))
            lv = lp = None
            if _field(tm, "has_lengths", bool, tw):
                lv, lp = array(f"t{i}.len_values", "i"), array(f"t{i}.len_probs", "f")
                if lv.shape != lp.shape:
                    raise DataError(f"{tw}: length pmf arrays differ in size")
            touch = None
            touch_meta = tm.get("touch")
            if touch_meta is not None:
                if not isinstance(touch_meta, dict):
                    raise DataError(f"{tw}: field 'touch' is not an object")
                lookups, bucket, prob, rows = (array(f"t{i}.touch_{k}", kind) for k, kind in TOUCH_ARRAYS)
                touch = TouchProfile(
                    lookups=lookups,
                    entry_bucket=bucket,
                    entry_prob=prob,
                    entry_rows=rows,
                    quantization=float(_field(touch_meta, "quantization", (int, float), tw)),
                    bucket_error=float(_field(touch_meta, "bucket_error", (int, float), tw)),
                    sampling=_field(touch_meta, "sampling", str, tw),
                    rank_entry=(
                        array(f"t{i}.touch_rank_entry", "i", 4)
                        if _field({"has_rank_entry": False, **touch_meta}, "has_rank_entry", bool, tw)
                        else None
                    ),
                )
                touch.check_ranks(block_bounds(hist.rows))
            table = TableSpec(
                name=tname,
                num_rows=rows_meta,
                dim=_field(tm, "dim", int, tw),
                ids_per_sample=float(ids),
                hist=hist,
                element_bytes=_field(tm, "element_bytes", int, tw),
                optimizer_bytes_per_row=_field(tm, "optimizer_bytes_per_row", int, tw),
                length_values=lv,
                length_probs=lp,
                touch=touch,
            )
            tables.append(table)
            if _field(tm, "has_order", bool, tw):
                order = _check_order(table, array(f"t{i}.order", "i"), tw)
                if np.unique(order).size != order.size:
                    raise DataError(f"{tw}: hotness order repeats a row id")
                orders[tname] = order
        workload = Workload(name=name, tables=tuple(tables), batch_size_per_gpu=batch)
    if fingerprint(workload) != stored_fp:
        raise DataError(f"{where}: content does not match its fingerprint (file altered or corrupt)")
    vocab = _vocabulary(arrays, meta, where)
    for table in vocab.tables if vocab else []:
        spec = next((t for t in workload.tables if t.name == table), None)
        if spec is None or vocab.size(table) > spec.num_rows:
            raise DataError(f"{where}: the vocabulary of {table!r} does not fit the file's tables")
    return workload, orders, vocab


def _vocabulary(arrays: dict[str, np.ndarray], meta: dict, where: str) -> Vocabulary | None:
    """The stats file's vocabulary of string ids, checked against its fingerprint; None without one."""
    info = meta.get("vocabulary")
    if info is None:
        return None
    if not isinstance(info, dict):
        raise DataError(f"{where}: field 'vocabulary' is not an object")
    tables = _field(info, "tables", list, where)
    if not all(isinstance(t, str) for t in tables):
        raise DataError(f"{where}: field 'vocabulary' lists a table name that is not a string")
    vocab = Vocabulary.from_arrays(arrays, tables, where)
    if vocab.fingerprint() != _field(info, "fingerprint", str, where):
        raise DataError(f"{where}: the vocabulary does not match its fingerprint (file altered or corrupt)")
    return vocab
