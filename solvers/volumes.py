"""Expected counts of one iteration, per table: lookups and distinct rows per GPU, per group and in the
cluster along the hotness order (:class:`TableMass`), and their split into a plan's tiers and owners
(:class:`TierVolumes`). The cost model (:mod:`solvers.cost_model`) prices these counts into bytes.

Independent draws: a row of probability ``p`` is in a GPU's batch of ``n`` lookups with probability
``1 - (1 - p)^n``; with a measured :class:`~solvers.types.TouchProfile`, a row a sample touches with
probability ``q`` is in a batch of ``s`` samples with probability ``1 - (1 - q)^s`` (docs/cost_model.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.vocabulary import Deal
from solvers import dealing, torchrec_default
from solvers.types import TablePlan, TableSpec, Workload, batch_touch_probability
from topology.views import ClusterView


@dataclass(frozen=True)
class TableMass:
    """Cumulative per-row quantities of one table along hotness rank, at histogram bucket edges.

    ``rows[k]`` rows precede edge k; ``lookups`` the expected lookups per GPU per iteration of
    those rows, ``unique`` their expected distinct rows per GPU batch (per-rank dedup volume),
    ``group`` their expected distinct rows per group batch (group fetch volume), ``touched`` their
    expected rows touched anywhere in the cluster per iteration.

    With a measured profile that says which row is which (``TouchProfile.rank_entry``), ``per_entry``
    holds one row's quantities in each profile entry, so that a deal by id can be priced row by row
    (:func:`solvers.dealing.range_masses`).
    """

    rows: np.ndarray  # float64[K+1]
    lookups: np.ndarray
    unique: np.ndarray
    group: np.ndarray
    touched: np.ndarray
    rank_entry: np.ndarray | None = None  # int32[L]: profile entry of each row in hotness order (-1: none)
    per_entry: np.ndarray | None = None  # float64[E, 4]: one row's quantities per entry, ``FIELDS`` order

    FIELDS = ("lookups", "unique", "group", "touched")  # the quantities, in :meth:`stacked`'s order

    def at(self, row: float | np.ndarray) -> dict[str, np.ndarray]:
        """``{"lookups", "unique", "group", "touched"}`` of the first ``row`` rows, linear inside a
        bucket (rows in a bucket are identical)."""
        x = np.asarray(row, dtype=np.float64)
        return {name: np.interp(x, self.rows, getattr(self, name)) for name in self.FIELDS}

    def stacked(self) -> np.ndarray:
        """float64[K+1, 4]: the quantities side by side, columns in ``FIELDS`` order."""
        return np.stack([getattr(self, name) for name in self.FIELDS], axis=1)


def table_mass(table: TableSpec, lookups_per_gpu: float, num_ranks: int, group_size: int = 1) -> TableMass:
    """Cumulative masses of ``table`` for ``lookups_per_gpu`` lookups per GPU on ``num_ranks`` GPUs in
    groups of ``group_size``.

    Independent draws (no touch profile): a row of probability ``p`` is in a GPU's batch with
    probability ``1 - (1 - p)^n``, in a group's with ``1 - (1 - p)^(g n)``, somewhere with
    ``1 - (1 - p)^(N n)``. Measured (``table.touch``): the batch holds ``s = lookups_per_gpu /
    ids_per_sample`` independent samples, and a row a sample touches with probability ``q`` is in a
    GPU's batch with probability ``1 - (1 - q)^s`` (group ``g s``, cluster ``N s``); lookups per bucket
    are the measured ones."""
    rows = table.hist.rows.astype(np.float64)

    def cumulative(per_bucket: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(per_bucket)])

    if table.touch is not None:
        samples = lookups_per_gpu / table.ids_per_sample
        tp = table.touch
        # one row's chance to be in a GPU's, a group's and the cluster's batch, per profile entry
        in_batch = [tp.entry_touched(samples * k) for k in (1, group_size, num_ranks)]
        per_entry = None
        if tp.rank_entry is not None:  # a bucket's lookups spread over its touched rows
            touched_rows = tp.rows_per_bucket()
            lookups_per_row = np.divide(
                tp.lookups * samples, touched_rows, out=np.zeros(tp.num_buckets), where=touched_rows > 0
            )
            per_entry = np.stack([lookups_per_row[tp.entry_bucket], *in_batch], axis=1)
        unique, group, touched = (cumulative(tp.bucket_sums(p)) for p in in_batch)
        return TableMass(
            rows=cumulative(rows),
            lookups=cumulative(tp.lookups * samples),
            unique=unique,
            group=group,
            touched=touched,
            rank_entry=tp.rank_entry,
            per_entry=per_entry,
        )
    p = table.hist.prob
    return TableMass(
        rows=cumulative(rows),
        lookups=cumulative(rows * p * lookups_per_gpu),
        unique=cumulative(rows * batch_touch_probability(p, lookups_per_gpu)),
        group=cumulative(rows * batch_touch_probability(p, lookups_per_gpu * group_size)),
        touched=cumulative(rows * batch_touch_probability(p, lookups_per_gpu * num_ranks)),
    )


@dataclass(frozen=True)
class TierVolumes:
    """Per-table tier quantities of a plan: lookup volumes per GPU and touched rows per iteration.

    The ``*_by_*`` arrays split a volume over the owners the rows are dealt to (:func:`dealt_volumes`);
    ``None`` splits it in proportion to the owners' row shares."""

    warm_volume: float  # lookups (or unique rows with dedup) per GPU per iteration
    cold_volume: float
    hot_touched: float  # rows touched cluster-wide per iteration
    warm_touched: float
    cold_group_volume: float | None = None  # distinct cold rows per group per iteration (group fetch)
    warm_by_position: np.ndarray | None = None  # float64[g]: warm_volume by owner position
    warm_touched_by_position: np.ndarray | None = None  # float64[g]: warm_touched by owner position
    warm_rows_by_position: np.ndarray | None = None  # int64[g]: warm rows by owner position
    cold_by_rank: np.ndarray | None = None  # float64[N]: cold_volume by owner rank
    cold_group_by_rank: np.ndarray | None = None  # float64[N]: cold_group_volume by owner rank
    cold_touched: float = 0.0  # cold rows touched cluster-wide per iteration (each updated once)
    cold_touched_by_rank: np.ndarray | None = None  # float64[N]: cold_touched by owner rank


def tier_volumes(mass: TableMass, plan: TablePlan, dedup: bool) -> TierVolumes:
    edges = np.array([0.0, plan.hot_rows, plan.hot_rows + plan.warm_rows, mass.rows[-1]])
    at = mass.at(edges)
    vol = np.diff(at["unique"] if dedup else at["lookups"])
    tch = np.diff(at["touched"])
    return TierVolumes(
        warm_volume=vol[1],
        cold_volume=vol[2],
        hot_touched=tch[0],
        warm_touched=tch[1],
        cold_group_volume=float(np.diff(at["group"])[2]),
        cold_touched=tch[2],
    )


def dealt_volumes(
    mass: TableMass, table: TableSpec, plan: TablePlan, view: ClusterView, dedup: bool
) -> TierVolumes:
    """:func:`tier_volumes` with every warm and cold volume split over the owners the rows are actually
    dealt to (:mod:`solvers.dealing`): the interleave from each tier's start position, or TorchRec's
    contiguous id ranges. A rank's share of a tier's accesses is then the share of the rows it holds,
    weighted by their masses, not its share of the rows."""
    volumes = tier_volumes(mass, plan, dedup)
    cumulative = mass.stacked()
    volume = TableMass.FIELDS.index("unique" if dedup else "lookups")
    group, touched = TableMass.FIELDS.index("group"), TableMass.FIELDS.index("touched")
    h, w, n = plan.hot_rows, plan.warm_rows, view.num_ranks
    warm = {}
    if w > 0:
        by_position = np.asarray(plan.warm_share, dtype=np.float64)[list(view.groups[0])]
        pattern = dealing.owner_pattern(by_position, dealing.OWNER_PATTERN_PERIOD, plan.warm_start)
        rows, masses = dealing.interleave_masses(mass.rows, cumulative, h, h + w, pattern, by_position.size)
        warm = dict(
            warm_by_position=masses[:, volume],
            warm_touched_by_position=masses[:, touched],
            warm_rows_by_position=rows,
        )
    cold = {}
    if plan.cold_rows > 0:
        if plan.deal is Deal.RANGES and table.order is None:  # no id order: priced by evaluate's draws
            masses = torchrec_default.expected_range_masses(table.num_rows, n, cumulative[-1] - cumulative[0])
        elif plan.deal is Deal.RANGES:
            entries = None if mass.per_entry is None else (mass.rank_entry, mass.per_entry)
            _, masses = dealing.range_masses(mass.rows, cumulative, table.order, table.num_rows, n, entries)
        else:
            pattern = dealing.owner_pattern(plan.cold_share, dealing.OWNER_PATTERN_PERIOD, plan.cold_start)
            _, masses = dealing.interleave_masses(mass.rows, cumulative, h + w, table.num_rows, pattern, n)
        cold = dict(
            cold_by_rank=masses[:, volume],
            cold_group_by_rank=masses[:, group],
            cold_touched_by_rank=masses[:, touched],
        )
    return replace(volumes, **warm, **cold)


def view_mass(workload: Workload, view: ClusterView, table: TableSpec) -> TableMass:
    """:func:`table_mass` of ``table`` at the workload's batch on ``view`` (its largest group)."""
    return table_mass(table, workload.lookups_per_gpu(table), view.num_ranks, int(view.group_sizes.max()))


def routed_ids(
    workload: Workload, view: ClusterView, table: TableSpec, dedup: bool, mass: TableMass | None = None
) -> float:
    """Ids per GPU per iteration the runtime routes for ``table`` (tier test, owner, order by
    destination): with dedup it deduplicates first and routes the distinct ids, else every lookup
    (:func:`flexshard.runtime.lookups.local_lookups`). ``mass``: the table's :func:`view_mass`, when the
    caller has it already."""
    if not dedup:
        return float(workload.lookups_per_gpu(table))
    return float((mass if mass is not None else view_mass(workload, view, table)).unique[-1])
