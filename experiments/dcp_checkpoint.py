"""DCP checkpoints of ``ShardedSequenceEmbedding``: bytes moved, time and files, against ``flexshard train``'s
own checkpoint format.

One synthetic table (``zipf_table``, ``--rows`` x ``--dim``, row-wise Adagrad) on a FlexShard plan at
``--budget`` x row-wise memory; ``--world`` gloo ranks in ``--groups`` emulated groups build it, train one
step and save it: ``flexshard.checkpoint.save`` (per-rank files, rows where the plan holds
them), the move alone (``dcp_state_dict``: rows to contiguous blocks by one all-to-all) and ``save_dcp``
(the move, then ``dcp.save``). Then
``--load-world`` ranks (one group) with a plan of their own load the DCP checkpoint (``load_dcp``: DCP
reshards the blocks, one all-to-all re-deals them by the new plan) and check every row they hold
against the saved table. Per phase: the all-to-all's bytes sent per rank (max over ranks; a rank's rows to
itself included), seconds (max
over ranks; wall time on a shared CPU: indicative), and the checkpoint's size on disk. Run:

    .venv/bin/python experiments/dcp_checkpoint.py [--rows 1e6] [--dim 32] [--world 4] [--groups 2]
        [--load-world 2]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import study
import torch
import torch.distributed as dist

from flexshard import checkpoint
from flexshard.checkpoint_dcp import load_dcp, save_dcp
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.report import human_bytes
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.local import run_on_ranks
from flexshard.workloads import sample_ids, zipf_table
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.presets import h100_cluster
from topology.views import cluster_view

BATCH, LENGTH = 64, 20


def _workload(rows: int, dim: int) -> Workload:
    return Workload(f"dcp-{rows}", (zipf_table("items", rows, dim, float(LENGTH)),), BATCH)


def _plan(rows: int, dim: int, world: int, groups: int, budget_x: float, path: Path) -> Path:
    wl = _workload(rows, dim)
    view = cluster_view(h100_cluster(groups, world // groups))
    planned = make_plan("flexshard", wl, view, budget_bytes(wl, view, budget_x))
    write_plan(path, to_dict(planned.plan, wl, view, planned.report, "dcp-checkpoint"))
    return path


class _Counted:
    """Counts the bytes this rank sends through ``dist.all_to_all_single`` while active."""

    def __enter__(self):
        self.sent, self.original = 0, dist.all_to_all_single

        def counted(out, inp, out_splits=None, in_splits=None, **kw):
            self.sent += inp.numel() * inp.element_size()
            return self.original(out, inp, out_splits, in_splits, **kw)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original


def _module(plan_path: str, rows: int, dim: int, seed: int) -> ShardedSequenceEmbedding:
    return ShardedSequenceEmbedding(read_plan(plan_path), [("items", rows, dim)], None, init=seed,
                                    optimizer="adagrad", lr=0.05)  # fmt: skip


def save_rank(rank: int, world: int, plan_path: str, rows: int, dim: int, out: str) -> dict:
    module = _module(plan_path, rows, dim, 0)
    hist = _workload(rows, dim).tables[0].hist
    ids = torch.as_tensor(sample_ids(hist, BATCH * LENGTH, np.random.default_rng(rank)))
    module({"items": (ids, torch.full((BATCH,), LENGTH, dtype=torch.int64))})["items"].sum().backward()
    module.step()
    res = {}
    dist.barrier()
    t0 = time.perf_counter()
    checkpoint.save(module, torch.nn.Linear(1, 1), None, 1, Path(out) / "flexshard")
    res["flexshard save"] = (0, time.perf_counter() - t0)
    module.dcp_state_dict()  # warm-up: the device mesh is made once
    dist.barrier()
    with _Counted() as c:
        t0 = time.perf_counter()
        module.dcp_state_dict()
    res["DCP move alone"] = (c.sent, time.perf_counter() - t0)
    dist.barrier()
    with _Counted() as c:
        t0 = time.perf_counter()
        save_dcp(module, Path(out) / "dcp")
    res["DCP save"] = (c.sent, time.perf_counter() - t0)
    return res


def load_rank(rank: int, world: int, plan_path: str, rows: int, dim: int, out: str) -> dict:
    module = _module(plan_path, rows, dim, 1)
    dist.barrier()
    with _Counted() as c:
        t0 = time.perf_counter()
        load_dcp(module, Path(out) / "dcp")
    res = {"DCP load": (c.sent, time.perf_counter() - t0)}
    full = checkpoint.load_full(checkpoint.latest(Path(out) / "flexshard"))
    res["rows equal"] = all(
        torch.equal(s.weights, full.weights["items"][s.ids])
        and torch.equal(s.state, full.state["items"][s.ids])
        for s in module.shards.values()
    )
    return res


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--rows", type=float, default=1e6)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--load-world", type=int, default=2)
    p.add_argument("--budget", type=float, default=2.0, help="per-GPU budget, multiple of row-wise")
    args = p.parse_args(argv)
    rows = int(args.rows)
    with tempfile.TemporaryDirectory(prefix="dcp-checkpoint-") as tmp:
        root = Path(tmp)
        plan_a = _plan(rows, args.dim, args.world, args.groups, args.budget, root / "a.json")
        plan_b = _plan(rows, args.dim, args.load_world, 1, args.budget, root / "b.json")
        saved = run_on_ranks(save_rank, args.world, str(plan_a), rows, args.dim, str(root), timeout_s=1800.0)
        loaded = run_on_ranks(load_rank, args.load_world, str(plan_b), rows, args.dim, str(root),
                              timeout_s=1800.0)  # fmt: skip
        sizes = {"flexshard save": _disk(root / "flexshard"), "DCP save": _disk(root / "dcp")}
    table = []
    phases = (("flexshard save", saved), ("DCP move alone", saved), ("DCP save", saved), ("DCP load", loaded))
    for phase, ranks in phases:
        sent = max(r[phase][0] for r in ranks)
        secs = max(r[phase][1] for r in ranks)
        disk = human_bytes(sizes[phase]) if phase in sizes else ""
        table.append([phase, len(ranks), human_bytes(sent) if sent else "-", f"{secs:.2f}", disk])
    print(f"one table of {rows:,} x {args.dim} (float32 {human_bytes(rows * args.dim * 4)}, Adagrad state "
          f"{human_bytes(rows * 4)}), FlexShard plan at {args.budget:g}x; save at {args.world} ranks in "
          f"{args.groups} groups, load at {args.load_world} ranks with their own plan")  # fmt: skip
    print(
        study.md_table(["phase", "ranks", "all-to-all sent / rank (max)", "s (max rank)", "on disk"], table)
    )
    print(f"every row loaded equals the saved one: {all(r['rows equal'] for r in loaded)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
