"""Synthetic sequence-embedding workloads with production-like skew.

Each table's rows follow a two-part mixture: with probability ``1 - tail_mass`` a Zipf(``alpha``)
head over hotness ranks ``i = 1..H`` (``p_i`` proportional to ``i**-alpha``, ``H = head_rows``),
plus ``tail_mass`` spread uniformly over all ``R`` rows, so on a table of hundreds of millions of
rows the tail rows are touched about once per iteration. The histogram is built analytically: ranks
``1..exact_ranks`` get one bucket each, the rest of the head is bucketed on a geometric grid of ranks
(``ratio`` 1.01 gives ~1,700 buckets for 10^9 ranks) and ranks ``H+1..R`` are one bucket; each bucket
carries its exact mean probability, computed from generalized-harmonic sums
(``harmonic.harmonic_range``, Euler–Maclaurin, ~1e-15 relative). No per-row array is ever built: a
10^9-row table costs ~30 KB and ~10 ms.

Calibration (``DEFAULT_ALPHA``, ``HEAD_ROWS_PER_LOOKUP``, ``DEFAULT_TAIL_MASS``)
-------------------------------------------------------------------------------
Target: Meta's production-calibrated DLRM traces (``facebookresearch/dlrm_datasets``,
``/work/shared/data/meta-dlrm-locality``): over the rows one batch touches, the hottest 0.1% take
27-31% of lookups, the hottest 1% 44-48%, the hottest 10% 70-74%; 34-47% of touched rows are used
once; mean reuse 6.9-12.7; the touched-once rows carry 5.6-6.9% of the lookups in the 2021 traces
(2.7% in 2022). The planner prices one training iteration, so the fit is at the *iteration* level:
``L = REFERENCE_GPUS x DEFAULT_BATCH_SIZE_PER_GPU x 157.6 = 64 x 512 x 157.6 = 5,164,237`` lookups of
one sequence table (``REFERENCE_ITERATION_LOOKUPS``; 8 nodes x 8 GPUs). We grid-searched
``(alpha, c = H / L, tail_mass)`` with ``batch_locality`` (realised-count ranking, validated against
Monte-Carlo) on tables of ``R`` = 2e8, 5e7 and 1e7 rows:

* Coarse grid: alpha 0.85-1.05 (step 0.01) x c 0.02-4 (36 geometric steps) x tail_mass 0-0.15
  (step 0.005), 23,436 points. Inside all five ranges at all three sizes: 40 points, all with
  alpha 0.85-0.88, c 0.05-0.12, tail_mass 0.025-0.05. Fine grid (R = 2e8): alpha 0.855-0.91
  (step 0.005) x c 0.04-0.25 (40 steps) x tail_mass 0-0.065 (step 0.0025): 573 of 12,960 inside,
  at alpha 0.855-0.885 only (alpha 0.87: c 0.048-0.10, tail_mass 0.025-0.05; alpha 0.885: c
  0.12-0.14, tail_mass 0.0125-0.025). Table size barely matters once ``R >> tail_mass L``: from 2e8
  to 1e7 rows the top shares move by < 0.003 and the touched-once share by < 0.02.
* No alpha >= 0.89 fits at this scale. The best alpha 0.89 point (c 0.19, no tail) puts 31.3% on
  the hottest 0.1% and only 69.7% on the hottest 10%; alpha 0.95 at best (c 1.2) gives 0.381 /
  0.527 / 0.701 with 70% touched once and reuse 3.8. Steeper heads concentrate the very top too
  much relative to the top 10%, and reaching enough reuse needs a small head whose top is then too
  sharp. (The fitted alpha falls as the batch grows: the pure-Zipf fit at Meta's ~1.04M lookups per
  table and batch was alpha 0.91 on 0.18 L rows.) Meta's "alpha 0.9-1.0" is a loose description;
  the fitted value is 0.87.
* How the parameters act: the head is small (``c`` ~ 0.08, so each head row is drawn ~12 times per
  iteration and almost all are touched), its ``alpha`` sets the top-0.1%/1%/10% shares; each tail
  draw lands on a fresh row, so ``tail_mass`` sets the touched-once rows (~tail_mass L of them) and
  their share of lookups; ``c`` sets the reuse. The max-min-margin point (alpha 0.865, c 0.061,
  tail_mass 0.035) leaves the touched-once rows only 3.9% of lookups (reuse 10.6); a heavier tail
  brings that to Meta 2021's level at the cost of a touched-once share nearer the top of its range.
* Chosen (round values): ``alpha = 0.87``, ``c = 0.08`` (H = 413,139 head rows at L = 5.16M),
  ``tail_mass = 0.045``. Top 0.1% / 1% / 10%, touched once, reuse, lookups on touched-once rows:
  R = 2e8: 0.297 / 0.471 / 0.711, 45.0%, 8.27, 5.4%; R = 5e7: 0.297 / 0.471 / 0.710, 44.8%, 8.29,
  5.4%; R = 1e7: 0.296 / 0.469 / 0.709, 43.4%, 8.42, 5.2%. The reuse histogram matches Meta 2021's
  shards too (rows used 1 / 2 / 3-4 / 5-8 / 9-16 times: 45 / 10 / 17 / 15 / 7% vs 42 / 17 / 17 / 12
  / 7%). ``calibration_table`` rebuilds these tables; tests check all three.

Caveats. The fit is per iteration, not scale-free: at the same constants 1.04M lookups give 0.264 /
0.447 / 0.699 and 10.3M (128 GPUs) 0.309 / 0.479 / 0.715; a one-id-per-sample table (32,768
lookups, a 2,621-row head) only 0.150 / 0.357 / 0.653, since its "top 0.1%" is four rows. And the
model is i.i.d. from a static distribution, so the same ~0.2% of rows carries ~95% of the lookups
in every iteration; real traces drift, so their hot set over many iterations is wider than this.
"""

from __future__ import annotations

import math

import numpy as np

from core.errors import ConfigError
from solvers.types import RowHistogram, TableSpec, Workload

from .harmonic import harmonic_range
from .locality import BatchLocality, batch_locality

DEFAULT_ALPHA = 0.87  # Zipf exponent of the head, from the Meta calibration
DEFAULT_TAIL_MASS = 0.045  # share of lookups spread uniformly over all rows
HEAD_ROWS_PER_LOOKUP = 0.08  # head rows per lookup of one iteration at the reference cluster
DEFAULT_EXACT_RANKS = 64
DEFAULT_RANK_RATIO = 1.01

# Sequence-length pmf of the default workload's item-side tables (histories capped at 256 ids).
DEFAULT_SEQ_LENGTHS = np.array([16, 32, 64, 128, 192, 256], dtype=np.int64)
DEFAULT_SEQ_PROBS = np.array([0.05, 0.10, 0.15, 0.20, 0.15, 0.35])  # mean 157.6 ids per sample
DEFAULT_BATCH_SIZE_PER_GPU = 512
REFERENCE_GPUS = 64  # the default cluster (8 nodes x 8 GPUs) the default workload's heads are sized for
SYNTHETIC_REFERENCE_GPUS = 128  # the cluster synthetic_workload's heads are sized for (16 nodes x 8)
REFERENCE_ITERATION_LOOKUPS = REFERENCE_GPUS * DEFAULT_BATCH_SIZE_PER_GPU * 157.6  # ~5.16M per seq table

META_2021_LOOKUPS_PER_BATCH = 887_017_990  # "Avg # of indices", 2021 trace, batch 65,536
META_2021_TABLES = 856
META_LOOKUPS_PER_TABLE = META_2021_LOOKUPS_PER_BATCH / META_2021_TABLES  # ~1.036M
# Ranges from /work/shared/data/meta-dlrm-locality/README.md (over rows touched by one batch).
META_RANGES: dict[str, tuple[float, float]] = {
    "top_0.1%": (0.27, 0.31),
    "top_1%": (0.44, 0.48),
    "top_10%": (0.70, 0.74),
    "touched_once": (0.34, 0.47),
    "mean_reuse": (6.9, 12.7),
}


def rank_grid(
    num_rows: int, exact_ranks: int = DEFAULT_EXACT_RANKS, ratio: float = DEFAULT_RANK_RATIO
) -> tuple[np.ndarray, np.ndarray]:
    """First and last rank (1-based, inclusive) of each histogram bucket.

    Ranks ``1..exact_ranks`` are single buckets; after that bucket starts follow
    ``ceil((exact_ranks+1) * ratio**k)`` (deduplicated), so a bucket spans at most a factor ``ratio``
    of ranks. Returns two int64 arrays ``(first, last)``.
    """
    R = int(num_rows)
    if R < 1:
        raise ConfigError(f"num_rows: must be a positive integer, got {num_rows!r}")
    if not ratio > 1.0:
        raise ConfigError(f"ratio: the rank-grid ratio must be > 1, got {ratio!r}")
    if exact_ranks < 1:
        raise ConfigError(f"exact_ranks: must be >= 1, got {exact_ranks!r}")
    head = np.arange(1, min(exact_ranks, R) + 1, dtype=np.int64)
    if exact_ranks >= R:
        first = head
    else:
        s0 = exact_ranks + 1
        steps = int(math.ceil(math.log(R / s0) / math.log(ratio))) + 2
        grid = np.ceil(s0 * ratio ** np.arange(steps, dtype=np.float64)).astype(np.int64)
        grid = np.unique(grid[grid <= R])
        first = np.concatenate([head, grid])
    last = np.concatenate([first[1:] - 1, [R]])
    return first, last


def zipf_histogram(
    num_rows: int,
    alpha: float = DEFAULT_ALPHA,
    tail_mass: float = DEFAULT_TAIL_MASS,
    exact_ranks: int = DEFAULT_EXACT_RANKS,
    ratio: float = DEFAULT_RANK_RATIO,
    *,
    head_rows: int | None = None,
) -> RowHistogram:
    """Histogram of ``(1 - tail_mass) * Zipf(alpha, 1..head_rows) + tail_mass * Uniform(1..num_rows)``.

    The Zipf head covers hotness ranks ``1..head_rows`` (``None``: all ``num_rows`` rows); the
    uniform tail covers every row. Ranks ``1..head_rows`` are bucketed by ``rank_grid(head_rows)``
    and ranks ``head_rows+1..num_rows`` form one final bucket of probability ``tail_mass /
    num_rows``. Each bucket's probability is the exact mean of the per-rank probabilities it covers
    (per lookup), so ``sum(rows * prob) == 1`` and per-bucket access mass is exact; within a head
    bucket per-rank probabilities differ from the mean by at most a factor ``ratio**alpha``.
    """
    alpha = float(alpha)
    tail_mass = float(tail_mass)
    if not np.isfinite(alpha) or alpha < 0:
        raise ConfigError(f"alpha: the Zipf exponent must be finite and >= 0, got {alpha!r}")
    if not 0.0 <= tail_mass <= 1.0:
        raise ConfigError(f"tail_mass: must be in [0, 1], got {tail_mass!r}")
    R = int(num_rows)
    if R < 1:
        raise ConfigError(f"num_rows: must be a positive integer, got {num_rows!r}")
    H = R
    if head_rows is not None:
        try:
            H = int(head_rows)
        except (TypeError, ValueError, OverflowError):
            H = 0
        if head_rows != H or not 1 <= H <= R:
            raise ConfigError(f"head_rows: must be an integer in [1, num_rows = {R}], got {head_rows!r}")
    first, last = rank_grid(H, exact_ranks, ratio)
    sums = harmonic_range(first, last, alpha)
    total = math.fsum(sums.tolist())  # H(head_rows, alpha), summed bucket by bucket
    rows = last - first + 1
    prob = (1.0 - tail_mass) * (sums / total) / rows + tail_mass / R
    prob = np.minimum.accumulate(prob)  # guard rounding: means over consecutive rank ranges never rise
    if H < R:  # ranks beyond the head: the uniform tail only
        rows = np.concatenate([rows, [R - H]])
        prob = np.concatenate([prob, [min(tail_mass / R, float(prob[-1]))]])
    return RowHistogram(rows=rows, prob=prob)


def zipf_table(
    name: str,
    num_rows: int,
    dim: int,
    ids_per_sample: float | None,
    alpha: float = DEFAULT_ALPHA,
    tail_mass: float = DEFAULT_TAIL_MASS,
    *,
    length_values: np.ndarray | None = None,
    length_probs: np.ndarray | None = None,
    element_bytes: int = 4,
    optimizer_bytes_per_row: int = 4,
    exact_ranks: int = DEFAULT_EXACT_RANKS,
    ratio: float = DEFAULT_RANK_RATIO,
    head_rows: int | None = None,
) -> TableSpec:
    """A table whose rows follow ``zipf_histogram(num_rows, alpha, tail_mass, head_rows=head_rows)``.

    Rows are numbered in hotness order (row ``r`` has rank ``r + 1``); ``head_rows`` (None: all rows)
    is the number of Zipf head ranks, see ``zipf_histogram``. ``ids_per_sample`` is the
    mean sequence length (lookups per sample); if a length pmf is given and ``ids_per_sample`` is
    None, its mean is used.
    """
    if length_values is not None or length_probs is not None:
        if length_values is None or length_probs is None:
            raise ConfigError(f"table {name!r}: length_values and length_probs go together")
        length_values = np.asarray(length_values, dtype=np.int64)
        length_probs = np.asarray(length_probs, dtype=np.float64)
        if length_values.shape != length_probs.shape or length_values.ndim != 1:
            raise ConfigError(
                f"table {name!r}: length_values and length_probs must be equal-length 1-D arrays"
            )
        if abs(float(length_probs.sum()) - 1.0) > 1e-9 or (length_probs < 0).any():
            raise ConfigError(f"table {name!r}: length_probs must be >= 0 and sum to 1")
        if ids_per_sample is None:
            ids_per_sample = float(np.dot(length_values, length_probs))
    return TableSpec(
        name=name,
        num_rows=int(num_rows),
        dim=dim,
        ids_per_sample=float(ids_per_sample),
        hist=zipf_histogram(num_rows, alpha, tail_mass, exact_ranks, ratio, head_rows=head_rows),
        element_bytes=element_bytes,
        optimizer_bytes_per_row=optimizer_bytes_per_row,
        length_values=length_values,
        length_probs=length_probs,
    )


def sample_ids(hist: RowHistogram, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` row ids (int64) drawn independently from a table's access distribution, as the cost model
    assumes; row ``i`` is the ``i``-th hottest (apply a hotness order to get real ids). Vectorised: a
    bucket by its mass, then a uniform row inside it."""
    mass = hist.rows * hist.prob
    bucket = rng.choice(hist.rows.size, size=n, p=mass / mass.sum())
    starts = np.cumsum(hist.rows) - hist.rows
    return starts[bucket] + (rng.random(n) * hist.rows[bucket]).astype(np.int64)


def iteration_lookups(
    ids_per_sample: float,
    num_gpus: int = REFERENCE_GPUS,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
) -> float:
    """Lookups of one table in one training iteration: ``num_gpus * batch_size_per_gpu * ids_per_sample``."""
    return float(num_gpus) * float(batch_size_per_gpu) * float(ids_per_sample)


def head_rows_for(num_rows: int, lookups: float, head_rows_per_lookup: float = HEAD_ROWS_PER_LOOKUP) -> int:
    """The calibrated head: ``min(num_rows, round(head_rows_per_lookup * lookups))``, at least 1."""
    if not head_rows_per_lookup > 0:
        raise ConfigError(f"head_rows_per_lookup: must be > 0, got {head_rows_per_lookup!r}")
    return int(min(int(num_rows), max(1, round(float(head_rows_per_lookup) * float(lookups)))))


def calibration_table(num_rows: int = 200_000_000, lookups: float = REFERENCE_ITERATION_LOOKUPS) -> TableSpec:
    """A table of the calibrated mixture: ``num_rows`` rows, a head of ``0.08 * lookups`` ranks.

    ``lookups`` is one iteration's draws; ``ids_per_sample`` is set so that the reference cluster
    (``REFERENCE_GPUS`` x ``DEFAULT_BATCH_SIZE_PER_GPU``) draws exactly that many (157.6 by default,
    so the default is the default workload's ``item_id`` distribution).
    """
    ids = float(lookups) / iteration_lookups(1.0)
    return zipf_table(
        "meta_calibration",
        num_rows,
        64,
        ids,
        DEFAULT_ALPHA,
        DEFAULT_TAIL_MASS,
        head_rows=head_rows_for(num_rows, lookups),
    )


def calibration_locality(
    num_rows: int = 200_000_000, lookups: float = REFERENCE_ITERATION_LOOKUPS
) -> BatchLocality:
    """``batch_locality`` of ``calibration_table(num_rows, lookups)`` for one iteration of ``lookups``."""
    return batch_locality(calibration_table(num_rows, lookups).hist, lookups)


# name, rows, dim, sequence (True: item-side, one id per history item) or ids per sample, alpha
_DEFAULT_TABLES: tuple[tuple[str, int, int, bool | float, float], ...] = (
    ("item_id", 200_000_000, 128, True, DEFAULT_ALPHA),
    ("item_creator", 50_000_000, 64, True, DEFAULT_ALPHA),
    ("item_seller", 10_000_000, 64, True, DEFAULT_ALPHA),
    ("item_brand", 2_000_000, 64, True, DEFAULT_ALPHA),
    ("item_category", 20_000, 32, True, 1.05),
    ("action_type", 1_000, 32, True, 1.05),
    ("user_id", 100_000_000, 128, 1.0, DEFAULT_ALPHA),
    ("user_geo", 100_000, 32, 1.0, 1.05),
)


def default_workload(
    alpha: float | None = None,
    tail_mass: float = DEFAULT_TAIL_MASS,
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    *,
    head_rows_per_lookup: float | None = HEAD_ROWS_PER_LOOKUP,
    reference_gpus: int = REFERENCE_GPUS,
) -> Workload:
    """The embedded default: a sequential-recommendation workload of 362M rows (deterministic).

    Item-side tables (item id, creator, seller, brand, category, action type) are looked up once per
    history item, with the length pmf ``DEFAULT_SEQ_LENGTHS`` / ``DEFAULT_SEQ_PROBS`` (16-256 ids,
    mean 157.6; 35% of users at the 256 cap). User-side tables (user id, geo) once per sample.

    Every table is the calibrated head + tail mixture (module docstring): a Zipf head of
    ``head_rows = min(num_rows, head_rows_per_lookup * L)`` ranks, where ``L`` is the table's lookups
    in one iteration of the reference cluster, ``reference_gpus`` = 64 GPUs (8 nodes x 8) at the
    reference batch of 512 samples per GPU (``iteration_lookups``; 5.16M for item-side tables, 32,768
    for user-side ones), plus ``tail_mass`` uniform over all rows. The heads are a property of the
    data, so they do not follow ``batch_size_per_gpu``. ``head_rows_per_lookup=None`` puts the head
    over the whole table (the pre-mixture model). Alphas: the calibrated 0.87 for the id and large
    attribute tables (>= 2M rows; steeper ones leave Meta's ranges: 0.91 already puts 35% of one
    iteration's lookups on the hottest 0.1% of touched rows) and 1.05 for the small vocabularies,
    which are steeper in real data (the Amazon/Yelp attribute tables here have alpha 1.1-1.4); their
    heads cover the whole table where it is smaller than ``0.08 L``. ``alpha`` overrides every table.

    ``batch_size_per_gpu = 512``: Meta's trace batch of 65,536 samples is 512 per GPU on 128 GPUs
    (16 nodes x 8), and ~160-id sequences make activation memory, not embedding traffic, cap the
    per-GPU batch of sequence models at a few hundred to a thousand samples.
    """
    seq_ids = float(np.dot(DEFAULT_SEQ_LENGTHS, DEFAULT_SEQ_PROBS))
    tables = []
    for name, rows, dim, seq, table_alpha in _DEFAULT_TABLES:
        a = table_alpha if alpha is None else alpha
        ids = seq_ids if seq is True else float(seq)
        head = None
        if head_rows_per_lookup is not None:
            lookups = iteration_lookups(ids, reference_gpus, DEFAULT_BATCH_SIZE_PER_GPU)
            head = head_rows_for(rows, lookups, head_rows_per_lookup)
        if seq is True:
            tables.append(
                zipf_table(
                    name,
                    rows,
                    dim,
                    None,
                    a,
                    tail_mass,
                    length_values=DEFAULT_SEQ_LENGTHS,
                    length_probs=DEFAULT_SEQ_PROBS,
                    head_rows=head,
                )
            )
        else:
            tables.append(zipf_table(name, rows, dim, ids, a, tail_mass, head_rows=head))
    label = "default" if alpha is None else f"default-zipf{alpha:g}"
    return Workload(name=label, tables=tuple(tables), batch_size_per_gpu=batch_size_per_gpu)


def synthetic_workload(
    num_tables: int = 100,
    total_rows: int = 1_000_000_000,
    alpha: float = DEFAULT_ALPHA,
    tail_mass: float = DEFAULT_TAIL_MASS,
    *,
    alpha_jitter: float = 0.05,
    size_decades: float = 5.0,
    dims: tuple[int, ...] = (32, 64, 128),
    ids_per_sample_range: tuple[float, float] = (1.0, 200.0),
    batch_size_per_gpu: int = DEFAULT_BATCH_SIZE_PER_GPU,
    seed: int = 0,
    name: str | None = None,
    head_rows_per_lookup: float | None = HEAD_ROWS_PER_LOOKUP,
    reference_gpus: int = SYNTHETIC_REFERENCE_GPUS,
) -> Workload:
    """``num_tables`` head + tail Zipf tables summing to exactly ``total_rows`` rows, for benchmarks.

    Table sizes are log-uniform over ``size_decades`` decades, then rescaled to sum to
    ``total_rows`` (each >= 1 row); dims are drawn from ``dims``; ids per sample log-uniform in
    ``ids_per_sample_range``; per-table alpha uniform in ``alpha +- alpha_jitter``. Each table has the
    calibrated head (module docstring): ``min(rows, head_rows_per_lookup * L)`` Zipf ranks, ``L``
    being its lookups in one iteration of ``reference_gpus`` = 128 GPUs (16 nodes x 8) at the
    reference batch of 512 per GPU (65k-13M lookups), plus ``tail_mass`` uniform over all rows
    (``head_rows_per_lookup=None``: the head spans the table). Deterministic in ``seed``. 100 tables
    / 10^9 rows build in ~0.1 s into ~1.1 MB of histograms (~69k buckets).
    """
    if num_tables < 1:
        raise ConfigError(f"num_tables: must be >= 1, got {num_tables!r}")
    total_rows = int(total_rows)
    if total_rows < num_tables:
        raise ConfigError(
            f"total_rows: need at least one row per table, got {total_rows} for {num_tables} tables"
        )
    lo, hi = ids_per_sample_range
    if not 0 < lo <= hi:
        raise ConfigError(f"ids_per_sample_range: need 0 < low <= high, got {ids_per_sample_range!r}")
    rng = np.random.default_rng(seed)
    weights = 10.0 ** rng.uniform(0.0, size_decades, num_tables)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * total_rows).astype(np.int64))
    sizes[np.argmax(sizes)] += total_rows - int(sizes.sum())  # exact total
    if sizes.min() < 1:
        raise ConfigError(f"total_rows: {total_rows} is too small for {num_tables} tables of this spread")
    table_dims = rng.choice(np.asarray(dims, dtype=np.int64), num_tables)
    ids = np.exp(rng.uniform(math.log(lo), math.log(hi), num_tables))
    alphas = np.clip(alpha + rng.uniform(-alpha_jitter, alpha_jitter, num_tables), 0.0, None)
    width = len(str(num_tables - 1))
    heads: list[int | None] = [None] * num_tables
    if head_rows_per_lookup is not None:
        heads = [
            head_rows_for(
                int(sizes[i]),
                iteration_lookups(float(ids[i]), reference_gpus, DEFAULT_BATCH_SIZE_PER_GPU),
                head_rows_per_lookup,
            )
            for i in range(num_tables)
        ]
    tables = tuple(
        zipf_table(
            f"t{i:0{width}d}",
            int(sizes[i]),
            int(table_dims[i]),
            float(ids[i]),
            float(alphas[i]),
            tail_mass,
            head_rows=heads[i],
        )
        for i in range(num_tables)
    )
    label = name or f"synthetic-{num_tables}t-{total_rows:.0e}r-a{alpha:g}-s{seed}"
    return Workload(name=label, tables=tables, batch_size_per_gpu=batch_size_per_gpu)
