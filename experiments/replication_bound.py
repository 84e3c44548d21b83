"""How far can where rows live take inter-group traffic? A per-row bound over the exact schemes.

Per iteration, a row of vector size ``V`` bytes (fp32) and per-lookup probability ``p``, on ``N`` GPUs
in ``G`` groups of ``g``, each GPU looking up ``n`` ids of its table:

* **fetched once per group that looks it up** (the group fetch): each of the ``G - 1`` groups other
  than the owner's that has the row in its batch (probability ``t = 1 - (1 - p)^(g n)``) pulls it once
  across the fabric and pushes one summed gradient back: ``(G - 1) t (2 V + 8)`` bytes (with the id);
* **replicated in every group**, its gradient kept in sync by a bandwidth-optimal all-reduce: when the
  row was touched anywhere (``u = 1 - (1 - p)^(N n)``) each group sends and receives
  ``2 (G - 1) / G * V``, the known lower bound of an all-reduce: ``2 (G - 1) u V`` in all.

Each row takes the cheaper of the two, memory unlimited; the bound is their total, spread evenly over
the ``N`` ranks. Beside it, against row-wise's flat fetch spread evenly the same way (each rank pulls its
own ids, per-rank deduplicated or not: with dedup off, TorchRec's default), FlexShard's planned bytes at
2x (``make_plan`` + ``evaluate``: the bottleneck rank, with split sizes and sync masks) and its distance
from the bound; and row-wise as TorchRec lays it out (contiguous id ranges; the synthetic default has no
id order, so the expected slowest rank over uniformly random id orders, ``solvers.torchrec_default``),
with FlexShard's cut against that.

Also shown, and labelled as out of reach: the same choice with sync at ``(G - 1) u V``, one transfer
per other group, which is below what any all-reduce can do (the figure this study reported before
the group fetch existed). Run:

    .venv/bin/python experiments/replication_bound.py [--nodes 8] [--batches 512,2048,8192]
"""

from __future__ import annotations

import sys

import numpy as np
import study

from core.vocabulary import INDEX_BYTES
from flexshard import workloads
from solvers.planner import budget_bytes, make_plan
from solvers.tier_program import OptimizerConfig
from solvers.types import Workload
from topology import cluster_view, h100_cluster

PIPELINED = OptimizerConfig(overlap=True)  # as `flexshard plan` and `simulate` plan by default


def inter_group_bytes(workload: Workload, num_ranks: int, group_size: int, dedup: bool) -> dict[str, float]:
    """Inter-group bytes per rank per iteration (ids, embeddings and gradients): row-wise's flat fetch,
    the per-row bound (group fetch or all-reduce-synced replica), and the same with sync at one transfer
    per other group (below any all-reduce)."""
    n_r, g = num_ranks, group_size
    groups = n_r // g
    out = {"row_wise": 0.0, "bound": 0.0, "below_allreduce": 0.0}
    for t in workload.tables:
        n = workload.lookups_per_gpu(t)
        rows, p = t.hist.rows.astype(np.float64), t.hist.prob
        log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-15))
        in_rank = -np.expm1(n * log_miss)  # the row in a rank's batch
        in_group = -np.expm1(g * n * log_miss)  # in a group's batch
        anywhere = -np.expm1(n_r * n * log_miss)  # in the cluster's batch
        per_rank = in_rank if dedup else n * p  # flat fetches per rank
        v, lookup = float(t.vector_bytes), 2.0 * t.vector_bytes + INDEX_BYTES
        flat = rows * per_rank * lookup * (n_r - g) / n_r
        group_fetch = rows * (groups - 1) * in_group * lookup / n_r
        allreduce = rows * 2 * (groups - 1) * anywhere * v / n_r
        one_transfer = rows * (groups - 1) * anywhere * v / n_r
        out["row_wise"] += float(flat.sum())
        out["bound"] += float(np.minimum(group_fetch, allreduce).sum())
        out["below_allreduce"] += float(np.minimum(group_fetch, one_transfer).sum())
    return out


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--nodes", type=int, default=8, help="h100 nodes of 8 GPUs (default 8)")
    p.add_argument("--batches", default="512,2048,8192", help="per-GPU batch sizes (default 512,2048,8192)")
    p.add_argument("--no-planner", action="store_true", help="skip FlexShard's planned bytes")
    args = p.parse_args(argv)
    view = cluster_view(h100_cluster(args.nodes))
    g = int(view.uniform_group_size)
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b.strip()):
        wl = workloads.default_workload(batch_size_per_gpu=batch)
        for dedup in (True, False):
            b = inter_group_bytes(wl, view.num_ranks, g, dedup)
            planned = distance = busiest = "-"
            if not args.no_planner:
                budget = budget_bytes(wl, view, 2.0)
                fs = make_plan(
                    "flexshard", wl, view, budget, dedup, config=PIPELINED
                ).report.inter_group_bytes
                rw = make_plan("row_wise", wl, view, budget, dedup, config=PIPELINED).report.inter_group_bytes
                planned = f"{fs / 1e6:.2f} MB ({1 - fs / b['row_wise']:.1%})"
                distance = f"{fs / b['bound'] - 1:+.2%}"
                busiest = f"{rw / 1e6:.2f} MB ({1 - fs / rw:.1%})"
            rows.append(
                [
                    batch,
                    "on" if dedup else "off",
                    f"{b['row_wise'] / 1e6:.2f} MB",
                    f"{b['bound'] / 1e6:.2f} MB ({1 - b['bound'] / b['row_wise']:.1%})",
                    planned,
                    distance,
                    busiest,
                    f"{1 - b['below_allreduce'] / b['row_wise']:.1%}",
                ]
            )
            print(f"batch {batch}, dedup {'on' if dedup else 'off'} done", file=sys.stderr, flush=True)
    print(
        f"Default workload on h100:{args.nodes} ({view.num_ranks} GPUs, groups of {g}): inter-group bytes "
        "per rank per iteration, and the reduction against row-wise's flat fetch with the same dedup"
    )
    header = [
        "batch/GPU",
        "per-rank dedup",
        "row-wise (flat), even share",
        "per-row bound",
        "FlexShard at 2x (planned)",
        "FlexShard vs bound",
        "row-wise as TorchRec lays it out, slowest rank (FlexShard's cut)",
        "out of reach: sync (G-1)V",
    ]
    print(study.md_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
