"""Vectorised tokenising of whitespace-separated integer text (the hot path of the readers).

Files are read in chunks cut at line ends (``CHUNK_BYTES``, so memory stays bounded whatever the
file size); each chunk is tokenised with numpy on its bytes: token boundaries from a whitespace
mask, line numbers from newline positions, and non-negative decimal integers parsed digit by digit
with ``np.add.reduceat``. No Python code runs per line or per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import DataError
from core.osutil import physical_memory_bytes

CHUNK_BYTES = 1 << 22  # 4 MiB of text per chunk (~0.2 GB of transient arrays)
MAX_DIGITS = 18  # longer integer tokens are rejected (int64 overflow)
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 11, 12, 13, 32]] = True  # the set bytes.split() splits on
_POW10 = 10 ** np.arange(MAX_DIGITS + 1, dtype=np.int64)


def bad_value(path: str | Path, line: int | None, field: str, value: object, problem: str) -> DataError:
    """One-line DataError naming file, line, field and value."""
    where = f"{path}:{line}" if line is not None else str(path)
    text = value if isinstance(value, str) else repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return DataError(f"{where}: field {field!r} value {text!r}: {problem}")


def read_chunks(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Yield ``(text, first_line_number)`` pieces of a file, each ending at a line end."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
    with fh:
        line0 = 1
        rest = b""
        while True:
            block = fh.read(chunk_bytes)
            if not block:
                if rest:
                    yield rest, line0
                return
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            yield data[:cut], line0
            line0 += data.count(b"\n", 0, cut)
            rest = data[cut:]


@dataclass
class Tokens:
    """Whitespace-separated tokens of one chunk of text."""

    buf: bytes
    starts: np.ndarray  # int64[T] offset of each token in buf
    ends: np.ndarray  # int64[T] one past its last byte
    line: np.ndarray  # int64[T] 1-based line number in the file
    values: np.ndarray  # int64[T] the token as a non-negative integer, -1 if it is not one

    @property
    def size(self) -> int:
        return int(self.starts.size)

    def text(self, i: int) -> str:
        return self.buf[int(self.starts[i]) : int(self.ends[i])].decode("utf-8", errors="replace")

    def line_starts(self) -> np.ndarray:
        """bool[T]: the token is the first of its line."""
        first = np.ones(self.size, dtype=bool)
        first[1:] = self.line[1:] != self.line[:-1]
        return first

    def as_strings(self, idx: np.ndarray, max_len: int = 64) -> np.ndarray:
        """The tokens ``idx`` as a bytes array (``S`` dtype), gathered without a Python loop.

        Tokens longer than ``max_len`` bytes are cut (callers only parse numbers from them).
        """
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return np.zeros(0, dtype="S1")
        start = self.starts[idx]
        length = np.minimum(self.ends[idx] - start, max_len)
        width = max(int(length.max()), 1)
        pos = start[:, None] + np.arange(width)
        inside = np.arange(width) < length[:, None]
        grid = np.zeros((idx.size, width), dtype=np.uint8)
        grid[inside] = np.frombuffer(self.buf, dtype=np.uint8)[pos[inside]]
        return grid.view(f"S{width}").ravel()


def tokenize(buf: bytes, line0: int = 1, separators: bytes = b"") -> Tokens:
    """Tokenise ``buf`` on ASCII whitespace (plus each byte of ``separators``).

    Args:
        buf: text, ideally ending at a line end.
        line0: line number of the first line of ``buf`` in its file.
        separators: extra single-byte separators (e.g. ``b","``), treated like spaces.
    """
    if separators:
        buf = buf.translate(bytes.maketrans(separators, b" " * len(separators)))
    a = np.frombuffer(buf, dtype=np.uint8)
    ws = _WS[a]
    body = ~ws
    prev_ws = np.ones_like(ws)
    prev_ws[1:] = ws[:-1]
    next_ws = np.ones_like(ws)
    next_ws[:-1] = ws[1:]
    starts = np.flatnonzero(body & prev_ws)
    ends = np.flatnonzero(body & next_ws) + 1
    newlines = np.flatnonzero(a == 10)
    line = np.searchsorted(newlines, starts) + line0
    values = _parse_uint(a, starts, ends)
    return Tokens(buf=buf, starts=starts, ends=ends, line=line.astype(np.int64), values=values)


def _parse_uint(a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each token ``a[starts:ends]`` as a non-negative decimal integer; -1 where it is not one.

    Works column by column over right-aligned digits (one vector pass per digit position, at most
    ``MAX_DIGITS`` passes), so the cost is O(tokens x longest token) with no per-token Python.
    """
    values = np.zeros(starts.size, dtype=np.int64)
    if starts.size == 0:
        return values
    length = ends - starts
    bad = length > MAX_DIGITS
    width = int(min(length.max(), MAX_DIGITS))
    for k in range(width):  # the k-th of ``width`` right-aligned character positions
        pos = ends - (width - k)
        inside = pos >= starts
        ch = a[np.where(inside, pos, 0)]
        bad |= inside & ((ch < 48) | (ch > 57))
        values = np.where(inside, values * 10 + (ch.astype(np.int64) - 48), values)
    values[bad] = -1
    return values


def split_cells(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split each bytes cell on whitespace: ``(tokens S-array, owner int64[ntokens])``."""
    if cells.size == 0:
        return np.array([], dtype="S1"), np.zeros(0, dtype=np.int64)
    joined = b"\n".join(cells.tolist())
    toks = tokenize(joined)
    words = np.array(joined.split()) if toks.size else np.array([], dtype="S1")
    return words, toks.line - 1


def grow(arr: np.ndarray, size: int) -> np.ndarray:
    """``arr`` zero-padded to at least ``size`` elements (per-row counts: index = row id). DataError when
    the array is larger than this machine's physical memory or cannot be allocated (ids that large need
    remapping to dense ones); the bound does not rely on ``MemoryError``, which overcommit defers to a
    kill when the pages are touched."""
    if arr.size >= size:
        return arr
    need, have = size * arr.dtype.itemsize, physical_memory_bytes()
    if have is not None and need > have:
        raise DataError(
            f"ids up to {size - 1:,} need a {need / 2**30:.1f} GiB per-row array, more than this machine's "
            f"{have / 2**30:.1f} GiB of memory: remap the ids to dense ones (0..rows-1)"
        )
    try:
        out = np.zeros(size, dtype=arr.dtype)
    except MemoryError:
        raise DataError(
            f"ids up to {size - 1:,} need a {need / 2**30:.1f} GiB per-row array, more than this machine can "
            "allocate: remap the ids to dense ones (0..rows-1)"
        ) from None
    out[: arr.size] = arr
    return out
