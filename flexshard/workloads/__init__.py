"""Workloads for the planner: synthetic production-like skew, real data readers, stats files.

Public API (all histograms are ``solvers.types.RowHistogram``, never per-row objects):

* synthetic: ``zipf_histogram``, ``zipf_table`` (Zipf head + uniform tail), ``default_workload``,
  ``synthetic_workload``, ``calibration_table`` / ``calibration_locality``, ``iteration_lookups``,
  ``head_rows_for``, constants ``DEFAULT_ALPHA``, ``DEFAULT_TAIL_MASS``, ``HEAD_ROWS_PER_LOOKUP``,
  ``REFERENCE_GPUS``, ``META_RANGES``;
* locality: ``batch_locality`` / ``BatchLocality``, ``top_share``, ``zipf_slope``,
  ``parse_locality_stats`` / ``LocalitySection`` (Meta's ``locality_stats.txt``);
* harmonic sums: ``generalized_harmonic``, ``harmonic_range``;
* readers: ``read_workload`` (``seq`` / ``csv`` / ``recbole`` / ``parquet``), ``detect_format``,
  ``hotness_order``, table names ``USER_TABLE``, ``ITEM_TABLE``, ``ATTRIBUTE_TABLE``;
* Parquet logs (streamed, bounded memory): ``ParquetColumns``, ``read_parquet``, ``parquet_histories``
  (per-user histories of logs larger than memory, in any row order), ``write_parquet_log``;
* row statistics computed elsewhere (Parquet: ``table``, ``row``, ``lookups``, optional
  ``samples_touched``, ``samples``): ``read_row_stats``, ``row_stats_inputs``, ``row_stats_has_touched``;
* sequences (per-user item histories, the same line parsers as the readers): ``Sequences``,
  ``read_sequences`` (``user item ...``: one line per user, per interaction, or mixed),
  ``read_count_sequences`` (``user,item,count``), ``sequences_from_lines``, ``sequences_from_counts``;
* batches and measured rates: ``Sampling`` (how a sample is formed), ``HistorySampler`` /
  ``SampleBatch`` (the batches training draws), ``item_rates`` / ``user_rates`` (exact per-row touch
  probability and lookups per sample), ``touch_profile`` (their compact, bucketed form);
* delimited files (CSV, TSV; read by their header, string ids through a vocabulary): ``csv_histories``,
  ``history_chunks``, ``order_note``, ``Vocabulary``;
* stats files: ``save_stats``, ``load_stats``, ``load_stats_with_vocabulary``, ``fingerprint``;
* presets: ``load_workload``, ``load_workload_with_orders``, ``build_stats``, ``describe``,
  ``preset``, ``preset_names``, ``data_root``.
"""

from .delimited_reads import csv_histories, history_chunks, order_note
from .harmonic import generalized_harmonic, harmonic_range
from .locality import (
    BatchLocality,
    LocalitySection,
    batch_locality,
    parse_locality_stats,
    poisson_sf,
    top_share,
    zipf_slope,
)
from .parquet import ParquetColumns, parquet_histories, read_parquet, write_parquet_log
from .parsed import ATTRIBUTE_TABLE, ITEM_TABLE, USER_TABLE
from .presets import (
    build_stats,
    data_root,
    describe,
    load_workload,
    load_workload_full,
    load_workload_with_orders,
    preset,
    preset_names,
)
from .readers import DEFAULT_DIM, detect_format, hotness_order, read_workload
from .row_stats import read_row_stats, row_stats_has_touched, row_stats_inputs
from .samples import HistorySampler, SampleBatch
from .sequences import (
    Sequences,
    id_sorted_note,
    read_count_sequences,
    read_sequences,
    sequences_from_counts,
    sequences_from_lines,
)
from .stats_file import fingerprint, load_stats, load_stats_with_vocabulary, save_stats
from .synthetic import (
    DEFAULT_ALPHA,
    DEFAULT_BATCH_SIZE_PER_GPU,
    DEFAULT_TAIL_MASS,
    HEAD_ROWS_PER_LOOKUP,
    META_LOOKUPS_PER_TABLE,
    META_RANGES,
    REFERENCE_GPUS,
    REFERENCE_ITERATION_LOOKUPS,
    SYNTHETIC_REFERENCE_GPUS,
    calibration_locality,
    calibration_table,
    default_workload,
    head_rows_for,
    iteration_lookups,
    rank_grid,
    sample_ids,
    synthetic_workload,
    zipf_histogram,
    zipf_table,
)
from .touch import (
    DEFAULT_NEGATIVES,
    DEFAULT_WINDOW,
    SAMPLING_MODES,
    Sampling,
    item_rates,
    touch_profile,
    user_rates,
)
from .vocabulary import Vocabulary

__all__ = [
    "Vocabulary",
    "csv_histories",
    "history_chunks",
    "id_sorted_note",
    "load_stats_with_vocabulary",
    "order_note",
    "DEFAULT_NEGATIVES",
    "DEFAULT_WINDOW",
    "SAMPLING_MODES",
    "HistorySampler",
    "SampleBatch",
    "Sampling",
    "item_rates",
    "touch_profile",
    "user_rates",
    "ATTRIBUTE_TABLE",
    "DEFAULT_ALPHA",
    "DEFAULT_BATCH_SIZE_PER_GPU",
    "DEFAULT_DIM",
    "DEFAULT_TAIL_MASS",
    "HEAD_ROWS_PER_LOOKUP",
    "ITEM_TABLE",
    "META_LOOKUPS_PER_TABLE",
    "META_RANGES",
    "REFERENCE_GPUS",
    "REFERENCE_ITERATION_LOOKUPS",
    "SYNTHETIC_REFERENCE_GPUS",
    "USER_TABLE",
    "BatchLocality",
    "LocalitySection",
    "ParquetColumns",
    "Sequences",
    "batch_locality",
    "build_stats",
    "calibration_locality",
    "calibration_table",
    "data_root",
    "default_workload",
    "describe",
    "detect_format",
    "fingerprint",
    "generalized_harmonic",
    "harmonic_range",
    "head_rows_for",
    "hotness_order",
    "iteration_lookups",
    "load_stats",
    "load_workload",
    "load_workload_full",
    "load_workload_with_orders",
    "parquet_histories",
    "parse_locality_stats",
    "poisson_sf",
    "preset",
    "preset_names",
    "rank_grid",
    "row_stats_has_touched",
    "row_stats_inputs",
    "sample_ids",
    "read_count_sequences",
    "read_parquet",
    "read_row_stats",
    "read_sequences",
    "read_workload",
    "save_stats",
    "sequences_from_counts",
    "sequences_from_lines",
    "synthetic_workload",
    "top_share",
    "write_parquet_log",
    "zipf_histogram",
    "zipf_slope",
    "zipf_table",
]
