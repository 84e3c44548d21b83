"""Runtime memory benchmark: what one rank of ``ShardedSequenceEmbedding`` holds as a table grows.

For each table size, ``--world`` gloo ranks in ``--groups`` emulated groups build the module for one
synthetic table (``zipf_table``, ``--dim`` wide, the calibrated head plus tail) on a FlexShard plan at
``--budget`` x row-wise memory, run one forward / backward / step on a small batch, and report:

* the rank's shard: weights and row-wise Adagrad state of the hot, warm and cold rows it holds (bytes);
* its routing arrays: per row of the table in the ``exact`` layout (tier, owner, slot: 9 bytes), per
  replicated row in the ``compact`` one (id, hotness rank, hole: 20 bytes);
* the peak resident memory of the rank's process (``ru_maxrss``), which also counts torch itself
  (about 0.3-0.4 GB) and the transient full hotness order and owner deal of the build;
* the build time (plan read, routing, initialisation of the rank's rows) in seconds.

A full copy of the table on every rank, as a full-table initializer would need, is printed beside
them for scale. Each size runs in fresh processes, one size after another. Run:

    .venv/bin/python experiments/bench_runtime_memory.py [--rows 1e6,1e7,3e7] [--layouts exact,compact]
        [--world 4] [--groups 2]
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import study
import torch

from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.report import human_bytes
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.local import run_on_ranks
from flexshard.workloads import sample_ids, zipf_table
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.presets import h100_cluster
from topology.views import cluster_view

BATCH, LENGTH = 64, 20  # samples per rank, ids per sample of the smoke step


def table_workload(rows: int, dim: int) -> Workload:
    return Workload(f"memory-{rows}", (zipf_table("items", rows, dim, float(LENGTH)),), BATCH)


def measure(rank: int, world: int, plan_path: str, rows: int, dim: int, layout: str) -> dict:
    """On one rank: build the module, run one step, and report its memory (bytes) and build time (s)."""
    t0 = time.perf_counter()
    module = ShardedSequenceEmbedding(
        read_plan(plan_path), [("items", rows, dim)], None, init=0, optimizer="adagrad", layout=layout
    )
    build_s = time.perf_counter() - t0
    hist = table_workload(rows, dim).tables[0].hist
    ids = torch.as_tensor(sample_ids(hist, BATCH * LENGTH, np.random.default_rng(rank)))
    out = module({"items": (ids, torch.full((BATCH,), LENGTH, dtype=torch.int64))})
    out["items"].sum().backward()
    module.step()
    shards = module.shards.values()
    shard = sum(s.weights.nbytes + sum(t.nbytes for t in s.states.values()) for s in shards)
    routing = sum(a.nbytes for r in module.routing for a in r.arrays())
    return {
        "shard": shard,
        "routing": routing,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_s": build_s,
    }


def run_size(
    rows: int, dim: int, world: int, groups: int, budget_x: float, layout: str, tmp: Path
) -> list[dict]:
    wl = table_workload(rows, dim)
    view = cluster_view(h100_cluster(groups, world // groups))  # H100-class NVLink and NICs
    planned = make_plan("flexshard", wl, view, budget_bytes(wl, view, budget_x))
    plan_path = tmp / f"plan-{rows}.json"
    write_plan(plan_path, to_dict(planned.plan, wl, view, planned.report, "bench-runtime-memory"))
    return run_on_ranks(
        measure, world, str(plan_path), rows, dim, layout, timeout_s=1800.0, label=f"{rows:,} rows, {layout}"
    )


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--rows", default="1e6,1e7,3e7", help="comma-separated table sizes (default 1e6,1e7,3e7)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument(
        "--budget", type=float, default=2.0, help="per-GPU budget, multiple of row-wise (default 2)"
    )
    p.add_argument("--layouts", default="exact,compact", help="routing layouts to measure (default both)")
    args = p.parse_args(argv)
    sizes = [int(float(x)) for x in args.rows.split(",") if x.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-runtime-memory-") as tmp:
        for rows in sizes:
            for layout in layouts:
                print(f"{rows:,} rows, {layout}: {args.world} ranks ...", file=sys.stderr, flush=True)
                ranks = run_size(rows, args.dim, args.world, args.groups, args.budget, layout, Path(tmp))
                records.append((rows, layout, max(ranks, key=lambda r: r["peak_rss"])))
    header = [
        "rows",
        "layout",
        "full table",
        "shard (max rank)",
        "routing",
        "routing B/row",
        "peak RSS",
        "build s",
    ]
    table = [
        [
            f"{rows:,}",
            layout,
            human_bytes(rows * args.dim * 4),
            human_bytes(r["shard"]),
            human_bytes(r["routing"]),
            f"{r['routing'] / rows:.2f}",
            human_bytes(r["peak_rss"]),
            f"{r['build_s']:.2f}",
        ]
        for rows, layout, r in records
    ]
    print(
        f"ShardedSequenceEmbedding, one table of dim {args.dim}, FlexShard plan at {args.budget:g}x, "
        f"{args.world} gloo ranks in {args.groups} groups (per rank; the rank with the highest peak RSS)"
    )
    print(study.md_table(header, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
