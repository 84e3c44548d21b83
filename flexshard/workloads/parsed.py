"""What every reader of interaction data shares: table names, id limits and one input's parsed tables.

``readers`` (``seq`` / ``csv`` assembly), ``sequences`` (the line parsers) and ``recbole`` import
these at module top; none of them imports another's private helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import ConfigError, DataError
from core.osutil import physical_memory_bytes

from ._text import Tokens, bad_value, grow

MAX_ID = 1 << 32  # larger raw ids need remapping (a dense table that size would not fit in memory)
USER_TABLE = "user_id"
ITEM_TABLE = "item_id"
ATTRIBUTE_TABLE = "item_attribute"
HISTORY_BYTES_PER_ITEM = 16  # an expanded history item (int64) and its copy while histories are built


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


def table_limits(num_rows: Mapping[str, int] | None) -> dict[str, int]:
    """``num_rows`` (``{table: rows}`` or None) checked: every value a positive integer (ConfigError)."""
    out: dict[str, int] = {}
    for name, rows in (num_rows or {}).items():
        if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows <= 0:
            raise ConfigError(f"num_rows[{name!r}]: rows must be a positive integer, got {rows!r}")
        out[name] = int(rows)
    return out


def table_size(name: str, counts: np.ndarray, limits: dict[str, int]) -> int:
    """Rows of table ``name``: its explicit limit, else ``max id + 1`` (at least 1)."""
    return limits.get(name, max(int(counts.size), 1))


def check_ids(
    tok: Tokens, idx: np.ndarray, ids: np.ndarray, table: str, limit: int | None, path: Path, field_name: str
) -> None:
    """Raise DataError on tokens that are not non-negative integers or reach past an explicit table size."""
    bad = (ids < 0) | (ids >= (MAX_ID if limit is None else limit))
    if bad.any():
        k = int(np.argmax(bad))
        i = int(idx[k])
        text = tok.text(i)
        if ids[k] >= 0 or _ascii_digits(text):  # all digits yet parsed negative: past int64
            if limit is None:
                problem = f"ids of {MAX_ID:,} and above need remapping to dense ids (or an explicit num_rows)"
            else:
                problem = f"ids outside the table ({table!r} has num_rows {limit})"
        elif text[:1] == "-" and _ascii_digits(text[1:]):
            problem = "ids < 0 are not allowed"
        else:  # '٣' and other non-ASCII digits are not ids (str.isdigit and int() accept them)
            problem = "not a non-negative integer id"
            if not text.isascii() and any(ch.isdigit() for ch in text):
                problem += " (ids are written with the ASCII digits 0-9)"
        raise bad_value(path, int(tok.line[i]), field_name, text, problem)


def _ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more of the ASCII digits 0-9."""
    return text.isascii() and text.isdigit()


def check_max_len(max_len: object) -> int:
    """``max_len`` as an int when it is a positive integer, else ConfigError."""
    if not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool) or max_len <= 0:
        raise ConfigError(f"max_len: must be a positive integer, got {max_len!r}")
    return int(max_len)


def check_expansion(total: float, largest: int, where: str) -> None:
    """DataError when counts adding up to ``total`` (the largest ``largest``), expanded into history items
    (each item ``count`` times), would not fit in this machine's memory (``HISTORY_BYTES_PER_ITEM``
    each): the limit, the total and the largest count are named (a timestamp or rating column taken for
    a count is the usual cause)."""
    have = physical_memory_bytes()
    limit = (have if have is not None else 1 << 40) // HISTORY_BYTES_PER_ITEM
    if total > limit:
        raise DataError(
            f"{where}: the counts add up to {total:.4g} interactions, past the {limit:,} that fit in this "
            f"machine's memory as histories ({HISTORY_BYTES_PER_ITEM} bytes each; largest count "
            f"{largest:,}); a count is interactions of one user with one item: if that column is a "
            "timestamp or a rating, name the columns in a header line (e.g. user,item,timestamp)"
        )


def history_counts(histories: Iterable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts of per-user histories (chunks of :class:`~flexshard.workloads.sequences.Sequences`, every
    user in one chunk): lookups per item (int64[largest item + 1]), the users ascending (a sample each)
    and each one's history length. Memory: the counts plus two int64 per user."""
    item_counts = np.zeros(0, dtype=np.int64)
    users, lengths = [], []
    for seq in histories:
        if seq.items.size:
            top = int(seq.items.max()) + 1
            item_counts = grow(item_counts, top)
            item_counts[:top] += np.bincount(seq.items)
        users.append(seq.users)
        lengths.append(seq.lengths)
    all_users = np.concatenate(users)
    order = np.argsort(all_users)
    return item_counts, all_users[order], np.concatenate(lengths)[order]


def interaction_counts(
    chunks: Iterable, unit_counts: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts of interaction rows (chunks with ``users``, ``items`` and ``counts``, int64 each): lookups per
    item (int64[largest item + 1]), the users seen ascending (a sample each) and each one's interactions.
    ``unit_counts``: every count is 1 (no count column), summed by ``bincount``; else exact int64 sums.
    Memory: int64 counts per item and per user id, and a flag per user id."""
    item_counts = np.zeros(0, dtype=np.int64)
    seen = np.zeros(0, dtype=bool)
    user_totals = np.zeros(0, dtype=np.int64)
    for chunk in chunks:
        top_item, top_user = int(chunk.items.max()) + 1, int(chunk.users.max()) + 1
        item_counts, user_totals = grow(item_counts, top_item), grow(user_totals, top_user)
        seen = grow(seen, top_user)
        seen[chunk.users] = True
        if unit_counts:
            item_counts[:top_item] += np.bincount(chunk.items)
            user_totals[:top_user] += np.bincount(chunk.users)
        else:
            np.add.at(item_counts, chunk.items, chunk.counts)  # exact int64 sums
            np.add.at(user_totals, chunk.users, chunk.counts)
    sample_user = np.flatnonzero(seen).astype(np.int64)
    return item_counts, sample_user, user_totals[sample_user]
