"""RecBole atomic files (``.inter`` + optional ``.user`` / ``.item``) as multi-table workloads.

Files are tab-separated with a ``name:type`` header (types ``token``, ``token_seq``, ``float``,
``float_seq``). Every interaction looks up ``user_id``, ``item_id``, each other token field of the
interaction, and each token feature of its user (``.user``) and item (``.item``): a ``token`` is one
row, a ``token_seq`` one row per space-separated token (multi-hot); float fields are not embedding
tables and are skipped. Tokens are remapped to dense row ids in first-seen order (``.inter``
first, then the feature file). One sample per user: its interactions in timestamp order (so
``max_len`` keeps the most recent ones); a table's ids per sample are its lookups per user.
:func:`recbole_histories` gives the same users' item histories, for measured touch rates and training.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from core.arrays import block_bounds
from core.errors import DataError

from ._text import _WS, bad_value, split_cells
from .parsed import ITEM_TABLE, USER_TABLE, Parsed, table_limits
from .sequences import Sequences

TYPES = ("token", "token_seq", "float", "float_seq")


class AtomicFile:
    """A parsed atomic file: header fields and a bytes cell matrix with file line numbers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from exc
        raw = raw.replace(b"\r", b"")
        if not raw.endswith(b"\n"):
            raw += b"\n"
        a = np.frombuffer(raw, dtype=np.uint8)
        newlines = np.flatnonzero(a == 10)
        n_lines = newlines.size
        nonblank = np.zeros(n_lines, dtype=bool)
        nonblank[np.searchsorted(newlines, np.flatnonzero(~_WS[a]))] = True
        if not nonblank.any():
            raise DataError(f"{path}: empty file")
        lines = np.array(raw.split(b"\n")[:n_lines], dtype=object)
        head = int(np.argmax(nonblank))
        self.fields: list[tuple[str, str]] = []
        for item in lines[head].decode("utf-8", errors="replace").split("\t"):
            name, sep, kind = item.strip().partition(":")
            if not sep or not name:
                raise bad_value(path, head + 1, "header", item, "expected name:type")
            if kind not in TYPES:
                raise bad_value(
                    path, head + 1, name, kind, f"unknown field type (expected one of {', '.join(TYPES)})"
                )
            if any(name == f for f, _ in self.fields):
                raise bad_value(path, head + 1, name, item, "duplicate field name")
            self.fields.append((name, kind))
        body = np.flatnonzero(nonblank)
        body = body[body > head]
        if body.size == 0:
            raise DataError(f"{path}: empty file (header only)")
        n_fields = len(self.fields)
        tabs = np.bincount(np.searchsorted(newlines, np.flatnonzero(a == 9)), minlength=n_lines)
        wrong = tabs[body] != n_fields - 1
        if wrong.any():
            k = int(body[int(np.argmax(wrong))])
            raise bad_value(
                path,
                k + 1,
                "line",
                lines[k].decode(errors="replace"),
                f"expected {n_fields} tab-separated fields, got {tabs[k] + 1}",
            )
        cells = np.array(b"\t".join(lines[body].tolist()).split(b"\t"))
        self.cells = cells.reshape(body.size, n_fields)
        self.line = body + 1  # 1-based file line of each row

    def has(self, name: str) -> bool:
        return any(f == name for f, _ in self.fields)

    def kind(self, name: str) -> str:
        return dict(self.fields)[name]

    def column(self, name: str) -> np.ndarray:
        return self.cells[:, [f for f, _ in self.fields].index(name)]

    def floats(self, name: str) -> np.ndarray:
        col = self.column(name)
        try:
            return col.astype(np.float64)
        except ValueError:
            for k, v in enumerate(col.tolist()):  # error path only: find the culprit
                try:
                    float(v)
                except ValueError:
                    raise bad_value(
                        self.path, int(self.line[k]), name, v.decode(errors="replace"), "not a number"
                    ) from None
            raise


def _dense(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids in first-seen order: ``(id per token, index of each id's first occurrence)``."""
    if tokens.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, inverse = np.unique(tokens, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[inverse.ravel()].astype(np.int64), first[order]


def _check_vocab(
    paths: list[Path],
    lines: np.ndarray,
    first: np.ndarray,
    tokens: np.ndarray,
    table: str,
    limit: int | None,
    source: np.ndarray | None = None,
) -> None:
    """Raise if a feature has more distinct tokens than an explicit ``num_rows`` allows. ``source[k]``
    indexes ``paths`` with the file of token ``k`` (every token from ``paths[0]`` when None)."""
    if limit is not None and first.size > limit:
        k = int(first[limit])
        raise bad_value(
            paths[int(source[k])] if source is not None else paths[0],
            int(lines[k]),
            table,
            tokens[k].decode(errors="replace"),
            f"ids outside the table ({table!r} has num_rows {limit}, this is distinct token {limit + 1})",
        )


def _interactions(path: Path) -> AtomicFile:
    """The ``.inter`` beside ``path``, checked for non-empty ``user_id`` and ``item_id`` tokens."""
    inter = AtomicFile(path.with_suffix(".inter"))
    for key in (USER_TABLE, ITEM_TABLE):
        if not inter.has(key) or inter.kind(key) != "token":
            raise DataError(
                f"{inter.path}:1: field {key!r}: missing; a .inter needs user_id:token and item_id:token"
            )
        empty = inter.column(key) == b""
        if empty.any():
            raise bad_value(inter.path, int(inter.line[int(np.argmax(empty))]), key, "", "empty id")
    return inter


def _timestamps(inter: AtomicFile) -> np.ndarray:
    """float64 per interaction: its ``timestamp:float`` field, or its file position when there is none."""
    if inter.has("timestamp") and inter.kind("timestamp") == "float":
        return inter.floats("timestamp")
    return np.arange(inter.cells.shape[0], dtype=np.float64)


def recbole_histories(path: str | Path, max_len: int | None = None) -> Sequences:
    """Per-user item histories of ``<stem>.inter``: users and items as the dense ids :func:`read_recbole`
    gives them (first seen in the ``.inter``), each history in timestamp order (file order on ties),
    truncated to its last ``max_len`` items when given."""
    inter = _interactions(Path(path))
    user, _ = _dense(inter.column(USER_TABLE))
    item, _ = _dense(inter.column(ITEM_TABLE))
    order = np.lexsort((np.arange(user.size), _timestamps(inter), user))
    users, lengths = np.unique(user, return_counts=True)
    seq = Sequences(users, block_bounds(lengths), item[order])
    return seq if max_len is None else seq.truncated(max_len)


def read_recbole(
    path: str | Path, num_rows: Mapping[str, int] | None = None, max_len: int | None = None
) -> Parsed:
    """Parse ``<stem>.inter`` and, when present, ``<stem>.user`` / ``<stem>.item`` beside it."""
    path = Path(path)
    limits = table_limits(num_rows)
    inter = _interactions(path)
    n_inter = inter.cells.shape[0]
    side: dict[str, AtomicFile] = {}
    for key, suffix in ((USER_TABLE, ".user"), (ITEM_TABLE, ".item")):
        fp = path.with_suffix(suffix)
        if fp.is_file():
            af = AtomicFile(fp)
            if not af.has(key) or af.kind(key) != "token":
                raise DataError(f"{fp}:1: field {key!r}: missing; a {suffix} file is keyed by {key}:token")
            side[key] = af

    # dense user / item ids over the .inter column, then the feature file's key column
    ids: dict[str, np.ndarray] = {}
    key_ids: dict[str, np.ndarray] = {}
    vocab: dict[str, int] = {}
    for key in (USER_TABLE, ITEM_TABLE):
        col = inter.column(key)
        af = side.get(key)
        both = np.concatenate([col, af.column(key)]) if af is not None else col
        dense, first = _dense(both)
        lines = np.concatenate([inter.line, af.line]) if af is not None else inter.line
        source = np.concatenate([np.zeros(n_inter, np.int64), np.ones(both.size - n_inter, np.int64)])
        paths = [inter.path, af.path] if af is not None else [inter.path]
        _check_vocab(paths, lines, first, both, key, limits.get(key), source)
        ids[key] = dense[:n_inter]
        vocab[key] = limits.get(key, int(first.size))
        if af is not None:
            key_ids[key] = dense[n_inter:]
            uniq, counts = np.unique(key_ids[key], return_counts=True)
            if (counts > 1).any():
                dup = int(uniq[int(np.argmax(counts > 1))])
                k = int(np.flatnonzero(key_ids[key] == dup)[1])
                raise bad_value(
                    af.path, int(af.line[k]), key, af.column(key)[k].decode(errors="replace"), "duplicate key"
                )

    # keep each user's most recent max_len interactions (timestamp order, file order on ties)
    user, item = ids[USER_TABLE], ids[ITEM_TABLE]
    when = _timestamps(inter)
    kept = np.arange(n_inter)
    if max_len is not None:
        order = np.lexsort((np.arange(n_inter), when, user))
        su = user[order]
        group_start = np.flatnonzero(np.r_[True, su[1:] != su[:-1]])
        size = np.diff(np.r_[group_start, su.size])
        pos = np.arange(su.size) - np.repeat(group_start, size)
        from_end = np.repeat(size, size) - 1 - pos
        kept = np.sort(order[from_end < max_len])
    u, it = user[kept], item[kept]
    samples = np.unique(u)
    sample_of = np.searchsorted(samples, u)
    n_samples = samples.size
    hist_len = np.bincount(u, minlength=vocab[USER_TABLE])  # interactions per user
    per_sample = hist_len[samples]

    counts: dict[str, np.ndarray] = {}
    lengths: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}

    def add(name: str, prefix: str, c: np.ndarray, length: np.ndarray, n_rows: int) -> None:
        if name in counts:
            name = f"{prefix}_{name}"
        counts[name] = np.rint(c).astype(np.int64)
        lengths[name] = np.rint(length).astype(np.int64)
        rows[name] = limits.get(name, n_rows)

    add(USER_TABLE, "user", hist_len, per_sample, vocab[USER_TABLE])
    add(ITEM_TABLE, "item", np.bincount(it, minlength=vocab[ITEM_TABLE]), per_sample, vocab[ITEM_TABLE])

    # other token fields of the interactions
    for name, kind in inter.fields:
        if name in (USER_TABLE, ITEM_TABLE) or kind not in ("token", "token_seq"):
            continue
        col = inter.column(name)[kept]
        lines = inter.line[kept]
        if kind == "token":  # one token per interaction, or none
            owner = np.flatnonzero(col != b"")
            words = col[owner]
        else:  # a space-separated list per interaction
            words, owner = split_cells(col)
        dense, first = _dense(words)
        _check_vocab([inter.path], lines[owner], first, words, name, limits.get(name))
        add(
            name,
            "inter",
            np.bincount(dense, minlength=first.size),
            np.bincount(sample_of[owner], minlength=n_samples),
            first.size,
        )

    # features of the user (weighted by the user's interactions) and of the item (per interaction)
    item_lookups = np.bincount(it, minlength=vocab[ITEM_TABLE])
    for key, prefix in ((USER_TABLE, "user"), (ITEM_TABLE, "item")):
        af = side.get(key)
        if af is None:
            continue
        owner_ids = key_ids[key]
        n_owner = vocab[key]
        weight = hist_len if key == USER_TABLE else item_lookups  # lookups of each owner row
        for name, kind in af.fields:
            if name == key or kind not in ("token", "token_seq"):
                continue
            col = af.column(name)
            if kind == "token":
                present = np.flatnonzero(col != b"")
                words, owner = col[present], present
            else:
                words, owner = split_cells(col)
            dense, first = _dense(words)
            _check_vocab([af.path], af.line[owner], first, words, name, limits.get(name))
            who = owner_ids[owner]  # user / item dense id of each token
            c = np.bincount(dense, weights=weight[who], minlength=first.size)
            per_owner = np.bincount(who, minlength=n_owner)  # tokens of each user / item
            if key == USER_TABLE:
                length = per_sample * per_owner[samples]
            else:
                length = np.bincount(sample_of, weights=per_owner[it], minlength=n_samples)
            add(name, prefix, c, length, first.size)

    return Parsed(
        source=str(inter.path),
        counts=counts,
        num_rows=rows,
        sample_user=samples,
        lengths=lengths,
        per_sample_table=None,
        mergeable=False,
    )
