"""What a stage's process group costs on gloo: the same blocks sent by an all-to-all over every rank
(empty blocks to the ranks they do not reach) and over the smallest group that holds them, on spawned
local ranks in groups of ``--group-size`` (the runtime's layout: consecutive ranks per group, a rail per
position). Two shapes, as the group fetch's stages send them: each rank's block to its rail peer only
(``rows``: owner to rail peer) and a third of it to each other rank of its group (``grads``: requester
to rail peer). Prints, per shape and group, each rank's process CPU per collective (user and system,
gloo's threads included; the mean over the ranks) and rank 0's wall time per collective, over
``--repeats`` back-to-back collectives after 5 untimed ones.

    nice .venv/bin/python experiments/gloo_stage_scope.py [--nproc 8] [--group-size 4] [--mb 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from core.osutil import free_port  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, world: int, port: int, g: int, floats: int, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = world // g
    intra = [dist.new_group(list(range(k * g, (k + 1) * g))) for k in range(groups)][rank // g]
    rails = [dist.new_group([p + k * g for k in range(groups)]) for p in range(g)][rank % g]
    to, at = (rank + g) % world, (rank - g) % world  # the rail peer sent to, the one received from
    mine = range((rank // g) * g, (rank // g + 1) * g)

    def send(out: list[int], into: list[int] | None = None, group=None) -> None:
        into = out if into is None else into
        recv = torch.empty(sum(into))
        dist.all_to_all_single(recv, torch.ones(sum(out)), into, out, group=group)

    def one(n: int, peer: int) -> list[int]:
        return [floats if p == peer else 0 for p in range(n)]

    k = rank // g  # this rank's place in its rail
    world_group = [floats // (g - 1) if p in mine and p != rank else 0 for p in range(world)]
    group = [0 if p == rank else floats // (g - 1) for p in mine]
    cases = {
        ("rows: block to the rail peer", "world"): lambda: send(one(world, to), one(world, at)),
        ("rows: block to the rail peer", "rail"): lambda: send(
            one(groups, (k + 1) % groups), one(groups, (k - 1) % groups), rails
        ),
        ("grads: blocks to the group", "world"): lambda: send(world_group),
        ("grads: blocks to the group", "group"): lambda: send(group, None, intra),
    }
    got = {}
    for key, run in cases.items():
        for _ in range(5):
            run()
        dist.barrier()
        cpu, wall = _cpu_s(), time.perf_counter()
        for _ in range(repeats):
            run()
        got[key] = ((_cpu_s() - cpu) / repeats * 1e3, (time.perf_counter() - wall) / repeats * 1e3)
        dist.barrier()
    out.put((rank, got))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--mb", type=float, default=1.0, help="MB each rank sends per collective")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    if args.nproc % args.group_size or args.nproc // args.group_size < 2 or args.group_size < 2:
        ap.error(f"--nproc {args.nproc} --group-size {args.group_size}: needs 2+ groups of 2+ ranks")
    floats = int(args.mb * 1e6 / 4) // (args.group_size - 1) * (args.group_size - 1)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.nproc, port, args.group_size, floats, args.repeats, queue))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"{args.nproc} gloo ranks in groups of {args.group_size}, {args.mb:g} MB a rank per collective")
    print(f"{'stage shape':32s} {'process group':>13s} {'CPU ms/rank':>12s} {'wall ms':>8s}")
    for key in results[0]:
        cpu = sum(results[r][key][0] for r in results) / len(results)
        print(f"{key[0]:32s} {key[1]:>13s} {cpu:12.2f} {results[0][key][1]:8.2f}")


if __name__ == "__main__":
    main()
