"""CPU time of a benchmark step, every rank summed: FlexShard's plan against its row-wise ablation on the
same batches (``flexshard bench``'s data and plans), steps alternating between the two.

Process CPU time (``time.process_time``) counts the work a step does and not the time a rank waits for a
core, so on a machine whose cores are shared with other jobs it compares two code versions (run the script
from each tree) or two plans far more steadily than the wall-clock step. Prints per strategy the median
over steps of the CPU time summed over ranks and of the slowest rank's wall time (ms), and each rank's
median CPU time (where the work sits).

    nice .venv/bin/python experiments/step_cpu.py [--nproc 4] [--batch 1024] [--plan-for probed] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.osutil import free_port  # noqa: E402

STRATEGIES = ("flexshard", "row_wise")


def _rank(rank: int, args, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    torch.set_num_threads(1)
    from flexshard.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # as the bench's ranks do
    from flexshard.bench.config import BenchConfig
    from flexshard.bench.plans import h100_view, make_plans, probed_view
    from flexshard.bench.worker import _build, load_data
    from flexshard.training.garbage import StepGarbageCollection

    cfg = BenchConfig(nproc=args.nproc, groups=2, batch=args.batch, plan_for="h100", torchrec=False)
    data = load_data(cfg, args.nproc)
    view = h100_view(args.nproc, 2) if args.plan_for == "h100" else probed_view(2, 60.0)
    plans = make_plans(data, view, view, cfg.budget, False, "step", None)
    with tempfile.TemporaryDirectory() as tmp:
        systems, _ = _build(cfg, data, plans, Path(tmp))
    systems = [s for s in systems if s.key in STRATEGIES]
    batches = [data.make_batch(s, rank) for s in range(3 + args.steps)]
    for s in systems:
        for b in batches[:3]:
            s.step(b)
    cpu: dict[str, list[float]] = {s.key: [] for s in systems}
    wall: dict[str, list[float]] = {s.key: [] for s in systems}
    with StepGarbageCollection(1) as collector:  # Python's collector out of the timed steps, as the bench
        for k, b in enumerate(batches[3:]):
            collector.collect()  # untimed, before each round
            for s in systems[k % 2 :] + systems[: k % 2]:  # alternate which strategy goes first
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                s.step(b)
                cpu[s.key].append(time.process_time() - c0)
                wall[s.key].append(time.perf_counter() - t0)
    every: list = [None] * args.nproc
    dist.all_gather_object(every, (cpu, wall))
    if rank == 0:
        lines = []
        for key in cpu:
            c = np.sum([e[0][key] for e in every], axis=0) * 1e3
            w = np.max([e[1][key] for e in every], axis=0) * 1e3
            med_c, med_w = np.median(c), np.median(w)
            lines.append(f"{key}: CPU (all ranks) {med_c:.1f} ms/step, wall (slowest) {med_w:.1f} ms")
            per_rank = " ".join(f"{np.median(e[0][key]) * 1e3:.1f}" for e in every)
            lines.append(f"  CPU per rank (ms/step): {per_rank}")
        Path(out, "cpu.txt").write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--plan-for", default="probed", choices=("probed", "h100"))
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(args, free_port(), out), nprocs=args.nproc, start_method="spawn")
        print(Path(out, "cpu.txt").read_text(), end="")


if __name__ == "__main__":
    main()
