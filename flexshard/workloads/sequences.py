"""Per-user item histories from interaction files, and the line parsers every reader of them shares.

Two text formats, one parser each (``readers.read_seq`` / ``read_csv`` stream the same chunks into
counts; the functions here keep every id):

* ``user item item ...`` (``seq_chunks``): the lines of one user are concatenated in file order, so
  one line per user (``user i1 i2 i3``: Amazon / Yelp ``*.txt``, gowalla ``train_reconstructed.txt``),
  one line per interaction (``user item``: SASRec's format) and any mix of the two (a user's lines
  interleaved with other users') give the same histories. A line holding only a user id is a user
  with no items (an empty history). Blank lines are skipped.
* ``user,item,count`` (``csv_chunks``; ``repeat-consumption-uci``; a first line naming the columns is
  skipped): each row is ``count`` consumptions of ``item`` by ``user``; a user's history is its rows in
  file order, each item repeated ``count`` times (count 0 rows add nothing; a user whose rows all have
  count 0 has an empty history).

:class:`Sequences` lists users by ascending raw user id (not in order of first appearance). Files are
read in bounded chunks and parsed with numpy only (no Python code per line or per id). Bad ids and
counts raise one-line :class:`~core.errors.DataError` naming the file, line, field and value; bad
argument values raise :class:`~core.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.arrays import block_bounds
from core.errors import ConfigError, DataError

from ._text import Tokens, bad_value, read_chunks, tokenize
from .parsed import ITEM_TABLE, USER_TABLE, check_expansion, check_ids, check_max_len, table_limits

# ------------------------------------------------------------------------------------ line parsers


@dataclass(frozen=True)
class SeqChunk:
    """The non-blank lines of one chunk of a ``user item item ...`` file."""

    users: np.ndarray  # int64[L] the user id of each line
    lengths: np.ndarray  # int64[L] the items on each line
    items: np.ndarray  # int64[sum(lengths)] the items, line after line, in file order


def seq_chunks(path: str | Path, limits: Mapping[str, int] | None = None) -> Iterator[SeqChunk]:
    """Parse a ``user item item ...`` file chunk by chunk (bounded memory).

    Every user and item id is checked: a non-negative integer below ``limits[table]`` (tables
    ``user_id`` / ``item_id``), or below ``MAX_ID`` when the table has no limit.
    """
    path = Path(path)
    limits = limits or {}
    for buf, line0 in read_chunks(path):
        tok = tokenize(buf, line0)
        if tok.size == 0:
            continue
        first = tok.line_starts()
        first_idx = np.flatnonzero(first)
        users = tok.values[first_idx]
        check_ids(tok, first_idx, users, USER_TABLE, limits.get(USER_TABLE), path, "user id")
        item_idx = np.flatnonzero(~first)
        items = tok.values[item_idx]
        check_ids(tok, item_idx, items, ITEM_TABLE, limits.get(ITEM_TABLE), path, "item id")
        lengths = np.diff(np.append(first_idx, tok.size)) - 1
        yield SeqChunk(users=users, lengths=lengths, items=items)


@dataclass(frozen=True)
class CountChunk:
    """The non-blank lines of one chunk of a ``user,item,count`` file, one entry per line."""

    users: np.ndarray  # int64[L]
    items: np.ndarray  # int64[L]
    counts: np.ndarray  # int64[L] (>= 0)


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


CSV_HEADER = re.compile(rb"^\s*user\w*\s*,\s*item\w*\s*,\s*count\w*\s*$", re.IGNORECASE)


def csv_chunks(path: str | Path, limits: Mapping[str, int] | None = None) -> Iterator[CountChunk]:
    """Parse a ``user,item,count`` file chunk by chunk (bounded memory).

    A first line that names the columns (``user,item,count``; ``user_id,item_id,counts`` and other
    spellings that start so, any case) is a header and is skipped. Every other line must hold exactly
    three fields; ids are checked as in :func:`seq_chunks`, counts must be whole non-negative numbers
    (``3`` or ``3.0``).
    """
    path = Path(path)
    limits = limits or {}
    for buf, line0 in read_chunks(path):
        if line0 == 1:
            head, _sep, rest = buf.partition(b"\n")
            if CSV_HEADER.match(head.lstrip(b"\xef\xbb\xbf")):
                buf, line0 = rest, 2
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
        users = tok.values[u_idx]
        items = tok.values[i_idx]
        check_ids(tok, u_idx, users, USER_TABLE, limits.get(USER_TABLE), path, "user")
        check_ids(tok, i_idx, items, ITEM_TABLE, limits.get(ITEM_TABLE), path, "item")
        yield CountChunk(users=users, items=items, counts=_csv_counts(tok, c_idx, path))


# ----------------------------------------------------------------------------- segment arithmetic


def keep_last(lengths: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """bool[sum(lengths)] over segments laid end to end: True on the last ``keep[s]`` of segment ``s``."""
    ends = np.cumsum(lengths)
    from_end = np.repeat(ends, lengths) - np.arange(int(ends[-1]) if ends.size else 0)
    return from_end <= np.repeat(keep, lengths)


def items_after(users: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64[L]: for each line, the items of the same user on later lines (0 for a user's last line)."""
    if users.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(users, kind="stable")
    su, sl = users[order], lengths[order]
    total = np.cumsum(sl)  # within a group of equal users, later lines come later (stable sort)
    last = np.flatnonzero(np.append(su[1:] != su[:-1], True))  # each group's last line
    group = np.cumsum(np.append(True, su[1:] != su[:-1])) - 1
    after = np.empty_like(total)
    after[order] = total[last][group] - total
    return after


# ---------------------------------------------------------------------------------------- histories


@dataclass(frozen=True)
class Sequences:
    """Per-user item histories.

    ``users`` int64[U]: distinct raw user ids, ascending; ``offsets`` int64[U+1]; ``items`` int64[T].
    User ``users[u]``'s items are ``items[offsets[u]:offsets[u+1]]``, oldest first (file order).
    """

    users: np.ndarray
    offsets: np.ndarray
    items: np.ndarray

    def __len__(self) -> int:
        return int(self.users.size)

    @property
    def lengths(self) -> np.ndarray:
        """int64[U]: the items of each user."""
        return np.diff(self.offsets)

    def history(self, u: int) -> np.ndarray:
        """The items of the ``u``-th user (index into ``users``, not a raw user id), oldest first."""
        return self.items[int(self.offsets[u]) : int(self.offsets[u + 1])]

    def ascending_pairs(self) -> tuple[int, int]:
        """``(pairs, ascending)``: consecutive items within a history that differ (repeats left out), and
        how many of them rise in id."""
        owner = np.repeat(np.arange(self.users.size), self.lengths)
        step = np.diff(self.items)[owner[1:] == owner[:-1]]
        return int((step != 0).sum()), int((step > 0).sum())

    def truncated(self, max_len: int) -> Sequences:
        """Each user's most recent ``max_len`` items (the last ones of its history)."""
        max_len = check_max_len(max_len)
        lengths = self.lengths
        if lengths.size == 0 or int(lengths.max()) <= max_len:
            return self
        keep = np.minimum(lengths, max_len)
        items = self.items[keep_last(lengths, keep)]
        return Sequences(self.users, block_bounds(keep), items)

    def subset(self, keep: np.ndarray) -> Sequences:
        """The users where the bool[U] mask ``keep`` is True (e.g. ``seq.lengths >= 2``)."""
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != self.users.shape:
            raise ConfigError(f"keep: expected a bool mask of {self.users.size} users, got {keep.shape}")
        lengths = self.lengths
        items = self.items[np.repeat(keep, lengths)]
        offsets = block_bounds(lengths[keep])
        return Sequences(self.users[keep], offsets, items)


SORTED_SHARE = 0.99  # histories whose consecutive items rise this often are taken for id-sorted sets
SORTED_MIN_PAIRS = 10


def id_sorted_note(pairs: int, ascending: int, source: str | Path) -> str | None:
    """The line readers show when ``ascending`` of ``pairs`` consecutive, differing history items (summed
    over users and chunks, :meth:`Sequences.ascending_pairs`) rise in id so often that the histories are
    id-sorted sets, not sequences (random order rises about half the time); None otherwise."""
    if pairs < SORTED_MIN_PAIRS or ascending < SORTED_SHARE * pairs:
        return None
    return (
        f"{source}: {ascending / pairs:.1%} of consecutive history items that differ rise in id: the "
        "histories look "
        "sorted by item id, not by time (item sets, not sequences); next-item samples will learn id order"
    )


def sequences_from_lines(users: np.ndarray, lengths: np.ndarray, items: np.ndarray) -> Sequences:
    """Group lines into per-user histories: line ``l`` is user ``users[l]`` with the next ``lengths[l]``
    of ``items``; a user's lines are concatenated in line order, users come out ascending."""
    users = np.asarray(users, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    items = np.asarray(items, dtype=np.int64)
    if users.shape != lengths.shape or users.ndim != 1 or int(lengths.sum()) != items.size:
        raise ConfigError(
            f"lines: {users.size} users and {lengths.size} lengths summing to {int(lengths.sum())} "
            f"do not describe {items.size} items"
        )
    if users.size > 1 and (users[1:] < users[:-1]).any():  # sort lines by user, stable
        order = np.argsort(users, kind="stable")
        starts = (np.cumsum(lengths) - lengths)[order]
        users, lengths = users[order], lengths[order]
        items = items[np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(items.size)]
    new_user = np.ones(users.size, dtype=bool)
    new_user[1:] = users[1:] != users[:-1]
    ends = np.cumsum(lengths)
    last_line = np.append(np.flatnonzero(new_user)[1:] - 1, users.size - 1) if users.size else users
    offsets = np.concatenate([[0], ends[last_line]]).astype(np.int64)
    return Sequences(users[new_user], offsets, items)


def sequences_from_counts(users: np.ndarray, items: np.ndarray, counts: np.ndarray) -> Sequences:
    """Histories from ``(user, item, count)`` rows: a user's rows in row order, each item ``count`` times."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size and int(counts.min()) < 0:
        raise ConfigError(f"counts: must be >= 0, got {int(counts.min())}")
    items = np.asarray(items, dtype=np.int64)
    if items.shape != counts.shape:
        raise ConfigError(f"items: {items.size} items for {counts.size} counts")
    return sequences_from_lines(users, counts, np.repeat(items, counts))


def _joined(chunks: list) -> tuple[np.ndarray, ...]:
    """Each field of the chunks (``SeqChunk`` or ``CountChunk``), concatenated, in field order."""
    return tuple(np.concatenate([getattr(c, f.name) for c in chunks]) for f in dataclasses.fields(chunks[0]))


def read_sequences(
    path: str | Path, max_len: int | None = None, num_rows: Mapping[str, int] | None = None
) -> Sequences:
    """Every user's item history in a ``user item item ...`` file (see the module docstring).

    Args:
        path: the file; one line per user, one line per interaction, or a mix.
        max_len: keep only each user's most recent ``max_len`` items.
        num_rows: explicit table sizes ``{"user_id": rows, "item_id": rows}``; ids at or past them
            are errors.
    """
    limits = table_limits(num_rows)
    if max_len is not None:
        max_len = check_max_len(max_len)
    chunks = list(seq_chunks(path, limits))
    if not chunks:
        raise DataError(f"{path}: empty file (no user lines)")
    seq = sequences_from_lines(*_joined(chunks))
    return seq if max_len is None else seq.truncated(max_len)


def read_count_sequences(path: str | Path, num_rows: Mapping[str, int] | None = None) -> Sequences:
    """Every user's history in a ``user,item,count`` file: its rows in file order, each item repeated
    ``count`` times; users ascending. ``num_rows`` as in :func:`read_sequences`."""
    chunks = list(csv_chunks(path, table_limits(num_rows)))
    if not chunks:
        raise DataError(f"{path}: empty file (no user,item,count lines)")
    users, items, counts = _joined(chunks)
    if counts.size:
        check_expansion(float(counts.sum(dtype=np.float64)), int(counts.max()), f"{path}: column 3 (count)")
    return sequences_from_counts(users, items, counts)
