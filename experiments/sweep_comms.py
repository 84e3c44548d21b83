"""Communication sweep: FlexShard against every baseline over budget, cluster size, skew and real data.

For each point, every strategy of ``solvers.planner.STRATEGIES`` (FlexShard, table-wise, row-wise, 2D,
hybrid, data-parallel) is planned with ``make_plan`` under the same per-GPU budget and priced by the
cost model: inter-group bytes, intra-group bytes and replica-sync bytes per iteration at the
bottleneck rank (max over ranks of max(send, recv)), and the modeled communication time of the slowest
rank (bytes over bandwidth per link class; latency not included); FlexShard is planned for bytes
(``--objective bytes``). Each sweep varies one axis around the
base point (embedded default workload, ``h100:8`` = 8 nodes x 8 H100, budget 2x row-wise memory) and is
run with per-rank id dedup on and off:

* budget: 1x .. 8x row-wise memory;
* cluster: ``h100_cluster(n)`` for n = 2 .. 128 nodes of 8 GPUs, and ``nvl72_pod(p)`` for p = 1, 2, 4;
* skew: ``default_workload(alpha=a)`` for a = 0.6, 0.8, 1.0, 1.2 (every table's Zipf exponent);
* data: every real data set found under ``flexshard.workloads.data_root()`` (absent ones are skipped
  with a note), loaded with ``load_workload`` (dim 64, batch 512 per GPU).

Writes docs/results/comms.md (tables) and docs/results/comms_*.png (figures), and prints the tables.
FlexShard's CBC time limit is lowered to 2 s per solve (the integer finish otherwise runs up to 120 s on
a few small real tables); each plan's gap to the Lagrangian lower bound is in the tables. Run:

    .venv/bin/python experiments/sweep_comms.py [--quick] [--no-write]

``--quick`` uses fewer budgets and clusters and skips the integer finish (about 1 minute on 2 cores).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import study

from core.errors import PlannerError
from flexshard import workloads
from flexshard.report import human_bytes, tradeoffs
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from solvers.types import Workload
from topology import ClusterView, cluster_view, h100_cluster, nvl72_pod

LABELS = {
    "flexshard": "FlexShard",
    "table_wise": "table-wise",
    "row_wise": "row-wise",
    "row_wise_group_dedup": "row-wise, group fetch",
    "2d": "2D (TorchRec-style)",
    "hybrid": "hybrid (HugeCTR-style)",
    "data_parallel": "data-parallel",
}
STYLE = {
    "flexshard": ("tab:red", "o", "-"),
    "table_wise": ("tab:gray", "x", ":"),
    "row_wise": ("black", "s", "--"),
    "row_wise_group_dedup": ("tab:orange", "P", "--"),
    "2d": ("tab:blue", "^", "-"),
    "hybrid": ("tab:green", "D", "-"),
    "data_parallel": ("tab:purple", "v", "-"),
}
BASE_NODES = 8
BASE_BUDGET = 2.0


def data_sets() -> list[tuple[str, Path]]:
    """(label, path) of every real data set the readers take; missing ones are reported and skipped."""
    root = workloads.data_root()
    wanted: list[tuple[str, Path]] = []
    for stem in ("Beauty", "Sports_and_Outdoors", "Toys_and_Games", "Yelp", "LastFM"):
        wanted.append((stem, root / "amazon-yelp-sequences" / f"{stem}.txt"))
    wanted.append(("gowalla", root / "gowalla-lightgcn" / "train_reconstructed.txt"))
    for name in ("lastfm", "tw_ny", "go_sf", "go_ny"):
        wanted.append((f"rc-{name}", root / "repeat-consumption-uci" / name))
    wanted.append(("ml-100k", root / "movielens-100k-recbole" / "ml-100k.inter"))
    found = []
    for label, path in wanted:
        if path.exists():
            found.append((label, path))
        else:
            study.note_missing(path, f"data set {label}")
    return found


def price_all(
    workload: Workload, view: ClusterView, budget_x: float, dedup: bool, quick: bool
) -> dict[str, dict]:
    """One record per strategy: bytes per iteration at the bottleneck rank and modeled time."""
    budget = budget_bytes(workload, view, budget_x)
    out = {}
    for strategy in STRATEGIES:
        try:
            config = study.optimizer_config(quick, objective="bytes")  # a study of bytes
            planned = make_plan(strategy, workload, view, budget, dedup, config=config)
        except PlannerError:
            out[strategy] = {"feasible": False}
            continue
        rep = planned.report
        out[strategy] = {
            "feasible": True,
            "inter": rep.inter_group_bytes,
            "intra": rep.intra_group_bytes,
            "sync": rep.sync_bytes,
            "time_s": rep.modeled_time_s,
            "gap": planned.plan.solver.get("gap"),
        }
    rw = out["row_wise"]
    for rec in out.values():
        rec["reduction"] = reduction(rec, rw)
    return out


def reduction(rec: dict, rw: dict) -> float:
    """1 - inter / row-wise inter; NaN when infeasible or when row-wise has no inter-group bytes."""
    if not rec["feasible"] or not rw["feasible"] or rw["inter"] <= 1e-9 * max(rw["intra"], 1.0):
        return math.nan
    return 1.0 - rec["inter"] / rw["inter"]


def table(title: str, axis: str, rows: list[tuple[str, bool, dict[str, dict]]]) -> str:
    header = [axis, "dedup", "strategy", "inter-group", "intra-group", "sync", "modeled time"]
    header += ["inter-group vs row-wise", "gap to bound"]
    cells = []
    for value, dedup, recs in rows:
        for s in STRATEGIES:
            r = recs[s]
            if not r["feasible"]:
                cells.append([value, _onoff(dedup), LABELS[s], "infeasible", "", "", "", "", ""])
                continue
            red = "n/a" if math.isnan(r["reduction"]) else f"{0.0 - r['reduction'] + 0.0:+.1%}"
            if s == "row_wise":
                red = "(reference)" if red != "n/a" else red
            gap = f"{r['gap']:.2%}" if r.get("gap") is not None else ""
            cells.append(
                [value, _onoff(dedup), LABELS[s], human_bytes(r["inter"]), human_bytes(r["intra"])]
                + [human_bytes(r["sync"]), f"{r['time_s'] * 1e3:.3f} ms", red, gap]
            )
    return f"#### {title}\n\n" + study.md_table(header, cells)


def trade_offs(swept: list[tuple[str, list]]) -> str:
    """The points where FlexShard moves more bytes across groups than some baseline, and why
    (:func:`flexshard.report.tradeoffs`)."""
    records = [
        {
            "sweep": title,
            "point": value,
            "dedup": dedup,
            "strategy": s,
            "feasible": r["feasible"],
            "inter_group_bytes": r.get("inter"),
            "intra_group_bytes": r.get("intra"),
            "modeled_time_s": r.get("time_s"),
        }
        for title, rows in swept
        for value, dedup, recs in rows
        for s, r in recs.items()
    ]
    notes = tradeoffs(records, ("sweep", "point", "dedup"))
    head = "#### Where FlexShard moves more bytes across groups than a baseline\n\n"
    if not notes:
        return (
            head + "Nowhere: at every point FlexShard's inter-group bytes are at or below every baseline's."
        )
    return head + "\n".join(f"- {line}" for line in notes)


def summary(title: str, axis: str, rows: list[tuple[str, bool, dict[str, dict]]]) -> str:
    """Inter-group bytes saved vs row-wise by every strategy, and FlexShard's and row-wise's times."""
    others = [s for s in STRATEGIES if s != "row_wise"]
    header = [axis, "dedup", "row-wise inter-group", *(f"{LABELS[s]} saving" for s in others)]
    header += ["FlexShard time", "row-wise time", "speed-up"]
    cells = []
    for value, dedup, recs in rows:
        rw, fs = recs["row_wise"], recs["flexshard"]
        saved = ["infeasible" if not recs[s]["feasible"] else _pct(recs[s]["reduction"]) for s in others]
        speed = f"{rw['time_s'] / fs['time_s']:.2f}x" if fs["time_s"] > 0 else "n/a"
        times = [f"{fs['time_s'] * 1e3:.3f} ms", f"{rw['time_s'] * 1e3:.3f} ms", speed]
        cells.append([value, _onoff(dedup), human_bytes(rw["inter"]), *saved, *times])
    return f"#### {title}: summary\n\n" + study.md_table(header, cells)


def _onoff(dedup: bool) -> str:
    return "on" if dedup else "off"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def line_figure(
    path: Path, xlabel: str, series: dict[bool, list[tuple[float, dict[str, dict]]]], title: str, logx: bool
) -> None:
    """Reduction of inter-group bytes vs row-wise against one axis; a panel per dedup setting."""
    fig, axes = study.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, dedup in zip(axes, (True, False), strict=True):
        pts = series[dedup]
        for s in STRATEGIES:
            if s == "row_wise":
                continue
            xs = [x for x, _ in pts]
            ys = [100 * recs[s]["reduction"] for _, recs in pts]
            if all(math.isnan(y) for y in ys):
                ax.plot([], [], label=f"{LABELS[s]} (infeasible)", color=STYLE[s][0], ls=STYLE[s][2])
                continue
            color, marker, ls = STYLE[s]
            ax.plot(xs, ys, marker=marker, ls=ls, color=color, label=LABELS[s])
        ax.axhline(0, color="black", lw=0.8, ls="--")
        ax.set_title(f"per-rank id dedup {'on' if dedup else 'off'}")
        ax.set_xlabel(xlabel)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("inter-group bytes saved vs row-wise (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    study.save_figure(fig, path)


def cluster_figure(path: Path, h100: dict, nvl: dict) -> None:
    fig, axes = study.subplots(1, 2, figsize=(11, 5.0), sharey=True)
    for ax, dedup in zip(axes, (True, False), strict=True):
        for s in STRATEGIES:
            if s == "row_wise":
                continue
            color, marker, _ = STYLE[s]
            xs = [x for x, _ in h100[dedup]]
            ys = [100 * recs[s]["reduction"] for _, recs in h100[dedup]]
            ax.plot(xs, ys, marker=marker, ls="-", color=color, label=f"{LABELS[s]}, H100 nodes")
            xs = [x for x, _ in nvl[dedup]]
            ys = [100 * recs[s]["reduction"] for _, recs in nvl[dedup]]
            ax.plot(xs, ys, marker=marker, ls=":", color=color, mfc="none", ms=8, label=f"{LABELS[s]}, NVL72")
        ax.axhline(0, color="black", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (H100: 8 per NVLink group; NVL72: 72 per group)")
        ax.set_title(f"per-rank id dedup {'on' if dedup else 'off'}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("inter-group bytes saved vs row-wise (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7)
    fig.suptitle(
        f"Default workload, budget {BASE_BUDGET:g}x row-wise: cluster size (one NVL72 pod has no inter-group)"
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    study.save_figure(fig, path)


def dataset_figure(path: Path, rows: dict[bool, list[tuple[str, dict[str, dict]]]]) -> None:
    strategies = [s for s in STRATEGIES if s != "row_wise"]
    fig, axes = study.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    for ax, dedup in zip(axes, (True, False), strict=True):
        names = [n for n, _ in rows[dedup]]
        width = 0.8 / len(strategies)
        for k, s in enumerate(strategies):
            ys = [100 * recs[s]["reduction"] for _, recs in rows[dedup]]
            xs = [i + (k - (len(strategies) - 1) / 2) * width for i in range(len(names))]
            label = LABELS[s] + (" (infeasible)" if all(math.isnan(y) for y in ys) else "")
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, color=STYLE[s][0], label=label)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("inter-group bytes saved\nvs row-wise (%)")
        ax.set_title(f"per-rank id dedup {'on' if dedup else 'off'}")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=3)
    fig.suptitle(
        f"Real data sets on h100:{BASE_NODES} (64 GPUs), budget {BASE_BUDGET:g}x row-wise, batch 512/GPU"
    )
    fig.tight_layout()
    study.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick="fewer points, no integer finish (about 1 minute)")
    args = p.parse_args(argv)
    start = time.perf_counter()

    budgets = (1.0, 1.5, 2.0, 8.0) if args.quick else (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    nodes = (2, 8, 32) if args.quick else (2, 4, 8, 16, 32, 64, 128)
    pods = (1, 2) if args.quick else (1, 2, 4)
    alphas = (0.6, 0.8, 1.0, 1.2)
    dedups = (True, False)
    default = workloads.default_workload()
    base_view = cluster_view(h100_cluster(BASE_NODES))
    summaries: list[str] = []
    details: list[str] = []
    swept: list[tuple[str, list]] = []  # every sweep's rows, for the trade-off notes
    figures: list[tuple[str, str]] = []

    # budget
    rows, series = [], {d: [] for d in dedups}
    for dedup in dedups:
        for x in budgets:
            recs = price_all(default, base_view, x, dedup, args.quick)
            rows.append((f"{x:g}x", dedup, recs))
            series[dedup].append((x, recs))
    title = f"Budget (default workload, h100:{BASE_NODES})"
    swept.append((title, rows))
    summaries.append(summary(title, "budget", rows))
    details.append(table(title, "budget", rows))
    if not args.no_write:
        line_figure(
            study.RESULTS / "comms_budget.png",
            "per-GPU memory budget (x row-wise memory)",
            series,
            f"Default workload on h100:{BASE_NODES} (64 GPUs): memory budget",
            logx=True,
        )
        figures.append(("comms_budget.png", "inter-group saving vs row-wise against the budget"))
    print(f"budget sweep done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    # cluster size
    rows, h100, nvl = [], {d: [] for d in dedups}, {d: [] for d in dedups}
    views = [(f"h100:{n} ({8 * n} GPUs)", 8 * n, h100, cluster_view(h100_cluster(n))) for n in nodes]
    views += [(f"nvl72:{q} ({72 * q} GPUs)", 72 * q, nvl, cluster_view(nvl72_pod(q))) for q in pods]
    for dedup in dedups:
        for label, gpus, bucket, view in views:
            recs = price_all(default, view, BASE_BUDGET, dedup, args.quick)
            rows.append((label, dedup, recs))
            bucket[dedup].append((gpus, recs))
    title = f"Cluster size (default workload, budget {BASE_BUDGET:g}x)"
    swept.append((title, rows))
    summaries.append(summary(title, "cluster", rows))
    details.append(table(title, "cluster", rows))
    if not args.no_write:
        cluster_figure(study.RESULTS / "comms_cluster.png", h100, nvl)
        figures.append(("comms_cluster.png", "inter-group saving vs row-wise against cluster size"))
    print(f"cluster sweep done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    # skew
    rows, series = [], {d: [] for d in dedups}
    for dedup in dedups:
        for a in alphas:
            recs = price_all(workloads.default_workload(alpha=a), base_view, BASE_BUDGET, dedup, args.quick)
            rows.append((f"{a:g}", dedup, recs))
            series[dedup].append((a, recs))
    title = f"Skew (default tables, alpha overridden; h100:{BASE_NODES}, 2x)"
    swept.append((title, rows))
    summaries.append(summary(title, "alpha", rows))
    details.append(table(title, "alpha", rows))
    if not args.no_write:
        line_figure(
            study.RESULTS / "comms_alpha.png",
            "Zipf exponent alpha of every table",
            series,
            f"Default tables with alpha overridden, h100:{BASE_NODES}, budget {BASE_BUDGET:g}x",
            logx=False,
        )
        figures.append(("comms_alpha.png", "inter-group saving vs row-wise against alpha"))
    print(f"skew sweep done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    # real data
    rows, by_set = [], {d: [] for d in dedups}
    found = data_sets()
    loaded = [(label, workloads.load_workload(path)) for label, path in found]
    for dedup in dedups:
        for label, w in loaded:
            recs = price_all(w, base_view, BASE_BUDGET, dedup, args.quick)
            rows.append((label, dedup, recs))
            by_set[dedup].append((label, recs))
    if loaded:
        title = f"Real data sets (h100:{BASE_NODES}, budget {BASE_BUDGET:g}x)"
        swept.append((title, rows))
        summaries.append(summary(title, "data set", rows))
        details.append(table(title, "data set", rows))
        if not args.no_write:
            dataset_figure(study.RESULTS / "comms_datasets.png", by_set)
            figures.append(("comms_datasets.png", "inter-group saving vs row-wise per real data set"))
    print(f"data sweep done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    elapsed = time.perf_counter() - start
    body = "\n\n".join([*summaries, trade_offs(swept), "### Full tables", *details])
    print(body)
    print(f"\n{elapsed:.0f} s")
    if not args.no_write:
        cmd = study.command(__file__, *(["--quick"] if args.quick else []))
        head = [
            "# Communication per iteration: FlexShard vs baselines",
            "",
            study.generated(cmd, elapsed),
            "Modeled bytes and times from the cost model (docs/cost_model.md), not GPU measurements.",
            "Bytes are per iteration at the bottleneck rank, max(send, recv), sync included in inter/intra;",
            "`sync` is the replica gradient-sync part over both link classes. Modeled time = slowest rank's",
            "bytes / bandwidth per link class, latency excluded. `inter-group vs row-wise` is the change",
            "against row-wise (negative = fewer bytes). Infeasible = the strategy cannot fit the budget",
            "(table-wise needs a whole table on one GPU; data-parallel a whole table on every GPU).",
            "FlexShard is planned for bytes here (`flexshard plan --objective bytes`): this is a study of",
            "bytes. `plan`'s default, the modeled step pipelined, may trade bytes for fewer collectives;",
            "its plans are priced in step_time.md and tier_savings.md.",
            "",
        ]
        head += [f"![{text}]({name})" + "\n" for name, text in figures]
        study.write_markdown(study.RESULTS / "comms.md", "\n".join(head) + "\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
