"""The sample-placement decision's cost per batch: what ``train --sample-placement owner`` adds to a step
before the samples move (scores from the plan's routing, wanted moves, the swap plan, destinations).

For each cluster size (H100-class hosts of 8 GPUs, one NVLink group each) a FlexShard plan is made for
two tables (``item``: 10M rows, dim 64, 50 ids per sample as history plus 5 candidates; ``user``: 10M
rows, dim 64, one per sample; Zipf 0.9 over the rows, rows numbered hottest first), and one rank's
decision is timed on batches drawn from those distributions, per batch size. The swap plan takes every
rank's want counts (here this rank's, repeated, since only one process runs). No collective runs: the
move itself is two all-to-alls whose bytes the runtime counts. Prints a markdown table. Run:

    .venv/bin/python experiments/bench_sample_placement.py [--quick]
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import numpy as np
import study
import torch

from core.ranks import RankLayout
from core.vocabulary import WireDtype
from flexshard.batching import SamplePlacer
from flexshard.batching.assign import SwapPlan, destinations, want_counts, wanted_moves
from flexshard.model import Batch
from flexshard.runtime.routing import build_routing
from flexshard.workloads.synthetic import zipf_table
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology import cluster_view, from_preset

ROWS, DIM, HISTORY, CANDIDATES, ALPHA = 10_000_000, 64, 50, 5, 0.9
NODES, QUICK_NODES = (2, 8, 32, 128), (2, 8)
BATCHES = (512, 4096)
REPEATS = 5


def _pmf() -> np.ndarray:
    p = np.arange(1, ROWS + 1, dtype=np.float64) ** -ALPHA
    return p / p.sum()


def placer_for(nodes: int) -> SamplePlacer:
    """Rank 0's placer for a FlexShard plan of the two tables on ``nodes`` hosts of 8 GPUs."""
    specs = tuple(
        zipf_table(name, ROWS, DIM, per, alpha=ALPHA, tail_mass=0.0)
        for name, per in (("item", HISTORY + CANDIDATES), ("user", 1.0))
    )
    workload = Workload("bench-placement", specs, batch_size_per_gpu=512)
    view = cluster_view(from_preset(f"h100:{nodes}"))
    plan = make_plan("flexshard", workload, view, budget_bytes(workload, view, 2.0)).plan
    layout = RankLayout.of(view.groups)
    routing = [build_routing(tp, layout.to_lists(), None, 1 << 16) for tp in plan.tables]
    module = SimpleNamespace(
        table_names=["item", "user"], routing=routing, dims=[DIM, DIM], wire_dtype=WireDtype.BF16,
        rank=0, plan_file=SimpleNamespace(layout=layout), device=torch.device("cpu"),
    )  # fmt: skip
    return SamplePlacer("owner", module, "user")


def draw(batch: int, cdf: np.ndarray, rng: np.random.Generator) -> Batch:
    lengths = np.full(batch, HISTORY, dtype=np.int64)
    ids = np.searchsorted(cdf, rng.random(batch * (HISTORY + CANDIDATES)), side="right")
    ids = np.minimum(ids, ROWS - 1).astype(np.int64)
    hist, cand = ids[: batch * HISTORY], ids[batch * HISTORY :].reshape(batch, CANDIDATES)
    users = rng.integers(0, ROWS, batch)
    return Batch(lengths, {"item": hist}, {"item": cand}, users)


def decide(placer: SamplePlacer, batch: Batch) -> float:
    """Seconds of one decision (what ``SamplePlacer.place`` times)."""
    layout = placer.layout
    start = time.perf_counter()
    best, gain = wanted_moves(placer.scores(batch), 0)
    mine = want_counts(best, gain, layout.num_groups)
    plan = SwapPlan.between_rail_peers(np.tile(mine, (layout.num_ranks, 1)), layout, batch.size)
    destinations(best, gain, plan.counts[0], layout, 0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick=f"clusters of {', '.join(map(str, QUICK_NODES))} hosts", write=False)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cdf = np.cumsum(_pmf())
    rng = np.random.default_rng(0)
    rows = []
    for nodes in QUICK_NODES if args.quick else NODES:
        print(f"bench_sample_placement: planning {nodes} hosts", file=sys.stderr, flush=True)
        placer = placer_for(nodes)
        for b in BATCHES:
            batches = [draw(b, cdf, rng) for _ in range(REPEATS)]
            decide(placer, batches[0])  # warm the routing's tensors
            t = np.median([decide(placer, x) for x in batches])
            lookups = b * (HISTORY + CANDIDATES + 1)
            rows.append([nodes * 8, nodes, b, f"{lookups:,}", f"{t * 1e3:.1f}", f"{t / lookups * 1e9:.0f}"])
    header = ["GPUs", "groups", "samples per rank", "lookups per rank", "decision (ms per batch)"]
    print(study.md_table([*header, "ns per lookup"], rows, align="rrrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
