"""``flexshard`` command line: stats, plan, simulate, topology, probe, train.

Bad input ends with one line on stderr naming the field and the value, and exit status 2; no
output file is written unless the command succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.errors import ConfigError, InputError, PlannerError
from core.osutil import check_writable
from core.vocabulary import SyncMode, WireDtype
from flexshard import probe, workloads
from flexshard.cli_common import Parser, first_line, positive_float, positive_int
from flexshard.plan_file import to_dict, write_plan
from flexshard.progress import Progress
from flexshard.report import comparison_table, plan_report, touch_rates_line, tradeoffs
from flexshard.workloads.measured import HISTORY_FORMATS, histories, with_touch_rates
from solvers.optimizer import OptimizerConfig
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from topology import cluster_view, load_topology, summary, write_json

DEFAULT_TOPOLOGY = "h100:8"
DEFAULT_BUDGETS = "1,1.5,2,3,4,6,8"


def _budgets(text: str) -> list[float]:
    budgets = [positive_float(x) for x in text.split(",") if x.strip()]
    if not budgets:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated multiples of row-wise memory, got {text!r}"
        )
    return budgets


def _add_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="default",
        help="stats file (.npz from `flexshard stats`), a data file, or a preset name (default: the embedded "
        f"synthetic workload; presets: {', '.join(workloads.preset_names())})",
    )
    p.add_argument(
        "--topology", default=DEFAULT_TOPOLOGY, help="topology JSON or preset, e.g. h100:8, nvl72:2, skewed:8"
    )
    p.add_argument(
        "--sync",
        choices=[m.value for m in SyncMode],
        default=SyncMode.SPARSE.value,
        help="replica gradient sync (default sparse)",
    )
    p.add_argument(
        "--wire-dtype",
        choices=[m.value for m in WireDtype],
        default=WireDtype.FP32.value,
        help="element type of embeddings and gradients on the wire, as the plan prices it (default fp32)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="samples per GPU per iteration, replacing the workload's own (row statistics unchanged)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flexshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    st = sub.add_parser("stats", help="row statistics from interaction data -> stats file")
    st.add_argument(
        "inputs",
        nargs="+",
        help="data files: `user item ...` lines, user,item,count CSV, RecBole .inter, Parquet logs, or "
        "Parquet row statistics computed elsewhere (columns table, row, lookups, [samples_touched,] samples)",
    )
    st.add_argument(
        "--format",
        default="auto",
        help="auto (by extension, then content; Parquet with columns table, row, lookups is row "
        "statistics), seq, csv, recbole, parquet, rows",
    )
    st.add_argument("--dim", type=int, default=64, help="embedding dimension of every table (default 64)")
    st.add_argument(
        "--batch-size",
        type=int,
        default=workloads.DEFAULT_BATCH_SIZE_PER_GPU,
        help=f"samples per GPU per iteration (default {workloads.DEFAULT_BATCH_SIZE_PER_GPU})",
    )
    st.add_argument("--max-len", type=int, default=None, help="truncate each history to its last N ids")
    st.add_argument(
        "--num-rows",
        action="append",
        default=[],
        metavar="TABLE=ROWS",
        help="declare a table's size; ids at or past it are errors (repeatable)",
    )
    for role, default in (("user", "user"), ("item", "item"), ("time", None), ("count", None)):
        st.add_argument(
            f"--{role}-col",
            default=default,
            metavar="NAME",
            help=f"Parquet and CSV inputs: the {role} column's name (default {default or 'none'}; CSV: "
            "by the header's names)",
        )
    st.add_argument(
        "--touch-rates",
        choices=(*workloads.SAMPLING_MODES, "off"),
        default=None,
        help="measure per-row touch rates for samples formed as training forms them (next-item, the "
        "default for one history file), as whole-history windows (history), or not (off: independent "
        "draws from the counts); for row statistics with samples_touched, required: how their job formed a "
        "sample",
    )
    st.add_argument(
        "--window",
        type=int,
        default=workloads.DEFAULT_WINDOW,
        help=f"history positions a sample keeps (train --max-len; default {workloads.DEFAULT_WINDOW})",
    )
    st.add_argument(
        "--negatives",
        type=int,
        default=workloads.DEFAULT_NEGATIVES,
        help="random negatives per next-item sample "
        f"(train --negatives; default {workloads.DEFAULT_NEGATIVES})",
    )
    st.add_argument("--out", required=True, help="stats file to write (.npz)")

    pl = sub.add_parser("plan", help="workload + topology + budget -> plan file and report")
    _add_inputs(pl)
    pl.add_argument(
        "--budget", type=positive_float, default=2.0, help="per-GPU budget as a multiple of row-wise"
    )
    pl.add_argument("--strategy", choices=STRATEGIES, default="flexshard")
    pl.add_argument("--no-dedup", action="store_true", help="model no per-rank id dedup")
    pl.add_argument("--out", help="plan file to write (JSON)")
    pl.add_argument("--json", action="store_true", help="print the plan document instead of the report")

    sm = sub.add_parser("simulate", help="compare FlexShard with every baseline over budgets")
    _add_inputs(sm)
    sm.add_argument(
        "--budgets", type=_budgets, default=_budgets(DEFAULT_BUDGETS), help=f"default {DEFAULT_BUDGETS}"
    )
    sm.add_argument("--dedup", choices=("on", "off", "both"), default="on")
    sm.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    sm.add_argument("--json", action="store_true", help="print a JSON list of records instead of the table")

    tr = sub.add_parser(
        "train",
        help="train a sequence model on a plan (also torchrun -m flexshard.train; see train --help)",
        add_help=False,
    )
    tr.add_argument("args", nargs=argparse.REMAINDER)

    tp = sub.add_parser("topology", help="summarise a topology; write it as JSON")
    tp.add_argument("--topology", default=DEFAULT_TOPOLOGY)
    tp.add_argument("--out", help="write the node-link JSON here")

    pr = sub.add_parser("probe", help="measure this cluster (under torchrun, or --nproc local ranks)")
    probe.add_arguments(pr)
    return parser


def cmd_stats(args: argparse.Namespace) -> int:
    for name in ("dim", "batch_size"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    check_writable(args.out, "--out")
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
        print(f"note: {note}")
    print(workloads.describe(workload))
    print(touch_rates_line(workload))
    print(f"\nwrote {args.out} (fingerprint {workloads.fingerprint(workload)[:16]})")
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
    elif args.touch_rates is None:
        print("note: no samples_touched column; plans price this workload as independent draws")
    return workloads.read_row_stats(
        files, sampling, num_rows or None, args.dim, args.batch_size, name=Path(args.inputs[0]).stem
    )


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
            print(
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
        print(f"note: {note}")
    return measured


def _workload(args: argparse.Namespace) -> tuple[workloads.Workload, dict, workloads.Vocabulary | None]:
    """``--workload``, its hotness orders and vocabulary of string ids, with ``--batch-size`` replacing its
    per-GPU batch when given."""
    workload, orders, vocab = workloads.load_workload_full(args.workload)
    if args.batch_size is not None:
        workload = dataclasses.replace(workload, batch_size_per_gpu=args.batch_size)
    return workload, orders, vocab


def cmd_plan(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "--out")
    workload, orders, vocab = _workload(args)
    view = cluster_view(load_topology(args.topology))
    budget = budget_bytes(workload, view, args.budget)
    with Progress(1, "plan") as bar:
        planned = make_plan(
            args.strategy,
            workload,
            view,
            budget,
            not args.no_dedup,
            args.sync,
            progress=bar.note,
            wire=args.wire_dtype,
        )
        bar.advance()
    document = to_dict(planned.plan, workload, view, planned.report, workloads.fingerprint(workload), orders)
    if vocab:  # train refuses string ids mapped to rows by another vocabulary
        document["fingerprints"]["vocabulary"] = vocab.fingerprint()
    if args.out:
        write_plan(args.out, document)
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print(plan_report(workload, view, planned.plan, planned.report, args.budget))
        if args.out:
            print(f"\nwrote {args.out}")
    return 0


def simulate_records(
    workload: workloads.Workload,
    view: Any,
    budgets: Sequence[float],
    dedups: Sequence[bool],
    strategies: Sequence[str],
    sync: SyncMode | str = SyncMode.SPARSE,
    config: OptimizerConfig | None = None,
    wire: WireDtype | str = WireDtype.FP32,
) -> list[dict[str, Any]]:
    """One record per (dedup, budget, strategy); infeasible ones have ``feasible: false``."""
    records = []
    with Progress(len(budgets) * len(dedups) * len(strategies), "simulate") as bar:
        for dedup in dedups:
            for x in budgets:
                budget = budget_bytes(workload, view, x)
                for strategy in strategies:
                    bar.note(f"{strategy} {x:g}x")
                    record: dict[str, Any] = {
                        "strategy": strategy,
                        "budget_x": x,
                        "budget_bytes": budget,
                        "dedup": dedup,
                    }
                    try:
                        planned = make_plan(strategy, workload, view, budget, dedup, sync, config, wire=wire)
                    except PlannerError as e:
                        record.update(feasible=False, error=str(e))
                        for key in ("inter_group_bytes", "intra_group_bytes", "sync_bytes", "modeled_time_s"):
                            record[key] = None
                        record["memory_per_gpu_bytes"] = None
                    else:
                        rep = planned.report
                        record.update(
                            feasible=True,
                            inter_group_bytes=rep.inter_group_bytes,
                            intra_group_bytes=rep.intra_group_bytes,
                            sync_bytes=rep.sync_bytes,
                            modeled_time_s=rep.modeled_time_s,
                            memory_per_gpu_bytes=rep.memory_per_gpu_bytes,
                        )
                        for key in ("objective_s", "lower_bound_s", "gap"):
                            if key in planned.plan.solver:
                                record[key] = planned.plan.solver[key]
                    records.append(record)
                    bar.advance(f"{strategy} {x:g}x")
    return records


def cmd_simulate(args: argparse.Namespace) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise ConfigError(f"--strategies: unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    workload, _orders, _vocab = _workload(args)
    view = cluster_view(load_topology(args.topology))
    dedups = {"on": [True], "off": [False], "both": [True, False]}[args.dedup]
    records = simulate_records(
        workload, view, args.budgets, dedups, strategies, args.sync, wire=args.wire_dtype
    )
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(
            f"workload {workload.name!r}: {len(workload.tables)} tables, {workload.num_rows:,} rows, "
            f"batch {workload.batch_size_per_gpu} per GPU; topology {args.topology}: "
            f"{view.num_ranks} GPUs in "
            f"{view.num_groups} groups; {args.sync} sync; {args.wire_dtype} vectors on the wire. Bytes per "
            "iteration at the bottleneck rank."
        )
        print(comparison_table(records))
        notes = tradeoffs(records)
        if notes:
            print("\nWhere FlexShard moves more bytes across groups than a baseline:")
            print("\n".join(f"- {line}" for line in notes))
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "--out")
    graph = load_topology(args.topology)
    cluster_view(graph)  # validates the derived view too
    print(summary(graph))
    if args.out:
        write_json(graph, args.out)
        print(f"\nwrote {args.out}")
    return 0


COMMANDS = {
    "stats": cmd_stats,
    "plan": cmd_plan,
    "simulate": cmd_simulate,
    "topology": cmd_topology,
    "probe": probe.run,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the training entry point has its own options
        from flexshard import train

        return train.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except InputError as e:  # bad input: one line; anything else is a bug and keeps its traceback
        message = first_line(e)
        print(f"flexshard {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
