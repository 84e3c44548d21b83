"""How much inter-group traffic can *any* synchronous replication scheme save on a workload?

An upper bound on the saving against row-wise, independent of FlexShard's tiers and optimizer.
Per iteration, a row of vector size ``V`` bytes (fp32) on ``N`` GPUs in ``G`` groups of ``g``:

* fetched (row-wise: one owner): every rank that looks it up pulls ``V`` forward and pushes ``V``
  backward, over inter-group links for the ``(N - g) / N`` of ranks outside the owner's group.
  With per-rank dedup a rank pays once if the row is in its batch (probability ``q = 1 - (1 - p)^n``
  for ``n`` lookups of per-lookup probability ``p``); without dedup, once per lookup (``n p``);
* replicated in every group: no lookup traffic, but after the step all ``G`` copies must hold the
  same row. If the row was touched anywhere (probability ``u = 1 - (1 - q)^N``), at least ``G - 1``
  groups must each receive ``V`` bytes, which is a lower bound for any synchronous scheme. The cost
  model's hierarchical all-reduce moves ``2 (G - 1) V`` across groups.

Each row takes the cheaper of the two, with memory unlimited, and the bound is the total against
row-wise, both spread evenly over the ``N`` ranks. Ids (8 bytes a lookup) are left out of both
sides. A partial replica (some groups only) does not beat this: the groups are symmetric, so each
one makes the same choice. Beside the bound, FlexShard's planned reduction at 2x (``make_plan`` +
``evaluate``, which counts ids, sync, the bottleneck rank and the budget). Run:

    .venv/bin/python experiments/replication_bound.py [--nodes 8] [--batches 512,2048,8192]
"""

from __future__ import annotations

import sys

import numpy as np
import study

from flexshard import workloads
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology import cluster_view, h100_cluster


def lookup_bytes(workload: Workload, num_ranks: int, group_size: int, dedup: bool) -> dict[str, float]:
    """Inter-group bytes per rank per iteration (forward + backward, ids excluded): row-wise, the best
    per-row choice with sync at its lower bound ``(G-1) V``, and with the model's all-reduce sync."""
    n_r, g = num_ranks, group_size
    groups = n_r // g
    remote = (n_r - g) / n_r
    out = {"row_wise": 0.0, "bound": 0.0, "allreduce": 0.0}
    for t in workload.tables:
        n = workload.lookups_per_gpu(t)
        rows, p = t.hist.rows.astype(np.float64), t.hist.prob
        q = -np.expm1(n * np.log1p(-np.minimum(p, 1.0 - 1e-15)))  # row in a rank's batch
        u = -np.expm1(n_r * np.log1p(-np.minimum(q, 1.0 - 1e-15)))  # row touched anywhere
        per_rank = q if dedup else n * p  # fetches per rank
        v = float(t.vector_bytes)
        fetch = rows * per_rank * 2 * v * remote
        sync_bound = rows * u * (groups - 1) * v / n_r
        sync_allreduce = rows * u * 2 * (groups - 1) / groups * v / g
        out["row_wise"] += float(fetch.sum())
        out["bound"] += float(np.minimum(fetch, sync_bound).sum())
        out["allreduce"] += float(np.minimum(fetch, sync_allreduce).sum())
    return out


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--nodes", type=int, default=8, help="h100 nodes of 8 GPUs (default 8)")
    p.add_argument("--batches", default="512,2048,8192", help="per-GPU batch sizes (default 512,2048,8192)")
    p.add_argument("--no-planner", action="store_true", help="skip FlexShard's planned reduction")
    args = p.parse_args(argv)
    view = cluster_view(h100_cluster(args.nodes))
    g = int(view.uniform_group_size)
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b.strip()):
        wl = workloads.default_workload(batch_size_per_gpu=batch)
        for dedup in (True, False):
            b = lookup_bytes(wl, view.num_ranks, g, dedup)
            planned = "-"
            if not args.no_planner:
                budget = budget_bytes(wl, view, 2.0)
                fs = make_plan("flexshard", wl, view, budget, dedup).report.inter_group_bytes
                rw = make_plan("row_wise", wl, view, budget, dedup).report.inter_group_bytes
                planned = f"{1 - fs / rw:.1%}"
            rows.append(
                [
                    batch,
                    "on" if dedup else "off",
                    f"{b['row_wise'] / 1e6:.2f} MB",
                    f"{1 - b['bound'] / b['row_wise']:.1%}",
                    f"{1 - b['allreduce'] / b['row_wise']:.1%}",
                    planned,
                ]
            )
            print(f"batch {batch}, dedup {'on' if dedup else 'off'} done", file=sys.stderr, flush=True)
    print(
        f"Default workload on h100:{args.nodes} ({view.num_ranks} GPUs, groups of {g}): the most inter-group "
        "traffic any synchronous replication can remove against row-wise"
    )
    header = [
        "batch/GPU",
        "dedup",
        "row-wise lookups",
        "bound: sync (G-1)V",
        "bound: all-reduce sync",
        "FlexShard at 2x (planned)",
    ]
    print(study.md_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
