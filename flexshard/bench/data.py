"""The benchmark's tables and batches: the same batches for every strategy, a function of (seed, step, rank).

The default workload is the TorchRec comparison's (``experiments/bench_vs_torchrec.py``): three tables of
dim 64 (TorchRec's ``EmbeddingCollection`` needs one dim) small enough for 16 CPU ranks, every sample a
history of 50-100 ids drawn from the calibrated head + tail mixture of :mod:`flexshard.workloads.synthetic`
(Zipf 0.87 over a head of ``0.08 x`` the lookups of an 8-rank iteration, plus 4.5% uniform), mapped to ids
through a fixed random permutation (real ids are hashed, so hot rows are spread over row-wise blocks).
Plans see the histogram; the hotness order they route with is counted on profiling batches that are not
timed. A stats file (``--workload stats.npz``) gives its own tables; ids are drawn from each table's
histogram and mapped through the file's hotness order, which the plans use as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from flexshard.runtime.routing import complete_order
from flexshard.workloads.synthetic import head_rows_for, iteration_lookups, sample_ids, zipf_table
from solvers.types import TableSpec, Workload

DEFAULT_TABLES = (("item", 100_000, 64), ("creator", 50_000, 64), ("category", 10_000, 64))
LEN_MIN, LEN_MAX = 50, 100  # ids per sample of the default tables, uniform
ALPHA, TAIL_MASS = 0.87, 0.045
REFERENCE_RANKS = 8  # the default head is sized on an 8-rank iteration, so --nproc does not change the data
PROFILE_STEPS = 4  # batches (of every rank) the default hotness order is counted on
PROFILE_STEP0 = 1_000_000  # their step numbers start here, apart from the timed ones


@dataclass
class BenchData:
    """``workload`` (as the planners see it, batch ``batch`` per rank), the hotness ``orders`` the plans
    name, and per table the id of each hotness rank (``ids``) the batches are drawn through."""

    workload: Workload
    orders: dict[str, np.ndarray]
    ids: list[np.ndarray]
    seed: int

    @property
    def tables(self) -> list[tuple[str, int, int]]:
        """``(name, rows, dim)`` per table, in the workload's order."""
        return [(t.name, t.num_rows, t.dim) for t in self.workload.tables]

    @property
    def batch(self) -> int:
        return self.workload.batch_size_per_gpu

    def make_batch(self, step: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{table: (values int64, lengths int64)}`` of ``rank`` at ``step`` (deterministic)."""
        out = {}
        for t, (spec, ids) in enumerate(zip(self.workload.tables, self.ids, strict=True)):
            rng = np.random.default_rng((self.seed, step, rank, t))
            lengths = _lengths(spec, self.batch, rng)
            values = ids[sample_ids(spec.hist, int(lengths.sum()), rng)]
            out[spec.name] = (torch.from_numpy(values), torch.from_numpy(lengths))
        return out


def _lengths(spec: TableSpec, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Ids per sample: from the table's length pmf, else ``floor(m)`` or ``floor(m) + 1`` with mean ``m``."""
    if spec.length_values is not None and spec.length_probs is not None:
        return rng.choice(spec.length_values, size=batch, p=spec.length_probs).astype(np.int64)
    m = spec.ids_per_sample
    return (np.floor(m) + (rng.random(batch) < m - np.floor(m))).astype(np.int64)


def default_data(
    batch: int, seed: int, ranks: int, tables: tuple[tuple[str, int, int], ...] = DEFAULT_TABLES
) -> BenchData:
    """The default tables at ``batch`` samples per rank; orders counted on ``ranks`` ranks' profiling
    batches. ``tables``: ``(name, rows, dim)`` per table, drawn as the default ones are (e.g. the
    default ones with more rows, for a GPU whose L2 cache holds the default ones)."""
    lengths = np.arange(LEN_MIN, LEN_MAX + 1)
    probs = np.full(lengths.size, 1.0 / lengths.size)
    mean = float(lengths.mean())
    lookups = iteration_lookups(mean, REFERENCE_RANKS, batch)
    specs = tuple(
        zipf_table(
            name,
            rows,
            dim,
            None,
            ALPHA,
            TAIL_MASS,
            length_values=lengths,
            length_probs=probs,
            head_rows=head_rows_for(rows, lookups),
        )
        for name, rows, dim in tables
    )
    perms = [
        np.random.default_rng((seed, 1_000 + t)).permutation(rows) for t, (_n, rows, _d) in enumerate(tables)
    ]
    data = BenchData(Workload("bench-default", specs, batch_size_per_gpu=batch), {}, perms, seed)
    data.orders = counted_orders(data, ranks)
    return data


def counted_orders(data: BenchData, ranks: int) -> dict[str, np.ndarray]:
    """Per table the ids touched by the profiling batches of ``ranks`` ranks, most counted first."""
    counts = {name: np.zeros(rows, dtype=np.int64) for name, rows, _d in data.tables}
    for k in range(PROFILE_STEPS):
        for r in range(ranks):
            for name, (values, _lengths) in data.make_batch(PROFILE_STEP0 + k, r).items():
                counts[name] += np.bincount(values.numpy(), minlength=counts[name].size)
    return orders_by_count(counts)


def orders_by_count(counts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per table the ids with a non-zero count (``counts[name][id]``), most counted first (ties by id)."""
    orders = {}
    for name, c in counts.items():
        touched = np.flatnonzero(c)
        orders[name] = touched[np.argsort(-c[touched], kind="stable")]
    return orders


def stats_data(workload: Workload, orders: dict[str, np.ndarray], batch: int, seed: int) -> BenchData:
    """A stats file's tables at ``batch`` samples per rank; ids follow the file's hotness orders."""
    ids = [complete_order(orders.get(t.name), t.num_rows, t.name) for t in workload.tables]
    workload = dataclasses.replace(workload, batch_size_per_gpu=batch)
    return BenchData(
        workload, {t.name: orders[t.name] for t in workload.tables if t.name in orders}, ids, seed
    )
