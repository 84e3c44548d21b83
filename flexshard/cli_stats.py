"""``flexshard stats``: row statistics (hotness histograms, orders, touch rates and the vocabulary of
string ids) from interaction data or from per-row statistics computed elsewhere, saved as a stats file."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from core.errors import ConfigError
from core.osutil import check_writable
from flexshard import workloads
from flexshard.progress import Progress
from flexshard.report import touch_rates_line
from flexshard.workloads.measured import HISTORY_FORMATS, histories, with_touch_rates

log = logging.getLogger(__name__)


def cmd_stats(args: argparse.Namespace) -> int:
    for name in ("dim", "batch_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    check_writable(args.out, "--out", [("the input", path) for path in args.inputs])
    num_rows = {}
    for item in args.num_rows:
        name, _, rows = item.partition("=")
        if not rows.strip().isdigit() or int(rows) <= 0:
            raise ConfigError(f"--num-rows: expected TABLE=ROWS with ROWS a positive integer, got {item!r}")
        num_rows[name] = int(rows)
    columns = workloads.ParquetColumns(args.user_col, args.item_col, args.time_col, args.count_col)
    rows_files = workloads.row_stats_inputs(args.inputs, args.format)
    vocab = workloads.Vocabulary()  # string ids of delimited inputs -> rows, saved with the stats
    if rows_files is not None:
        workload, orders = _row_stats(args, rows_files, num_rows, columns)
    else:
        if num_rows or columns != workloads.ParquetColumns():
            workload, orders = workloads.read_workload(
                args.inputs,
                args.format,
                args.dim,
                args.batch_size,
                args.max_len,
                num_rows=num_rows or None,
                columns=columns,
                vocabulary=vocab,
            )
        else:
            workload, orders = workloads.build_stats(
                args.inputs, args.format, args.dim, args.batch_size, args.max_len, vocabulary=vocab
            )
        workload = _with_touch_rates(args, workload, orders, columns, vocab)
    workloads.save_stats(args.out, workload, orders, vocab)
    for note in filter(None, (workloads.order_note(p, columns) for p in args.inputs if Path(p).is_file())):
        log.info(f"note: {note}")
    print(workloads.describe(workload))
    print(touch_rates_line(workload))
    log.info(f"wrote {args.out} (fingerprint {workloads.fingerprint(workload)[:16]})")
    return 0


def _row_stats(
    args: argparse.Namespace, files: list[Path], num_rows: dict, columns: workloads.ParquetColumns
) -> tuple[workloads.Workload, dict]:
    """The workload of row statistics computed elsewhere. Their touch rates are used when the files have
    ``samples_touched`` and ``--touch-rates`` says how the job formed a sample (plans record it)."""
    if args.max_len is not None:
        raise ConfigError("--max-len: row statistics are counted already; keep the last N ids in their job")
    if columns != workloads.ParquetColumns():
        raise ConfigError("--user-col/--item-col/--time-col/--count-col: row statistics have fixed columns")
    touched = workloads.row_stats_has_touched(files)
    sampling = None
    if args.touch_rates in workloads.SAMPLING_MODES:
        if not touched:
            raise ConfigError(
                f"--touch-rates {args.touch_rates}: {files[0]} has no samples_touched column, which measured "
                "rates need; use --touch-rates off"
            )
        mode = args.touch_rates
        sampling = workloads.Sampling(mode, args.window, args.negatives if mode == "next-item" else 0)
    elif args.touch_rates is None and touched:
        raise ConfigError(
            f"--touch-rates: {files[0]} has samples_touched; say how its job formed a sample (e.g. "
            "--touch-rates history --window 20: plans record it, train checks it), or --touch-rates off"
        )
    read = workloads.read_row_stats(
        files, sampling, num_rows or None, args.dim, args.batch_size, name=Path(args.inputs[0]).stem
    )
    if args.touch_rates is None and not touched:  # once the files were read: an error stays one line
        log.info("note: no samples_touched column; plans price this workload as independent draws")
    return read


def _with_touch_rates(
    args: argparse.Namespace,
    workload: workloads.Workload,
    orders: dict,
    columns: workloads.ParquetColumns,
    vocab: workloads.Vocabulary | None = None,
) -> workloads.Workload:
    """``workload`` with measured touch rates (``--touch-rates``), when its input has user histories."""
    if args.touch_rates == "off":
        return workload
    path = Path(args.inputs[0])
    fmt = workloads.detect_format(path) if args.format == "auto" and path.is_file() else args.format
    usable = len(args.inputs) == 1 and path.is_file() and fmt in HISTORY_FORMATS
    if not usable:
        if args.touch_rates is None:  # the default: measure where possible, say so where not
            log.info(
                "note: touch rates not measured (they need one file of user histories: "
                f"{', '.join(HISTORY_FORMATS)}); plans price this workload as independent draws"
            )
            return workload
        raise ConfigError(
            f"--touch-rates {args.touch_rates}: needs one file of user histories "
            f"({', '.join(HISTORY_FORMATS)}), got {' '.join(args.inputs)} ({fmt}); use --touch-rates off"
        )
    mode = args.touch_rates or "next-item"
    sampling = workloads.Sampling(mode, args.window, args.negatives if mode == "next-item" else 0)
    options = {"columns": columns} if fmt in ("parquet", "csv") else {}
    with Progress(1, "touch rates") as bar:
        if fmt == "parquet":
            options["progress"] = lambda done, total: bar.note(f"{done:,}/{total:,} rows")
        chunks = histories(path, fmt, args.max_len, vocab, **options)
        pairs = [0, 0]  # consecutive history items, and those rising in id

        def inspected():
            for seq in chunks():
                pairs[:] = [a + b for a, b in zip(pairs, seq.ascending_pairs(), strict=True)]
                yield seq

        measured = with_touch_rates(workload, orders, inspected, sampling)
        bar.advance()
    note = workloads.id_sorted_note(*pairs, path)
    if note:
        log.info(f"note: {note}")
    return measured
