"""Planner scaling: wall time and peak memory of ``make_plan("flexshard", ...)`` against problem size.

Three one-axis sweeps around a base point of 100 tables, 10^8 rows in all, 128 GPUs (16 H100 nodes x 8),
budget 2x row-wise memory, the analytic histograms of ``synthetic_workload`` (seed 0, calibrated
head + tail Zipf tables):

* total rows 10^6 .. 10^9 (100 tables, 128 GPUs);
* number of tables 1 .. 300 (10^8 rows, 128 GPUs);
* GPUs 8 .. 1024 (``h100_cluster(n)`` for n = 1 .. 128 nodes; 100 tables, 10^8 rows).

Every point runs in a fresh subprocess (``--point``) so that its peak memory is its own: wall time is
``time.perf_counter`` around ``make_plan`` (tier optimizer + placement + pricing, FlexShard's baseline
candidates included); peak memory is the process's ``ru_maxrss`` (and its growth over the resident size
after imports, before the workload is built) plus the largest ``ru_maxrss`` of its child processes (the
CBC solver PuLP runs; ``ru_maxrss`` of ``RUSAGE_CHILDREN``, which includes the image forked from the
interpreter). Building the workload and the topology view is timed apart. Writes
docs/results/solver_scaling.md and docs/results/solver_scaling.png and prints the table. Run:

    .venv/bin/python experiments/solver_scaling.py [--quick] [--no-write]

``--quick`` runs fewer points per axis.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import study

BASE = {"tables": 100, "rows": 10**8, "nodes": 16}


def rss_kib(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss  # KiB on Linux


def current_rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure(tables: int, rows: int, nodes: int, budget_x: float) -> dict:
    """Run in the child: plan one point and return its measurements."""
    from flexshard.workloads import synthetic_workload
    from solvers.planner import budget_bytes, make_plan
    from topology import cluster_view, h100_cluster

    base_rss = current_rss_kib()
    t = time.perf_counter()
    workload = synthetic_workload(num_tables=tables, total_rows=rows, seed=0)
    view = cluster_view(h100_cluster(nodes))
    setup_s = time.perf_counter() - t
    t = time.perf_counter()
    planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, budget_x))
    plan_s = time.perf_counter() - t
    s = planned.plan.solver
    return {
        "tables": tables,
        "rows": rows,
        "gpus": view.num_ranks,
        "buckets": int(sum(tb.hist.num_buckets for tb in workload.tables)),
        "setup_s": setup_s,
        "plan_s": plan_s,
        "peak_rss_mib": rss_kib() / 1024,
        "growth_mib": (rss_kib() - base_rss) / 1024,
        "cbc_peak_mib": rss_kib(resource.RUSAGE_CHILDREN) / 1024,
        "gap": s.get("gap"),
        "rounds": s.get("rounds"),
        "variables": s.get("variables"),
        "chosen": s.get("chosen", "optimizer"),
    }


def run_point(tables: int, rows: int, nodes: int, budget_x: float, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--point", str(tables), str(rows), str(nodes), "--budget", str(budget_x)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def figure(path: Path, sweeps: dict[str, list[dict]]) -> None:
    axes_spec = (
        ("rows", "total rows", "100 tables, 128 GPUs"),
        ("tables", "number of tables", "10^8 rows, 128 GPUs"),
        ("gpus", "GPUs", "100 tables, 10^8 rows"),
    )
    fig, axes = study.subplots(2, 3, figsize=(13, 7))
    for col, (key, xlabel, fixed) in enumerate(axes_spec):
        pts = sweeps[key]
        xs = [p[key] for p in pts]
        ax = axes[0, col]
        ax.loglog(xs, [p["plan_s"] for p in pts], "o-", color="tab:red", label="make_plan")
        ax.loglog(xs, [p["setup_s"] for p in pts], "s--", color="tab:gray", label="workload + view build")
        ax.set_title(f"vs {xlabel} ({fixed})", fontsize=10)
        ax.set_ylabel("wall time (s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = axes[1, col]
        ax.loglog(xs, [p["peak_rss_mib"] for p in pts], "o-", color="tab:blue", label="process peak RSS")
        ax.loglog(
            xs,
            [max(p["growth_mib"], 1e-1) for p in pts],
            "^-",
            color="tab:green",
            label="growth after imports",
        )
        ax.loglog(
            xs,
            [max(p["cbc_peak_mib"], 1e-1) for p in pts],
            "x:",
            color="tab:purple",
            label="child (CBC) peak RSS",
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("peak memory (MiB)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("FlexShard planner on 2 CPU cores: optimizer wall time and peak memory (log-log)")
    fig.tight_layout()
    study.save_figure(fig, path)


def markdown(sweeps: dict[str, list[dict]]) -> str:
    header = ["axis", "tables", "total rows", "GPUs", "histogram buckets", "make_plan", "build", "peak RSS"]
    header += ["growth after imports", "child (CBC) peak RSS", "gap to bound", "rounds", "plan from"]
    rows = []
    for axis, pts in sweeps.items():
        for p in pts:
            gap = f"{p['gap']:.3%}" if p["gap"] is not None else "-"
            size = [axis, p["tables"], f"{p['rows']:.0e}", p["gpus"], f"{p['buckets']:,}"]
            times = [f"{p['plan_s']:.2f} s", f"{p['setup_s']:.2f} s"]
            memory = [f"{p[k]:.0f} MiB" for k in ("peak_rss_mib", "growth_mib", "cbc_peak_mib")]
            rows.append(size + times + memory + [gap, p["rounds"], p["chosen"]])
    return study.md_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick="fewer points per axis")
    p.add_argument("--point", nargs=3, type=int, metavar=("TABLES", "ROWS", "NODES"), help=argparse.SUPPRESS)
    p.add_argument(
        "--budget", type=float, default=2.0, help="per-GPU budget, multiple of row-wise (default 2)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per point (default 300)")
    args = p.parse_args(argv)
    if args.point:
        print(json.dumps(measure(*args.point, args.budget)))
        return 0

    if args.quick:
        axes = {
            "rows": [10**6, 10**8, 10**9],
            "tables": [1, 10, 100],
            "gpus": [8, 128, 1024],
        }
    else:
        axes = {
            "rows": [10**6, 10**7, 10**8, 10**9],
            "tables": [1, 3, 10, 30, 100, 300],
            "gpus": [8, 64, 128, 256, 512, 1024],
        }
    start = time.perf_counter()
    sweeps: dict[str, list[dict]] = {}
    for axis, values in axes.items():
        sweeps[axis] = []
        for v in values:
            point = dict(BASE)
            if axis == "gpus":
                point["nodes"] = v // 8
            else:
                point[axis] = v
            rec = run_point(point["tables"], point["rows"], point["nodes"], args.budget, args.timeout)
            sweeps[axis].append(rec)
            print(
                f"{axis}={v}: make_plan {rec['plan_s']:.2f} s, peak {rec['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
            )
    elapsed = time.perf_counter() - start
    body = markdown(sweeps)
    print(body)
    print(f"\n{elapsed:.0f} s")
    if not args.no_write:
        figure(study.RESULTS / "solver_scaling.png", sweeps)
        flags = ["--quick"] if args.quick else []
        flags += ["--budget", f"{args.budget:g}"] if args.budget != 2.0 else []
        head = [
            "# Planner scaling: wall time and peak memory",
            "",
            study.generated(study.command(__file__, *flags), elapsed, "one subprocess per point"),
            "`make_plan` = `time.perf_counter` around",
            f'`make_plan("flexshard", ...)` at a {args.budget:g}x budget (tier optimizer, placement, pricing',
            "and the baseline candidates); `build` = synthetic workload (analytic histograms) and topology",
            "view. Peak RSS is the point's own process (`ru_maxrss`); `growth after imports` subtracts",
            "the resident size before the workload is built. CBC runs as a child process: its column is",
            "`ru_maxrss` of `RUSAGE_CHILDREN`, the largest child, which includes the interpreter image",
            "the child is forked from (so it is never below the parent's resident size at the fork).",
            "Histogram buckets are the planner's input size (rows never appear one by one).",
            "",
            "![planner wall time and peak memory](solver_scaling.png)",
            "",
        ]
        study.write_markdown(study.RESULTS / "solver_scaling.md", "\n".join(head) + "\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
