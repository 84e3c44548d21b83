"""``flexshard`` command line: stats, plan, simulate, topology, probe, train, bench.

Bad input ends with one line on stderr naming the field and the value, and exit status 2; no
output file is written unless the command succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from core.errors import ConfigError, InputError, PlannerError
from core.osutil import check_writable
from core.vocabulary import SyncMode, WireDtype
from flexshard import logs, probe, workloads
from flexshard.checkpoint_dcp import add_parser as add_convert_parser
from flexshard.checkpoint_dcp import cmd_convert
from flexshard.cli_bench import add_parser as add_bench_parser
from flexshard.cli_bench import cmd_bench
from flexshard.cli_common import (
    Parser,
    add_objective,
    first_line,
    optimizer_config,
    positive_float,
    positive_int,
    run_program,
)
from flexshard.cli_stats import cmd_stats
from flexshard.plan_file import to_dict, write_plan
from flexshard.progress import Progress
from flexshard.report import comparison_table, plan_report, plan_shape, tradeoffs
from flexshard.runtime.optimizers import OPTIMIZER_CHOICES
from flexshard.simulate_headline import LEGEND, TORCHREC_DEFAULT, baseline_keys, headline
from flexshard.step_report import (
    GROUP_DEDUP,
    TORCHREC_ROW,
    plan_step_lines,
    step_record,
    step_table,
    tier_savings,
    torchrec_record,
)
from flexshard.training.planning import priced_for
from flexshard.workloads.readers import FORMATS
from solvers.optimizer import OptimizerConfig
from solvers.planner import STRATEGIES, budget_bytes, make_plan, torchrec_step
from topology import cluster_view, load_topology, summary, write_json

log = logging.getLogger(__name__)

DEFAULT_TOPOLOGY = "h100:8"
DEFAULT_BUDGETS = "1,1.5,2,3,4,6,8"


STATS_FORMATS = (*FORMATS, "rows")  # stats --format: the readers' formats and row statistics


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
        "--topology",
        default=DEFAULT_TOPOLOGY,
        help=f"topology JSON or preset, e.g. h100:8, nvl72:2, skewed:8 (default {DEFAULT_TOPOLOGY})",
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
    add_objective(p)
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="samples per GPU per iteration, replacing the workload's own (row statistics unchanged; "
        "default: the workload's)",
    )
    p.add_argument(
        "--tables",
        metavar="NAME,...",
        help="plan these of the workload's tables only, in this order, e.g. the tables a model looks up "
        "(comma-separated; default: every table)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flexshard", description=__doc__.splitlines()[0])
    logs.add_log_level(parser)
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
        choices=STATS_FORMATS,
        help="auto (by extension, then content; Parquet with columns table, row, lookups is row "
        "statistics), seq, csv, recbole, parquet, rows (default auto)",
    )
    st.add_argument("--dim", type=int, default=64, help="embedding dimension of every table (default 64)")
    st.add_argument(
        "--batch-size",
        type=int,
        default=workloads.DEFAULT_BATCH_SIZE_PER_GPU,
        help=f"samples per GPU per iteration (default {workloads.DEFAULT_BATCH_SIZE_PER_GPU})",
    )
    st.add_argument(
        "--max-len", type=int, default=None, help="truncate each history to its last N ids (default: all)"
    )
    st.add_argument(
        "--num-rows",
        action="append",
        default=[],
        metavar="TABLE=ROWS",
        help="declare a table's size; ids at or past it are errors (repeatable; default: sizes from the "
        "data)",
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
        "sample (default: next-item for one history file, else off)",
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
    st.add_argument("-o", "--out", required=True, help="stats file to write (.npz; required)")

    pl = sub.add_parser("plan", help="workload + topology + budget -> plan file and report")
    _add_inputs(pl)
    pl.add_argument(
        "--budget",
        type=positive_float,
        default=2.0,
        help="memory per GPU for embeddings and optimizer state, as a multiple of what row-wise sharding "
        "needs (1 = no room to replicate; default %(default)s)",
    )
    pl.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="flexshard",
        help="how rows are placed: flexshard (the tier optimizer) or a baseline to compare with "
        "(default %(default)s)",
    )
    pl.add_argument("--no-dedup", action="store_true", help="model no per-rank id dedup (default: dedup on)")
    pl.add_argument(
        "--optimizer",
        choices=OPTIMIZER_CHOICES,
        help="price the state of this row optimizer (train --optimizer): sgd 0 bytes per row, "
        "rowwise_adagrad (or adagrad) 4, elementwise_adagrad 4 x dim, adam 8 x dim (default: the "
        "workload's own optimizer_bytes_per_row)",
    )
    pl.add_argument("-o", "--out", help="plan file to write (JSON; default: none, the report only)")
    pl.add_argument("--json", action="store_true", help="print the plan document instead of the report")

    sm = sub.add_parser("simulate", help="compare FlexShard with every baseline over budgets")
    _add_inputs(sm)
    sm.add_argument(
        "--budgets",
        type=_budgets,
        default=_budgets(DEFAULT_BUDGETS),
        help=f"comma-separated per-GPU budgets, multiples of row-wise memory (default {DEFAULT_BUDGETS})",
    )
    sm.add_argument(
        "--dedup",
        choices=("on", "off", "both"),
        default="on",
        help="price with per-rank id dedup (on), without (off), or both (default %(default)s)",
    )
    sm.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated subset of the strategies to compare (default: all, %(default)s)",
    )
    sm.add_argument("--json", action="store_true", help="print a JSON list of records instead of the table")

    tr = sub.add_parser(
        "train",
        help="train a sequence model on a plan (also torchrun -m flexshard.train; see train --help)",
        add_help=False,
    )
    tr.add_argument("args", nargs=argparse.REMAINDER, help="the options of flexshard train --help")

    tp = sub.add_parser("topology", help="summarise a topology; write it as JSON")
    tp.add_argument(
        "--topology",
        default=DEFAULT_TOPOLOGY,
        help=f"topology JSON or preset, e.g. h100:8, nvl72:2, skewed:8 (default {DEFAULT_TOPOLOGY})",
    )
    tp.add_argument("-o", "--out", help="write the node-link JSON here (default: none, the summary only)")

    pr = sub.add_parser("probe", help="measure this cluster (under torchrun, or --nproc local ranks)")
    probe.add_arguments(pr)
    be = add_bench_parser(sub)
    cv = add_convert_parser(sub)
    for command in (
        st,
        pl,
        sm,
        tp,
        pr,
        be,
        cv,
    ):  # `flexshard plan --log-level debug` as well as before the command
        logs.add_log_level(command, default=None)
    return parser


def _workload(args: argparse.Namespace) -> tuple[workloads.Workload, dict, workloads.Vocabulary | None]:
    """``--workload``, its hotness orders and vocabulary of string ids, with ``--batch-size`` replacing its
    per-GPU batch when given."""
    workload, orders, vocab = workloads.load_workload_full(args.workload)
    if args.batch_size is not None:
        workload = dataclasses.replace(workload, batch_size_per_gpu=args.batch_size)
    if args.tables is not None:
        workload = only_tables(workload, args.tables)
    return workload, orders, vocab


def only_tables(workload: workloads.Workload, names: str) -> workloads.Workload:
    """``workload`` with the tables ``names`` (comma-separated, ``--tables``) alone, in that order; a
    ConfigError naming the value where one is not among its tables, is named twice, or none is named."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    specs = {t.name: t for t in workload.tables}
    if not wanted:
        raise ConfigError(f"--tables: {names!r} names no table; the workload's: {', '.join(specs)}")
    for name in wanted:
        if name not in specs:
            raise ConfigError(f"--tables: no table {name!r} in the workload; its tables: {', '.join(specs)}")
        if wanted.count(name) > 1:
            raise ConfigError(f"--tables: table {name!r} named twice in {names!r}")
    return dataclasses.replace(workload, tables=tuple(specs[n] for n in wanted))


def cmd_plan(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "--out", [("--workload", args.workload), ("--topology", args.topology)])
    workload, orders, vocab = _workload(args)
    if args.optimizer:
        workload = priced_for(workload, args.optimizer)
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
            optimizer_config(args),
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
        baseline = None
        if args.strategy == "flexshard":
            try:
                baseline = make_plan(
                    GROUP_DEDUP, workload, view, budget, not args.no_dedup, args.sync, wire=args.wire_dtype
                ).step
            except PlannerError:
                baseline = None
        print("\n".join(plan_step_lines(planned.plan, planned.step, baseline)))
    if args.out:
        log.info(f"wrote {args.out}")
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
                        record.update(step_record(None))
                        if (strategy, dedup) == TORCHREC_DEFAULT:
                            record.update(torchrec_record(None))
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
                        record.update(plan_shape(planned.plan))
                        record.update(step_record(planned.step))
                        if (strategy, dedup) == TORCHREC_DEFAULT:  # also in TorchRec's own collectives
                            theirs = torchrec_step(workload, view, planned.plan, config)
                            record.update(torchrec_record(theirs))
                        for key in ("objective_s", "lower_bound_s", "gap", "chosen"):
                            if key in planned.plan.solver:
                                record[key] = planned.plan.solver[key]
                    records.append(record)
                    log.debug(
                        f"simulate: {strategy} at {x:g}x, dedup {'on' if dedup else 'off'}: "
                        + (f"{record['modeled_time_s'] * 1e3:.3f} ms" if record["feasible"] else "infeasible")
                    )
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
    config = optimizer_config(args)
    records = simulate_records(
        workload, view, args.budgets, dedups, strategies, args.sync, config, wire=args.wire_dtype
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
        print(LEGEND)
        extra = []
        for (dedup, strategy), budgets in baseline_keys(records).items():  # one pass each (one bar)
            extra += simulate_records(
                workload, view, budgets, [dedup], [strategy], args.sync, config, wire=args.wire_dtype
            )
        print("\n" + "\n".join(headline(records, extra)))
        print(
            "\nModeled step time (ms, slowest rank): collective latency + bytes / bandwidth + local work"
            + (" - overlapped (pipelined, --pipeline on)" if config.overlap else "")
        )
        print(step_table(records, extra))
        print(f"{TORCHREC_ROW}: the row-wise plan without dedup in TorchRec's own collectives")
        saved_extra = []
        for dedup in dedups:
            budgets = [
                r["budget_x"]
                for r in records
                if r["strategy"] == "flexshard" and r["dedup"] is dedup and GROUP_DEDUP not in strategies
            ]
            if budgets:
                saved_extra += simulate_records(
                    workload, view, budgets, [dedup], [GROUP_DEDUP], args.sync, config, wire=args.wire_dtype
                )
        print("\n".join(tier_savings(records, saved_extra)))
        notes = tradeoffs(records)
        if notes:
            print("\nWhere FlexShard moves more bytes across groups than a baseline:")
            print("\n".join(f"- {line}" for line in notes))
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, "--out", [("--topology", args.topology)])
    graph = load_topology(args.topology)
    cluster_view(graph)  # validates the derived view too
    print(summary(graph))
    if args.out:
        write_json(graph, args.out)
        log.info(f"wrote {args.out}")
    return 0


COMMANDS = {
    "stats": cmd_stats,
    "plan": cmd_plan,
    "simulate": cmd_simulate,
    "topology": cmd_topology,
    "probe": probe.run,
    "bench": cmd_bench,
    "convert-checkpoint": cmd_convert,
}


def main(argv: Sequence[str] | None = None) -> int:
    """The ``flexshard`` command's exit status (a launcher's worker run as the program ends the process
    with it: :func:`flexshard.cli_common.run_program`)."""
    return run_program(_main, argv)


def _main(argv: list[str]) -> int:
    level = argv[:2] if argv[:1] == ["--log-level"] else argv[:1] if argv[0:1] != ["train"] else []
    level = level if level and level[0].startswith("--log-level") else []  # `flexshard --log-level L train`
    if argv[len(level) : len(level) + 1] == ["train"]:  # the training entry point has its own options
        from flexshard import train

        return train.main([*level, *argv[len(level) + 1 :]])
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return COMMANDS[args.command](args)
    except InputError as e:  # bad input: one line; anything else is a bug and keeps its traceback
        message = first_line(e)
        print(f"flexshard {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
