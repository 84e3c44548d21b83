"""The gloo teardown abort that ``flexshard.runtime.local.end_rank`` avoids, reproduced without TorchRec.

Each run spawns 2 gloo ranks that start 8 all-reduces of 4 MiB asynchronously. ``--mode plain`` returns
with them in flight, so the interpreter finalizes while gloo's worker threads still hold the tensors;
``--mode end_rank`` waits for them and leaves through ``end_rank`` (barrier, destroy, ``os._exit(0)``).
Prints each run's exit codes (-6: SIGABRT; None: still running after ``--wait`` seconds) and the
count. Measured 2026-11-26 under heavy load: plain 3 runs of 6 with a rank killed by SIGABRT, each
printing "terminate called without an active exception" (the message of the TorchRec tests' aborts);
end_rank 0 of 4.

    python experiments/teardown_abort.py --mode plain --runs 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.osutil import free_port  # noqa: E402
from flexshard.runtime.local import end_rank  # noqa: E402


def _rank(rank: int, world: int, port: int, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors = [torch.randn(1 << 20) for _ in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    if mode == "end_rank":
        for w in works:
            w.wait()
        end_rank()
    # plain: return with the all-reduces in flight; the interpreter finalizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("plain", "end_rank"), default="plain")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for each rank")
    args = p.parse_args()
    aborted = 0
    for i in range(args.runs):
        ctx = mp.start_processes(
            _rank, args=(2, free_port(), args.mode), nprocs=2, join=False, start_method="spawn"
        )
        for proc in ctx.processes:
            proc.join(args.wait)
        codes = [proc.exitcode for proc in ctx.processes]
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        aborted += -6 in codes
        print(f"run {i}: exit codes {codes}", flush=True)
    print(f"{args.mode}: {aborted} of {args.runs} runs with a rank killed by SIGABRT")


if __name__ == "__main__":
    main()
