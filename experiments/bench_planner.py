"""Planner scaling benchmark: 100 tables, 10^9 rows in total, 128 GPUs (16 H100-class nodes).

Prints wall time and peak resident memory of each phase; the targets are at most 60 s and 8 GB
for the whole run on 2 CPU cores. Run:

    .venv/bin/python experiments/bench_planner.py [--tables 100] [--rows 1e9] [--nodes 16] [--budget 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from flexshard.workloads import synthetic_workload
from solvers.planner import budget_bytes, make_plan
from topology import cluster_view, h100_cluster

TARGET_S = 60.0
TARGET_PEAK_BYTES = 8 * 2**30


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=100)
    p.add_argument("--rows", type=float, default=1e9)
    p.add_argument("--nodes", type=int, default=16, help="8-GPU nodes (16 -> 128 GPUs)")
    p.add_argument("--budget", type=float, default=2.0, help="per-GPU budget, multiple of row-wise")
    args = p.parse_args(argv)

    phases: list[tuple[str, float]] = []
    start = time.perf_counter()
    t = time.perf_counter()
    workload = synthetic_workload(num_tables=args.tables, total_rows=int(args.rows), seed=0)
    phases.append(("build workload statistics", time.perf_counter() - t))
    t = time.perf_counter()
    view = cluster_view(h100_cluster(args.nodes))
    phases.append(("build topology", time.perf_counter() - t))
    t = time.perf_counter()
    planned = make_plan("flexshard", workload, view, budget_bytes(workload, view, args.budget))
    phases.append(("optimize tiers + placement + evaluate", time.perf_counter() - t))
    total = time.perf_counter() - start
    peak = peak_rss_bytes()

    s = planned.plan.solver
    print(f"workload: {len(workload.tables)} tables, {workload.num_rows:,} rows; {view.num_ranks} GPUs")
    for name, secs in phases:
        print(f"  {name:<40s} {secs:8.2f} s")
    print(f"  {'total':<40s} {total:8.2f} s   (target <= {TARGET_S:.0f} s)")
    print(f"peak memory: {peak / 2**30:.2f} GiB   (target <= {TARGET_PEAK_BYTES / 2**30:.0f} GiB)")
    print(
        f"optimizer: gap {s['gap']:.3%} to the lower bound, {s['variables']} variables, "
        f"{s['rounds']} rounds; "
        f"modeled time {planned.report.modeled_time_s * 1e3:.3f} ms/iteration"
    )
    ok = total <= TARGET_S and peak <= TARGET_PEAK_BYTES
    print("targets met" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
