"""String ids (product codes, hashes) mapped to dense row ids, one vocabulary per table.

A table's vocabulary lists its id strings in first-seen order (the first file of an input list first,
then row order): the ``k``-th distinct string is row ``k``. ``flexshard stats`` stores it in the stats
file (:mod:`flexshard.workloads.stats_file`, arrays ``vocab.<table>.offsets`` / ``.data``, covered by a
fingerprint the stats file records and verifies), and ``train --vocab`` reuses it so that every string
maps to the same row; a frozen vocabulary (one read back) refuses a string it does not hold.

Encoding is vectorised with ``pyarrow.compute``: per block of rows, one ``index_in`` against the
vocabulary (a hash table of its strings, rebuilt per block: O(vocabulary) per block) and one ``unique``
over the strings it lacks. Memory: the strings' bytes plus 8 bytes of offset per string.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.errors import DataError

from .parsed import MAX_ID

PREFIX = "vocab."  # stats file arrays: vocab.<table>.offsets (int64), vocab.<table>.data (uint8)


def _as_large_strings(values: pa.Array) -> pa.Array:
    """``values`` (strings, or integers taken as their decimal text) as one ``large_string`` array."""
    if isinstance(values, pa.ChunkedArray):
        values = pa.concat_arrays(values.chunks) if values.num_chunks else pa.array([], pa.large_string())
    return pc.cast(values, pa.large_string())


class Vocabulary:
    """Per table: id string -> dense row id (first-seen order). ``frozen``: no string may be added."""

    def __init__(self, frozen: bool = False, source: str = "") -> None:
        self.frozen = frozen
        self.source = source  # where a frozen vocabulary came from (for messages)
        self._strings: dict[str, pa.Array] = {}
        self.integer: set[str] = set()  # tables read as integer ids (not persisted; a mix is refused)

    def __contains__(self, table: str) -> bool:
        return table in self._strings

    def __bool__(self) -> bool:
        return bool(self._strings)

    @property
    def tables(self) -> list[str]:
        return list(self._strings)

    def size(self, table: str) -> int:
        """Distinct strings of ``table`` (its rows, unless a table size is declared larger)."""
        return len(self._strings[table]) if table in self._strings else 0

    def strings(self, table: str) -> list[str]:
        """The strings of ``table`` in row order (for inspection and tests; a Python list)."""
        return self._strings[table].to_pylist() if table in self._strings else []

    def encode(self, table: str, values: pa.Array, where: str) -> np.ndarray:
        """int64 row ids of ``values`` (strings; integers are taken as their decimal text). New strings
        get the next rows in order of first appearance; a frozen vocabulary raises DataError naming
        ``where`` (e.g. ``"x.csv: column 'item'"``) and the first string it lacks."""
        values = _as_large_strings(values)
        known = self._strings.get(table)
        if known is None:
            if self.frozen:
                raise DataError(
                    f"{where}: ids are strings but the vocabulary of {self.source} has none for {table!r} "
                    f"(it has {', '.join(self.tables) or 'no table'})"
                )
            known = pa.array([], pa.large_string())
        index = pc.index_in(values, value_set=known)
        missing = index.is_null()
        if pc.any(missing).as_py():
            new = pc.unique(values.filter(missing))  # in order of first appearance
            if self.frozen:
                raise DataError(
                    f"{where}: id {new[0].as_py()!r} is not in the vocabulary of {self.source} "
                    f"({len(known):,} {table} ids); pass the stats file made from this data"
                )
            if len(known) + len(new) > MAX_ID:
                raise DataError(f"{where}: more than {MAX_ID:,} distinct {table} ids")
            known = pa.concat_arrays([known, new])
            self._strings[table] = known
            index = pc.index_in(values, value_set=known)
        else:
            self._strings[table] = known
        return index.to_numpy(zero_copy_only=False).astype(np.int64)

    # ------------------------------------------------------------------------------ file arrays

    def _buffers(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets int64[n+1] from 0, data uint8)`` of a table's strings."""
        arr = self._strings[table]
        n = len(arr)
        raw = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset : arr.offset + n + 1]
        data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if n else np.zeros(0, np.uint8)
        data = data[int(raw[0]) : int(raw[-1])] if n else data[:0]
        return (raw - raw[0]).astype("<i8"), np.ascontiguousarray(data)

    def arrays(self) -> dict[str, np.ndarray]:
        """The stats file's arrays: ``vocab.<table>.offsets`` and ``vocab.<table>.data`` per table."""
        out = {}
        for table in self._strings:
            offsets, data = self._buffers(table)
            out[f"{PREFIX}{table}.offsets"], out[f"{PREFIX}{table}.data"] = offsets, data
        return out

    def fingerprint(self) -> str:
        """sha256 (hex) of every table's name and strings in row order; ``""`` for no vocabulary."""
        if not self._strings:
            return ""
        h = hashlib.sha256(b"flexshard-vocabulary-v1")
        for table in sorted(self._strings):
            offsets, data = self._buffers(table)
            for blob in (table.encode("utf-8"), offsets.tobytes(), data.tobytes()):
                h.update(struct.pack("<Q", len(blob)))
                h.update(blob)
        return h.hexdigest()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], tables: list[str], where: str) -> Vocabulary:
        """A frozen vocabulary from a stats file's arrays (DataError naming ``where`` when malformed)."""
        vocab = cls(frozen=True, source=where)
        for table in tables:
            offsets = arrays.get(f"{PREFIX}{table}.offsets")
            data = arrays.get(f"{PREFIX}{table}.data")
            ok = (
                offsets is not None
                and data is not None
                and offsets.ndim == 1
                and offsets.dtype == np.int64
                and data.ndim == 1
                and data.dtype == np.uint8
                and offsets.size >= 1
                and int(offsets[0]) == 0
                and int(offsets[-1]) == data.size
                and bool((np.diff(offsets) >= 0).all())
            )
            if not ok:
                raise DataError(f"{where}: vocabulary of {table!r} is missing or malformed")
            try:
                strings = pa.LargeStringArray.from_buffers(
                    offsets.size - 1, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())
                )
                strings.validate(full=True)
            except pa.ArrowException as exc:
                raise DataError(f"{where}: vocabulary of {table!r} is not UTF-8 text ({exc})") from None
            vocab._strings[table] = strings
        return vocab
