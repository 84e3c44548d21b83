"""A workload with measured touch rates: each table that training's samples look up gets a
:class:`~solvers.types.TouchProfile` from the real histories (:mod:`flexshard.workloads.touch`).

Tables measured: ``item_id`` (history, target and negatives) and ``user_id`` (one per sample). Other
tables (e.g. ``item_attribute``) keep the independent-draw model; reports say which is which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from core.errors import ConfigError
from solvers.types import TableSpec, Workload

from .delimited_reads import history_chunks
from .parquet import parquet_histories
from .parsed import ITEM_TABLE, USER_TABLE
from .recbole import recbole_histories
from .sequences import Sequences, read_sequences
from .touch import Sampling, item_rates, touch_profile, user_rates
from .vocabulary import Vocabulary

HISTORY_FORMATS = ("seq", "csv", "recbole", "parquet")


def histories(
    path: str | Path,
    fmt: str,
    max_len: int | None = None,
    vocabulary: Vocabulary | None = None,
    **parquet_options,
) -> Callable[[], Iterable[Sequences]]:
    """A function giving the per-user histories of one data file as chunks of users (one chunk for the
    text formats and RecBole; partitions of bounded size for Parquet), each truncated to its last
    ``max_len`` items when given (as ``flexshard stats --max-len`` counts them). Delimited files map
    string ids through ``vocabulary`` (the one their counts were read with, so rows agree) and take the
    ``columns`` option as Parquet does."""
    path = Path(path)
    if fmt == "seq":
        return lambda: [read_sequences(path, max_len=max_len)]
    if fmt == "csv":
        vocab = vocabulary if vocabulary is not None else Vocabulary()
        columns = parquet_options.get("columns")
        return lambda: history_chunks(path, columns, vocab, max_len)
    if fmt == "recbole":
        return lambda: [recbole_histories(path, max_len=max_len)]
    if fmt == "parquet":
        return lambda: parquet_histories(path, max_len=max_len, **parquet_options)
    raise ConfigError(
        f"--touch-rates: measured rates need user histories ({', '.join(HISTORY_FORMATS)} input), "
        f"got {fmt!r}; use --touch-rates off"
    )


def measured_table(
    table: TableSpec, order: np.ndarray, q: np.ndarray, m: np.ndarray, sampling: Sampling
) -> TableSpec:
    """``table`` with the touch profile of per-row ``q`` / ``m`` (indexed by row id) along ``order``: its
    histogram refined to the profile's buckets, ids per sample from the profile, no length pmf."""
    hist, profile = touch_profile(table.hist, order, q[: table.num_rows], m[: table.num_rows], sampling)
    return dataclasses.replace(
        table,
        hist=hist,
        ids_per_sample=profile.lookups_per_sample,
        length_values=None,  # the whole histories' pmf; a sample's length is the sampler's
        length_probs=None,
        touch=profile,
    )


def with_touch_rates(
    workload: Workload,
    orders: dict[str, np.ndarray],
    chunks: Callable[[], Iterable[Sequences]],
    sampling: Sampling,
) -> Workload:
    """``workload`` with measured profiles on its ``item_id`` and ``user_id`` tables.

    ``orders``: the tables' hotness orders (the negatives' pool is the item table's touched rows, as in
    training); ``chunks``: the histories the workload was counted from (:func:`histories`).
    """
    specs = {t.name: t for t in workload.tables}
    if ITEM_TABLE not in specs or ITEM_TABLE not in orders:
        raise ConfigError(f"--touch-rates: the workload has no {ITEM_TABLE!r} table with a hotness order")
    item = specs[ITEM_TABLE]
    users: list[np.ndarray] = []
    lengths: list[np.ndarray] = []

    def recorded() -> Iterator[Sequences]:
        for seq in chunks():
            users.append(seq.users)
            lengths.append(seq.lengths)
            yield seq

    pool = orders[ITEM_TABLE] if sampling.negatives else None
    q, m, _ = item_rates(recorded(), sampling, max(item.num_rows, 1), pool)
    measured = {ITEM_TABLE: measured_table(item, orders[ITEM_TABLE], q, m, sampling)}
    if USER_TABLE in specs and USER_TABLE in orders:
        user = specs[USER_TABLE]
        all_users, all_lengths = np.concatenate(users), np.concatenate(lengths)
        if all_users.size and int(all_users.max()) >= user.num_rows:
            raise ConfigError(f"{USER_TABLE}: user id {int(all_users.max())} is outside the table")
        uq, um = user_rates(all_users, all_lengths, sampling, user.num_rows)
        measured[USER_TABLE] = measured_table(user, orders[USER_TABLE], uq, um, sampling)
    tables = tuple(measured.get(t.name, t) for t in workload.tables)
    return dataclasses.replace(workload, tables=tables)
